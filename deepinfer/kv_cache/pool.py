"""KV cache: paged pools for what grows with context, state slots for what does not.

What a DeepSeek-V4 layer keeps per request (hd = head_dim, ihd = index_head_dim, m = ratio):

    paged (one block table per request, shared by every layer; block = block_size tokens)
    ---------------------------------------------------------------------------------
    CSA layer  compressed_kv [num_blocks, block_size/4, hd]    entry w <- tokens [4w, 4w+4)
               index_keys    [num_blocks, block_size/4, ihd]   (Lightning indexer keys)
    HCA layer  compressed_kv [num_blocks, block_size/m', hd]   entry w <- tokens [m'w, m'w+m')
    sliding    (nothing paged)

        entry w of a layer with ratio m lives in block block_table[(w*m) // block_size]
        at row ((w*m) % block_size) // m.

    state slots (one per running request, not paged)
    ---------------------------------------------------------------------------------
    every layer  window_ring [num_slots, R, hd]   R = sliding_window + ring_margin;
                                                  token p's post-rope K=V at row p % R
    CSA layer    comp_kv / comp_gate [num_slots, 3, 2hd]   open window's raw kv_proj/gate_proj
                 comp_prev_kv / comp_prev_gate [num_slots, 4, hd]  previous window's Ca half
                 idx_kv / idx_gate [num_slots, 3, 2ihd], idx_prev_kv / idx_prev_gate [.., 4, ihd]
    HCA layer    comp_kv / comp_gate [num_slots, m'-1, hd]  open window's raw tokens

    Open-window token p sits at row p % m. Gates are stored without the position bias.

A slot needs no reset between requests: a request starting at position 0 reads no ring rows,
no buffered tokens and no previous-window state before writing them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepinfer.engine.attention_metadata import CacheGeometry
from deepinfer.model.config import CSA, HCA, ModelArgs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheLayout:
    """Sizes derived from the model and cache config (elements, not bytes)."""

    block_size: int
    ring_size: int
    elements_per_block: int
    elements_per_slot: int

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        return self.elements_per_block * _itemsize(dtype)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        return self.elements_per_slot * _itemsize(dtype)

    def bytes_per_token(self, dtype: torch.dtype) -> float:
        return self.bytes_per_block(dtype) / self.block_size


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def cache_layout(args: ModelArgs, block_size: int, ring_margin: int) -> CacheLayout:
    for ratio in {r for r in args.compress_ratios if r}:
        if block_size % ratio:
            raise ValueError(
                f"cache.block_size={block_size} must be a multiple of every compression "
                f"ratio of the model (got ratio {ratio})"
            )
    ring = args.sliding_window + ring_margin
    hd, ihd = args.head_dim, args.index_head_dim
    per_block = 0
    per_slot = 0
    for layer_type, ratio in zip(args.layer_types, args.compress_ratios, strict=True):
        per_slot += ring * hd
        if layer_type == CSA:
            per_block += (block_size // ratio) * (hd + ihd)
            per_slot += 2 * (ratio - 1) * 2 * hd + 2 * ratio * hd
            per_slot += 2 * (ratio - 1) * 2 * ihd + 2 * ratio * ihd
        elif layer_type == HCA:
            per_block += (block_size // ratio) * hd
            per_slot += 2 * (ratio - 1) * hd
    return CacheLayout(block_size, ring, per_block, per_slot)


class KVCache:
    """Device tensors of the paged pools and state slots, with per-request read/write helpers.

    Producer: the executor allocates it once. Consumers: the model's attention, compressor and
    indexer modules (through the helpers below). Indexing inputs are host ints / lists.
    """

    def __init__(
        self,
        args: ModelArgs,
        *,
        num_blocks: int,
        num_slots: int,
        block_size: int,
        num_snapshots: int = 0,
        ring_margin: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.args = args
        self.layout = cache_layout(args, block_size, ring_margin)
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.block_size = block_size
        self.ring_size = self.layout.ring_size
        self.dtype = dtype
        self.device = device
        self._init_pools()
        self._init_state_slots()
        self._init_snapshots()

    # One block and one slot past the scheduler's, never allocated to a request: padded requests
    # of a graphed decode step and the writes it discards land there.
    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    def _init_pools(self) -> None:
        a, nb = self.args, self.num_blocks + 1
        self.compressed_kv: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        for i, ratio in enumerate(a.compress_ratios):
            if ratio:
                rows = self.block_size // ratio
                self.compressed_kv[i] = self._zeros(nb, rows, a.head_dim)
                if a.layer_types[i] == CSA:
                    self.index_keys[i] = self._zeros(nb, rows, a.index_head_dim)

    def _init_state_slots(self) -> None:
        a, ns = self.args, self.num_slots + 1
        self.window_ring = [self._zeros(ns, self.ring_size, a.head_dim) for _ in a.layer_types]
        # Compressor state per layer: {"comp": (buf_kv, buf_gate, prev_kv, prev_gate)} and
        # {"idx": ...} for the indexer's compressor (prev_* are None for HCA).
        self.compressor_state: dict[tuple[int, str], CompressorState] = {}
        for i, (layer_type, ratio) in enumerate(zip(a.layer_types, a.compress_ratios, strict=True)):
            if layer_type == CSA:
                self.compressor_state[i, "comp"] = self._csa_state(ratio, a.head_dim)
                self.compressor_state[i, "idx"] = self._csa_state(ratio, a.index_head_dim)
            elif layer_type == HCA:
                buf = self._zeros(ns, ratio - 1, a.head_dim)
                self.compressor_state[i, "comp"] = CompressorState(buf, buf.clone(), None, None)

    def _snapshot_parts(self) -> list[torch.Tensor]:
        """The state-slot tensors a block boundary needs: rings and CSA overlap state. The open
        window buffers are empty at a boundary (block_size is a multiple of every ratio)."""
        parts = list(self.window_ring)
        for state in self.compressor_state.values():
            if state.prev_kv is not None and state.prev_gate is not None:
                parts += [state.prev_kv, state.prev_gate]
        return parts

    def _init_snapshots(self) -> None:
        # Snapshot pool: one [num_snapshots, ...] twin per snapshot part, apart from the slots.
        self._snapshot_pool = [
            torch.zeros((self.num_snapshots, *t.shape[1:]), dtype=t.dtype, device=t.device)
            for t in self._snapshot_parts()
        ]

    @property
    def bytes_per_snapshot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self._snapshot_parts())

    def save_snapshot(self, slot: int, snapshot_id: int) -> None:
        for part, pool in zip(self._snapshot_parts(), self._snapshot_pool, strict=True):
            pool[snapshot_id].copy_(part[slot])

    def restore_snapshot(self, snapshot_id: int, slot: int) -> None:
        for part, pool in zip(self._snapshot_parts(), self._snapshot_pool, strict=True):
            part[slot].copy_(pool[snapshot_id])

    def block_payload(self, block_id: int) -> list[torch.Tensor]:
        """One block's rows of every paged pool (copies): compressed entries, then indexer keys,
        each in layer order. [block_size / ratio, d] per tensor."""
        return [pool[block_id].clone() for pool in self._paged_pools()]

    def write_block(self, block_id: int, payload: list[torch.Tensor]) -> None:
        pools = self._paged_pools()
        assert len(payload) == len(pools), f"block payload of {len(payload)} != {len(pools)}"
        for pool, rows in zip(pools, payload, strict=True):
            pool[block_id].copy_(rows)

    def _paged_pools(self) -> list[torch.Tensor]:
        return [self.compressed_kv[i] for i in sorted(self.compressed_kv)] + [
            self.index_keys[i] for i in sorted(self.index_keys)
        ]

    def snapshot_payload(self, snapshot_id: int) -> list[torch.Tensor]:
        return [pool[snapshot_id].clone() for pool in self._snapshot_pool]

    def restore_slot_from_payload(self, slot: int, payload: list[torch.Tensor]) -> None:
        parts = self._snapshot_parts()
        assert len(payload) == len(parts), f"snapshot payload of {len(payload)} != {len(parts)}"
        for part, rows in zip(parts, payload, strict=True):
            part[slot].copy_(rows)

    def clear_slot(self, slot: int) -> None:
        """Zero a slot before a replay that starts from an empty state."""
        for part in self._snapshot_parts():
            part[slot].zero_()
        for state in self.compressor_state.values():
            state.buf_kv[slot].zero_()
            state.buf_gate[slot].zero_()

    def _csa_state(self, ratio: int, dim: int) -> CompressorState:
        ns = self.num_slots + 1
        buf = self._zeros(ns, ratio - 1, 2 * dim)
        prev = self._zeros(ns, ratio, dim)
        return CompressorState(buf, buf.clone(), prev, prev.clone())

    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def log_sizes(self) -> None:
        lay = self.layout
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f KiB/block, %.1f B/token), %d state slots "
            "(%.1f KiB/slot, ring %d), %d snapshots (%.1f KiB/snapshot = %.2f blocks), "
            "total %.1f MiB",
            self.num_blocks,
            self.block_size,
            lay.bytes_per_block(self.dtype) / 1024,
            lay.bytes_per_token(self.dtype),
            self.num_slots,
            lay.bytes_per_slot(self.dtype) / 1024,
            self.ring_size,
            self.num_snapshots,
            self.bytes_per_snapshot / 1024,
            self.bytes_per_snapshot / lay.bytes_per_block(self.dtype),
            (
                self.num_blocks * lay.bytes_per_block(self.dtype)
                + self.num_slots * lay.bytes_per_slot(self.dtype)
                + self.num_snapshots * self.bytes_per_snapshot
            )
            / 2**20,
        )

    @property
    def geometry(self) -> CacheGeometry:
        a = self.args
        ratios = tuple(sorted({r for r in a.compress_ratios if r}))
        dense = {r for r, t in zip(a.compress_ratios, a.layer_types, strict=True) if t == HCA}
        return CacheGeometry(
            self.args.sliding_window,
            self.ring_size,
            self.block_size,
            ratios,
            dense_ratios=tuple(sorted(dense)),
            scratch_slot=self.scratch_slot,
            scratch_block=self.scratch_block,
        )


@dataclass
class CompressorState:
    """State-slot tensors of one compressor: the open window's raw tokens and, for overlapping
    (CSA) compressors, the previous complete window's Ca half.

    buf_kv / buf_gate: [num_slots, ratio - 1, width]; prev_kv / prev_gate: [num_slots, ratio, dim].
    """

    buf_kv: torch.Tensor
    buf_gate: torch.Tensor
    prev_kv: torch.Tensor | None
    prev_gate: torch.Tensor | None
