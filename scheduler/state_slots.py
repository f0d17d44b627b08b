"""StateSlotManager: owns the per-request state slot ids (torch-free).

A state slot is the non-paged part of a request's cache on the device: the sliding-window KV
rings (``window + backtrack`` tokens per layer) and the compressors' partial-window buffers. Every
running request holds exactly one; a request is admitted only when one is free. The device
buffers are indexed by the ids handed out here.
"""

from __future__ import annotations

import heapq


class StateSlotManager:
    """Slot ids ``0 .. num_slots - 1``; ``allocate`` always returns the lowest free id."""

    def __init__(self, num_slots: int) -> None:
        assert num_slots >= 1, f"num_slots must be >= 1, got {num_slots}"
        self.num_slots = num_slots
        # A min-heap, so the lowest id comes first whatever order slots were freed in: the slots
        # in use stay packed at the low end, which keeps tests and device dumps predictable.
        self._free_slots: list[int] = list(range(num_slots))
        self._used_slots: set[int] = set()

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_used_slots(self) -> int:
        return len(self._used_slots)

    @property
    def used_slots(self) -> frozenset[int]:
        return frozenset(self._used_slots)

    def can_allocate(self) -> bool:
        return bool(self._free_slots)

    def allocate(self) -> int:
        assert self._free_slots, f"allocate with all {self.num_slots} state slots in use"
        slot = heapq.heappop(self._free_slots)
        self._used_slots.add(slot)
        return slot

    def free(self, slot: int) -> None:
        assert slot in self._used_slots, (
            f"free of state slot {slot}, which is not in use (double free?); "
            f"in use: {sorted(self._used_slots)}"
        )
        self._used_slots.remove(slot)
        heapq.heappush(self._free_slots, slot)

    def check_integrity(self) -> None:
        """Raise RuntimeError unless every slot id is either free or used, exactly once."""
        num_free, num_used = len(self._free_slots), len(self._used_slots)
        if num_free + num_used != self.num_slots:
            raise RuntimeError(
                f"state slot accounting: {num_free} free + {num_used} used "
                f"!= {self.num_slots} total"
            )
        free_set = set(self._free_slots)
        if len(free_set) != num_free or free_set & self._used_slots:
            raise RuntimeError(
                f"state slots listed twice: free {sorted(self._free_slots)}, "
                f"used {sorted(self._used_slots)}"
            )
        if free_set | self._used_slots != set(range(self.num_slots)):
            raise RuntimeError(f"state slot ids outside 0..{self.num_slots - 1}")
