"""Cache spec: what a model family keeps per layer, declared once.

A family describes its cache as parts; everything that touches the cache enumerates the same
parts, so the memory sizing, the allocated tensors and the payloads moved between tiers (and
between nodes) cannot disagree:

    part kind   tensor                                  what
    ---------   -------------------------------------   ----------------------------------------
    paged       [num_blocks + 1, rows, row]             grows with context: ``rows`` per block
    state       [num_slots + 1, rows, row]              per running request (rings, open windows)
    snapshot    [num_snapshots, rows, row]               a twin of each state part marked
                                                        ``snapshot``: what a block boundary needs

The last block and slot (``num_blocks``, ``num_slots``) are scratch rows, never a request's. A row
is ``width`` elements of the part's dtype (None: the cache's dtype) or one ``RowFormat``: a byte
row packed by the family's kernels (FP8 values with in-row scales, ...), stored as uint8.

Producers: the model families (``deepinfer/model/<family>/cache.py``). Consumers: the pools
(``pool.py``), memory sizing (the engine) and the tiers (through the pools' payloads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

PartKey = tuple[int, str]  # (layer, name within the layer)


@dataclass(frozen=True)
class RowFormat:
    """A byte-packed row: ``nbytes`` per row (e.g. 584 for DeepSeek's FP8 entry with its
    scales and a bf16 rope part), stored as uint8 and decoded by the family's kernels."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class CachePart:
    """One tensor per layer and name. ``rows``: per block (paged) or per slot (state)."""

    key: PartKey
    kind: Literal["paged", "state"]
    rows: int
    row: int | RowFormat  # elements per row, or a packed row
    dtype: torch.dtype | None = None  # None: the cache's dtype (ignored for a packed row)
    snapshot: bool = False  # state parts only: kept by the block-boundary snapshots

    def tensor_dtype(self, cache_dtype: torch.dtype) -> torch.dtype:
        if isinstance(self.row, RowFormat):
            return torch.uint8
        return self.dtype or cache_dtype

    def row_shape(self) -> tuple[int, int]:
        width = self.row.nbytes if isinstance(self.row, RowFormat) else self.row
        return self.rows, width

    def nbytes(self, cache_dtype: torch.dtype) -> int:
        """Bytes per block (paged) or per slot (state)."""
        rows, width = self.row_shape()
        return rows * width * _itemsize(self.tensor_dtype(cache_dtype))

    @property
    def num_elements(self) -> int:
        """Elements per block or slot (a packed row counts its bytes)."""
        rows, width = self.row_shape()
        return rows * width


@dataclass(frozen=True)
class CacheSpec:
    """A family's cache for one block size and its margins.

    ``ring_margin``: rows a window ring keeps past the window (steps longer than it write the
    ring once per position; a rollback may forget at most that many). ``max_draft``: draft
    tokens whose state can be rolled back (the family keeps room for them, e.g. DeepSeek-V4's
    compressor rings). ``salt``: what else changes the cached bytes and the payloads' layout
    (part of the prefix cache's hash salt and of the disk tier's files).
    """

    block_size: int
    parts: tuple[CachePart, ...]
    ring_margin: int = 0
    max_draft: int = 0
    salt: str = ""

    def __post_init__(self) -> None:
        keys = [p.key for p in self.parts]
        assert len(set(keys)) == len(keys), "cache parts must have distinct keys"
        assert all(p.kind == "state" or not p.snapshot for p in self.parts), "paged snapshot"

    @property
    def paged(self) -> tuple[CachePart, ...]:
        return tuple(p for p in self.parts if p.kind == "paged")

    @property
    def state(self) -> tuple[CachePart, ...]:
        return tuple(p for p in self.parts if p.kind == "state")

    @property
    def snapshot(self) -> tuple[CachePart, ...]:
        return tuple(p for p in self.parts if p.snapshot)

    @property
    def elements_per_block(self) -> int:
        return sum(p.num_elements for p in self.paged)

    @property
    def elements_per_slot(self) -> int:
        return sum(p.num_elements for p in self.state)

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        return sum(p.nbytes(dtype) for p in self.paged)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        return sum(p.nbytes(dtype) for p in self.state)

    def bytes_per_snapshot(self, dtype: torch.dtype) -> int:
        return sum(p.nbytes(dtype) for p in self.snapshot)

    def bytes_per_token(self, dtype: torch.dtype) -> float:
        return self.bytes_per_block(dtype) / self.block_size

    def total_bytes(
        self, dtype: torch.dtype, *, num_blocks: int, num_slots: int, num_snapshots: int
    ) -> int:
        """What a pool of these counts allocates, the scratch block and slot included."""
        return (
            (num_blocks + 1) * self.bytes_per_block(dtype)
            + (num_slots + 1) * self.bytes_per_slot(dtype)
            + num_snapshots * self.bytes_per_snapshot(dtype)
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
