"""Tier I/O: a step's moves between the device KV cache and its host/disk tiers, before the forward.

    SchedulerOutput.block_offloads / snapshot_offloads: device pools ──put──▶ KVTiers
    ScheduledRequest.block_loads / restore_snapshot_key: KVTiers ──take──▶ device block / slot
    ScheduledRequest.restore_snapshot: device snapshot ──▶ slot

Producer of the moves: the scheduler (CPU). Run by the model runner on the cache's device, in
this order: offloads first, since the step's loads and its forward may overwrite what was
evicted.
"""

from __future__ import annotations

import torch

from deepinfer.kv_cache.pool import KVCache
from deepinfer.kv_cache.tiered import KVTiers
from deepinfer.scheduler.output import SchedulerOutput


def move_between_tiers(
    scheduler_output: SchedulerOutput, kv: KVCache, tiers: KVTiers | None
) -> None:
    """Before the forward: evicted blocks/snapshots down to the lower tiers (before anything
    overwrites them), lower-tier hits up into their new blocks, snapshots into slots."""
    if tiers is not None:
        for block_id, key in scheduler_output.block_offloads:
            tiers.put("block", key, kv.block_payload(block_id))
        for snapshot_id, key in scheduler_output.snapshot_offloads:
            tiers.put("snapshot", key, kv.snapshot_payload(snapshot_id))
    for sched in scheduler_output.scheduled:
        for block_id, key in sched.block_loads:
            kv.write_block(block_id, _take(tiers, key, "block", kv.device))
        if sched.restore_snapshot is not None:
            kv.restore_snapshot(sched.restore_snapshot, sched.state_slot)
        elif sched.restore_snapshot_key is not None:
            payload = _take(tiers, sched.restore_snapshot_key, "snapshot", kv.device)
            kv.restore_slot_from_payload(sched.state_slot, payload)
        elif sched.window_floor and sched.start_pos == sched.window_floor:
            kv.clear_slot(sched.state_slot)


def _take(tiers: KVTiers | None, key: bytes, kind: str, device: torch.device) -> list[torch.Tensor]:
    """The staged payload of ``key``, on ``device`` (copies queued, not waited for)."""
    assert tiers is not None, f"a {kind} load was scheduled without lower tiers"
    payload = tiers.take(kind, key)
    assert payload is not None, f"staged {kind} {key.hex()[:16]} is gone"
    return [t.to(device, non_blocking=True) for t in payload]
