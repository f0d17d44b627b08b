"""What a node's prefix cache holds, as an ordered event stream for the coordinator (torch-free).

    PrefixCache (device) ──stored / removed──▶ CacheEventLog ──pending events──▶ the node's
    HostTier (host)      ──stored / removed──▶   (numbered,     publisher (server/cache_events.py)
    DiskTier (disk)      ──stored / removed──▶    mirrored)     ──▶ coordinator /internal/cache_*

Every change to which block hashes a tier holds is one event, numbered in the order it happened
(one lock orders the recording threads: the step thread for the device and host tiers, the disk
writers for the disk tier). The log keeps the events not yet acknowledged by the coordinator
and a mirror of what each tier holds, so that a full snapshot at a known sequence number can be
sent at any time: after the node registers (the coordinator starts empty), when the coordinator
saw a gap, or when more events piled up than ``max_pending_events`` while it was unreachable.

Blocks are named by ``block_key``: the first 8 bytes of the block's SHA-256 chain hash as an
unsigned integer. The coordinator only predicts hit lengths with them, so a collision (2^-64
per pair) costs one misrouted request, never a wrong token; and the index stays small.
Only "block" entries count: snapshots shorten a replay but do not change what a hit is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

TIERS = ("device", "host", "disk")


def block_key(block_hash: bytes) -> int:
    """The 64-bit name of a block in the coordinator's index."""
    return int.from_bytes(block_hash[:8], "big")


@dataclass(frozen=True)
class CacheLayout:
    """How a node names its blocks (scheduler/prefix_cache.py): the chain's salt (model,
    weights, cache format) and the block size; and the disk tier it shares with other nodes
    (``DiskTier.tier_id``; "": none)."""

    salt: bytes
    block_size: int
    disk_tier_id: str = ""


@dataclass(frozen=True)
class CacheEvent:
    """``keys`` entered (``is_stored``) or left ``tier``."""

    tier: str
    is_stored: bool
    keys: tuple[int, ...]


class CacheEventLog:
    """Thread-safe: ``stored``/``removed`` from any thread, the rest from the publisher."""

    def __init__(self, max_pending_events: int = 100_000) -> None:
        self.max_pending_events = max_pending_events
        self._lock = threading.Lock()
        self._held: dict[str, set[int]] = {tier: set() for tier in TIERS}
        self._pending: list[CacheEvent] = []
        self._first_pending_seq = 1  # the sequence number of _pending[0]
        self._is_lost = False  # pending events were dropped: only a snapshot can follow

    # -- recording (any thread) -------------------------------------------------------------

    def stored(self, tier: str, block_hashes: Iterable[bytes]) -> None:
        self._record(tier, True, block_hashes)

    def removed(self, tier: str, block_hashes: Iterable[bytes]) -> None:
        self._record(tier, False, block_hashes)

    def _record(self, tier: str, is_stored: bool, block_hashes: Iterable[bytes]) -> None:
        keys = tuple(block_key(h) for h in block_hashes)
        if not keys:
            return
        with self._lock:
            held = self._held[tier]
            if is_stored:
                held.update(keys)
            else:
                held.difference_update(keys)
            if len(self._pending) >= self.max_pending_events:
                # The coordinator is not taking them: forget them, resynchronize later.
                self._first_pending_seq += len(self._pending)
                self._pending = []
                self._is_lost = True
            self._pending.append(CacheEvent(tier, is_stored, keys))

    # -- publishing -------------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        """The sequence number of the newest event (0: none yet)."""
        with self._lock:
            return self._first_pending_seq + len(self._pending) - 1

    @property
    def num_held(self) -> dict[str, int]:
        with self._lock:
            return {tier: len(keys) for tier, keys in self._held.items()}

    def pending(self, max_events: int) -> tuple[int, list[CacheEvent]] | None:
        """Up to ``max_events`` unacknowledged events and the sequence number of the first;
        None when some were dropped (send a snapshot instead)."""
        with self._lock:
            if self._is_lost:
                return None
            return self._first_pending_seq, self._pending[:max_events]

    def acknowledge(self, last_seq: int) -> None:
        """The coordinator applied every event up to ``last_seq``."""
        with self._lock:
            num = last_seq - self._first_pending_seq + 1
            if num > 0:
                del self._pending[:num]
                self._first_pending_seq += num

    def snapshot(self) -> tuple[int, dict[str, list[int]]]:
        """What every tier holds after event ``seq``; the events up to it are no longer pending
        (the snapshot replaces them)."""
        with self._lock:
            seq = self._first_pending_seq + len(self._pending) - 1
            self._first_pending_seq = seq + 1
            self._pending = []
            self._is_lost = False
            return seq, {tier: sorted(keys) for tier, keys in self._held.items() if keys}
