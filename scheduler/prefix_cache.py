"""PrefixCache: full KV blocks keyed by a hash chain, shared across requests (torch-free).

    hash(block k) = sha256(hash(block k-1) || token ids of block k [|| image digests])
    hash(block -1) = salt

A block overlapping images adds their digests (deepinfer/images.py): their positions hold the
same placeholder ids whatever the image.

The salt names the model (its name, a fingerprint of its weights, the cache format) and, when a
request carries one, its ``cache_salt``, so tenants never share blocks. Only full blocks whose
entries are all written are inserted; a block is full once ``block_size`` tokens of it are known
and computed, so blocks filled while decoding enter the cache too (a multi-turn conversation hits
on its own history).

Lookup returns the longest cached prefix in whole blocks. Cached blocks are ref-counted by the
BlockManager and stay cached at ref count 0 until the free list hands them out again, which is
the LRU eviction (see block_manager.py). SHA-256 rather than Python's hash(): the chain must be
the same in every process (a shared disk tier keys files by it).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.images import images_key
from deepinfer.kv_cache.events import CacheEventLog
from deepinfer.scheduler.block_manager import BlockManager
from deepinfer.scheduler.request import Request


def chain_root(salt: bytes, cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block."""
    root = hashlib.sha256(b"deepinfer-prefix-v1\0" + salt)
    if cache_salt is not None:
        root.update(b"\0cache_salt\0" + cache_salt.encode())
    return root.digest()


def hash_block(parent: bytes, token_ids: Sequence[int], images: bytes = b"") -> bytes:
    """``images``: the digests of the images the block overlaps (``images_key``)."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))  # each id as 4 bytes, little-endian
    if images:
        h.update(b"\0images\0" + images)
    return h.digest()


@dataclass
class PrefixCacheStats:
    """Counts since start, in tokens unless named otherwise."""

    num_query_tokens: int = 0
    num_evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, block_manager: BlockManager, block_size: int, salt: bytes) -> None:
        self.block_manager = block_manager
        self.block_size = block_size
        self.salt = salt
        self._blocks: dict[bytes, int] = {}
        self.evicted: list[tuple[int, bytes]] = []  # since the last drain, for offloading
        self.stats = PrefixCacheStats()
        self.events: CacheEventLog | None = None  # the node's, when it publishes to a router
        block_manager.on_evict = self._evict

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def block_hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        """The hashes of the request's full blocks within its first ``num_tokens`` tokens,
        extending (and caching on the request) the chain as tokens become known."""
        hashes = request.reuse.block_hashes
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        if len(hashes) < num_full:
            parent = hashes[-1] if hashes else chain_root(self.salt, request.cache_salt)
            for k in range(len(hashes), num_full):
                start, end = k * self.block_size, (k + 1) * self.block_size
                ids = request.get_token_ids(start, end)
                parent = hash_block(parent, ids, images_key(request.images, start, end))
                hashes.append(parent)
        return hashes[:num_full]

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (no references taken)."""
        block_ids = []
        for block_hash in hashes:
            block_id = self._blocks.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        self.stats.num_query_tokens += len(hashes) * self.block_size
        return block_ids

    def insert(self, request: Request) -> None:
        """Cache the request's blocks that became full and computed since the last call."""
        num_full = request.num_computed_tokens // self.block_size
        if request.reuse.num_inserted_blocks >= num_full:
            return
        hashes = self.block_hashes(request, num_full * self.block_size)
        inserted = []
        for k in range(request.reuse.num_inserted_blocks, num_full):
            block_id = request.block_table[k]
            # The same content computed twice (two cold requests at once): keep the first copy.
            if hashes[k] not in self._blocks and self.block_manager.block_hash(block_id) is None:
                self._blocks[hashes[k]] = block_id
                self.block_manager.set_hash(block_id, hashes[k])
                inserted.append(hashes[k])
        request.reuse.num_inserted_blocks = num_full
        if self.events is not None:
            self.events.stored("device", inserted)

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Cache a block whose content the executor loads from a lower tier before it is read."""
        assert block_hash not in self._blocks, "a lower-tier hit for a block already on device"
        self._blocks[block_hash] = block_id
        self.block_manager.set_hash(block_id, block_hash)
        if self.events is not None:
            self.events.stored("device", (block_hash,))

    def unregister(self, block_id: int) -> None:
        block_hash = self.block_manager.clear_hash(block_id)
        if block_hash is not None:
            del self._blocks[block_hash]
            if self.events is not None:
                self.events.removed("device", (block_hash,))

    def _evict(self, block_id: int, block_hash: bytes) -> None:
        assert self._blocks.get(block_hash) == block_id, (
            f"evicting block {block_id}, but its hash maps to {self._blocks.get(block_hash)}"
        )
        del self._blocks[block_hash]
        self.evicted.append((block_id, block_hash))
        self.stats.num_evicted_blocks += 1
        if self.events is not None:
            self.events.removed("device", (block_hash,))
