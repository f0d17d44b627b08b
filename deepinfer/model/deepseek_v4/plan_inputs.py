"""What every DeepSeek-V4 step plan starts from: the step's requests as host arrays, and the
cache's geometry (the sizes of the flat views the plans address)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import SeqSpan
from deepinfer.model.deepseek_v4.cache import buffer_rows, overlap_windows


@dataclass(frozen=True)
class CacheGeometry:
    """What the plans need to know about the cache: sizes of the flat views above, and the
    scratch slot and block that padded requests and discarded writes of graphed steps use."""

    window: int
    ring_size: int
    block_size: int
    ratios: tuple[int, ...]
    dense_ratios: tuple[int, ...] = ()  # ratios of layers attending to every entry (HCA)
    scratch_slot: int = -1
    scratch_block: int = -1
    max_draft: int = 0  # draft tokens a rollback may forget (the compressors' rings keep them)

    @classmethod
    def of(cls, cache: KVCache) -> CacheGeometry:
        """The geometry of ``cache``, read from its spec's parts (cache.py): the cache the plans
        address decides it, whatever model runs on it."""
        spec = cache.spec
        [ring] = {p.rows for p in spec.state if p.key[1] == "ring"}
        ratio = {p.key[0]: spec.block_size // p.rows for p in spec.paged if p.key[1] == "entries"}
        sparse = {p.key[0] for p in spec.paged if p.key[1] == "index_keys"}
        return cls(
            ring - spec.ring_margin,
            ring,
            spec.block_size,
            tuple(sorted(set(ratio.values()))),
            dense_ratios=tuple(sorted({r for i, r in ratio.items() if i not in sparse})),
            scratch_slot=cache.scratch_slot,
            scratch_block=cache.scratch_block,
            max_draft=spec.max_draft,
        )

    def buffer_rows(self, ratio: int) -> int:
        """B: rows of a compressor's buffer ring per slot (cache.py)."""
        return buffer_rows(ratio, self.max_draft)

    def overlap_windows(self, ratio: int) -> int:
        """K: windows of an overlap ring per slot (cache.py)."""
        return overlap_windows(ratio, self.max_draft)


@dataclass
class Requests:
    """The step's requests as arrays (host): per request [B], per token [T] (batch order), and
    the block tables padded with block 0 [B, most blocks]."""

    start: np.ndarray
    num_tokens: np.ndarray
    offset: np.ndarray
    slot: np.ndarray
    floor: np.ndarray
    protected: np.ndarray
    table: np.ndarray
    token_req: np.ndarray
    positions: np.ndarray
    num_pad: np.ndarray  # trailing rows that stand in for no token (SeqSpan.num_pad)

    @classmethod
    def of(cls, seqs: list[SeqSpan], table_width: int = 0) -> Requests:
        """``table_width`` (graphed decode): exactly this many block-table columns, the blocks
        of positions under the context bound; else as many as the longest table."""

        def ints(values: list[int]) -> np.ndarray:
            return np.asarray(values, dtype=np.int64)

        num_tokens = ints([s.num_tokens for s in seqs])
        width = table_width or max(max(len(s.block_ids) for s in seqs), 1)
        table = np.zeros((len(seqs), width), np.int64)
        for b, seq in enumerate(seqs):
            ids = seq.block_ids[:width]
            table[b, : len(ids)] = ids
        start, offset = ints([s.start_pos for s in seqs]), ints([s.offset for s in seqs])
        token_req = np.repeat(np.arange(len(seqs)), num_tokens)
        local = np.arange(token_req.shape[0]) - np.repeat(starts(num_tokens), num_tokens)
        assert np.array_equal(offset, starts(num_tokens)), "requests must tile the batch in order"
        return cls(
            start=start,
            num_tokens=num_tokens,
            offset=offset,
            slot=ints([s.slot for s in seqs]),
            floor=ints([max(s.window_floor, 0) for s in seqs]),
            protected=ints([s.num_protected for s in seqs]),
            table=table,
            token_req=token_req,
            positions=start[token_req] + local,
            num_pad=ints([s.num_pad for s in seqs]),
        )

    @property
    def end(self) -> np.ndarray:
        return self.start + self.num_tokens

    @property
    def real_end(self) -> np.ndarray:
        """Where each request's real tokens end (its pad rows are past it)."""
        return self.end - self.num_pad

    @property
    def is_pad(self) -> np.ndarray:
        """[T] the token rows that are pads."""
        return self.positions >= self.real_end[self.token_req]

    def entry_rows(self, req: np.ndarray, entries: np.ndarray, per_block: int) -> np.ndarray:
        """Entry-pool rows of entries ``entries`` of requests ``req`` (same shapes)."""
        blocks = self.table[req, np.minimum(entries // per_block, self.table.shape[1] - 1)]
        return blocks * per_block + entries % per_block


def starts(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums: where each run of ``counts`` starts."""
    return np.cumsum(counts) - counts
