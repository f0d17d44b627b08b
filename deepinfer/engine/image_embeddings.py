"""ImageEmbeddings: the vision tower's output for the image positions a step computes, cached by
image content.

    step's chunks -> images they overlap (deepinfer/images.py) -> embeddings by digest
        (cached, or the missing ones encoded together: family.encode_images, one batch)
    -> ForwardBatch.image_rows (the chunks' rows at image positions) + image_embeds

A chunk may cover part of an image (chunked prefill through an image, a prefix hit ending in
one, a recompute after preemption): the image is encoded whole, since each of its embeddings
depends on all its patches, and the chunk takes its rows. Embeddings stay cached, least recently
used evicted first, within ``cache.image_embedding_mib``; a request's later chunks and a repeated
image (the same bytes, any request) are not encoded again. Tiered as KV blocks are, with the KV
cache's tiers (kind "image", key the digest):

    device (this LRU) --evicted--> HostTier (cache.image_embedding_host_mib; accelerators only)
                      --evicted--> DiskTier (cache.image_embedding_disk_dir, its own directory,
                                   possibly a shared mount: any node's files serve every node)
    a hit in either comes back to the device (a disk read is synchronous: a few MB an image)

Disk files carry a salt of the checkpoint, the tower's dtype and the random-weights seed
(``image_salt``), the same on serving and encode nodes. An image that came with its
embeddings (``ImageInput.embeds``: an encoder node computed them) is not encoded here unless
they are needed again once evicted. An encoder node keeps one of these for its own cache
(``embeddings``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from deepinfer.config import CacheConfig
from deepinfer.images import ImageInput, PromptImage, overlapping
from deepinfer.kv_cache.disk_tier import DiskTier
from deepinfer.kv_cache.tiers import HostTier
from deepinfer.model.batch import ForwardBatch
from deepinfer.scheduler.output import ScheduledRequest

_KIND = "image"  # the tiers' kind of an image's embeddings
Encode = Callable[[list[torch.Tensor], list[ImageInput]], list[torch.Tensor]]


@dataclass
class ImageEncodeStats:
    """Counts since start."""

    num_encoded: int = 0  # images run through the tower
    num_hits: int = 0  # images a step needed and found cached
    num_received: int = 0  # images whose embeddings came with the request (an encoder node's)
    num_host_hits: int = 0  # of the hits, those brought back from the host tier
    num_disk_hits: int = 0  # of the hits, those read back from the disk tier
    encode_seconds: float = 0.0  # in the tower (on CUDA: to the end of its kernels)


class ImageEmbeddings:
    def __init__(
        self,
        encode: Encode,
        device: torch.device,
        upload: Callable[[np.ndarray], torch.Tensor],
        budget_bytes: int,
        host: HostTier | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        self.encode = encode
        self.device = device
        self.upload = upload
        self._cached = _LRU(budget_bytes)
        self.host = host
        self.disk = disk
        self.stats = ImageEncodeStats()

    @classmethod
    def from_config(
        cls,
        config: CacheConfig,
        encode: Encode,
        device: torch.device,
        upload: Callable[[np.ndarray], torch.Tensor],
        salt: bytes,
    ) -> ImageEmbeddings:
        """The cache ``config`` sizes: no host tier on the CPU (the device cache is host
        memory there), a disk tier when ``image_embedding_disk_dir`` is set."""
        host = None
        if device.type != "cpu" and config.image_embedding_host_mib > 0:
            host = HostTier(int(config.image_embedding_host_mib * 2**20), pin_memory=True)
        disk = None
        if config.image_embedding_disk_dir is not None:
            capacity = int(config.image_embedding_disk_gib * 2**30)
            disk = DiskTier(Path(config.image_embedding_disk_dir), capacity, salt)
        return cls(encode, device, upload, int(config.image_embedding_mib * 2**20), host, disk)

    def place(self, batch: ForwardBatch, scheduled: list[ScheduledRequest]) -> None:
        """Set ``batch``'s image rows and embeddings for the step's chunks (none: unchanged)."""
        rows: list[np.ndarray] = []
        parts: list[tuple[PromptImage, int, int]] = []  # image, its first and last + 1 row
        offset = 0
        for sched in scheduled:
            start, end = sched.start_pos, sched.start_pos + sched.num_tokens
            for image in overlapping(sched.request.images, start, end):
                lo, hi = max(start, image.offset), min(end, image.end)
                rows.append(np.arange(offset + lo - start, offset + hi - start, dtype=np.int64))
                parts.append((image, lo - image.offset, hi - image.offset))
            offset += sched.num_tokens
        if not parts:
            return
        embeddings = self.embeddings([image.image for image, _, _ in parts])
        batch.image_rows = self.upload(np.concatenate(rows))
        batch.image_embeds = torch.cat([embeddings[i.digest][lo:hi] for i, lo, hi in parts])

    def embeddings(self, images: list[ImageInput]) -> dict[bytes, torch.Tensor]:
        """Each image's embeddings [num_tokens, D] by digest: cached, come with the image, or
        (the rest) encoded in one batch."""
        out: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, ImageInput] = {}
        for image in images:
            digest = image.digest
            if digest in out or digest in missing:
                continue
            cached = self._cached.get(digest)
            if cached is None:
                cached = self._from_tiers(digest)
            if cached is not None:
                self.stats.num_hits += 1
                out[digest] = cached
            elif image.embeds is not None:
                out[digest] = image.embeds.to(self.device)
                self.stats.num_received += 1
                self._keep(digest, out[digest])
            else:
                missing[digest] = image
        if missing:
            out.update(self._encode(list(missing.values())))
        return out

    def _encode(self, images: list[ImageInput]) -> dict[bytes, torch.Tensor]:
        began = time.perf_counter()
        # A handed-off request's images come undecoded (only a recompute encodes them here).
        pixels = [torch.from_numpy(i.decoded().pixels).to(self.device) for i in images]
        encoded = self.encode(pixels, images)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.stats.encode_seconds += time.perf_counter() - began
        self.stats.num_encoded += len(images)
        out = {}
        for image, embeds in zip(images, encoded, strict=True):
            out[image.digest] = embeds
            self._keep(image.digest, embeds)
        return out

    def _from_tiers(self, digest: bytes) -> torch.Tensor | None:
        """An image's embeddings from the host or disk tier, back on the device (None: in
        neither)."""
        held = self.host.pop(_KIND, digest) if self.host is not None else None
        if held is not None:
            self.stats.num_host_hits += 1
        elif self.disk is not None and (held := self.disk.get(_KIND, digest)) is not None:
            self.stats.num_disk_hits += 1
        if held is None:
            return None
        embeds = held[0].to(self.device, non_blocking=True)
        self._keep(digest, embeds)
        return embeds

    def _keep(self, digest: bytes, embeds: torch.Tensor) -> None:
        evicted: list[tuple[str, bytes, list[torch.Tensor]]] = [
            (_KIND, old, [tensor]) for old, tensor in self._cached.put(digest, embeds)
        ]
        if self.host is not None:
            evicted = [
                e for kind, key, payload in evicted for e in self.host.put(kind, key, payload)
            ]
        if self.disk is not None:
            for kind, key, payload in evicted:
                # The device's tensor stays as it is (steps only read it) until it is written.
                self.disk.put(kind, key, [t.cpu() for t in payload])


class _LRU:
    """Tensors by digest within ``budget_bytes``, least recently used out first."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.num_bytes = 0
        self._tensors: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def get(self, digest: bytes) -> torch.Tensor | None:
        tensor = self._tensors.get(digest)
        if tensor is not None:
            self._tensors.move_to_end(digest)
        return tensor

    def put(self, digest: bytes, tensor: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        """Keep ``tensor`` (not if it alone is over the budget); the ones evicted for it."""
        if _size(tensor) > self.budget_bytes or digest in self._tensors:
            return []
        self._tensors[digest] = tensor
        self.num_bytes += _size(tensor)
        evicted = []
        while self.num_bytes > self.budget_bytes:
            old_digest, old = self._tensors.popitem(last=False)
            self.num_bytes -= _size(old)
            evicted.append((old_digest, old))
        return evicted


def _size(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
