"""Scheduler invariants, checked by tests and when idle (torch-free).

Every block and state slot in use is held by a running request (or a hand-off: held on the
prefill side, reserved on the decode side), ref counts
equal the number of holders, waiting requests hold nothing, and the queues hold exactly the
unfinished requests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from deepinfer.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from deepinfer.scheduler.scheduler import Scheduler


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_integrity(
    scheduler: Scheduler,
    running: Sequence[Request],
    waiting: Sequence[Request],
    unfinished: Collection[str],
    held: Sequence[Request] = (),
    reserved: Sequence[tuple[list[int], int]] = (),
) -> None:
    """Raise RuntimeError unless every block and slot in use is held by a running request, a
    held hand-off (first token sampled, its cache kept for export) or a reservation (blocks and
    a slot for a hand-off on its way).

    ``running``/``waiting`` are the scheduler's queues, ``unfinished`` the ids it tracks.
    """
    scheduler.block_manager.check_integrity()
    scheduler.state_slots.check_integrity()
    if scheduler.prefix is not None:
        scheduler.prefix.snapshots.check_integrity()
    _require(
        len(running) <= scheduler.config.max_num_seqs,
        f"{len(running)} running > max_num_seqs {scheduler.config.max_num_seqs}",
    )
    for r in running:
        num_blocks = _cdiv(r.num_computed_tokens, scheduler.block_size)
        _require(
            r.status == RequestStatus.RUNNING
            and r.state_slot is not None
            and len(r.block_table) == num_blocks
            and r.num_computed_tokens <= r.num_tokens + r.num_pending_tokens,
            f"running request {r.request_id!r}: status {r.status.name}, slot {r.state_slot}, "
            f"{len(r.block_table)} blocks for {r.num_computed_tokens} computed tokens "
            f"(expected {num_blocks}), {r.num_tokens} tokens + {r.num_pending_tokens} pending",
        )
    for r in waiting:
        _require(
            r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            and not r.block_table
            and r.state_slot is None
            and r.num_computed_tokens == 0
            and r.num_pending_tokens == 0,
            f"waiting request {r.request_id!r}: status {r.status.name}, slot {r.state_slot}, "
            f"{len(r.block_table)} blocks, {r.num_computed_tokens} computed tokens, "
            f"{r.num_pending_tokens} pending",
        )
    queued_ids = [r.request_id for r in running] + [r.request_id for r in waiting]
    _require(
        len(queued_ids) == len(unfinished) and set(queued_ids) == set(unfinished),
        f"{len(running)} running + {len(waiting)} waiting do not match the "
        f"{len(unfinished)} unfinished requests",
    )
    for r in held:
        _require(
            r.state_slot is not None
            and len(r.block_table) == _cdiv(r.num_computed_tokens, scheduler.block_size),
            f"held hand-off {r.request_id!r}: slot {r.state_slot}, {len(r.block_table)} blocks "
            f"for {r.num_computed_tokens} computed tokens",
        )
    holders = [(r.block_table, r.state_slot) for r in (*running, *held)] + list(reserved)
    held_blocks = Counter(block_id for block_table, _ in holders for block_id in block_table)
    ref_counts = {b: scheduler.block_manager.ref_count(b) for b in held_blocks}
    _require(
        ref_counts == held_blocks and len(held_blocks) == scheduler.block_manager.num_used_blocks,
        f"{scheduler.block_manager.num_used_blocks} blocks used, running requests hold "
        f"{len(held_blocks)}; ref counts {ref_counts} vs holders {dict(held_blocks)}",
    )
    slots = [slot for _, slot in holders]
    _require(
        len(set(slots)) == len(slots) and set(slots) == scheduler.state_slots.used_slots,
        f"running requests hold state slots {slots}, "
        f"in use: {sorted(scheduler.state_slots.used_slots)}",
    )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)
