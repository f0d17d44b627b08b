"""DeepSeek-V4.1, as DeepSeek's engine implements it, on paged KV caches.

Parameter names are the release's (``layers.3.attn.wq_a.weight``, ``mtp.0.main_proj.weight``),
except that routed experts are stacked per layer (``ffn.experts.w1`` [E, I, D]). Shapes: T =
tokens in the flat batch, D = hidden size, H = attention heads, hd = head dim, hc = residual
streams, Hi / Di = indexer heads / head dim.

Per layer (shifted hyper-connections: each sub-layer's input collapses the streams with the
mix the *previous* sub-layer computed; the first uses stream 0, the last mix feeds the head)::

    x [T, hc, D] --engram (its layers)--> --hc(pre of the last sub-layer)--> attn_norm
        -> Attention --hc_post--> x --hc(pre of attention)--> ffn_norm -> MoE --hc_post--> x

Attention on a compressed layer (ratio 1 or 2) reads the compressed entries of its KV source
and the top-k its index source selected; the sources compute them for their segment (one
forward: ``CrossLayer`` carries them from layer to layer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch
from deepinfer.model.deepseek_v4.compress_plan import CompressPlan
from deepinfer.model.deepseek_v4.compressor import CompressorState, compress_rows
from deepinfer.model.deepseek_v4.model import MLP, MoE, register_hc_parameters
from deepinfer.model.deepseek_v41.args import ModelArgs
from deepinfer.model.deepseek_v41.engram import Engram, EngramTables, hash_params, ngram_hashes
from deepinfer.model.deepseek_v41.step_plan import StepMetadata, build_metadata
from deepinfer.model.deepseek_v41.vision import ImageEncoder
from deepinfer.model.layers import (
    FusedLinears,
    RMSNorm,
    grouped_linear,
    inverse,
    linear,
    project,
    step_rope,
)
from deepinfer.ops import Kernels, reference_kernels
from deepinfer.ops.norm import rope_cos_sin, rope_inv_freq


@dataclass
class CrossLayer:
    """What source layers hand to later layers within one forward (each value is the nearest
    source's: segments are contiguous and layers run in order).

    pre_rope: [W, hd] the KV source's compressed entries of this step before RoPE (its
    index-key source projects them); topk: [T, k] entry-pool rows the index source selected;
    candidates: [T, N] bool, entries inside the candidate source's blocks; shared_hidden:
    [T, D] the YoCo boundary layer's attention input (the consumer half's KV sources compress
    it instead of their own), over every row of the step; full_plans: under a compact YoCo
    truncation, the step's plans over every row (the consumer half's compressors run on them,
    its attention on the kept rows).
    """

    pre_rope: torch.Tensor | None = None
    topk: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    shared_hidden: torch.Tensor | None = None
    full_plans: StepMetadata | None = None
    # DSpark served: each target layer's input streams averaged [T', D], by its index in
    # dspark_target_layer_ids, and the batch of those rows (the consumer half's under YoCo).
    features: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    feature_batch: ForwardBatch | None = None
    # RoPE tables at the positions of a plan's windows, by id(plan): computed by the first
    # compressor or index-key source that needs them in this forward, read by the rest.
    window_rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=dict
    )

    def windows_rope(
        self, plan: CompressPlan, ratio: int, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at ``plan``'s windows' positions (window id * ratio), once a forward."""
        if id(plan) not in self.window_rope:
            self.window_rope[id(plan)] = rope_cos_sin(plan.window_ids * ratio, inv_freq)
        return self.window_rope[id(plan)]


class Compressor(nn.Module):
    """C2: softmax-gated pooling of every 2 tokens' latents (per channel) into one entry; C1:
    each token's latent is its entry. Then RMSNorm and RoPE at position w * ratio. Windows are
    aligned to absolute position 0 and never overlap; there is no position bias."""

    def __init__(self, args: ModelArgs, ratio: int, kernels: Kernels) -> None:
        super().__init__()
        self.ratio, self.norm_ops = ratio, kernels.norm
        self.wkv = linear(args.hidden_size, args.head_dim)
        if ratio > 1:
            self.wgate = linear(args.hidden_size, args.head_dim)
        self.norm = RMSNorm(args.head_dim, args.rms_norm_eps, kernels.norm)

    def forward(
        self,
        x: torch.Tensor,
        plan: CompressPlan,
        state: CompressorState | None,
        pool: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        projected: dict[nn.Module, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Write the entries of the windows this step closes into ``pool`` (flat [rows, hd]);
        returns them before RoPE [W, hd] (the indexer's keys are projected from those).
        ``rope``: cos, sin at the plan's windows' positions (``CrossLayer.windows_rope``);
        ``projected``: wkv(x), wgate(x) where a fused GEMM computed them."""
        kv = project(self.wkv, x, projected)  # [T, hd]
        if state is None:  # C1: a window is one token, nothing waits in a buffer
            pre_rope = self.norm(kv[plan.window_rows[:, 0]])
        else:
            gate = project(self.wgate, x, projected)
            pre_rope = self.norm_ops.compress_windows(
                kv, gate, compress_rows(plan, state), None, self.norm.weight, self.norm.eps
            )  # [W, hd], and the buffer ring kept
        entries = self.norm_ops.apply_rope(pre_rope, *rope)  # at the windows' positions
        pool[plan.entry_dst] = entries.to(pool.dtype)
        return pre_rope


class Indexer(nn.Module):
    """Lightning indexer of an index source: per query, the top-k compressed entries by
    sum_h w_h * relu(q_h . k). Its keys are ``wk`` + ``k_norm`` + RoPE of the KV source's
    pre-RoPE entries, written by the index-key source (``owns_keys``) and read by the rest of
    its segment. A candidate source also picks the blocks later indexers are confined to."""

    def __init__(self, args: ModelArgs, layer_id: int, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.ratio = args.ratio(layer_id)
        self.n_heads, self.head_dim, self.topk = (
            args.index_n_heads,
            args.index_head_dim,
            args.index_topk,
        )
        self.keys_layer = args.index_k_source(layer_id)
        self.owns_keys = self.keys_layer == layer_id
        self.is_candidate_source = args.candidate_source_layer_id == layer_id
        self.is_candidate_bound = args.candidate_source(layer_id) is not None
        self.candidate_blocks, self.candidate_block_size = (
            args.candidate_topk_blocks,
            args.candidate_block_size,
        )
        self.wq_b = linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = linear(args.hidden_size, self.n_heads)
        if self.owns_keys:
            self.wk = linear(args.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, kernels.norm)

    def write_keys(
        self,
        pre_rope: torch.Tensor,
        plan: CompressPlan,
        cache: KVCache,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """The keys of this step's closed windows into this layer's index-key pool."""
        pool = cache[self.keys_layer, "index_keys"].flatten(0, 1)  # [blocks * per block, Di]
        keys = self.k_norm(self.wk(pre_rope))  # [W, Di]
        keys = self.kernels.norm.apply_rope(keys, *rope)  # at the windows' positions
        pool[plan.entry_dst] = keys.to(pool.dtype)

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        cross: CrossLayer,
        projected: dict[nn.Module, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """[T, k] entry-pool rows each query attends to (-1 = none), k <= index_topk.
        ``projected``: weights_proj(x) and wq_b(qr) where fused GEMMs computed them."""
        meta = batch.metadata
        assert isinstance(meta, StepMetadata), "the model builds the step metadata first"
        pool = cache[self.keys_layer, "index_keys"].flatten(0, 1)
        q = project(self.wq_b, qr, projected).view(-1, self.n_heads, self.head_dim)  # [T, Hi, Di]
        # [T, Hi], unscaled: a common scale would not reorder the entries.
        weights = project(self.weights_proj, x, projected)
        entry_rows, num_visible = meta.entry_rows[self.ratio], meta.num_visible[self.ratio]
        scores = self.kernels.attention.indexer_scores(
            q, weights, pool, entry_rows, meta.token_req, num_visible,
            q_rope=batch.rope["compress"],
        )  # [T, N], q roped in the scores' launch  # fmt: skip
        if self.is_candidate_source:
            cross.candidates = candidate_entries(
                scores, num_visible, self.candidate_block_size, self.candidate_blocks
            )
        elif self.is_candidate_bound:
            assert cross.candidates is not None, "the candidate source runs first"
            scores = scores.masked_fill(~cross.candidates, float("-inf"))
        return self.kernels.attention.indexer_topk(scores, entry_rows, meta.token_req, self.topk)


def top_entries(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best columns of each row, ties to the lower column: scores [T, N] -> (values,
    indices) [T, min(k, N)]. Ties are common (a score is exactly 0 wherever every head's ReLU
    is), and which tied entry is chosen must not depend on N or on the batch."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def candidate_entries(
    scores: torch.Tensor, num_visible: torch.Tensor, block_size: int, num_blocks: int
) -> torch.Tensor:
    """Candidate blocks: entries grouped ``block_size`` at a time (by entry id), a block scored
    by its best visible entry, the last visible block always chosen (score +inf), the top
    ``num_blocks`` kept. scores [T, N] (-inf past num_visible [T]) -> [T, N] bool."""
    num_q, n = scores.shape
    nb = -(-n // block_size)
    padded = F.pad(scores, (0, nb * block_size - n), value=float("-inf"))
    block_scores = padded.view(num_q, nb, block_size).amax(dim=-1)  # [T, nb]
    last = (num_visible + block_size - 1) // block_size - 1  # [T], -1: nothing visible
    has_last = (last >= 0).unsqueeze(1)
    last_col = last.clamp(min=0).unsqueeze(1)
    block_scores = block_scores.scatter(
        1, last_col, torch.where(has_last, float("inf"), block_scores.gather(1, last_col))
    )
    _, chosen = top_entries(block_scores, num_blocks)  # [T, k]
    keep = torch.zeros(num_q, nb, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, chosen, True)
    return keep.repeat_interleave(block_size, dim=1)[:, :n]


class Attention(nn.Module):
    """Shared-KV MQA (one hd-wide head used as K and V) over a sliding window plus, on C1/C2
    layers, the top-k compressed entries; per-head sinks; inverse RoPE on the output; grouped
    low-rank output projection. The compressor and the indexer exist on their sources only."""

    def __init__(self, args: ModelArgs, layer_id: int, kernels: Kernels, *, ratio: int) -> None:
        super().__init__()
        self.kernels, self.layer_id, self.ratio = kernels, layer_id, ratio
        self.n_heads, self.head_dim = args.num_heads, args.head_dim
        self.o_groups = args.o_groups
        self.rope_kind = "compress" if ratio else "main"
        self.wq_a = linear(args.hidden_size, args.q_lora_rank)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps, kernels.norm)
        self.wq_b = linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.wkv = linear(args.hidden_size, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, args.rms_norm_eps, kernels.norm)
        group_in = self.n_heads * self.head_dim // self.o_groups
        self.wo_a = linear(group_in, self.o_groups * args.o_lora_rank)
        self.wo_b = linear(self.o_groups * args.o_lora_rank, args.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.is_yoco_boundary = layer_id == args.n_prefill_layer
        self.fused = FusedLinears([])
        self.fused_q = FusedLinears([])
        if not ratio:
            return
        self.kv_layer = args.kv_source(layer_id)
        self.compresses_shared = layer_id >= args.n_prefill_layer
        if self.kv_layer == layer_id:
            self.compressor = Compressor(args, ratio, kernels)
        if args.index_source(layer_id) == layer_id:
            self.indexer = Indexer(args, layer_id, kernels)

    def fuse_inputs(self) -> int:
        """Once the weights are loaded: one GEMM for the projections of x (wq_a, wkv, the
        indexer's weights_proj, and the compressor's wkv and wgate where it reads x, not the
        YoCo shared hidden state), and on an index source one for those of qr (wq_b and the
        indexer's). Returns how many it joined (V4's ``Attention.fuse_inputs``)."""
        modules = [self.wq_a, self.wkv]
        if hasattr(self, "indexer"):
            modules.append(self.indexer.weights_proj)
            self.fused_q = FusedLinears([self.wq_b, self.indexer.wq_b], self.kernels.linear)
        if hasattr(self, "compressor") and not self.compresses_shared:
            modules.append(self.compressor.wkv)
            if self.ratio > 1:
                modules.append(self.compressor.wgate)
        self.fused = FusedLinears(modules, self.kernels.linear)
        return len(self.fused.modules) + len(self.fused_q.modules)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        cross: CrossLayer,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        """x: [T, D] -> [T, D]. Writes this step's window rows (and, on sources, compressed
        entries and index keys)."""
        cos, sin = batch.rope[self.rope_kind]
        norm = self.kernels.norm
        projected = self.fused.outputs(x)
        qr = self.q_norm(project(self.wq_a, x, projected))  # [T, q_lora]
        projected |= self.fused_q.outputs(qr)  # the modules are distinct: one map for both
        q = project(self.wq_b, qr, projected).view(-1, self.n_heads, self.head_dim)
        q = norm.apply_rope(q, cos, sin)
        kv = project(self.wkv, x, projected)
        kv = norm.rms_norm_rope(kv, self.kv_norm.weight, self.kv_norm.eps, cos, sin)
        meta = batch.metadata
        assert isinstance(meta, StepMetadata), "the model builds the step metadata first"
        ring = cache[self.layer_id, "ring"].flatten(0, 1)  # [slots * ring, hd]
        sources = [(kv, meta.win_step_idx), (ring, meta.win_ring_idx)]
        if self.ratio:
            sources.append(self._compressed(x, qr, batch, cache, cross, inv_freq, projected))
        # V carried RoPE: the output rotated back at the query position, in its store.
        out = self.kernels.attention.sparse_attention(
            q, sources, self.attn_sink, self.head_dim**-0.5, batch.rope[inverse(self.rope_kind)]
        )
        self.kernels.attention.store_rows(ring, meta.ring_dst, kv, meta.ring_src)
        groups = out.view(-1, self.o_groups, self.n_heads // self.o_groups * self.head_dim)
        low_rank = grouped_linear(self.wo_a, groups).flatten(1)  # [T, G*o_lora]
        return self.wo_b(low_rank)

    def _compressed(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        cross: CrossLayer,
        inv_freq: torch.Tensor,
        projected: dict[nn.Module, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the KV source's entry pool, the selected rows of it): sources compute and hand on,
        consumers read. ``projected``: the fused projections of x (``fuse_inputs``)."""
        meta = batch.metadata
        assert isinstance(meta, StepMetadata)
        plan = (cross.full_plans or meta).compress[self.ratio]  # every row's windows
        pool = cache[self.kv_layer, "entries"].flatten(0, 1)  # [blocks * per block, hd]
        if hasattr(self, "compressor"):
            state = None
            if self.ratio > 1:
                state = CompressorState.of(cache, self.layer_id, "comp")
            source_x = cross.shared_hidden if self.compresses_shared else x
            assert source_x is not None, "the YoCo boundary layer is a KV source and runs first"
            fused = None if self.compresses_shared else projected  # they project x only
            rope = cross.windows_rope(plan, self.ratio, inv_freq)
            cross.pre_rope = self.compressor(source_x, plan, state, pool, rope, fused)
        if hasattr(self, "indexer"):
            if self.indexer.owns_keys:
                assert cross.pre_rope is not None, "the KV source runs first"
                rope = cross.windows_rope(plan, self.ratio, inv_freq)
                self.indexer.write_keys(cross.pre_rope, plan, cache, rope)
            cross.topk = self.indexer(x, qr, batch, cache, cross, projected)
        assert cross.topk is not None, "the index source runs first"
        return pool, cross.topk


class Gate(nn.Module):
    """Router: sqrt(softplus) scores; top-k by scores + a correction bias (``bias_vl`` for an
    image's positions: ids past the vocabulary, ``vision_args.py``), selection only; weights =
    the chosen scores renormalised and scaled."""

    def __init__(self, args: ModelArgs, num_experts: int, topk: int) -> None:
        super().__init__()
        self.topk, self.route_scale = topk, args.routed_scaling_factor
        self.vocab_size = args.vocab_size
        self.weight = nn.Parameter(torch.zeros(num_experts, args.hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
        scores = F.softplus(F.linear(x, self.weight).float()).sqrt()  # [T, E]
        is_image = (input_ids >= self.vocab_size).unsqueeze(1)
        bias = torch.where(is_image, self.bias_vl, self.bias)  # [T, E]
        ids = torch.topk(scores + bias, self.topk, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, ids


class Block(nn.Module):
    """One decoder layer: (engram,) attention and MoE, each between shifted hyper-connections."""

    def __init__(
        self,
        args: ModelArgs,
        layer_id: int,
        kernels: Kernels,
        num_local: int,
        *,
        ratio: int,
        num_experts: int,
        topk: int,
    ) -> None:
        super().__init__()
        self.args, self.kernels = args, kernels
        register_hc_parameters(self, args.hc_mix_size, args.hc_mult * args.hidden_size)
        if args.engram is not None and layer_id in args.engram.layer_ids:
            self.engram = Engram(
                args.engram, layer_id, args.hidden_size, args.hc_mult, args.rms_norm_eps
            )
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels.norm)
        self.attn = Attention(args, layer_id, kernels, ratio=ratio)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels.norm)
        # Index of this layer among the drafter's targets (DSpark served), else None.
        targets = args.dspark.target_layer_ids if args.dspark_served and args.dspark else ()
        self.target_index = targets.index(layer_id) if layer_id in targets else None
        gate = Gate(args, num_experts, topk)
        # V4's MoE (shared expert, routed experts through kernels.moe) with V4.1's router.
        self.ffn = MoE(args, layer_id, kernels, num_local, gate=gate)  # type: ignore[arg-type]

    def forward(
        self,
        x: torch.Tensor,
        pre: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        cross: CrossLayer,
        engram_rows: torch.Tensor | None,
        inv_freq: torch.Tensor,
        consumer: ForwardBatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [T, hc, D], the previous sub-layer's pre [T, hc]) -> the same after this layer.

        ``consumer`` (the YoCo boundary of a truncated step): the consumer half's batch. The
        attention input is computed for every row (the shared hidden the consumer half's KV
        sources compress); from the attention on, the layer runs on the consumer's rows (compact:
        the kept ones, ``yoco_rows``; mask: all, with the narrowed windows). Returns [Tk, ...]
        then."""
        a, norm = self.args, self.kernels.norm
        hc = (a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps)
        if engram_rows is not None:
            gated = self.engram(x, engram_rows)
            # An image's positions keep their trunk (DeepSeek's engine masks them).
            x = (
                gated
                if batch.image_rows is None
                else gated.index_copy(0, batch.image_rows, x[batch.image_rows])
            )
        pre_attn, post, comb, h = norm.hc_pre_shifted(
            x, pre, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, *hc,
            block_norm=self.attn_norm.params,
        )  # fmt: skip
        if self.attn.is_yoco_boundary:
            cross.shared_hidden = h
        if consumer is not None:
            meta = batch.metadata
            assert isinstance(meta, StepMetadata)
            if meta.yoco_rows is not None:
                cross.full_plans = meta
                x, pre_attn, post, comb, h = (
                    t[meta.yoco_rows] for t in (x, pre_attn, post, comb, h)
                )
            batch = consumer
        if self.target_index is not None:  # the drafter reads this layer's input streams
            cross.features[self.target_index] = x.float().mean(dim=1).to(x.dtype)
            cross.feature_batch = batch
        out = self.attn(h, batch, cache, cross, inv_freq)
        x = norm.hc_post(out, x, post, comb)
        pre_ffn, post, comb, h = norm.hc_pre_shifted(
            x, pre_attn, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, *hc,
            block_norm=self.ffn_norm.params,
        )  # fmt: skip
        return norm.hc_post(self.ffn(h, batch.input_ids), x, post, comb), pre_ffn


class MTPLayer(Block):
    """One layer of the block drafter (``mtp.{i}``): a sliding-window decoder layer with its own
    MoE; the first also projects the target layers' features (``main_proj``, ``main_norm``),
    the last holds the Markov and confidence heads. Loaded and kept; speculative decoding runs
    it (the embedding and the LM head are the backbone's)."""

    def __init__(self, args: ModelArgs, index: int, kernels: Kernels) -> None:
        assert args.dspark is not None
        ds, d = args.dspark, args.hidden_size
        super().__init__(
            args,
            args.num_layers + index,
            kernels,
            ds.num_experts,
            ratio=0,
            num_experts=ds.num_experts,
            topk=ds.num_experts_per_tok,
        )
        if index == 0:
            self.main_proj = linear(len(ds.target_layer_ids) * d, d)
            self.main_norm = RMSNorm(d, args.rms_norm_eps, kernels.norm)
        if index == args.num_mtp_layers - 1:
            self.norm = RMSNorm(d, args.rms_norm_eps, kernels.norm)
            self.markov_head = nn.Module()
            self.markov_head.embed = nn.Embedding(args.vocab_size, ds.markov_rank)
            self.markov_head.head = linear(ds.markov_rank, args.vocab_size)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = linear(d + ds.markov_rank, 1)


class DeepseekV41(nn.Module):
    """Embedding -> hc_mult residual streams -> blocks -> the last mix -> norm -> head.

    ``experts``: the routed experts this rank holds (None: all); its kernels' MoE backend must
    then be the expert-parallel one over the ranks holding the rest."""

    def __init__(
        self, args: ModelArgs, kernels: Kernels | None = None, experts: range | None = None
    ) -> None:
        super().__init__()
        self.args = args
        kernels = kernels or reference_kernels()
        self.norm_ops = kernels.norm
        self.experts = experts or range(args.num_experts)
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        n = len(self.experts)
        self.layers = nn.ModuleList(
            Block(
                args,
                i,
                kernels,
                n,
                ratio=args.ratio(i),
                num_experts=args.num_experts,
                topk=args.num_experts_per_tok,
            )
            for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels.norm)
        self.head = linear(args.hidden_size, args.vocab_size)
        self.mtp = nn.ModuleList(MTPLayer(args, i, kernels) for i in range(args.num_mtp_layers))
        if args.vision is not None:
            self.image_encoder = ImageEncoder(args.vision, args.hidden_size, kernels.norm)
        if args.engram is not None:
            # Compressed-vocabulary id of every token id (the loader fills it from the
            # checkpoint's tokenizer): the engram hashes read n-grams of those.
            self.register_buffer(
                "engram_vocab", torch.zeros(args.vocab_size, dtype=torch.int64), persistent=True
            )
        self.init_buffers(None)

    def fuse_inputs(self) -> int:
        """After loading: each attention's dense projections of its input as one GEMM
        (``Attention.fuse_inputs``), and each shared expert's w1 and w3 (V4's
        ``MLP.fuse_inputs``). Returns the projections joined, over all layers."""
        return sum(m.fuse_inputs() for m in self.modules() if isinstance(m, Attention | MLP))

    def init_buffers(self, device: torch.device | None) -> None:
        """(Re)compute the RoPE inverse frequencies and the engram hash tables; needed after
        building on the meta device."""
        a = self.args
        for kind, rope in (("main", a.main_rope), ("compress", a.compress_rope)):
            inv_freq = rope_inv_freq(rope, a.rope_head_dim)
            if device is not None:
                inv_freq = inv_freq.to(device)
            self.register_buffer(f"{kind}_inv_freq", inv_freq, persistent=False)
        self.engram_tables = EngramTables.of(a.engram) if a.engram is not None else None
        self.engram_hash = {}
        if self.engram_tables is not None:
            self.engram_hash = {
                layer: hash_params(self.engram_tables, layer, device)
                for layer in self.engram_tables.layer_ids
            }

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run one step; returns logits [N, V] fp32 for ``batch.logits_indices``."""
        if batch.metadata is None:
            batch.metadata = build_metadata(batch, cache, self.args)
        meta = batch.metadata
        assert isinstance(meta, StepMetadata)
        meta.derive_lists()
        batch.rope = step_rope(
            batch.positions, {"main": self.main_inv_freq, "compress": self.compress_inv_freq}
        )
        engram_rows = self._engram_rows(batch, meta)
        h = self.embed_tokens(batch)  # [T, D]
        x = h.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()  # [T, hc, D]
        pre = torch.zeros(x.shape[0], self.args.hc_mult, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0  # the first sub-layer reads stream 0
        cross = CrossLayer()
        consumer = self._consumer_batch(batch, meta)
        for i, layer in enumerate(self.layers):
            rows = engram_rows.get(i)
            if i == self.args.n_prefill_layer and consumer is not None:
                args = (x, pre, batch, cache, cross, rows, self.compress_inv_freq)
                x, pre = layer(*args, consumer=consumer)
                batch = consumer
                continue
            x, pre = layer(x, pre, batch, cache, cross, rows, self.compress_inv_freq)
        if self.args.dspark_served:
            self._write_main_keys(cross, cache)
        x, pre = x[batch.logits_indices], pre[batch.logits_indices]  # [N, hc, D], [N, hc]
        collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)  # [N, D]
        return self.head(self.norm(collapsed)).float()

    def embed_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        """[T, D]: the token embeddings, and at image positions the vision tower's."""
        ids = batch.input_ids
        if batch.image_rows is None:
            return self.embed(ids)
        assert batch.image_embeds is not None
        h = self.embed(ids.clamp_max(self.args.vocab_size - 1))
        h[batch.image_rows] = batch.image_embeds.to(h.dtype)
        return h

    def _write_main_keys(self, cross: CrossLayer, cache: KVCache) -> None:
        """DSpark: every drafter layer's key of each token of the step, from the target layers'
        features (``main_norm(main_proj(cat))``, then the layer's own ``wkv`` and ``kv_norm``,
        roped at the token's position), into that layer's window ring by the step's ring plan
        (pads to the scratch slot's)."""
        batch = cross.feature_batch
        assert batch is not None and self.args.dspark is not None
        meta = batch.metadata
        assert isinstance(meta, StepMetadata)
        features = [cross.features[i] for i in range(len(self.args.dspark.target_layer_ids))]
        first = self.mtp[0]
        h = first.main_norm(first.main_proj(torch.cat(features, dim=-1)))  # [T', D]
        cos, sin = batch.rope["main"]
        for layer in self.mtp:
            attn = layer.attn
            norm = attn.kv_norm
            keys = self.norm_ops.rms_norm_rope(attn.wkv(h), norm.weight, norm.eps, cos, sin)
            ring = cache[attn.layer_id, "ring"].flatten(0, 1)
            attn.kernels.attention.store_rows(ring, meta.ring_dst, keys, meta.ring_src)

    @torch.inference_mode()
    def dspark_forward(
        self, batch: ForwardBatch, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's layers over a batch of draft blocks (``dspark.py`` plans it): logits
        [T, V] fp32 before the Markov correction, and the collapsed streams [T, D] before the
        last norm (the confidence head reads them)."""
        batch.rope = step_rope(batch.positions, {"main": self.main_inv_freq})
        x = self.embed(batch.input_ids).unsqueeze(1).expand(-1, self.args.hc_mult, -1)
        x = x.contiguous()  # [T, hc, D]
        pre = torch.zeros(x.shape[0], self.args.hc_mult, dtype=torch.float32, device=x.device)
        pre[:, 0] = 1.0
        cross = CrossLayer()
        for layer in self.mtp:
            x, pre = layer(x, pre, batch, cache, cross, None, self.compress_inv_freq)
        hidden = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)  # [T, D]
        return self.head(self.mtp[-1].norm(hidden)).float(), hidden

    def _consumer_batch(self, batch: ForwardBatch, meta: StepMetadata) -> ForwardBatch | None:
        """The consumer half's batch under a YoCo truncation that narrows this step (None:
        the step's own): compact, the kept rows' ids, positions and RoPE, logits rows among them;
        mask, the same rows with the narrowed windows."""
        plans = meta.consumer
        if plans is None:
            return None
        plans.derive_lists()
        if meta.yoco_rows is None:
            return dataclasses.replace(batch, metadata=plans)
        assert meta.yoco_logits is not None
        positions = batch.positions[meta.yoco_rows]
        return ForwardBatch(
            input_ids=batch.input_ids[meta.yoco_rows],
            positions=positions,
            seqs=batch.seqs,
            logits_indices=meta.yoco_logits,
            rope=step_rope(
                positions, {"main": self.main_inv_freq, "compress": self.compress_inv_freq}
            ),
            metadata=plans,
        )

    def _engram_rows(self, batch: ForwardBatch, meta: StepMetadata) -> dict[int, torch.Tensor]:
        """Each engram layer's table rows [T, R], hashed once per step from every token's
        n-gram window of compressed ids (the window's earlier tokens come from the step or,
        before its first token, from the request's history in the plan)."""
        if self.engram_tables is None:
            return {}
        assert meta.engram_history is not None and meta.engram_src is not None
        assert self.args.engram is not None
        pad = self.args.engram.pad_token_id
        ids = torch.cat([meta.engram_history, batch.input_ids])  # [H + T], -1: before position 0
        image = ids >= self.args.vocab_size
        ids = torch.where((ids < 0) | image, pad, ids)
        windows = self.engram_vocab[ids][meta.engram_src]  # [T, n] compressed, newest first
        # An n-gram stops at an image: the window from an image position back reads padding
        # (as DeepSeek's engine builds them; an image's own positions are all padding).
        cut = image[meta.engram_src].to(torch.int32).cumsum(dim=1) > 0
        windows = torch.where(cut, self.engram_vocab[pad], windows)
        return {
            layer: ngram_hashes(windows, self.engram_tables, layer, params)
            for layer, params in self.engram_hash.items()
        }

    @torch.inference_mode()
    def placeholder_step(self) -> None:
        """A step with no tokens of this rank while other ranks run theirs: every MoE layer's
        exchange, in layer order, as the forward would run them."""
        for layer in self.layers:
            layer.ffn.exchange_only(self.embed.weight.dtype)
