"""KVTiers: the host-memory and disk tiers of the KV cache behind one object.

    device pools ──evicted (block_offloads / snapshot_offloads)──▶ put ──▶ host LRU ──▶ (drop)
                                                                      └──▶ disk (async write)
    scheduler admission ── stage(kind, key) ◀── host hit, or disk read + checked ── "host"/"disk"
    executor, before the forward ── take(kind, key) ──▶ written into the new device block / slot

Shared by the scheduler (``stage``/``unstage``, through the torch-free ``LowerTiers`` protocol)
and the executor (``put``/``take``). Evicted content is written through to the disk tier when
there is one, so other nodes on a shared mount, and this node after a restart, find it. A staged
entry is held (by reference) until taken, so no eviction can drop it between the schedule that
found it and the step that loads it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from deepinfer.config import CacheConfig
from deepinfer.kv_cache.disk_tier import DiskTier
from deepinfer.kv_cache.tiers import HostTier, TierStats, can_pin_memory

logger = logging.getLogger(__name__)

Payload = list[torch.Tensor]


class KVTiers:
    def __init__(self, host: HostTier | None, disk: DiskTier | None) -> None:
        assert host is not None or disk is not None, "KVTiers needs at least one tier"
        self.host = host
        self.disk = disk
        self._lock = threading.Lock()
        # (kind, key) -> [payload, tier, count of stagers not yet served]
        self._staged: dict[tuple[str, bytes], list] = {}

    @classmethod
    def from_config(cls, cache: CacheConfig, salt: bytes, device: torch.device) -> KVTiers | None:
        host = disk = None
        if cache.host_tier_gib > 0:
            pin = device.type != "cpu" and can_pin_memory()
            host = HostTier(int(cache.host_tier_gib * 2**30), pin_memory=pin)
        if cache.disk_tier_dir:
            directory = Path(cache.disk_tier_dir).expanduser()
            disk = DiskTier(directory, int(cache.disk_tier_gib * 2**30), salt)
        if host is None and disk is None:
            return None
        logger.info(
            "KV cache tiers: host %s, disk %s",
            f"{cache.host_tier_gib:g} GiB" if host else "off",
            f"{cache.disk_tier_dir} ({cache.disk_tier_gib:g} GiB)" if disk else "off",
        )
        return cls(host, disk)

    # -- executor side ----------------------------------------------------------------------

    def put(self, kind: str, key: bytes, payload: Payload) -> None:
        """Content evicted from the device: keep it in host memory and write it to disk."""
        with self._lock:
            if self.host is not None:
                self.host.put(kind, key, payload)
        if self.disk is not None:
            self.disk.put(kind, key, payload)

    def take(self, kind: str, key: bytes) -> Payload | None:
        """A staged entry, for the executor to load; None if it was never staged."""
        with self._lock:
            entry = self._staged.get((kind, key))
            if entry is None:
                return None
            entry[2] -= 1
            if entry[2] == 0:
                del self._staged[kind, key]
            return entry[0]

    # -- scheduler side ---------------------------------------------------------------------

    def stage(self, kind: str, key: bytes) -> str | None:
        """Hold the entry for the executor and name its tier ("host" or "disk"); None if absent
        or unreadable (a corrupt or foreign disk file is ignored by the disk tier)."""
        with self._lock:
            entry = self._staged.get((kind, key))
            if entry is not None:
                entry[2] += 1
                return entry[1]
            payload = self.host.get(kind, key) if self.host is not None else None
            tier = "host"
        if payload is None and self.disk is not None:
            payload, tier = self.disk.get(kind, key), "disk"
            if payload is not None and self.host is not None:
                with self._lock:
                    self.host.put(kind, key, payload)
        if payload is None:
            return None
        with self._lock:
            self._staged[kind, key] = [payload, tier, 1]
        return tier

    def unstage(self, kind: str, key: bytes) -> None:
        self.take(kind, key)

    # -- lifecycle and numbers --------------------------------------------------------------

    def stats(self) -> dict[str, TierStats]:
        out = {}
        if self.host is not None:
            out["host"] = self.host.stats
        if self.disk is not None:
            out["disk"] = self.disk.stats
        return out

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
