"""The compressors (CSA, HCA) and the Lightning indexer of DeepSeek-V4 attention.

Compressor: every ``ratio`` tokens -> one KV entry, written to the paged pool through the request's
block table; the open window's raw tokens (and CSA's previous-window half) live in the state slot.
Indexer: per query, the top-k compressed entries a CSA layer attends to.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.engine.forward_batch import ForwardBatch, SeqSpan
from deepinfer.kv_cache.pool import CompressorState, KVCache
from deepinfer.model.config import ModelArgs
from deepinfer.model.layers import RMSNorm, linear
from deepinfer.ops import Kernels
from deepinfer.ops.norm import apply_rope, rope_cos_sin


class Compressor(nn.Module):
    """Softmax-gated pooling of every ``ratio`` tokens into one KV entry (CSA, HCA, indexer).

    Overlapping (CSA, ratio 4): each token yields two series [Ca | Cb]; entry w pools window w-1's
    Ca with window w's Cb over 2*ratio slots. Entries are normed, then roped at position w*ratio.
    Windows are aligned to absolute position 0; only complete windows emit an entry.
    """

    def __init__(self, args: ModelArgs, dim: int, ratio: int) -> None:
        super().__init__()
        self.dim, self.ratio = dim, ratio
        # Upstream decides the overlapping layout by the ratio alone (CSA's 4).
        self.overlap = ratio == 4
        width = 2 * dim if self.overlap else dim
        self.wkv = linear(args.hidden_size, width)
        self.wgate = linear(args.hidden_size, width)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        state: CompressorState,
        write: Callable[[SeqSpan, int, torch.Tensor], None],
        inv_freq: torch.Tensor,
    ) -> None:
        """Pool the batch's complete windows and hand each request's new entries to ``write``."""
        kv, gate = self.wkv(x), self.wgate(x)  # [T, width]
        for seq in batch.seqs:
            first, entries = self._compress_one(kv[seq.rows], gate[seq.rows], seq, state, inv_freq)
            write(seq, first, entries)

    def _compress_one(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        seq: SeqSpan,
        state: CompressorState,
        inv_freq: torch.Tensor,
    ) -> tuple[int, torch.Tensor]:
        m, dim, slot = self.ratio, self.dim, seq.slot
        window_start = seq.start_pos - seq.start_pos % m
        num_buffered = seq.start_pos - window_start
        kv = torch.cat([state.buf_kv[slot, :num_buffered], kv])  # [n, width], from window_start
        gate = torch.cat([state.buf_gate[slot, :num_buffered], gate])
        num_windows = kv.shape[0] // m
        first_window = window_start // m
        done = num_windows * m
        num_left = kv.shape[0] - done
        if num_windows == 0:
            state.buf_kv[slot, :num_left], state.buf_gate[slot, :num_left] = kv, gate
            return first_window, kv.new_zeros(0, dim)
        win_kv = kv[:done].view(num_windows, m, -1)  # [W, m, width]
        raw_gate = gate[:done].view(num_windows, m, -1)
        win_gate = raw_gate + self.ape
        if self.overlap:
            prev = (state.prev_kv[slot].clone(), state.prev_gate[slot] + self.ape[:, :dim])
            # The last complete window's Ca half feeds the next call's first entry. Its gate is
            # kept without the bias, which is added again (bit-identically) when it is used.
            state.prev_kv[slot] = win_kv[-1, :, :dim]
            state.prev_gate[slot] = raw_gate[-1, :, :dim]
            win_kv, win_gate = self._overlap(win_kv, win_gate, prev if first_window else None)
        weights = win_gate.softmax(dim=1, dtype=torch.float32).to(win_kv.dtype)
        pooled = self.norm((win_kv * weights).sum(dim=1))  # [W, dim]
        positions = (first_window + torch.arange(num_windows, device=kv.device)) * m
        pooled = apply_rope(pooled, *rope_cos_sin(positions, inv_freq))
        state.buf_kv[slot, :num_left], state.buf_gate[slot, :num_left] = kv[done:], gate[done:]
        return first_window, pooled

    def _overlap(
        self,
        win_kv: torch.Tensor,
        win_gate: torch.Tensor,
        prev: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[W, m, 2dim] -> [W, 2m, dim]: slots [previous window's Ca | this window's Cb].

        Window 0 of the sequence has no previous window: zero kv, -inf gate (weight 0).
        ``prev`` (kv, biased gate) [m, dim] is the window before this call's first one.
        """
        m, dim = self.ratio, self.dim
        num_windows = win_kv.shape[0]
        new_kv = win_kv.new_zeros(num_windows, 2 * m, dim)
        new_gate = win_gate.new_full((num_windows, 2 * m, dim), float("-inf"))
        new_kv[:, m:], new_gate[:, m:] = win_kv[..., dim:], win_gate[..., dim:]
        new_kv[1:, :m], new_gate[1:, :m] = win_kv[:-1, :, :dim], win_gate[:-1, :, :dim]
        if prev is not None:
            new_kv[0, :m], new_gate[0, :m] = prev
        return new_kv, new_gate


class Indexer(nn.Module):
    """Lightning indexer: its own compressor at index_head_dim, and per-query top-k entries."""

    def __init__(self, args: ModelArgs, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.topk, self.ratio = args.index_topk, args.csa_ratio
        self.wq_b = linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = linear(args.hidden_size, self.n_heads)
        self.compressor = Compressor(args, self.head_dim, self.ratio)

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        layer_id: int,
        inv_freq: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Per request: [C, k] selected entry ids (-1 = none) for each of its query tokens."""
        pool = cache.index_keys[layer_id]

        def write(seq: SeqSpan, first: int, keys: torch.Tensor) -> None:
            cache.write_entries(pool, seq.block_table, self.ratio, first, keys, seq)

        self.compressor(x, batch, cache.compressor_state[layer_id, "idx"], write, inv_freq)
        q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)  # [T, Hi, Di]
        q = apply_rope(q, *batch.rope["compress"])
        weights = self.weights_proj(x).float() * self.n_heads**-0.5  # [T, Hi]
        picks = []
        for seq in batch.seqs:
            keys = cache.read_entries(pool, seq.block_table, self.ratio, seq.end_pos // self.ratio)
            positions = batch.positions[seq.rows]
            picks.append(
                self.kernels.attention.indexer_topk(
                    q[seq.rows], keys, weights[seq.rows], positions, self.ratio, self.topk
                )
            )
        return picks
