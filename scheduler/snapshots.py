"""SnapshotIndex: which state snapshot holds which block boundary (torch-free).

A snapshot is a copy of a request's state slot (sliding-window rings, compressor buffers) taken
when its computed tokens end exactly at a block boundary; it is keyed by the hash of the block
that ends there. Restoring it lets a prefix hit skip replaying the window history (see
scheduler/prefix_reuse.py). The device copies live in the KV cache's snapshot pool, apart from
the state slots that admission needs; this class hands out their ids.

    ids: committed (keyed by a hash, LRU)  |  pending (a running request's latest boundary)  |  free

Pending snapshots belong to one running request (its newest decode-time boundary); they are
committed when it finishes, or dropped.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass


@dataclass
class SnapshotStats:
    num_stored: int = 0
    num_restored: int = 0
    num_evicted: int = 0


class SnapshotIndex:
    def __init__(self, num_snapshots: int) -> None:
        self.num_snapshots = num_snapshots
        self._free: list[int] = list(range(num_snapshots - 1, -1, -1))  # pop() = lowest id
        self._committed: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._num_pending = 0
        # Committed snapshots a scheduled step will restore: not evictable until it ran.
        self._pinned: Counter[int] = Counter()
        self.evicted: list[tuple[int, bytes]] = []  # since the last drain, for offloading
        self.stats = SnapshotStats()

    def __len__(self) -> int:
        return len(self._committed)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._committed

    def get(self, block_hash: bytes) -> int | None:
        """The snapshot of this boundary, marked most recently used; None if absent."""
        snapshot_id = self._committed.get(block_hash)
        if snapshot_id is not None:
            self._committed.move_to_end(block_hash)
        return snapshot_id

    def pin(self, snapshot_id: int) -> None:
        self._pinned[snapshot_id] += 1

    def unpin(self, snapshot_id: int) -> None:
        assert self._pinned[snapshot_id] > 0, f"unpin of unpinned snapshot {snapshot_id}"
        self._pinned[snapshot_id] -= 1
        if not self._pinned[snapshot_id]:
            del self._pinned[snapshot_id]

    def allocate(self) -> int | None:
        """A pending snapshot id, evicting the least recently used unpinned committed one if
        none is free; None when every snapshot is pending or pinned."""
        if not self._free:
            victim = next((h for h, i in self._committed.items() if i not in self._pinned), None)
            if victim is None:
                return None
            evicted_id = self._committed.pop(victim)
            self._free.append(evicted_id)
            self.evicted.append((evicted_id, victim))
            self.stats.num_evicted += 1
        self._num_pending += 1
        return self._free.pop()

    def commit(self, snapshot_id: int, block_hash: bytes) -> None:
        """A pending snapshot now holds this boundary (a duplicate is dropped)."""
        self._num_pending -= 1
        if block_hash in self._committed:
            self._free.append(snapshot_id)
            return
        self._committed[block_hash] = snapshot_id
        self.stats.num_stored += 1

    def drop(self, snapshot_id: int) -> None:
        self._num_pending -= 1
        self._free.append(snapshot_id)

    def check_integrity(self) -> None:
        num = len(self._free) + len(self._committed) + self._num_pending
        ids = set(self._free) | set(self._committed.values())
        if num != self.num_snapshots or len(ids) != len(self._free) + len(self._committed):
            raise RuntimeError(
                f"snapshots: {len(self._free)} free + {len(self._committed)} committed + "
                f"{self._num_pending} pending != {self.num_snapshots}, or ids repeat"
            )
