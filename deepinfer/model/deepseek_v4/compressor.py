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
from deepinfer.ops.norm import CompressRows


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
        self.norm_ops, self.attention_ops = kernels.norm, kernels.attention
        # Upstream decides the overlapping layout by the ratio alone (CSA's 4).
        width = 2 * dim if ratio == 4 else dim
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
        dense = isinstance(pool, torch.Tensor)  # a dense pool takes the entries in the pooling
        rows = compress_rows(plan, state, pool if dense else None)
        pooled = self.norm_ops.compress_windows(
            kv, gate, rows, self.ape, self.norm.weight, self.norm.eps, *rope
        )  # [W, dim]: normalised, at the windows' positions
        if plan.num_windows and not dense:
            self.attention_ops.store_rows(pool, plan.entry_dst, pooled)


def compress_rows(
    plan: CompressPlan, state: CompressorState, entries: torch.Tensor | None = None
) -> CompressRows:
    """What ``compress_windows`` reads and writes: ``state``'s rings (flat), ``plan``'s indices
    (the overlap ring's only where the compressor has one) and the entry pool ``entries``
    (dense, flat), where given."""
    ring = {}
    if state.prev_kv is not None and state.prev_gate is not None:
        m = plan.window_rows.shape[1]
        ring = {
            "ring_kv": state.prev_kv.view(-1, m, state.prev_kv.shape[-1]),  # [slots * K, m, dim]
            "ring_gate": state.prev_gate.view(-1, m, state.prev_gate.shape[-1]),
            "prev_slots": plan.prev_slots,
            "prev_src": plan.prev_src,
            "has_prev": plan.has_prev,
            "last_window": plan.last_window,
            "prev_dst": plan.prev_dst,
        }
    return CompressRows(
        state.buf_kv.flatten(0, 1),
        state.buf_gate.flatten(0, 1),
        plan.buf_rows,
        plan.window_rows,
        plan.left_src,
        plan.left_dst,
        **ring,
        entries=entries,
        entry_dst=None if entries is None else plan.entry_dst,
        keep_in_pool=plan.one_token,
    )


def _key_pool(cache: KVCache, layer_id: int) -> torch.Tensor:
    """A CSA layer's index keys, flat: [blocks * entries per block, Di]."""
    return cache[layer_id, "index_keys"].flatten(0, 1)


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

    def compress(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        layer_id: int,
        projected: dict[nn.Module, torch.Tensor] | None = None,
    ) -> None:
        """The step's windows of index keys pooled into the layer's key pool (before
        ``forward``, which reads it). ``projected``: as ``forward``'s."""
        meta = batch.metadata
        assert meta is not None, "the model builds the step metadata before the layers"
        pool = _key_pool(cache, layer_id)
        plan = meta.compress[self.ratio]
        state = CompressorState.of(cache, layer_id, "idx")
        self.compressor(x, plan, state, pool, batch.rope[windows(self.ratio)], projected)

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        layer_id: int,
        projected: dict[nn.Module, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """[T, k] entry-pool rows each query token attends to (-1 = none), k <= index_topk, once
        ``compress`` has pooled the step's keys. ``projected``: the projections of x (and wq_b's
        of qr) a fused GEMM computed (``FusedLinears.outputs``)."""
        meta = batch.metadata
        assert meta is not None, "the model builds the step metadata before the layers"
        pool = _key_pool(cache, layer_id)
        q = project(self.wq_b, qr, projected).view(-1, self.n_heads, self.head_dim)  # [T, Hi, Di]
        weights = project(self.weights_proj, x, projected)  # [T, Hi], scaled by Hi^-0.5 in the op
        entry_rows, visible = meta.entry_rows[self.ratio], meta.num_visible[self.ratio]
        return self.kernels.attention.indexer_select(
            q, weights, pool, entry_rows, meta.token_req, visible, self.topk, self.n_heads**-0.5,
            batch.rope["compress"],
        )  # q roped in the scores' launch, the top-k after them in it  # fmt: skip
