"""DeepSeek-V4 as the engine sees it (``deepinfer/model/family.py``'s ``ModelFamily``).

The package's rooms: ``args`` (config.json, torch-free), ``model`` (the blocks), ``compressor``
(the compressors and the Lightning indexer), ``cache`` (the cache spec), ``step_plan`` /
``compress_plan`` / ``plan_inputs`` (the host index plans of a step), ``weights`` (parameter
names and shapes), ``checkpoint`` (the loader), ``tiny`` (the built-in tiny checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepinfer.images import ImageInput, PromptImage
from deepinfer.kv_cache.pool import KVCache
from deepinfer.kv_cache.spec import CacheSpec
from deepinfer.model.batch import ForwardBatch, SeqSpan
from deepinfer.model.deepseek_v4 import cache as cache_layout
from deepinfer.model.deepseek_v4 import step_plan, tiny
from deepinfer.model.deepseek_v4.args import ModelArgs
from deepinfer.model.deepseek_v4.checkpoint import fp8_block, load_checkpoint
from deepinfer.model.deepseek_v4.model import DeepseekV4, measure_expert_scales
from deepinfer.model.deepseek_v4.mtp import MtpDrafts
from deepinfer.model.deepseek_v4.plan_inputs import CacheGeometry
from deepinfer.model.family import StepDrafts
from deepinfer.ops import Kernels


class DeepseekV4Family:
    model_type = "deepseek_v4"

    def parse_args(self, config: dict[str, Any]) -> ModelArgs:
        return ModelArgs.from_dict(config)

    def build_model(
        self, args: ModelArgs, kernels: Kernels, experts: range | None = None
    ) -> DeepseekV4:
        return DeepseekV4(args, kernels, experts)

    def num_experts(self, args: ModelArgs) -> int:
        return args.num_experts

    def run_placeholder(self, model: torch.nn.Module) -> None:
        assert isinstance(model, DeepseekV4)
        model.placeholder_step()

    def init_buffers(self, model: torch.nn.Module, device: torch.device) -> None:
        """What the loaded weights imply: the RoPE tables, the fused input projections, the
        packed experts' largest scale bytes."""
        assert isinstance(model, DeepseekV4)
        model.init_rope(device)
        model.fuse_inputs()
        measure_expert_scales(model)

    def fp8_block(self, args: ModelArgs) -> tuple[int, int]:
        return fp8_block(args)

    def fp4_experts(self, args: ModelArgs) -> bool:
        return (args.quantization or {}).get("expert_dtype") == "fp4"

    def load_weights(
        self,
        model_dir: Path,
        args: ModelArgs,
        *,
        device: torch.device,
        dtype: torch.dtype,
        keep_fp8: bool,
        keep_fp4: bool = False,
        experts: range | None = None,
    ) -> dict[str, torch.Tensor]:
        return load_checkpoint(
            model_dir,
            args,
            device=device,
            dtype=dtype,
            keep_fp8=keep_fp8,
            keep_fp4=keep_fp4,
            experts=experts,
        )

    def random_weights(
        self,
        args: ModelArgs,
        seed: int,
        device: torch.device,
        dtype: torch.dtype,
        *,
        fp8_block: tuple[int, int] | None,
        fp4_experts: bool = False,
        experts: range | None = None,
    ) -> dict[str, torch.Tensor]:
        return tiny.random_weights(
            args,
            seed,
            device,
            dtype,
            fp8_block=fp8_block,
            fp4_experts=fp4_experts,
            experts=experts,
        )

    def write_tiny_checkpoint(self, folder: Path, seed: int, quantized: bool = False) -> None:
        tiny.write_tiny_checkpoint(folder, seed, quantized)

    def cache_spec(
        self,
        args: ModelArgs,
        *,
        block_size: int,
        ring_margin: int,
        max_draft: int,
        kv_dtype: str = "auto",
    ) -> CacheSpec:
        kv_format = cache_layout.kv_fp8_format(args) if kv_dtype == "fp8" else None
        return cache_layout.cache_spec(
            args,
            block_size=block_size,
            ring_margin=ring_margin,
            max_draft=max_draft,
            kv_format=kv_format,
        )

    def geometry(self, args: ModelArgs, cache: KVCache) -> CacheGeometry:
        return CacheGeometry.of(cache)

    def step_arrays(
        self,
        seqs: list[SeqSpan],
        token_ids: list[int],
        logits_indices: list[int],
        geometry: CacheGeometry,
        decode_context: int | None = None,
    ) -> dict[str, np.ndarray]:
        return step_plan.step_arrays(seqs, token_ids, logits_indices, geometry, decode_context)

    def batch_views(
        self,
        flat: torch.Tensor,
        host: dict[str, np.ndarray],
        seqs: list[SeqSpan],
        geometry: CacheGeometry,
    ) -> ForwardBatch:
        return step_plan.batch_views(flat, host, seqs, geometry)

    def rollback(self, cache: KVCache, slot: int, end_pos: int, num_tokens: int) -> None:
        """Nothing moves: the step plans keep what a rollback of up to max_draft tokens needs
        (cache.py's ``rollback`` says why that is exact)."""
        cache_layout.rollback(cache, slot, end_pos, num_tokens)

    def drafts(
        self,
        model: torch.nn.Module,
        cache: KVCache,
        geometry: CacheGeometry,
        num_drafts: int,
        upload: Callable[[np.ndarray], torch.Tensor],
    ) -> StepDrafts | None:
        assert isinstance(model, DeepseekV4)
        if not model.args.mtp_served:
            return None
        return MtpDrafts(model, cache, geometry, num_drafts, upload)

    def history_tokens(self, args: ModelArgs) -> int:
        return 0

    def recompute_tokens(self, args: ModelArgs) -> int:
        return 1

    def replay_tokens(self, args: ModelArgs) -> int:
        """The sliding-window receptive field of the whole stack, num_layers * (window - 1)."""
        return args.num_layers * (args.sliding_window - 1)

    def expand_images(
        self, args: ModelArgs, token_ids: list[int], images: list[ImageInput]
    ) -> tuple[list[int], list[PromptImage]]:
        if images:
            raise ValueError("DeepSeek-V4 checkpoints have no vision tower: images are not served")
        return token_ids, []

    def image_encoder(self, model: torch.nn.Module) -> torch.nn.Module | None:
        return None

    def load_image_encoder(
        self,
        model_dir: Path,
        args: ModelArgs,
        kernels: Kernels,
        *,
        device: torch.device,
        dtype: torch.dtype,
        random_seed: int | None = None,
    ) -> torch.nn.Module:
        raise ValueError("DeepSeek-V4 checkpoints have no vision tower: there is nothing to encode")

    def encode_images(
        self, encoder: torch.nn.Module, pixels: list[torch.Tensor], images: list[ImageInput]
    ) -> list[torch.Tensor]:
        raise NotImplementedError("DeepSeek-V4 checkpoints have no vision tower")


FAMILY = DeepseekV4Family()
