"""What the engine knows of a model family: build the model, plan a step, describe the cache.

    families.py (model_type -> package) -> package.FAMILY: ModelFamily
        parse the config        -> args (vocab_size, eos_token_id, max_position_embeddings, ...)
        load or draw weights    -> a state dict in the model's names
        build_model(args, ...)  -> nn.Module: forward(ForwardBatch, KVCache) -> logits [N, V] fp32,
                                   ``args`` (what it was built from); init_buffers after loading
        cache_spec(args, ...)   -> CacheSpec (sizing, pools and payloads all enumerate its parts)
        geometry(args, cache)   -> the family's plan context for that cache
        step_arrays / batch_views: a step's host arrays (one upload) and the batch over them
        rollback(cache, slot, end_pos, num_tokens): forget a step's rejected draft tokens
        history_tokens(args): token ids before a span its plans read (n-gram inputs)
        drafts(model, cache, ...): the model's own drafter, run after each step (V4's MTP layer,
                                   V4.1's DSpark)
        run_placeholder(model): a lock-step rank's step with no tokens (its collectives only)
        expand_images(args, ids, images): a prompt's image placeholders grown to the images'
                                   positions (deepinfer/images.py), ValueError without a tower
        image_encoder(model): the model's vision tower (None: it has none);
        load_image_encoder(...): the tower alone (an encoder node's)
        encode_images(encoder, pixels, images): the tower's embeddings of images

Every array ``step_arrays`` returns is int64 and travels in one copy (``batch.flatten``); a
graphed step passes ``decode_context``, and the family must then give arrays whose shapes depend
only on the number of requests, their rows (every span has the same ``num_tokens``; its last
``num_pad`` rows are pads, which must leave nothing in the cache) and that bound.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from deepinfer.images import ImageInput, PromptImage
from deepinfer.kv_cache.pool import KVCache
from deepinfer.kv_cache.spec import CacheSpec
from deepinfer.model.batch import ForwardBatch, SeqSpan
from deepinfer.ops import Kernels


class DraftedRequest(Protocol):
    """What a drafter run after each step reads of one scheduled request (the scheduler's
    ScheduledRequest)."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    state_slot: int
    do_sample: bool
    num_draft_tokens: int
    window_floor: int

    @property
    def num_tokens(self) -> int: ...


class StepDrafts(Protocol):
    """A drafter that runs on the device after each step (DeepSeek-V4's MTP layer, DeepSeek-V4.1's
    DSpark block drafter)."""

    def run(
        self,
        scheduled: list[DraftedRequest],
        hidden: torch.Tensor | None,
        kept: dict[str, list[int]],
    ) -> dict[str, list[int]]:
        """After a step of ``scheduled`` (ScheduledRequests) whose forward kept ``hidden`` (None
        when the model keeps none) and whose sampled requests kept ``kept`` tokens: its own part
        of the step, and each sampled request's drafts of the tokens after its last kept one."""
        ...


class ModelFamily(Protocol):
    model_type: str

    def parse_args(self, config: dict[str, Any]) -> Any: ...

    def build_model(self, args: Any, kernels: Kernels, experts: range | None = None) -> nn.Module:
        """The model with empty parameters (call it under ``torch.device("meta")``), holding
        the routed ``experts`` (None: all; a share: ``kernels.moe`` exchanges tokens with the
        ranks holding the rest)."""
        ...

    def num_experts(self, args: Any) -> int:
        """Routed experts per MoE layer (what expert parallelism shards)."""
        ...

    def run_placeholder(self, model: nn.Module) -> None:
        """Lock-step ranks: the collectives of one step with no tokens of this rank."""
        ...

    def init_buffers(self, model: nn.Module, device: torch.device) -> None:
        """Recompute what building on the meta device left empty (buffers that are not
        weights), once the weights are loaded."""
        ...

    def fp8_block(self, args: Any) -> tuple[int, int]:
        """Rows and columns of a weight that share one FP8 scale."""
        ...

    def fp4_experts(self, args: Any) -> bool:
        """Whether the checkpoint stores its routed experts as FP4 (random weights in its
        shapes are packed the same way under ``model.fp4_experts``)."""
        ...

    def load_weights(
        self,
        model_dir: Path,
        args: Any,
        *,
        device: torch.device,
        dtype: torch.dtype,
        keep_fp8: bool,
        keep_fp4: bool = False,
        experts: range | None = None,
    ) -> dict[str, torch.Tensor]:
        """The state dict, with only the routed ``experts`` (None: all), read from the folder;
        ``keep_fp8`` / ``keep_fp4``: the checkpoint's FP8 linears / FP4 routed experts as they
        are stored (with their scales) instead of dequantized."""
        ...

    def random_weights(
        self,
        args: Any,
        seed: int,
        device: torch.device,
        dtype: torch.dtype,
        *,
        fp8_block: tuple[int, int] | None,
        fp4_experts: bool = False,
        experts: range | None = None,
    ) -> dict[str, torch.Tensor]: ...

    def write_tiny_checkpoint(self, folder: Path, seed: int, quantized: bool = False) -> None:
        """``config.json`` and the weights of the built-in tiny checkpoint (``quantized``: in
        the checkpoints' own FP8 / FP4 formats)."""
        ...

    def cache_spec(
        self,
        args: Any,
        *,
        block_size: int,
        ring_margin: int,
        max_draft: int,
        kv_dtype: str = "auto",
    ) -> CacheSpec:
        """``kv_dtype``: cache.kv_dtype; a family that cannot store its KV so raises
        ValueError naming the key."""
        ...

    def geometry(self, args: Any, cache: KVCache) -> Any: ...

    def step_arrays(
        self,
        seqs: list[SeqSpan],
        token_ids: list[int],
        logits_indices: list[int],
        geometry: Any,
        decode_context: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Host int64 arrays by name: ``input_ids``, ``positions``, ``logits_indices``, then
        the family's plans."""
        ...

    def batch_views(
        self, flat: torch.Tensor, host: dict[str, np.ndarray], seqs: list[SeqSpan], geometry: Any
    ) -> ForwardBatch:
        """The batch over ``flat`` (``step_arrays`` uploaded): views only, so that a CUDA graph's
        replays read whatever was copied in last."""
        ...

    def rollback(self, cache: KVCache, slot: int, end_pos: int, num_tokens: int) -> None:
        """Speculative decoding: the step that computed positions up to ``end_pos`` (exclusive)
        in ``slot`` accepted all but its last ``num_tokens``. Afterwards the slot reads exactly
        as if only positions < end_pos - num_tokens had been computed (the next step starts
        there and rewrites the rejected positions; their paged entries are never read before
        that). At most the cache spec's ``max_draft`` tokens (ValueError otherwise); call it
        before the next step of the slot is launched, or a snapshot of it saved."""
        ...

    def drafts(
        self,
        model: nn.Module,
        cache: KVCache,
        geometry: Any,
        num_drafts: int,
        upload: Callable[[np.ndarray], torch.Tensor],
    ) -> StepDrafts | None:
        """The model's drafter, proposing ``num_drafts`` a request per step (None: the model
        was built without one)."""
        ...

    def history_tokens(self, args: Any) -> int:
        """Token ids before a span's first that its plans read (``SeqSpan.history``; 0: none)."""
        ...

    def recompute_tokens(self, args: Any) -> int:
        """The prompt tokens a prefix hit must leave to compute (at least 1: the last one's
        logits; DeepSeek-V4.1 under YoCo truncation: the kept ones)."""
        ...

    def replay_tokens(self, args: Any) -> int:
        """Tokens to recompute on a prefix hit without a snapshot (the receptive field of the
        state that is not paged)."""
        ...

    def expand_images(
        self, args: Any, token_ids: list[int], images: list[ImageInput]
    ) -> tuple[list[int], list[PromptImage]]:
        """The prompt's ids with each image's placeholder grown to its positions, and the
        images' spans; ``token_ids`` unchanged without images. ValueError (naming the problem)
        when the model takes no images or they do not fit its prompt."""
        ...

    def image_encoder(self, model: nn.Module) -> nn.Module | None:
        """The model's vision tower, what ``encode_images`` runs (None: the model has none)."""
        ...

    def load_image_encoder(
        self,
        model_dir: Path,
        args: Any,
        kernels: Kernels,
        *,
        device: torch.device,
        dtype: torch.dtype,
        random_seed: int | None = None,
    ) -> nn.Module:
        """The vision tower alone (an encoder node's), its weights read from the folder (only
        the tower's), or drawn as ``random_weights(args, random_seed, ...)`` draws them (the
        same values as the whole model's); ValueError when the model has none."""
        ...

    def encode_images(
        self, encoder: nn.Module, pixels: list[torch.Tensor], images: list[ImageInput]
    ) -> list[torch.Tensor]:
        """Each image's embeddings [num_tokens, D] from its pixels (uint8 [h, w, 3] on the
        encoder's device), in one batch."""
        ...
