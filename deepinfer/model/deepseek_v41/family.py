"""DeepSeek-V4.1 as the engine sees it (``deepinfer/model/family.py``'s ``ModelFamily``).

The package's rooms: ``args`` (config.json, torch-free), ``model`` (the blocks), ``engram`` (the
n-gram hash memory), ``cache`` (the cache spec), ``step_plan`` (DeepSeek-V4's plans and the
engram's), ``weights`` (names and shapes), ``tiny`` (the built-in tiny checkpoint). The loader
is DeepSeek-V4's (``deepseek_v4/checkpoint.py``) with this family's names.
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
from deepinfer.model.deepseek_v4 import cache as v4_cache
from deepinfer.model.deepseek_v4.checkpoint import (
    CheckpointError,
    WeightNaming,
    fp8_block,
    load_checkpoint,
)
from deepinfer.model.deepseek_v4.model import measure_expert_scales
from deepinfer.model.deepseek_v41 import cache as cache_layout
from deepinfer.model.deepseek_v41 import step_plan, tiny, weights
from deepinfer.model.deepseek_v41.args import ModelArgs
from deepinfer.model.deepseek_v41.dspark import DSparkDrafts
from deepinfer.model.deepseek_v41.engram import vocabulary_of_file
from deepinfer.model.deepseek_v41.model import DeepseekV41
from deepinfer.model.deepseek_v41.step_plan import CacheGeometry
from deepinfer.model.deepseek_v41.vision import ImageEncoder
from deepinfer.model.deepseek_v41.vision_args import ImagePrompt
from deepinfer.model.family import StepDrafts
from deepinfer.ops import Kernels

NAMING = WeightNaming(
    expected_shapes=weights.expected_shapes,
    map_name=weights.map_checkpoint_name,
    is_fp8_linear=weights.is_fp8_linear,
    is_fp32_param=weights.is_fp32_param,
    is_integer_param=weights.is_integer_param,
    is_stacked_experts=weights.is_stacked_experts,
    fp8_block_of=weights.fp8_block_of,
)


class DeepseekV41Family:
    model_type = "deepseek_v41"

    def parse_args(self, config: dict[str, Any]) -> ModelArgs:
        return ModelArgs.from_dict(config)

    def build_model(
        self, args: ModelArgs, kernels: Kernels, experts: range | None = None
    ) -> DeepseekV41:
        return DeepseekV41(args, kernels, experts)

    def num_experts(self, args: ModelArgs) -> int:
        return args.num_experts

    def run_placeholder(self, model: torch.nn.Module) -> None:
        assert isinstance(model, DeepseekV41)
        model.placeholder_step()

    def init_buffers(self, model: torch.nn.Module, device: torch.device) -> None:
        """What the loaded weights imply: RoPE and engram tables, fused input projections,
        the packed experts' largest scale bytes."""
        assert isinstance(model, DeepseekV41)
        model.init_buffers(device)
        model.fuse_inputs()
        measure_expert_scales(model)

    def fp8_block(self, args: ModelArgs) -> tuple[int, int]:
        return fp8_block(args)  # type: ignore[arg-type]  # reads quantization only

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
        state = load_checkpoint(
            model_dir,
            args,  # type: ignore[arg-type]  # the naming reads this family's args
            device=device,
            dtype=dtype,
            keep_fp8=keep_fp8,
            keep_fp4=keep_fp4,
            experts=experts,
            naming=NAMING,
        )
        if args.engram is not None:
            state[weights.ENGRAM_VOCAB] = _engram_vocab(Path(model_dir), args).to(device)
        return state

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
        if kv_dtype == "fp8":
            raise ValueError(
                "cache.kv_dtype = 'fp8' is built for DeepSeek-V4 models so far, not for "
                f"{args.model_type}: use 'auto'"
            )
        return cache_layout.cache_spec(
            args, block_size=block_size, ring_margin=ring_margin, max_draft=max_draft
        )

    def geometry(self, args: ModelArgs, cache: KVCache) -> CacheGeometry:
        return CacheGeometry.of(cache, args)

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
        """Nothing moves, as in DeepSeek-V4 (``deepseek_v4/cache.py`` says why): the rings and
        the C2 buffers keep what a rollback of up to max_draft tokens needs."""
        v4_cache.rollback(cache, slot, end_pos, num_tokens)

    def drafts(
        self,
        model: torch.nn.Module,
        cache: KVCache,
        geometry: CacheGeometry,
        num_drafts: int,
        upload: Callable[[np.ndarray], torch.Tensor],
    ) -> StepDrafts | None:
        assert isinstance(model, DeepseekV41)
        if not model.args.dspark_served:
            return None
        return DSparkDrafts(model, cache, geometry, num_drafts, upload)

    def history_tokens(self, args: ModelArgs) -> int:
        """The engram's n-gram windows reach max_ngram_size - 1 tokens back."""
        return args.engram.max_ngram_size - 1 if args.engram is not None else 0

    def recompute_tokens(self, args: ModelArgs) -> int:
        """Under YoCo truncation a prefix hit recomputes every kept token: the consumer half's
        state of those positions depends on the request's own prompt length."""
        return args.yoco_keep if args.truncates else 1

    def replay_tokens(self, args: ModelArgs) -> int:
        """The sliding-window receptive field of the stack, num_layers * (window - 1)."""
        return args.num_layers * (args.sliding_window - 1)

    def expand_images(
        self, args: ModelArgs, token_ids: list[int], images: list[ImageInput]
    ) -> tuple[list[int], list[PromptImage]]:
        prompt = ImagePrompt(args.image_token_id, args.vocab_size, args.vision)
        return prompt.expand(token_ids, images)

    def image_encoder(self, model: torch.nn.Module) -> torch.nn.Module | None:
        return getattr(model, weights.VISION_MODULE, None)

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
        if args.vision is None:
            raise ValueError(f"the checkpoint in {model_dir} has no vision tower")
        prefix = f"{weights.VISION_MODULE}."

        def is_tower(name: str) -> bool:
            return name.startswith(prefix)

        if random_seed is not None:
            state = tiny.random_weights(
                args, random_seed, device, dtype, fp8_block=None, keep=is_tower
            )
        else:
            state = load_checkpoint(
                model_dir,
                args,  # type: ignore[arg-type]  # the naming reads this family's args
                device=device,
                dtype=dtype,
                naming=NAMING,
                only=is_tower,
            )
        with torch.device("meta"):
            encoder = ImageEncoder(args.vision, args.hidden_size, kernels.norm)
        tower = {name.removeprefix(prefix): tensor for name, tensor in state.items()}
        encoder.load_state_dict(tower, assign=True, strict=True)
        return encoder.eval()

    def encode_images(
        self, encoder: torch.nn.Module, pixels: list[torch.Tensor], images: list[ImageInput]
    ) -> list[torch.Tensor]:
        assert isinstance(encoder, ImageEncoder)
        grids = [encoder.args.grid(image.width, image.height) for image in images]
        return encoder(pixels, grids)


def _engram_vocab(model_dir: Path, args: ModelArgs) -> torch.Tensor:
    """int64 [vocab_size]: the compressed-vocabulary id of every token id, from the
    checkpoint's tokenizer; its size must be the config's ``engram_compressed_vocab_size``."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"the engram needs the checkpoint's tokenizer: no {path}")
    table, count = vocabulary_of_file(path)
    assert args.engram is not None
    expected = args.engram.compressed_vocab_size
    if expected and count != expected:
        raise CheckpointError(
            f"{path} compresses to {count} ids, config.json says "
            f"engram_compressed_vocab_size={expected}"
        )
    # Ids past the tokenizer's never occur in a request; they read as padding.
    out = np.full(args.vocab_size, args.engram.pad_token_id, dtype=np.int64)
    num = min(args.vocab_size, table.shape[0])
    out[:num] = table[:num]
    return torch.from_numpy(out)


FAMILY = DeepseekV41Family()
