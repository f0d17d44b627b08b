"""VisionArgs: DeepSeek-V4.1's vision tower and image geometry, from ``config.json``'s
``vision_config`` (torch-free).

An image the request side preprocessed (deepseek-recipe's ``OpenCvImagePreprocessor``: resized so
both sides are multiples of the patch) becomes a grid of ``grid_h x grid_w`` patches; the ViT
turns each patch into a feature, the projector merges each ``r x r`` square of features (the
downsample ratio, ragged edges padded with zeros) into one token embedding, and the prompt holds
the image as::

    [start] + ([image] * tokens_w + [newline]) * tokens_h + [end]      tokens_* = ceil(grid_* / r)

The release's ``vision_config`` names the geometry (``patch_size``, ``downsample_ratio``,
``max_image_tokens``, ``min_pixels``, ``max_wh_ratio``) and the ViT width (``hidden_size``); its
depth, heads and MLP width are fixed by the architecture (32 blocks, 16 heads, SwiGLU of 2.7x
rounded up to 128). ``depth``, ``num_heads``, ``mlp_ratio`` and ``mlp_multiple_of`` override them
(the built-in tiny checkpoint does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from deepinfer.images import ImageInput, PromptImage

# An image's prompt positions hold ids past the vocabulary (the offsets DeepSeek's engine uses):
# its first position vocab_size + IMAGE, the others vocab_size + IMAGE_PAD. The model embeds
# them from the tower's output; the router and the engram tell them by id >= vocab_size.
IMAGE_PAD = 1
IMAGE = 2


def image_ids(vocab_size: int, num_tokens: int) -> list[int]:
    """The prompt ids of one image of ``num_tokens`` positions."""
    return [vocab_size + IMAGE] + [vocab_size + IMAGE_PAD] * (num_tokens - 1)


@dataclass(frozen=True)
class ImagePrompt:
    """How a checkpoint's prompts hold images, from its ``config.json``: what ``expand_images``
    reads. The model's args take these fields from it, and the coordinator expands prompts
    with it for its routing keys, so that both grow a prompt alike."""

    image_token_id: int
    vocab_size: int
    vision: VisionArgs | None

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ImagePrompt:
        text = {**cfg, **(cfg.get("text_config") or {})}
        return cls(
            image_token_id=int(cfg.get("image_token_id", text.get("image_token_id", 129264))),
            vocab_size=int(text.get("vocab_size", 129280)),
            vision=VisionArgs.from_dict(cfg.get("vision_config")),
        )

    def expand(
        self, token_ids: list[int], images: list[ImageInput]
    ) -> tuple[list[int], list[PromptImage]]:
        return expand_images(
            token_ids,
            images,
            image_token_id=self.image_token_id,
            vocab_size=self.vocab_size,
            vision=self.vision,
        )


def expand_images(
    token_ids: list[int],
    images: list[ImageInput],
    *,
    image_token_id: int,
    vocab_size: int,
    vision: VisionArgs | None,
) -> tuple[list[int], list[PromptImage]]:
    """A prompt whose images are one ``image_token_id`` placeholder each (the request side's
    encoding) -> its ids with each placeholder grown to the image's positions (``image_ids``),
    and the images' spans. ValueError, naming the mismatch, when the model has no vision tower,
    when the placeholders and the images do not pair up, or when an image does not fit the
    model's geometry."""
    if not images:
        return token_ids, []
    if vision is None:
        raise ValueError("this model has no vision tower: requests with images are not served")
    at = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(at) != len(images):
        raise ValueError(
            f"the prompt has {len(at)} image placeholders (token {image_token_id}) for "
            f"{len(images)} images"
        )
    ids: list[int] = []
    spans: list[PromptImage] = []
    start = 0
    for position, image in zip(at, images, strict=True):
        grid = vision.grid(image.width, image.height)
        ids.extend(token_ids[start:position])
        spans.append(PromptImage(len(ids), grid.num_tokens, image.digest, image))
        ids.extend(image_ids(vocab_size, grid.num_tokens))
        start = position + 1
    ids.extend(token_ids[start:])
    return ids, spans


@dataclass(frozen=True)
class ImageGrid:
    """One image's patch grid and what it spans in the prompt."""

    grid_w: int
    grid_h: int
    ratio: int

    @property
    def tokens_w(self) -> int:
        return math.ceil(self.grid_w / self.ratio)

    @property
    def tokens_h(self) -> int:
        return math.ceil(self.grid_h / self.ratio)

    @property
    def num_patches(self) -> int:
        return self.grid_w * self.grid_h

    @property
    def num_tokens(self) -> int:
        """Prompt positions: start, each row of image tokens and its newline, end."""
        return self.tokens_h * (self.tokens_w + 1) + 2


@dataclass(frozen=True)
class VisionArgs:
    patch_size: int = 14
    downsample_ratio: int = 3
    max_image_tokens: int = 0  # 0: no bound of the checkpoint's (the request side bounds it)
    hidden_size: int = 1024
    depth: int = 32
    num_heads: int = 16
    mlp_ratio: float = 2.7
    mlp_multiple_of: int = 128
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for key in ("patch_size", "downsample_ratio", "hidden_size", "depth", "num_heads"):
            if getattr(self, key) <= 0:
                raise ValueError(f"config: vision_config.{key} must be positive")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(
                f"config: vision_config.hidden_size={self.hidden_size} must split into "
                f"num_heads={self.num_heads} heads of a multiple of 4 (2-D rotary halves)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        m = self.mlp_multiple_of
        return m * math.ceil(int(self.hidden_size * self.mlp_ratio) / m)

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size * self.patch_size

    def grid(self, width: int, height: int) -> ImageGrid:
        """The grid of a preprocessed image of ``width x height`` pixels; ValueError when it is
        not a whole number of patches or spans more tokens than the checkpoint allows."""
        p = self.patch_size
        if width <= 0 or height <= 0 or width % p or height % p:
            raise ValueError(
                f"image of {width}x{height} pixels is not a whole number of {p}-pixel patches "
                f"(images must be preprocessed to the model's geometry)"
            )
        grid = ImageGrid(width // p, height // p, self.downsample_ratio)
        if self.max_image_tokens and grid.num_tokens > self.max_image_tokens:
            raise ValueError(
                f"image of {width}x{height} pixels spans {grid.num_tokens} tokens, more than "
                f"the model's max_image_tokens={self.max_image_tokens}"
            )
        return grid

    @classmethod
    def from_dict(cls, vision: dict[str, Any] | None) -> VisionArgs | None:
        if not vision:
            return None
        defaults = cls()
        return cls(
            patch_size=int(vision.get("patch_size", defaults.patch_size)),
            downsample_ratio=int(vision.get("downsample_ratio", defaults.downsample_ratio)),
            max_image_tokens=int(vision.get("max_image_tokens") or 0),
            hidden_size=int(vision.get("hidden_size", defaults.hidden_size)),
            depth=int(vision.get("depth", defaults.depth)),
            num_heads=int(vision.get("num_heads", defaults.num_heads)),
            mlp_ratio=float(vision.get("mlp_ratio", defaults.mlp_ratio)),
            mlp_multiple_of=int(vision.get("mlp_multiple_of", defaults.mlp_multiple_of)),
        )
