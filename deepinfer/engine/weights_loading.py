"""Weight loading: a checkpoint folder (or random weights in its shapes) -> the model on a device.

    model_dir (config.json + safetensors) -> the family's load_weights / random_weights
    -> the model built on the meta device -> FP8 linears swapped in (model.fp8_weights, CUDA),
       packed routed experts (model.fp4_experts, FP4 checkpoints)
    -> load_state_dict(assign=True) on ``device``
    -> routed experts converted to FP8 blocks when the MoE backend takes them (fp8_experts)
    -> LoadedModel

Building on the meta device allocates nothing: ``assign=True`` makes the loaded tensors the
parameters, so the weights are held once. Also here: what of the weights goes into the prefix
cache's salt (``cache_salt``), so that cached KV is never reused across different weights.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer.config import ModelConfig
from deepinfer.model.family import ModelFamily
from deepinfer.model.fingerprint import checkpoint_fingerprint
from deepinfer.model.layers import (
    dequantize_small_fp8_linears,
    use_fp8_linears,
    use_mxfp4_experts,
)
from deepinfer.model.tiny import ensure_tiny_model
from deepinfer.ops import Kernels

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """Producer: ``load_model``. Consumer: the model runner. Device: the weights'."""

    model: torch.nn.Module  # in eval mode; called as model(ForwardBatch, KVCache) -> logits
    fp8_weights: bool  # FP8 linear weights kept (model.fp8_weights on CUDA)
    fp8_experts: bool  # routed experts converted to FP8 blocks for the MoE backend
    weight_bytes: WeightBytes


def model_folder(config: ModelConfig) -> Path:
    """``model.path``, or the built-in tiny checkpoint (written on first use) when unset."""
    if config.path is None:
        return ensure_tiny_model(config.tiny_model_seed)
    path = Path(config.path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {path} has no config.json")
    return path


def image_salt(model_dir: Path, config: ModelConfig, dtype: torch.dtype) -> bytes:
    """What image embeddings in a disk tier are keyed under besides their digest: the
    checkpoint, the tower's dtype, the random weights' seed (serving and encode nodes alike)."""
    return cache_salt(model_dir, config, False, f"image-embeddings:{dtype}")


def load_model(
    config: ModelConfig,
    family: ModelFamily,
    model_dir: Path,
    args: Any,
    kernels: Kernels,
    device: torch.device,
    dtype: torch.dtype,
    experts: range | None = None,
) -> LoadedModel:
    """The weights of ``model_dir`` (or ``config.random_weights`` in its shapes) in ``dtype`` on
    ``device``, FP8 linears kept on CUDA when ``config.fp8_weights`` asks; of the routed experts
    only ``experts`` (None: all)."""
    start = time.perf_counter()
    keep_fp8 = config.fp8_weights and device.type == "cuda"
    if config.fp8_weights and not keep_fp8:
        logger.warning("model.fp8_weights needs CUDA: dequantizing on %s", device)
    block = family.fp8_block(args)
    if config.random_weights:
        seed = config.tiny_model_seed
        logger.info("model: random weights (seed %d) in the shapes of %s", seed, model_dir)
        weights = family.random_weights(
            args,
            seed,
            device,
            dtype,
            fp8_block=block if keep_fp8 else None,
            fp4_experts=config.fp4_experts and family.fp4_experts(args),
            experts=experts,
        )
    else:
        weights = family.load_weights(
            model_dir,
            args,
            device=device,
            dtype=dtype,
            keep_fp8=keep_fp8,
            keep_fp4=config.fp4_experts,
            experts=experts,
        )
    num_dense = 0
    if keep_fp8 and config.fp8_min_weights > 0:
        num_dense = dequantize_small_fp8_linears(weights, config.fp8_min_weights, block, dtype)
    with torch.device("meta"):
        model = family.build_model(args, kernels, experts)
        num_fp8 = use_fp8_linears(model, weights, block, kernels.linear)
        num_fp4 = use_mxfp4_experts(model, weights)
    if keep_fp8:
        logger.info(
            "model: %d linear layers on FP8 weights (%dx%d blocks), %d smaller than "
            "model.fp8_min_weights = %d in %s",
            num_fp8,
            *block,
            num_dense,
            config.fp8_min_weights,
            str(dtype).removeprefix("torch."),
        )
    if num_fp4:
        logger.info("model: routed experts of %d layers packed FP4 (MXFP4)", num_fp4)
    model.load_state_dict(weights, strict=True, assign=True)
    del weights
    fp8_experts = getattr(kernels.moe, "fp8_experts", False)
    if fp8_experts:
        num_converted = convert_experts_to_fp8(model)
        logger.info(
            "model: routed experts of %d layers converted to FP8 128x128 blocks for %s",
            num_converted,
            type(kernels.moe).__name__,
        )
    family.init_buffers(model, device)
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    weight_bytes = parameter_bytes(model)
    logger.info(
        "model: %s, %.1f M parameters (%.3f GiB; routed experts %.3f GiB, %s), %s on %s, loaded "
        "in %.1f s",
        model_dir,
        num_params / 1e6,
        weight_bytes.total / 2**30,
        weight_bytes.routed_experts / 2**30,
        "all" if experts is None else f"{experts.start}..{experts.stop - 1}",
        str(dtype).removeprefix("torch."),
        device,
        time.perf_counter() - start,
    )
    return LoadedModel(model, keep_fp8, fp8_experts, weight_bytes)


def convert_experts_to_fp8(model: torch.nn.Module) -> int:
    """Every routed-experts module of ``model`` (those with ``to_fp8``) converted to FP8 with
    128 x 128 block scales, one module at a time; returns how many."""
    modules = [m for m in model.modules() if hasattr(m, "to_fp8")]
    for module in modules:
        module.to_fp8()
    return len(modules)


@dataclass(frozen=True)
class WeightBytes:
    total: int  # every parameter and buffer the model holds
    routed_experts: int  # of which the routed experts (1/N of them per rank with N-way EP)


def parameter_bytes(model: torch.nn.Module) -> WeightBytes:
    """The model's weight bytes on its device, and the routed experts' share of them."""
    total = routed = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        size = tensor.numel() * tensor.element_size()
        total += size
        if ".experts." in f".{name}":
            routed += size
    return WeightBytes(total, routed)


def cache_salt(
    model_dir: Path,
    config: ModelConfig,
    fp8_weights: bool,
    kv_layout: str,
    *,
    fp8_experts: bool = False,
) -> bytes:
    """The prefix cache's salt: the checkpoint's fingerprint, then ``kv_layout`` (what changes
    the cached bytes: dtype, block layout), then what else changes the weights (the random
    weights' seed, FP8 weights kept, experts converted to FP8). Disk-tier files carry it
    (kv_file.py): other bytes make every file already there foreign."""
    salt = kv_layout
    if config.random_weights:
        salt += f":random-{config.tiny_model_seed}"
    if fp8_weights:
        salt += f":fp8-weights-from-{config.fp8_min_weights}"
    if fp8_experts:
        salt += ":fp8-experts"
    return checkpoint_fingerprint(model_dir) + salt.encode()
