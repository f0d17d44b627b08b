"""Parameter names: what our DeepSeek-V4 model holds, and how checkpoint names map onto it.

Our names are DeepSeek's upstream checkpoint names, except that routed experts are stacked
(``layers.{i}.ffn.experts.w1`` [E, I, D] instead of ``ffn.experts.{e}.w1.weight`` [I, D]).
Three checkpoint namings reach the loader:

- upstream (the DeepSeek release): ``layers.0.attn.wq_a.weight``,
  ``layers.0.ffn.experts.3.w1.weight``, FP8/FP4 block scales as ``<module>.scale``;
- transformers (``model.state_dict()``): ``model.layers.0.self_attn.q_a_proj.weight``,
  ``model.layers.0.mlp.experts.gate_up_proj`` [E, 2I, D] = cat(w1, w3, dim=1), scales as
  ``<weight>_scale_inv``;
- hybrid (what transformers 5.23 ``save_pretrained`` writes: its reverse conversion mapping is
  only partly applied): upstream layer names under ``model.``, per-expert tensors, plus
  ``model.embed_tokens.weight``, ``model.hc_head.hc_fn``, ``model.norm.weight``, ``head.weight``,
  and ``model.layers.{i}.attn.norm.weight`` for the attention kv_norm.

The transformers table below is the inverse of ``conversion_mapping.py["deepseek_v4"]``
(transformers 5.23.0). Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from deepinfer.model.deepseek_v4.args import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelArgs

# transformers name (after ``model.`` and ``layers.{i}.``) -> upstream name.
_HF_LAYER_NAMES = {
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    # save_pretrained quirk: reversing ``.norm.`` -> ``.kv_norm.`` (meant for the compressors)
    # also hits the attention's own kv_norm.
    "attn.norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.experts.down_proj": "ffn.experts.w2",
}
_HF_TOP_NAMES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_LAYER_RE = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^(?:ffn|mlp)\.experts\.(\d+)\.(w[123])\.weight$")
_GATE_UP_NAMES = ("ffn.experts.gate_up_proj", "mlp.experts.gate_up_proj")
_MTP_RE = re.compile(r"^(?:model\.)?mtp\.(\d+)\.")


@dataclass(frozen=True)
class TensorTarget:
    """Where one checkpoint tensor lands in our state dict (produced by ``map_checkpoint_name``).

    - kind "copy": the tensor is ``names[0]`` as is.
    - kind "expert": it is slot ``expert`` of the stacked ``names[0]`` ([E, ...]).
    - kind "gate_up": transformers' fused [E, 2I, D]; rows [:, :I] are ``names[0]`` (w1) and
      rows [:, I:] are ``names[1]`` (w3).
    """

    kind: str
    names: tuple[str, ...]
    expert: int = -1


def map_checkpoint_name(name: str) -> TensorTarget | None:
    """Our name for a checkpoint tensor in any of the three namings (the MTP layers',
    ``mtp.{i}.*``, as upstream names them).

    Names we do not know pass through unchanged, so that the loader reports them as unexpected.
    Quantization scales are paired with their weights by ``find_scales`` before this is called.
    """
    short = name.removeprefix("model.")
    m = _LAYER_RE.match(short)
    if m is None:
        return TensorTarget("copy", (_HF_TOP_NAMES.get(short, short),))
    prefix, rest = f"{m.group(1)}.{m.group(2)}.", m.group(3)
    if rest in _GATE_UP_NAMES:
        return TensorTarget("gate_up", (prefix + "ffn.experts.w1", prefix + "ffn.experts.w3"))
    e = _EXPERT_RE.match(rest)
    if e is not None:
        return TensorTarget("expert", (f"{prefix}ffn.experts.{e.group(2)}",), int(e.group(1)))
    return TensorTarget("copy", (prefix + _HF_LAYER_NAMES.get(rest, rest),))


def skips_unserved_mtp(name: str, args: ModelArgs) -> bool:
    """A checkpoint tensor the model does not hold: an MTP layer's (``mtp.{i}.*``) that is not
    served (transformers ignores them all, ``_keys_to_ignore_on_load_unexpected``)."""
    m = _MTP_RE.match(name)
    return m is not None and int(m.group(1)) >= args.mtp_served


def find_scales(names: Iterable[str]) -> dict[str, str]:
    """Pair quantized weights with their block scales: {weight name: scale name}.

    Upstream ships ``X.weight`` + ``X.scale``; transformers ``X.weight`` + ``X.weight_scale_inv``
    (or ``gate_up_proj`` + ``gate_up_proj_scale_inv``). A ``.scale`` without a sibling
    ``.weight`` is a parameter (``attn_hc.scale``), not a quantization scale.
    """
    present = set(names)
    pairs = {}
    for s in present:
        if s.endswith("_scale_inv"):
            w = s.removesuffix("_scale_inv")
        elif s.endswith(".scale"):
            w = s.removesuffix(".scale") + ".weight"
        else:
            continue
        if w in present:
            pairs[w] = s
    return pairs


# Linears the model calls as modules (``self.wq_a(x)``, wo_a through ``grouped_linear``): the ones
# whose FP8 checkpoint weight may stay FP8 (model.fp8_weights). Not the router, the embedding, the
# LM head or the stacked routed experts.
_FP8_LINEAR_RE = re.compile(
    r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|compressor\.(wkv|wgate)|indexer\.(wq_b|weights_proj)"
    r"|shared_experts\.w[123]|e_proj|h_proj)\.weight$"
)


def is_fp8_linear(name: str) -> bool:
    """True for (our) weight names of the linears that can run on FP8 weights (``Fp8Linear``)."""
    return _FP8_LINEAR_RE.search(name) is not None


def fp8_scale_name(name: str) -> str:
    """Our name of an FP8 weight's block scales, as upstream names them:
    ``layers.0.attn.wq_a.weight`` -> ``layers.0.attn.wq_a.scale``."""
    assert name.endswith(".weight"), name
    return name.removesuffix(".weight") + ".scale"


def mxfp4_scale_name(name: str) -> str:
    """Our name of packed routed experts' ue8m0 scales (``model.fp4_experts``):
    ``layers.0.ffn.experts.w1`` -> ``layers.0.ffn.experts.w1_scales``."""
    assert is_stacked_experts(name), name
    return name + "_scales"


# Parameters transformers and upstream keep in fp32 whatever the compute dtype: norm weights,
# hyper-connection mixing, attention sinks, compressor position biases, router correction bias.
_FP32_SUFFIXES = ("norm.weight", "attn_sink", ".ape", "gate.bias", "_fn", "_base", "_scale")


def is_fp32_param(name: str) -> bool:
    """True for (our) parameter names that stay fp32 when the model runs in bf16."""
    return name.endswith(_FP32_SUFFIXES)


def is_integer_param(name: str) -> bool:
    """The dtype rule: ``tid2eid`` (hash routing table) is int64, every other tensor floating."""
    return name.endswith(".tid2eid")


def is_stacked_experts(name: str) -> bool:
    """True for (our) names of the stacked routed-expert tensors ([E, ...])."""
    return _STACKED_RE.search(name) is not None


_STACKED_RE = re.compile(r"\.ffn\.experts\.w[123]$")


def expected_shapes(args: ModelArgs, num_experts: int | None = None) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model, in our names, with its shape (routed experts stacked, their
    first dimension ``num_experts``: the experts one rank holds; None: all of them).

    Order: embed, then layer by layer, then the head; deterministic, so ``tiny.py`` draws
    random weights in this order.
    """
    d, hc = args.hidden_size, args.hc_mult
    e = num_experts or args.num_experts
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (args.vocab_size, d)}
    for i, (attn_type, mlp_type) in enumerate(
        zip(args.layer_types, args.mlp_layer_types, strict=True)
    ):
        shapes.update(_block_shapes(args, f"layers.{i}.", attn_type, mlp_type, e))
    shapes["hc_head_fn"] = (hc, hc * d)
    shapes["hc_head_base"] = (hc,)
    shapes["hc_head_scale"] = (1,)
    shapes["norm.weight"] = (d,)
    shapes["head.weight"] = (args.vocab_size, d)
    shapes.update(mtp_shapes(args, num_experts, args.mtp_served))
    return shapes


def mtp_shapes(
    args: ModelArgs, num_experts: int | None = None, num_layers: int | None = None
) -> dict[str, tuple[int, ...]]:
    """The first ``num_layers`` (None: all) next-token-prediction layers' parameters
    (``mtp.{i}.``): a sliding-window block with a scored router, the projections of the token
    embedding and of the stack's hidden streams, their norms, and the layer's own hyper-connection
    head and final norm (the embedding and the LM head are the stack's)."""
    d, hc = args.hidden_size, args.hc_mult
    e = num_experts or args.num_experts
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(args.num_mtp_layers if num_layers is None else num_layers):
        p = f"mtp.{i}."
        shapes.update(_block_shapes(args, p, SLIDING, MOE, e))
        shapes[f"{p}e_proj.weight"] = (d, d)
        shapes[f"{p}h_proj.weight"] = (d, d)
        for norm in ("enorm", "hnorm", "norm"):
            shapes[f"{p}{norm}.weight"] = (d,)
        shapes[f"{p}hc_head_fn"] = (hc, hc * d)
        shapes[f"{p}hc_head_base"] = (hc,)
        shapes[f"{p}hc_head_scale"] = (1,)
    return shapes


def _block_shapes(
    args: ModelArgs, p: str, attn_type: str, mlp_type: str, e: int
) -> dict[str, tuple[int, ...]]:
    """One block's parameters under the prefix ``p`` (``e`` routed experts held)."""
    d, hc, i_moe = args.hidden_size, args.hc_mult, args.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    for site in ("attn", "ffn"):
        shapes[f"{p}hc_{site}_fn"] = (args.hc_mix_size, hc * d)
        shapes[f"{p}hc_{site}_base"] = (args.hc_mix_size,)
        shapes[f"{p}hc_{site}_scale"] = (3,)
    shapes[f"{p}attn_norm.weight"] = (d,)
    shapes[f"{p}ffn_norm.weight"] = (d,)
    shapes.update(_attention_shapes(args, p + "attn.", attn_type))
    shapes[f"{p}ffn.gate.weight"] = (args.num_experts, d)
    if mlp_type == HASH_MOE:
        shapes[f"{p}ffn.gate.tid2eid"] = (args.vocab_size, args.num_experts_per_tok)
    else:
        shapes[f"{p}ffn.gate.bias"] = (args.num_experts,)
    shapes[f"{p}ffn.experts.w1"] = (e, i_moe, d)
    shapes[f"{p}ffn.experts.w3"] = (e, i_moe, d)
    shapes[f"{p}ffn.experts.w2"] = (e, d, i_moe)
    shapes[f"{p}ffn.shared_experts.w1.weight"] = (i_moe, d)
    shapes[f"{p}ffn.shared_experts.w3.weight"] = (i_moe, d)
    shapes[f"{p}ffn.shared_experts.w2.weight"] = (d, i_moe)
    return shapes


def held_bytes(
    args: ModelArgs,
    itemsize: int,
    *,
    fp8_block: tuple[int, int] | None = None,
    fp4_experts: bool = False,
    num_experts: int | None = None,
    fp8_min_weights: int = 0,
) -> int:
    """Bytes of the weights as the model holds them (the state dict ``load_checkpoint`` or
    ``random_weights`` returns), computed from the shapes alone: ``itemsize`` bytes per value
    of the compute dtype, 4 for the fp32 parameters, 8 for ``tid2eid``; ``fp8_block``: the
    ``is_fp8_linear`` weights 1 byte per value plus fp32 block scales; ``fp4_experts``: the
    routed experts half a byte per value plus one scale byte per 32; ``num_experts``: the
    routed experts one rank holds (None: all); ``fp8_min_weights``: FP8 linears of fewer
    weights held in the compute dtype (``model.fp8_min_weights``). For sizing a model that is
    not loaded (a full-depth V4-Flash on the accelerators it needs)."""
    total = 0
    for name, shape in expected_shapes(args, num_experts).items():
        numel = 1
        for size in shape:
            numel *= size
        if is_integer_param(name):
            total += 8 * numel
        elif is_fp32_param(name):
            total += 4 * numel
        elif fp8_block is not None and is_fp8_linear(name) and numel >= fp8_min_weights:
            rows, cols = shape
            scales = -(-rows // fp8_block[0]) * -(-cols // fp8_block[1])
            total += numel + 4 * scales
        elif fp4_experts and is_stacked_experts(name):
            total += numel // 2 + numel // 32
        else:
            total += itemsize * numel
    return total


def _attention_shapes(args: ModelArgs, p: str, attn_type: str) -> dict[str, tuple[int, ...]]:
    d, hd, h, g = args.hidden_size, args.head_dim, args.num_heads, args.o_groups
    shapes = {
        f"{p}wq_a.weight": (args.q_lora_rank, d),
        f"{p}q_norm.weight": (args.q_lora_rank,),
        f"{p}wq_b.weight": (h * hd, args.q_lora_rank),
        f"{p}wkv.weight": (hd, d),
        f"{p}kv_norm.weight": (hd,),
        f"{p}wo_a.weight": (g * args.o_lora_rank, h * hd // g),
        f"{p}wo_b.weight": (d, g * args.o_lora_rank),
        f"{p}attn_sink": (h,),
    }
    if attn_type == CSA:
        # Overlapping windows: every token contributes a [Ca | Cb] pair, hence 2*hd.
        shapes.update(_compressor_shapes(f"{p}compressor.", d, hd, args.csa_ratio, 2))
        ihd = args.index_head_dim
        shapes.update(_compressor_shapes(f"{p}indexer.compressor.", d, ihd, args.csa_ratio, 2))
        shapes[f"{p}indexer.wq_b.weight"] = (args.index_n_heads * ihd, args.q_lora_rank)
        shapes[f"{p}indexer.weights_proj.weight"] = (args.index_n_heads, d)
    elif attn_type == HCA:
        shapes.update(_compressor_shapes(f"{p}compressor.", d, hd, args.hca_ratio, 1))
    return shapes


def _compressor_shapes(
    p: str, d: int, dim: int, ratio: int, overlap: int
) -> dict[str, tuple[int, ...]]:
    return {
        f"{p}wkv.weight": (overlap * dim, d),
        f"{p}wgate.weight": (overlap * dim, d),
        f"{p}ape": (ratio, overlap * dim),
        f"{p}norm.weight": (dim,),
    }
