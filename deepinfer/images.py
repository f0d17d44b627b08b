"""A prompt's images (torch-free): what a request brings, where each image sits in the prompt,
and what keys its positions in the prefix cache.

    ImageInput (encoded bytes, size; from the request side)
        --family.expand_images--> prompt ids with each placeholder grown to the image's
                                  positions + one PromptImage per image (offset, num_tokens)

Every image's positions hold the same placeholder ids, so token ids alone cannot tell two images
apart: the prefix cache keys a block by its ids and the digests of the images it overlaps
(``images_key``), and an image's embeddings are cached by its digest (the SHA-256 of its encoded
bytes: the same bytes give the same pixels, hence the same embeddings).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ImageInput:
    """One image of a request, as the request side preprocessed it (deepseek-recipe: encoded
    bytes, WebP, at a size the model's patches divide). ``pixels``: the decoded image, uint8
    [height, width, 3] RGB (``decoded()``), what the vision tower reads. ``embeds``: the
    tower's output for it, [num_tokens, D], when an encoder node computed it (the engine then
    encodes it only if that is gone from its cache when a step needs it)."""

    data: bytes = field(repr=False)
    width: int
    height: int
    pixels: Any = field(default=None, repr=False, compare=False)
    embeds: Any = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def digest(self) -> bytes:
        return hashlib.sha256(self.data).digest()

    def decoded(self) -> ImageInput:
        """This image with its pixels; ValueError when the bytes are not an image of the
        stated size."""
        if self.pixels is not None:
            return self
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(self.data)) as image:
                pixels = np.array(image.convert("RGB"))
        except (UnidentifiedImageError, OSError) as e:
            raise ValueError(f"an image could not be decoded: {e}") from None
        if pixels.shape[:2] != (self.height, self.width):
            raise ValueError(
                f"an image said to be {self.width}x{self.height} pixels is "
                f"{pixels.shape[1]}x{pixels.shape[0]}"
            )
        return dataclasses.replace(self, pixels=pixels)


def decode_images(images: Sequence[ImageInput]) -> list[ImageInput]:
    """The images decoded, except those whose embeddings came with them."""
    return [image if image.embeds is not None else image.decoded() for image in images]


@dataclass(frozen=True)
class PromptImage:
    """An image in a request's prompt: positions ``offset .. offset + num_tokens - 1``."""

    offset: int
    num_tokens: int
    digest: bytes
    image: ImageInput = field(repr=False, compare=False)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def overlapping(images: Sequence[PromptImage], start: int, end: int) -> list[PromptImage]:
    """The images with a position in ``start .. end - 1`` (images are in prompt order)."""
    return [image for image in images if image.offset < end and start < image.end]


def images_key(images: Sequence[PromptImage], start: int, end: int) -> bytes:
    """What the prefix cache adds to the ids of positions ``start .. end - 1``: the digests of
    the images they overlap (empty when none, so text-only blocks keep their keys)."""
    return b"".join(image.digest for image in overlapping(images, start, end))
