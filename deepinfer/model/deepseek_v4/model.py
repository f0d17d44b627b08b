"""DeepSeek-V4, as the paper and the upstream reference write it, on paged KV caches.

Parameter names are the upstream checkpoint's (``layers.3.attn.wq_a.weight``), except that
routed experts are stacked per layer (``ffn.experts.w1`` [E, I, D]); ``checkpoint.py`` maps every
naming onto these. Shapes: T = tokens in the flat batch, D = hidden size,
H = attention heads, hd = head dim, hc = hyper-connection streams.

Per layer:  x [T, hc, D] --hc_pre--> attn_norm -> Attention --hc_post--> x
                         --hc_pre--> ffn_norm  -> MoE       --hc_post--> x

(each norm applied by its hc_pre call: ``block_norm``, one launch with the collapse on Triton;
each hc_post and the hc_pre after it are one ``hc_post_pre`` call, across blocks too, which on
Triton computes the next mix in the exit's launch)

MTP layer (``mtp.{i}``, built when served): position p reads the stack's last hidden streams at
p and the embedding of token p + 1, and predicts token p + 2 (``mtp.py`` drives it)::

    hnorm(h_p) -> h_proj  +  enorm(embed(t_p+1)) -> e_proj  -> Block -> its hc head -> norm -> head
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch
from deepinfer.model.deepseek_v4.args import CSA, HASH_MOE, SLIDING, ModelArgs
from deepinfer.model.deepseek_v4.cache import kv_rows
from deepinfer.model.deepseek_v4.compressor import Compressor, CompressorState, Indexer, windows
from deepinfer.model.deepseek_v4.step_plan import CacheGeometry, build_metadata
from deepinfer.model.layers import (
    Fp8Linear,
    FusedLinears,
    RMSNorm,
    grouped_linear,
    inverse,
    linear,
    project,
    step_rope,
)
from deepinfer.ops import Kernels, reference_kernels
from deepinfer.ops.attention.kv_fp8 import KVSource
from deepinfer.ops.moe import (
    MXFP4_BLOCK,
    ExpertWeight,
    Fp8ExpertWeight,
    MoEBackend,
    Mxfp4Weight,
    to_fp8_experts,
)
from deepinfer.ops.norm import rope_cos_sin, rope_inv_freq
from deepinfer.ops.streams import beside

# A sub-layer's hyper-connection entry (hc_pre's result): post, comb, its block input.
HcEntry = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    """Shared-KV MQA (one hd-wide head used as K and V) over a sliding window plus, on CSA/HCA
    layers, compressed entries; per-head sinks; inverse RoPE on the output; grouped low-rank
    output projection."""

    def __init__(self, args: ModelArgs, layer_id: int, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.args = args
        self.layer_id = layer_id
        self.layer_type = args.layer_types[layer_id]
        self.ratio = args.compress_ratio(layer_id)
        self.n_heads, self.head_dim = args.num_heads, args.head_dim
        self.window, self.eps = args.sliding_window, args.rms_norm_eps
        self.o_groups = args.o_groups
        self.rope_kind = "main" if self.layer_type == SLIDING else "compress"
        self.wq_a = linear(args.hidden_size, args.q_lora_rank)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps, kernels.norm)
        self.wq_b = linear(args.q_lora_rank, self.n_heads * self.head_dim)
        self.wkv = linear(args.hidden_size, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, args.rms_norm_eps, kernels.norm)
        group_in = self.n_heads * self.head_dim // self.o_groups
        self.wo_a = linear(group_in, self.o_groups * args.o_lora_rank)
        self.wo_b = linear(self.o_groups * args.o_lora_rank, args.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        if self.ratio:
            self.compressor = Compressor(args, self.head_dim, self.ratio, kernels)
        if self.layer_type == CSA:
            self.indexer = Indexer(args, kernels)
        self.fused = FusedLinears([])
        self.fused_q = FusedLinears([])

    def fuse_inputs(self) -> int:
        """Once the weights are loaded: one GEMM for the projections of x (wq_a, wkv, the
        compressor's wkv and wgate, the indexer's weights_proj and its compressor's), and on
        CSA layers one for those of qr (wq_b and the indexer's), each of one kind
        (``FusedLinears``). Returns how many it joined (0: none)."""
        modules = [self.wq_a, self.wkv]
        if self.ratio:
            modules += [self.compressor.wkv, self.compressor.wgate]
        if self.layer_type == CSA:
            indexer = self.indexer
            modules += [indexer.weights_proj, indexer.compressor.wkv, indexer.compressor.wgate]
            self.fused_q = FusedLinears([self.wq_b, indexer.wq_b], self.kernels.linear)
        self.fused = FusedLinears(modules, self.kernels.linear)
        return len(self.fused.modules) + len(self.fused_q.modules)

    def compress(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        projected: dict[nn.Module, torch.Tensor],
    ) -> KVSource | None:
        """The compressors' step: every window it closes pooled into the entry pool (and on CSA
        layers the indexer's keys into theirs), the open windows' rows kept. Returns the entry
        pool (flat rows, ``kv_rows``); a layer without compression: None, nothing done."""
        if not self.ratio:
            return None
        meta = batch.metadata
        assert meta is not None, "the model builds the step metadata before the layers"
        plan, rope = meta.compress[self.ratio], batch.rope[windows(self.ratio)]
        pool = kv_rows(cache, (self.layer_id, "entries"), self.args)  # [blocks * rows, hd]
        state = CompressorState.of(cache, self.layer_id, "comp")
        self.compressor(x, plan, state, pool, rope, projected)
        if self.layer_type == CSA:
            self.indexer.compress(x, batch, cache, self.layer_id, projected)
        return pool

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """x: [T, D] -> [T, D]. Writes this step's window rows and compressed entries."""
        cos, sin = batch.rope[self.rope_kind]
        norm = self.kernels.norm
        projected = self.fused.outputs(x)
        # The compressors read only x's projections: they pool beside the queries' path.
        pooled = beside(
            self.ratio > 0 and self.kernels.side_stream, x.device, self.compress, x, batch, cache,
            projected,
        )  # fmt: skip
        qr = self.q_norm(project(self.wq_a, x, projected))  # [T, q_lora]
        projected |= self.fused_q.outputs(qr)  # the modules are distinct: one map for both
        q = project(self.wq_b, qr, projected).view(-1, self.n_heads, self.head_dim)  # [T, H, hd]
        meta = batch.metadata
        assert meta is not None, "the model builds the step metadata before the layers"
        ring = kv_rows(cache, (self.layer_id, "ring"), self.args)  # [slots * ring, hd]
        attention = self.kernels.attention
        # Where the step allows it (StepMetadata.ring_first), its keys go into the ring before
        # attention: a dense ring's from the norm's launch; a packed ring's by their own store,
        # for a backend that reads a packed window from the ring alone (window_from_ring).
        dense_ring = isinstance(ring, torch.Tensor)
        from_ring = meta.ring_first and not dense_ring and attention.window_from_ring(x.shape[0])
        ring_first = from_ring or (meta.ring_first and dense_ring)
        # q's and kv's norms in one launch, with one eps: both are args.rms_norm_eps.
        q, kv = norm.rms_norm_rope_pair(
            q, project(self.wkv, x, projected), (None, self.kv_norm.weight), self.eps, cos, sin,
            store=(ring, meta.ring_dst) if ring_first and dense_ring else None,
        )  # fmt: skip
        # Keys: this step's window rows (as the ring will hold them: FP8-rounded in an FP8
        # cache, so a key reads the same in its own step and later), earlier window rows from
        # the ring, compressed entries; the first two as one list of ring rows from_ring.
        if from_ring:
            attention.store_rows(ring, meta.ring_dst, kv)
            sources = [(ring, meta.ring_window())]
        else:
            window = attention.as_stored(ring, kv)
            sources = [(window, meta.win_step_idx), (ring, meta.win_ring_idx)]
        pool = pooled.wait()
        if pool is not None:
            if self.layer_type == CSA:
                entries = self.indexer(x, qr, batch, cache, self.layer_id, projected)
            else:
                entries = meta.visible_idx[self.ratio]
            sources.append((pool, entries))
        # V carried RoPE: the output rotated back at the query position, in its store.
        back = batch.rope[inverse(self.rope_kind)]
        out = attention.sparse_attention(q, sources, self.attn_sink, self.head_dim**-0.5, back)
        if not ring_first:
            attention.store_rows(ring, meta.ring_dst, kv, meta.ring_src)  # the gather in it
        groups = out.view(-1, self.o_groups, self.n_heads // self.o_groups * self.head_dim)
        low_rank = grouped_linear(self.wo_a, groups).flatten(1)  # [T, G*o_lora]
        return self.wo_b(low_rank)


class Gate(nn.Module):
    """Router: sqrt(softplus) scores; top-k by scores + bias (selection only) or by the token
    id's hash table; weights = the chosen scores renormalised and scaled. After its GEMM, the
    MoE backend's ``route`` (torch_ref.route says how; one launch on Triton)."""

    def __init__(self, args: ModelArgs, layer_id: int, moe_ops: MoEBackend) -> None:
        super().__init__()
        self.moe_ops = moe_ops
        self.is_hash = args.mlp_layer_types[layer_id] == HASH_MOE
        self.topk, self.route_scale = args.num_experts_per_tok, args.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(args.num_experts, args.hidden_size))
        if self.is_hash:
            self.register_buffer(
                "tid2eid", torch.zeros(args.vocab_size, self.topk, dtype=torch.int64)
            )
        else:
            self.bias = nn.Parameter(torch.zeros(args.num_experts, dtype=torch.float32))

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
        logits = F.linear(x, self.weight)  # [T, E]
        if self.is_hash:
            return self.moe_ops.route(
                logits, None, self.tid2eid[input_ids], self.topk, self.route_scale
            )
        return self.moe_ops.route(logits, self.bias, None, self.topk, self.route_scale)


class Experts(nn.Module):
    """Routed experts, stacked: w1/w3 [E, I, D], w2 [E, D, I]; E = the experts this rank holds
    (all of them, or its share under expert parallelism). Dense, or after ``to_mxfp4`` packed
    as the checkpoint ships them (``model.fp4_experts``): each ``wN`` uint8 [E, rows, cols/2]
    beside ``wN_scales`` uint8 [E, rows, cols/32] (``ops.moe.Mxfp4Weight``); after ``to_fp8``
    FP8 with 128 x 128 block scales (``ops.moe.Fp8ExpertWeight``)."""

    def __init__(self, args: ModelArgs, num_local: int) -> None:
        super().__init__()
        e, i, d = num_local, args.moe_intermediate_size, args.hidden_size
        self.shapes = {"w1": (e, i, d), "w2": (e, d, i), "w3": (e, i, d)}
        for name, shape in self.shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))
        self.max_scale: int | None = None  # packed: the largest scale byte (measure_scales)

    def measure_scales(self) -> None:
        """After loading packed experts: their largest scale byte, which ``weights()`` passes
        on (``Mxfp4Weight.max_scale``), so that a kernel exact only up to some byte can tell.
        One reduction and a host sync a layer, at load."""
        if self.packed:
            names = ("w1_scales", "w2_scales", "w3_scales")
            self.max_scale = max(int(self.get_parameter(n).max()) for n in names)

    def to_mxfp4(self) -> None:
        """Packed parameters in place of the dense ones (empty: the loader fills them)."""
        for name, (e, rows, cols) in self.shapes.items():
            for suffix, width in (("", cols // 2), ("_scales", -(-cols // MXFP4_BLOCK))):
                empty = torch.empty(e, rows, width, dtype=torch.uint8)
                self.register_parameter(name + suffix, nn.Parameter(empty, requires_grad=False))

    def to_fp8(self) -> None:
        """The loaded experts (dense or packed) converted in place to FP8 with 128 x 128 block
        scales (``ops.moe.to_fp8_experts``), for a MoE backend that takes them (``fp8_experts``):
        each ``wN`` float8_e4m3fn [E, rows, cols] beside ``wN_block_scale`` fp32. One projection
        at a time, so the old tensor is freed before the next is converted."""
        for name, weight in zip(("w1", "w2", "w3"), self.weights(), strict=True):
            fp8 = to_fp8_experts(weight)
            if hasattr(self, name + "_scales"):
                delattr(self, name + "_scales")
            self.register_parameter(name, nn.Parameter(fp8.weight, requires_grad=False))
            scale = nn.Parameter(fp8.scale, requires_grad=False)
            self.register_parameter(name + "_block_scale", scale)

    @property
    def packed(self) -> bool:
        return self.w1.dtype == torch.uint8

    def weights(self) -> tuple[ExpertWeight, ExpertWeight, ExpertWeight]:
        """(w1, w2, w3) as the MoE backends take them."""
        names = ("w1", "w2", "w3")
        if self.w1.dtype == torch.float8_e4m3fn:
            w1, w2, w3 = (
                Fp8ExpertWeight(self.get_parameter(n), self.get_parameter(n + "_block_scale"))
                for n in names
            )
            return w1, w2, w3
        if not self.packed:
            return self.w1, self.w2, self.w3
        w1, w2, w3 = (
            Mxfp4Weight(self.get_parameter(n), self.get_parameter(n + "_scales"), self.max_scale)
            for n in names
        )
        return w1, w2, w3

    @property
    def dim(self) -> int:
        return self.shapes["w2"][1]


def measure_expert_scales(model: nn.Module) -> None:
    """After loading: each packed ``Experts`` module's largest scale byte, in any model that
    holds them (V4, V4.1)."""
    for module in model.modules():
        if isinstance(module, Experts):
            module.measure_scales()


class MLP(nn.Module):
    """The shared expert: clamped SwiGLU (the activation through ``moe_ops.swiglu``, or in an
    FP8 w2's input quantization)."""

    def __init__(self, dim: int, inter_dim: int, limit: float, moe_ops: MoEBackend) -> None:
        super().__init__()
        self.limit, self.moe_ops = limit, moe_ops
        self.w1, self.w2, self.w3 = (
            linear(dim, inter_dim),
            linear(inter_dim, dim),
            linear(dim, inter_dim),
        )
        self.fused = FusedLinears([])

    def fuse_inputs(self) -> int:
        """Once the weights are loaded: w1 and w3 as one GEMM where both are dense."""
        self.fused = FusedLinears([self.w1, self.w3])
        return len(self.fused.modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projected = self.fused.outputs(x)
        gate, up = project(self.w1, x, projected), project(self.w3, x, projected)
        if isinstance(self.w2, Fp8Linear):
            return self.w2(gate, swiglu=(up, self.limit))
        return self.w2(self.moe_ops.swiglu(gate, up, self.limit))


class MoE(nn.Module):
    """Router, routed experts (through ``kernels.moe``, which may exchange tokens with other
    ranks), shared expert."""

    def __init__(
        self,
        args: ModelArgs,
        layer_id: int,
        kernels: Kernels,
        num_local: int,
        gate: nn.Module | None = None,
    ) -> None:
        """``gate``: another family's router (its ``topk`` routed experts a token); default
        V4's ``Gate``."""
        super().__init__()
        self.kernels = kernels
        self.limit = args.swiglu_limit
        self.gate = gate if gate is not None else Gate(args, layer_id, kernels.moe)
        self.topk = self.gate.topk
        self.experts = Experts(args, num_local)
        self.shared_experts = MLP(
            args.hidden_size, args.moe_intermediate_size, self.limit, kernels.moe
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        # The shared expert runs beside the router and the routed experts' first GEMMs, and its
        # output joins the routed sum in the MoE's last launch.
        shared = beside(self.kernels.side_stream, x.device, self.shared_experts, x)
        weights, ids = self.gate(x, input_ids)
        return self.kernels.moe.fused_moe(
            x, *self.experts.weights(), ids, weights, self.limit, residual=shared
        )

    def exchange_only(self, dtype: torch.dtype) -> None:
        """A placeholder step's part: the routed experts' call with no tokens of this rank, so
        that an expert-parallel backend serves this rank's experts to the others."""
        device = self.experts.w2.device
        x = torch.empty(0, self.experts.dim, dtype=dtype, device=device)
        ids = torch.empty(0, self.topk, dtype=torch.int64, device=device)
        weights = torch.empty(0, self.topk, dtype=torch.float32, device=device)
        self.kernels.moe.fused_moe(x, *self.experts.weights(), ids, weights, self.limit)


def register_hc_parameters(block: nn.Module, mix_size: int, width: int) -> None:
    """A layer's hyper-connection mixes, as the checkpoints name them: ``hc_{attn,ffn}_fn``
    [mix_size, hc * D], ``_base`` [mix_size], ``_scale`` [3]."""
    for site in ("attn", "ffn"):
        block.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(mix_size, width)))
        block.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix_size)))
        block.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, kernels: Kernels, num_local: int) -> None:
        super().__init__()
        self.args, self.kernels = args, kernels
        register_hc_parameters(self, args.hc_mix_size, args.hc_mult * args.hidden_size)
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels.norm)
        self.attn = Attention(args, layer_id, kernels)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels.norm)
        self.ffn = MoE(args, layer_id, kernels, num_local)

    def hc_entry(self, site: str) -> tuple[tuple, tuple[torch.Tensor, float]]:
        """The hyper-connection entry of the sub-layer at ``site`` ("attn", "ffn"): hc_pre's
        arguments after x (fn, scale, base, the constants) and its norm as block_norm."""
        a = self.args
        params = tuple(getattr(self, f"hc_{site}_{name}") for name in ("fn", "scale", "base"))
        norm = self.attn_norm if site == "attn" else self.ffn_norm
        return (*params, a.hc_sinkhorn_iters, a.hc_eps, a.rms_norm_eps), norm.params

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        entry: HcEntry | None = None,
        then: Block | None = None,
    ) -> tuple[torch.Tensor, HcEntry | None]:
        """x: [T, hc, D] -> ([T, hc, D], the next block's entry or None). ``entry``: this
        block's attention entry (post, comb, block input) when the block before computed it;
        ``then``: the block after, whose entry this one's exit computes (one hc_post_pre)."""
        norm = self.kernels.norm
        if entry is None:
            args, block_norm = self.hc_entry("attn")
            entry = norm.hc_pre(x, *args, block_norm=block_norm)
        post, comb, h = entry
        out = self.attn(h, batch, cache)
        args, block_norm = self.hc_entry("ffn")
        x, post, comb, h = norm.hc_post_pre(out, x, post, comb, *args, block_norm=block_norm)
        out = self.ffn(h, batch.input_ids)
        if then is None:
            return norm.hc_post(out, x, post, comb), None
        args, block_norm = then.hc_entry("attn")
        x, post, comb, h = norm.hc_post_pre(out, x, post, comb, *args, block_norm=block_norm)
        return x, (post, comb, h)


class MTPLayer(Block):
    """A next-token-prediction layer: a sliding-window ``Block`` (layer id ``num_layers + i``,
    its own window ring) over the stack's hidden streams and the next token's embedding, with
    its own hyper-connection head and final norm; the embedding and LM head are the stack's."""

    def __init__(self, args: ModelArgs, layer_id: int, kernels: Kernels, num_local: int) -> None:
        """``args``: the stack with its MTP layers appended (``ModelArgs.with_mtp``)."""
        super().__init__(args, layer_id, kernels, num_local)
        d, hc, eps = args.hidden_size, args.hc_mult, args.rms_norm_eps
        self.e_proj, self.h_proj = linear(d, d), linear(d, d)
        self.enorm = RMSNorm(d, eps, kernels.norm)
        self.hnorm = RMSNorm(d, eps, kernels.norm)
        self.norm = RMSNorm(d, eps, kernels.norm)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * d))
        self.hc_head_base = nn.Parameter(torch.zeros(hc))
        self.hc_head_scale = nn.Parameter(torch.ones(1))

    def forward(  # type: ignore[override]
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
    ) -> torch.Tensor:
        """hidden [T, hc, D] (the stack's at each position), embedded [T, D] (the next token's)
        -> the layer's output streams [T, hc, D]."""
        x = self.e_proj(self.enorm(embedded)).unsqueeze(1) + self.h_proj(self.hnorm(hidden))
        return super().forward(x, batch, cache)[0]


class DeepseekV4(nn.Module):
    """Embedding -> hc_mult residual streams -> blocks -> hyper-connection head -> norm -> head.

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
        self.layers = nn.ModuleList(Block(args, i, kernels, n) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels.norm)
        self.head = linear(args.hidden_size, args.vocab_size)
        hc = args.hc_mult
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * args.hidden_size))
        self.hc_head_base = nn.Parameter(torch.zeros(hc))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        if args.mtp_served:
            mtp_args = args.with_mtp()
            self.mtp = nn.ModuleList(
                MTPLayer(mtp_args, args.num_layers + i, kernels, n) for i in range(args.mtp_served)
            )
        self.init_rope(None)

    def fuse_inputs(self) -> int:
        """After loading: each attention's dense projections of its input as one GEMM
        (``Attention.fuse_inputs``), and each shared expert's w1 and w3 (``MLP.fuse_inputs``).
        Returns the projections joined, over all layers."""
        return sum(m.fuse_inputs() for m in self.modules() if isinstance(m, Attention | MLP))

    def init_rope(self, device: torch.device | None) -> None:
        """(Re)compute the RoPE inverse frequencies; needed after building on the meta device."""
        a = self.args
        for kind, rope in (("main", a.main_rope), ("compress", a.compress_rope)):
            inv_freq = rope_inv_freq(rope, a.rope_head_dim)
            if device is not None:
                inv_freq = inv_freq.to(device)
            self.register_buffer(f"{kind}_inv_freq", inv_freq, persistent=False)
        # The compressors' windows start at window_id * ratio: for a power-of-two ratio,
        # window_id * (ratio * f) is (window_id * ratio) * f exactly (forward's RoPE tables).
        for ratio in (a.csa_ratio, a.hca_ratio):
            if ratio & (ratio - 1) == 0:
                scaled = self.compress_inv_freq * ratio
                self.register_buffer(f"window_inv_freq{ratio}", scaled, persistent=False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run one step; returns logits [N, V] fp32 for ``batch.logits_indices``."""
        if batch.metadata is None:
            batch.metadata = build_metadata(batch, CacheGeometry.of(cache))
        batch.metadata.derive_lists()
        batch.rope = step_rope(
            batch.positions, {"main": self.main_inv_freq, "compress": self.compress_inv_freq}
        )
        for ratio, plan in batch.metadata.compress.items():  # once for the ratio's compressors
            scaled = getattr(self, f"window_inv_freq{ratio}", None)  # init_rope's
            if scaled is not None:
                rope = rope_cos_sin(plan.window_ids, scaled)
            else:
                rope = rope_cos_sin(plan.window_ids * ratio, self.compress_inv_freq)
            batch.rope[windows(ratio)] = rope
        h = self.embed(batch.input_ids)  # [T, D]
        x = h.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()  # [T, hc, D]
        entry = None  # each block's exit computes the next one's entry
        for i, layer in enumerate(self.layers):
            then = self.layers[i + 1] if i + 1 < len(self.layers) else None
            x, entry = layer(x, batch, cache, entry, then)
        if self.args.mtp_served:
            batch.hidden = x  # what the MTP layer reads after the step
        x = x[batch.logits_indices]  # [N, hc, D]
        normed = hc_head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self, self.norm)
        return self.head(normed).float()

    @torch.inference_mode()
    def mtp_forward(
        self, hidden: torch.Tensor, batch: ForwardBatch, cache: KVCache, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer ``layer`` over ``batch`` (sliding-window plans only; ``input_ids``: the
        token after each position) reading the stack's ``hidden`` [T, hc, D]. Returns (logits
        [N, V] fp32 of ``batch.logits_indices``, the layer's output streams [T, hc, D])."""
        assert batch.metadata is not None, "MTP batches come with their window plans"
        batch.metadata.derive_window_lists()
        batch.rope = step_rope(batch.positions, {"main": self.main_inv_freq})
        mtp = self.mtp[layer]
        x = mtp(hidden, self.embed(batch.input_ids), batch, cache)
        rows = x[batch.logits_indices]
        normed = hc_head(rows, mtp.hc_head_fn, mtp.hc_head_scale, mtp.hc_head_base, self, mtp.norm)
        return self.head(normed).float(), x

    @torch.inference_mode()
    def placeholder_step(self) -> None:
        """A step with no tokens of this rank while other ranks run theirs: every MoE layer's
        exchange, in layer order, as the forward would run them."""
        for layer in self.layers:
            layer.ffn.exchange_only(self.embed.weight.dtype)


def hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    model: DeepseekV4,
    norm: RMSNorm,
) -> torch.Tensor:
    """[N, hc, D] -> [N, D]: a hyper-connection head's sigmoid-weighted sum of the streams,
    through ``norm`` (the norm before the LM head), in the norm backend's ``hc_head``."""
    a = model.args
    return model.norm_ops.hc_head(
        x, fn, scale, base, a.hc_eps, a.rms_norm_eps, block_norm=(norm.weight, norm.eps)
    )
