"""BlockManager: owns KV block ids, their ref counts and the free list (torch-free).

A block is ``block_size`` token positions of every paged KV pool (compressed KV entries and
indexer keys of all layers). The device pools are indexed by the ids handed out here; this module
never touches the device.

Free list order is deterministic so that tests (and replays) can assert exact block ids:

    free list:  front -> [3, 4, 5, 9, 8, 7] <- back
                          ^ allocate(2) takes 3, then 4 (lowest ids first at start-up)

    free([7, 8, 9])  # a request's block_table, head first
    appends 9, 8, 7: the table's tail goes to the free list first and is reused first.

Why tail first (vLLM v1 does the same): prefix caching keeps the contents of freed blocks until
they are reused, and a request's head blocks hold the prefix most likely to be shared (a system
prompt), so they should be reused last, while its tail (its own generated tokens) is reused first.

Cached blocks: a block whose content is in the prefix cache carries its hash. At ref count 0 it
stays on the free list (it counts as free) until ``allocate`` takes it, which evicts it from the
cache through ``on_evict``; ``reuse`` takes a cached block back off the free list on a hit. So the
free list is also the cache's LRU eviction order: front = evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class BlockManager:
    """Block ids ``0 .. num_blocks - 1`` with a FIFO free list and per-block ref counts.

    A block is used while its ref count is > 0 and free (on the free list) at 0. Ref counts above 1
    mean several requests share the block (a prefix-cache hit); ``free`` drops one reference.
    """

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 1, f"num_blocks must be >= 1, got {num_blocks}"
        self.num_blocks = num_blocks
        # An ordered set: O(1) pop from the front, append at the back, removal on a cache hit.
        self._free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks
        self._block_hashes: dict[int, bytes] = {}
        self.on_evict: Callable[[int, bytes], None] | None = None
        # Kept apart from the free list (not derived) so check_integrity() can catch drift.
        self._num_used_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free_block_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the front of the free list, each with ref count 1."""
        assert self.can_allocate(num_blocks), (
            f"allocate({num_blocks}) with only {self.num_free_blocks} of {self.num_blocks} free"
        )
        block_ids = [self._free_block_ids.popitem(last=False)[0] for _ in range(num_blocks)]
        for block_id in block_ids:
            assert self._ref_counts[block_id] == 0, (
                f"block {block_id} on the free list has ref count {self._ref_counts[block_id]}"
            )
            self._ref_counts[block_id] = 1
            block_hash = self._block_hashes.pop(block_id, None)
            if block_hash is not None and self.on_evict is not None:
                self.on_evict(block_id, block_hash)
        self._num_used_blocks += num_blocks
        return block_ids

    def reuse(self, block_ids: Sequence[int]) -> None:
        """Add one reference to cached blocks found by a prefix hit (free ones leave the list)."""
        for block_id in block_ids:
            assert block_id in self._block_hashes, f"reuse of uncached block {block_id}"
            if self._ref_counts[block_id] == 0:
                del self._free_block_ids[block_id]
                self._num_used_blocks += 1
            self._ref_counts[block_id] += 1

    def set_hash(self, block_id: int, block_hash: bytes) -> None:
        """Mark a used block's content as cached under ``block_hash``."""
        assert self._ref_counts[block_id] > 0, f"set_hash on free block {block_id}"
        self._block_hashes[block_id] = block_hash

    def clear_hash(self, block_id: int) -> bytes | None:
        return self._block_hashes.pop(block_id, None)

    def block_hash(self, block_id: int) -> bytes | None:
        return self._block_hashes.get(block_id)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_hashes)

    def incref(self, block_ids: Sequence[int]) -> None:
        """Add one reference to used blocks (another request now shares them)."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"incref of free block {block_id}"
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the back of the free list.

        ``block_ids`` is a request's block_table (head first); it is walked tail first, so the
        tail is reused first (see the module docstring for why).
        """
        for block_id in reversed(block_ids):
            ref_count = self._ref_counts[block_id]
            assert ref_count > 0, f"free of block {block_id} with ref count 0 (double free)"
            self._ref_counts[block_id] = ref_count - 1
            if ref_count == 1:
                self._free_block_ids[block_id] = None
                self._num_used_blocks -= 1

    def check_integrity(self) -> None:
        """Raise RuntimeError unless free + used == total and ref counts match the free list."""
        num_free = len(self._free_block_ids)
        if num_free + self._num_used_blocks != self.num_blocks:
            raise RuntimeError(
                f"block accounting: {num_free} free + {self._num_used_blocks} used "
                f"!= {self.num_blocks} total"
            )
        free_set = self._free_block_ids.keys()
        num_referenced = 0
        for block_id, ref_count in enumerate(self._ref_counts):
            is_free = block_id in free_set
            if ref_count < 0 or is_free != (ref_count == 0):
                raise RuntimeError(
                    f"block {block_id}: ref count {ref_count} but "
                    f"{'on' if is_free else 'not on'} the free list"
                )
            num_referenced += ref_count > 0
        if num_referenced != self._num_used_blocks:
            raise RuntimeError(
                f"{num_referenced} blocks have references but {self._num_used_blocks} are used"
            )
