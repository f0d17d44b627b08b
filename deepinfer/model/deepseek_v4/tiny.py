"""The built-in tiny DeepSeek-V4 checkpoint's architecture and weights (``deepinfer/model/tiny.py``
builds the folder): every layer kind (sliding / CSA / HCA attention, hash / learned MoE routing)
at toy sizes, the real 129,280-token vocabulary. ``config.json`` in transformers' keys,
``model.safetensors`` in DeepSeek's upstream naming (per-expert ``ffn.experts.{e}.w1.weight``, as
the release ships them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepinfer.model.deepseek_v4.args import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelArgs
from deepinfer.model.deepseek_v4.checkpoint import fp8_block
from deepinfer.model.deepseek_v4.weights import (
    expected_shapes,
    fp8_scale_name,
    is_fp8_linear,
    is_fp32_param,
    is_stacked_experts,
    mtp_shapes,
    mxfp4_scale_name,
)
from deepinfer.ops.linear.torch_ref import quantize_fp8
from deepinfer.ops.moe.torch_ref import quantize_mxfp4

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "layer_types": [SLIDING, CSA, HCA, CSA, HCA, SLIDING],
    "mlp_layer_types": [HASH_MOE, HASH_MOE, MOE, MOE, MOE, MOE],
    "compress_rates": {CSA: 4, HCA: 16},
    "sliding_window": 8,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "compress": {
            "rope_type": "yarn",
            "rope_theta": 160000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "attention_factor": 1.0,
            "partial_rotary_factor": 0.25,
        },
    },
    # The context limit of the built-in model (not a property of the weights: they are random).
    "max_position_embeddings": 8192,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


# The MTP layer's weights come from a generator of their own (seed + this), drawn after the
# stack's: the stack's weights are those of a checkpoint without it.
MTP_SEED_OFFSET = 7919

# ``make-tiny-model --quantized``: V4-Flash's quantization, as its config.json states it.
QUANTIZED_CONFIG: dict[str, Any] = {
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    "expert_dtype": "fp4",
}


def write_tiny_checkpoint(folder: Path, seed: int, quantized: bool = False) -> None:
    """Write the tiny checkpoint into ``folder`` (created if needed); same bytes for the same seed.

    Initialisation (torch.Generator seeded with ``seed``, tensors drawn in ``expected_shapes``
    order, all fp32):

    - matrices, embeddings, hc ``fn``: N(0, 0.02²), as transformers' ``initializer_range``;
    - ``head.weight``: N(0, 1/D). The final norm leaves unit-RMS hidden states, so logits have
      std ~1 instead of ~0.16 with 0.02: a peaked, non-degenerate next-token distribution whose
      greedy choice survives bf16 rounding (top-1 margins ~0.1 rather than ~0.01);
    - what transformers initialises to constants, randomised so that no code path is a no-op:
      attention sinks N(0, 1), compressor ``ape`` N(0, 0.5²), MoE gate bias N(0, 0.1²),
      hc ``base`` N(0, 0.5²), hc ``scale`` 1 + N(0, 0.2²), RMSNorm weights 1 + N(0, 0.1²);
    - ``tid2eid``: for every token id, top-k *distinct* experts drawn uniformly.

    ``quantized``: the same draws stored as V4-Flash stores them (``QUANTIZED_CONFIG``): the
    ``is_fp8_linear`` weights float8_e4m3fn with 128 x 128 ue8m0 block scales (``X.scale``,
    float8_e8m0fnu), the routed experts packed FP4 (int8 [rows, cols/2] with ue8m0 scales per
    32 inputs, ``ops.moe.quantize_mxfp4``); everything else as in the plain checkpoint.
    """
    config = {**TINY_CONFIG, **(QUANTIZED_CONFIG if quantized else {})}
    args = ModelArgs.from_dict(config)
    write_checkpoint(
        folder,
        config,
        expected_shapes(args),
        lambda name, shape, gen: init_tensor(name, shape, args, gen),
        seed,
        fp8_block(args) if quantized else None,
        more=((mtp_shapes(args), seed + MTP_SEED_OFFSET),),
    )


def write_checkpoint(
    folder: Path,
    config: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    init: Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor],
    seed: int,
    fp8: tuple[int, int] | None,
    is_fp8: Callable[[str], bool] = is_fp8_linear,
    block_of: Callable[[str, tuple[int, int]], tuple[int, int]] | None = None,
    more: Sequence[tuple[dict[str, tuple[int, ...]], int]] = (),
) -> None:
    """``config.json`` and ``model.safetensors`` of random weights drawn in ``shapes`` order
    (``init(name, shape, gen)``, one generator seeded ``seed``), the stacked routed experts
    written one by one as the releases ship them (``<layer>.ffn.experts.{e}.w1.weight``).
    ``fp8``: the ``is_fp8`` weights stored float8_e4m3fn with ue8m0 block scales of that block
    (``block_of(name, fp8)`` where given; ``X.scale``), the routed experts packed FP4 (int8 with
    ue8m0 scales per 32). ``more``: further (shapes, seed) groups, each drawn from a generator
    of its own (weights added later leave the earlier ones' values as they were)."""
    tensors: dict[str, torch.Tensor] = {}
    for group, group_seed in ((shapes, seed), *more):
        gen = torch.Generator().manual_seed(group_seed)
        for name, shape in group.items():
            _store(tensors, name, init(name, shape, gen), fp8, is_fp8, block_of)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with open(folder / "config.json", "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def _store(
    tensors: dict[str, torch.Tensor],
    name: str,
    value: torch.Tensor,
    fp8: tuple[int, int] | None,
    is_fp8: Callable[[str], bool],
    block_of: Callable[[str, tuple[int, int]], tuple[int, int]] | None,
) -> None:
    """One drawn tensor as the release stores it (``write_checkpoint``)."""
    base, _, proj = name.rpartition(".")
    if base.endswith("ffn.experts"):
        packed = quantize_mxfp4(value) if fp8 is not None else None
        for e in range(value.shape[0]):
            key = f"{base}.{e}.{proj}"
            if packed is None:
                tensors[f"{key}.weight"] = value[e].clone()
            else:
                tensors[f"{key}.weight"] = packed.packed[e].view(torch.int8).clone()
                tensors[f"{key}.scale"] = packed.scale[e].view(torch.float8_e8m0fnu).clone()
    elif fp8 is not None and is_fp8(name):
        block = block_of(name, fp8) if block_of is not None else fp8
        weight, scale = quantize_fp8(value, block, ue8m0=True)
        tensors[name] = weight
        tensors[fp8_scale_name(name)] = scale.to(torch.float8_e8m0fnu)
    else:
        tensors[name] = value


def random_weights(
    args: ModelArgs,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    *,
    fp8_block: tuple[int, int] | None = None,
    fp4_experts: bool = False,
    experts: range | None = None,
) -> dict[str, torch.Tensor]:
    """Random weights in ``args``' shapes, drawn on ``device`` (our names, stacked experts),
    initialised as ``make_tiny_model`` documents; the parameters kept in fp32 are fp32.
    ``fp8_block``: the ``is_fp8_linear`` weights quantized to float8_e4m3fn in blocks of that
    shape, each followed by its fp32 block scales, as ``load_checkpoint(keep_fp8=True)`` gives.
    ``fp4_experts``: the routed experts packed MXFP4 with their scale bytes, as
    ``load_checkpoint(keep_fp4=True)`` gives.
    ``experts``: keep only those routed experts (every rank draws all of them, so that the ranks'
    shares are of one model).

    For benchmarks in real shapes (V4-Flash layers do not fit a checkpoint written here): the
    values depend on the device's generator, so they are not those of ``make_tiny_model``.
    """
    return draw_weights(
        expected_shapes(args),
        lambda name, shape, gen, dtype: init_tensor(name, shape, args, gen, device, dtype),
        seed,
        device,
        dtype,
        fp8_block=fp8_block,
        fp4_experts=fp4_experts,
        experts=experts,
    )


def draw_weights(
    shapes: dict[str, tuple[int, ...]],
    init: Callable[[str, tuple[int, ...], torch.Generator, torch.dtype], torch.Tensor],
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    *,
    fp8_block: tuple[int, int] | None,
    fp4_experts: bool,
    experts: range | None,
    is_fp32: Callable[[str], bool] = is_fp32_param,
    is_fp8: Callable[[str], bool] = is_fp8_linear,
    is_sharded: Callable[[str], bool] = is_stacked_experts,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """``random_weights`` for any family: ``init(name, shape, gen, dtype)`` in ``shapes`` order
    on one generator of ``device``; ``is_sharded`` names the stacked experts ``experts``
    slices (the rest of the stacked experts, ``is_stacked_experts``, are packed under
    ``fp4_experts`` too). ``keep``: the names returned (None: all); the others are drawn and
    dropped one at a time, so that the kept ones are the same draws as in the whole."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        tensor = init(name, shape, gen, torch.float32 if is_fp32(name) else dtype)
        if keep is not None and not keep(name):
            continue
        out[name] = tensor
        if experts is not None and is_sharded(name):
            out[name] = out[name][experts.start : experts.stop].clone()
        if fp8_block is not None and is_fp8(name):
            out[name], out[fp8_scale_name(name)] = quantize_fp8(out[name], fp8_block)
        if fp4_experts and is_stacked_experts(name):
            packed = quantize_mxfp4(out[name])
            out[name], out[mxfp4_scale_name(name)] = packed.packed, packed.scale
    return out


def init_tensor(
    name: str,
    shape: tuple[int, ...],
    args: Any,
    gen: torch.Generator,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=dtype) * std + mean

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":
        vocab, k = shape
        # argsort of uniform noise = a random permutation per row; its first k are distinct.
        noise = torch.rand(vocab, args.num_experts, generator=gen, device=device)
        return noise.argsort(-1)[:, :k].contiguous()
    if name == "head.weight":
        return normal(args.hidden_size**-0.5)
    if leaf == "attn_sink":
        return normal(1.0)
    if leaf == "ape":
        return normal(0.5)
    if name.endswith("ffn.gate.bias"):
        return normal(0.1)
    if name.endswith("_base"):
        return normal(0.5)
    if name.endswith("_scale"):
        return normal(0.2, mean=1.0)
    if name.endswith("norm.weight"):
        return normal(0.1, mean=1.0)
    return normal(0.02)
