"""Host-memory tier of the KV cache, and the stats every tier reports.

Data flow (the lead's executor drives it; nothing here touches the device pools):

    device pools --evict--> HostTier.put --LRU victims--> DiskTier.put (disk_tier.py)
    device pools <--load--- HostTier.get <----promote---- DiskTier.get

A payload is one cached object as an ordered list of tensors whose layout only the caller knows,
e.g. one paged block's rows from every layer's pool (kind "block"), or a request's state-slot
snapshot (kind "snapshot"). It is named by (kind, key), key being the 32-byte SHA-256 of the
block's hash chain.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from deepinfer.kv_cache.events import CacheEventLog

logger = logging.getLogger(__name__)

Payload = list[torch.Tensor]
"""One cached object: a fixed, ordered list of tensors (layout known to the caller)."""

Evicted = list[tuple[str, bytes, Payload]]
"""(kind, key, payload) of the entries a put pushed out, oldest first."""


@dataclass
class TierStats:
    """Counters of one tier, for metrics. Tiers hand out copies, so a value never moves under you.

    ``corrupt_files`` counts files ignored as unreadable (corrupt, truncated, foreign salt, key or
    version, no magic), once per file; ``dropped_writes`` counts puts that were not stored (writer
    queue full, payload larger than the whole tier, tier closed).
    """

    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    corrupt_files: int = 0
    dropped_writes: int = 0

    def copy(self) -> TierStats:
        return dataclasses.replace(self)


def payload_nbytes(payload: Payload) -> int:
    """Bytes of the tensors' data (what the tier stores), headers and Python objects excluded."""
    return sum(t.numel() * t.element_size() for t in payload)


def can_pin_memory() -> bool:
    """Whether this torch build has a pinned host allocator (CUDA or another accelerator)."""
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError as e:
        logger.debug("pinned host memory unavailable: %s", e)
        return False
    return True


class HostTier:
    """LRU store of payloads in host memory, bounded by ``capacity_bytes`` of tensor data.

    ``put`` copies the payload to host memory (pinned when asked for and available, so that the
    loads back to the device can be asynchronous), then evicts least recently used entries until the
    tier holds at most ``capacity_bytes``, and returns them so the caller can hand them to the disk
    tier. A payload larger than the whole tier is not stored and comes back as evicted at once.

    Stored and returned tensors are owned by the tier: callers read them (copy them into a device
    pool) and never modify them. Thread-safe: one lock guards the map and the stats.
    """

    def __init__(self, capacity_bytes: int, *, pin_memory: bool) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"HostTier capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = pin_memory and can_pin_memory()
        if pin_memory and not self.pin_memory:
            logger.info("host KV tier: pinned memory asked for but unavailable; using pageable")
        self._entries: OrderedDict[tuple[str, bytes], tuple[Payload, int]] = OrderedDict()
        self._num_bytes = 0
        self._stats = TierStats()
        self._lock = threading.Lock()
        self.events: CacheEventLog | None = None  # the node's, when it publishes to a router

    def put(self, kind: str, key: bytes, payload: Payload) -> Evicted:
        """Store a host copy of ``payload`` (any device and dtypes) as the most recently used entry.

        Replaces an entry with the same (kind, key). Returns the evicted (kind, key, payload)
        entries, least recently used first; their tensors are the tier's host copies.
        """
        start = time.perf_counter()
        nbytes = payload_nbytes(payload)
        if nbytes > self.capacity_bytes:
            with self._lock:
                self._stats.dropped_writes += 1
            return [(kind, key, payload)]
        host = [self._to_host(t) for t in payload]
        evicted: Evicted = []
        with self._lock:
            old = self._entries.pop((kind, key), None)
            if old is not None:
                self._num_bytes -= old[1]
            self._entries[(kind, key)] = (host, nbytes)
            self._num_bytes += nbytes
            while self._num_bytes > self.capacity_bytes:
                (old_kind, old_key), (old_payload, old_nbytes) = self._entries.popitem(last=False)
                self._num_bytes -= old_nbytes
                evicted.append((old_kind, old_key, old_payload))
            self._stats.puts += 1
            self._stats.evictions += len(evicted)
            self._stats.bytes_written += nbytes
            self._stats.write_seconds += time.perf_counter() - start
            if self.events is not None:
                self.events.stored("host", [key] if kind == "block" else [])
                self.events.removed("host", [k for kind_, k, _ in evicted if kind_ == "block"])
        return evicted

    def get(self, kind: str, key: bytes) -> Payload | None:
        """The stored host tensors (read-only for the caller); marks the entry as most recent."""
        with self._lock:
            entry = self._entries.get((kind, key))
            if entry is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end((kind, key))
            self._stats.hits += 1
            self._stats.bytes_read += entry[1]
            return entry[0]

    def contains(self, kind: str, key: bytes) -> bool:
        """Membership only: touches neither the LRU order nor the stats."""
        with self._lock:
            return (kind, key) in self._entries

    def pop(self, kind: str, key: bytes) -> Payload | None:
        """Remove and return an entry (e.g. once promoted back to the device); not an eviction."""
        with self._lock:
            entry = self._entries.pop((kind, key), None)
            if entry is None:
                return None
            self._num_bytes -= entry[1]
            if self.events is not None and kind == "block":
                self.events.removed("host", [key])
            return entry[0]

    def keys(self) -> list[tuple[str, bytes]]:
        """(kind, key) of every entry, least recently used first."""
        with self._lock:
            return list(self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def num_bytes(self) -> int:
        """Tensor bytes held now (always <= capacity_bytes)."""
        with self._lock:
            return self._num_bytes

    @property
    def stats(self) -> TierStats:
        with self._lock:
            return self._stats.copy()

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        # Always a fresh copy: the source is usually a view into a pool that will be overwritten.
        # The copy is synchronous, so the caller may reuse the device block as soon as put returns.
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin_memory)
        out.copy_(t.detach())
        return out
