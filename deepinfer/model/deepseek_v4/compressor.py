"""The compressors (CSA, HCA) and the Lightning indexer of DeepSeek-V4 attention.

Compressor: every ``ratio`` tokens -> one KV entry, written to the paged pool through the request's
block table; the raw tokens of open windows (a ring) and CSA's overlap ring live in the state slot.
Indexer: per query, the top-k compressed entries a CSA layer attends to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch
from deepinfer.model.deepseek_v4.args import ModelArgs
from deepinfer.model.deepseek_v4.compress_plan import CompressPlan
from deepinfer.model.layers import RMSNorm, linear, project
from deepinfer.ops import Kernels
from deepinfer.ops.attention.kv_fp8 import KVSource


def windows(ratio: int) -> str:
    """The ``ForwardBatch.rope`` key of the RoPE tables at the positions of the windows a
    ratio's plan closes this step (window id * ratio; the model computes them once a step for
    every compressor of that ratio)."""
    return f"windows-{ratio}"


@dataclass
class CompressorState:
    """State-slot tensors of one compressor (cache.py): the buffer ring of raw tokens and, for
    overlapping (CSA) compressors, the overlap ring of closed windows' Ca halves.

    buf_kv / buf_gate: [num_slots, ratio - 1 + max_draft, width]; prev_kv / prev_gate:
    [num_slots, K * ratio, dim], K = 1 + ceil(max_draft / ratio) (None for HCA).
    """

    buf_kv: torch.Tensor
    buf_gate: torch.Tensor
    prev_kv: torch.Tensor | None
    prev_gate: torch.Tensor | None

    @classmethod
    def of(cls, cache: KVCache, layer: int, prefix: str) -> CompressorState:
        """Layer ``layer``'s compressor ``prefix`` ("comp", or "idx" for the indexer's)."""
        tensors = cache.tensors
        return cls(
            tensors[layer, f"{prefix}.buf_kv"],
            tensors[layer, f"{prefix}.buf_gate"],
            tensors.get((layer, f"{prefix}.prev_kv")),
            tensors.get((layer, f"{prefix}.prev_gate")),
        )


class Compressor(nn.Module):
    """Softmax-gated pooling of every ``ratio`` tokens into one KV entry (CSA, HCA, indexer).

    Overlapping (CSA, ratio 4): each token yields two series [Ca | Cb]; entry w pools window w-1's
    Ca with window w's Cb over 2*ratio slots. Entries are normed, then roped at position w*ratio.
    Windows are aligned to absolute position 0; only complete windows emit an entry.
    """

    def __init__(self, args: ModelArgs, dim: int, ratio: int, kernels: Kernels) -> None:
        super().__init__()
        self.dim, self.ratio = dim, ratio
        self.norm_ops, self.attention_ops = kernels.norm, kernels.attention
        # Upstream decides the overlapping layout by the ratio alone (CSA's 4).
        self.overlap = ratio == 4
        width = 2 * dim if self.overlap else dim
        self.wkv = linear(args.hidden_size, width)
        self.wgate = linear(args.hidden_size, width)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, args.rms_norm_eps, kernels.norm)

    def forward(
        self,
        x: torch.Tensor,
        plan: CompressPlan,
        state: CompressorState,
        pool: KVSource,
        rope: tuple[torch.Tensor, torch.Tensor],
        projected: dict[nn.Module, torch.Tensor] | None = None,
    ) -> None:
        """Pool every window the step closes into ``pool`` (the flat entry pool [rows, dim], or
        its packed FP8 rows) and keep the tokens a later step (or a rollback) needs in the buffer
        ring (compress_plan.py's plan). ``rope``: cos, sin at the plan's windows' positions
        (``windows``); ``projected``: wkv(x) and wgate(x) where a fused GEMM computed them
        (``FusedLinears.outputs``)."""
        kv, gate = project(self.wkv, x, projected), project(self.wgate, x, projected)  # [T, width]
        buf_kv, buf_gate = state.buf_kv.flatten(0, 1), state.buf_gate.flatten(0, 1)
        src_kv = torch.cat([buf_kv[plan.buf_rows], kv.to(buf_kv.dtype)])  # [nbuf + T, width]
        src_gate = torch.cat([buf_gate[plan.buf_rows], gate.to(buf_gate.dtype)])
        if plan.num_windows:
            win_kv = src_kv[plan.window_rows]  # [W, m, width]
            raw_gate = src_gate[plan.window_rows]
            win_gate = raw_gate + self.ape
            if self.overlap:
                win_kv, win_gate = self._overlap(win_kv, raw_gate, win_gate, plan, state)
            pooled = self.norm_ops.gated_pool_rope(
                win_kv,
                win_gate,
                self.norm.weight,
                self.norm.eps,
                *rope,
            )  # normalised, at the window's position
            self.attention_ops.store_rows(pool, plan.entry_dst, pooled[plan.keep_windows])
        buf_kv[plan.left_dst] = src_kv[plan.left_src]
        buf_gate[plan.left_dst] = src_gate[plan.left_src]

    def _overlap(
        self,
        win_kv: torch.Tensor,
        raw_gate: torch.Tensor,
        win_gate: torch.Tensor,
        plan: CompressPlan,
        state: CompressorState,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[W, m, 2dim] -> [W, 2m, dim]: slots [previous window's Ca | this window's Cb].

        The previous window is the one before in this step, or the slot's overlap ring for a
        request's first window of the step; a request's window 0 has none (zero kv, -inf gate).
        The last windows' Ca halves go to the ring; gates are kept without the bias, which is
        added again (bit-identically) when they are used.
        """
        assert state.prev_kv is not None and state.prev_gate is not None
        dim, m = self.dim, self.ratio
        ring_kv = state.prev_kv.view(-1, m, dim)  # [slots * K, m, dim]: row slot * K + w % K
        ring_gate = state.prev_gate.view(-1, m, dim)
        ape_a = self.ape[:, :dim]
        cand_kv = torch.cat([ring_kv[plan.prev_slots], win_kv[..., :dim]])  # [R' + W, m, dim]
        cand_gate = torch.cat([ring_gate[plan.prev_slots] + ape_a, win_gate[..., :dim]])
        has_prev = plan.has_prev.view(-1, 1, 1).bool()
        prev_kv = torch.where(has_prev, cand_kv[plan.prev_src], 0)
        prev_gate = torch.where(has_prev, cand_gate[plan.prev_src], float("-inf"))
        ring_kv[plan.prev_dst] = win_kv[plan.last_window, :, :dim].to(ring_kv.dtype)
        ring_gate[plan.prev_dst] = raw_gate[plan.last_window, :, :dim].to(ring_gate.dtype)
        new_kv = torch.cat([prev_kv.to(win_kv.dtype), win_kv[..., dim:]], dim=1)  # [W, 2m, dim]
        new_gate = torch.cat([prev_gate.to(win_gate.dtype), win_gate[..., dim:]], dim=1)
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
        self.compressor = Compressor(args, self.head_dim, self.ratio, kernels)

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        layer_id: int,
        projected: dict[nn.Module, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """[T, k] entry-pool rows each query token attends to (-1 = none), k <= index_topk.
        ``projected``: the projections of x a fused GEMM computed (``FusedLinears.outputs``)."""
        meta = batch.metadata
        assert meta is not None, "the model builds the step metadata before the layers"
        pool = cache[layer_id, "index_keys"].flatten(0, 1)  # [blocks * entries per block, Di]
        plan = meta.compress[self.ratio]
        state = CompressorState.of(cache, layer_id, "idx")
        self.compressor(x, plan, state, pool, batch.rope[windows(self.ratio)], projected)
        q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)  # [T, Hi, Di]
        q = self.kernels.norm.apply_rope(q, *batch.rope["compress"])
        weights = project(self.weights_proj, x, projected).float() * self.n_heads**-0.5  # [T, Hi]
        entry_rows = meta.entry_rows[self.ratio]
        scores = self.kernels.attention.indexer_scores(
            q, weights, pool, entry_rows, meta.token_req, meta.num_visible[self.ratio]
        )  # [T, N]
        return self.kernels.attention.indexer_topk(scores, entry_rows, meta.token_req, self.topk)
