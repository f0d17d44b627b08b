"""An encoder node's engine: the vision tower alone, the images of many requests encoded together.

    ImageEncodeEngine(config)         the checkpoint's tower (only its weights are read), on the
                                      model's device and dtype, with the node's embeddings cache
      .embeddings(images)             by digest: cached, or encoded in one batch (ImageEmbeddings)
    AsyncImageEncoder(engine, batch)  for the event loop: ``await encode(images)`` queues a
                                      request's images; one worker thread encodes whatever waits,
                                      up to ``batch`` images a run, requests kept whole

An image's embeddings do not depend on the others in its batch (each attends only to itself),
so batching across requests changes no request's result beyond the kernels' own rounding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from deepinfer.config import Config
from deepinfer.device import resolve_device, resolve_dtype, use_ieee_float32
from deepinfer.engine.image_embeddings import ImageEmbeddings
from deepinfer.engine.model_runner import kernel_config
from deepinfer.engine.weights_loading import image_salt, model_folder
from deepinfer.images import ImageInput
from deepinfer.model.families import load_args, load_family
from deepinfer.ops import select_kernels

logger = logging.getLogger(__name__)


class ImageEncodeEngine:
    """The vision tower of ``config.model`` with an embeddings cache of
    ``cache.image_embedding_mib``. Not thread-safe: one thread calls ``embeddings``."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.model_dir = model_folder(config.model)
        args = load_args(self.model_dir)
        self.max_model_len = config.model.max_model_len or args.max_position_embeddings
        self.family = load_family(args.model_type)
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        if config.kernel.num_threads > 0:
            torch.set_num_threads(config.kernel.num_threads)
        use_ieee_float32(self.device, self.dtype)
        kernels = select_kernels(kernel_config(config), self.device)
        seed = config.model.tiny_model_seed if config.model.random_weights else None
        self.encoder = self.family.load_image_encoder(
            self.model_dir, args, kernels, device=self.device, dtype=self.dtype, random_seed=seed
        )
        self.images = ImageEmbeddings.from_config(
            config.cache,
            partial(self.family.encode_images, self.encoder),
            self.device,
            lambda values: torch.from_numpy(values).to(self.device),
            image_salt(self.model_dir, config.model, self.dtype),
        )
        num_bytes = sum(p.numel() * p.element_size() for p in self.encoder.parameters())
        logger.info(
            "vision tower of %s: %.1f MiB of weights, %s on %s",
            self.model_dir,
            num_bytes / 2**20,
            self.dtype,
            self.device,
        )

    def stats(self) -> dict[str, float]:
        """The tower's counters since start (as ``LLMEngine.image_stats``)."""
        return dataclasses.asdict(self.images.stats)

    def embeddings(self, images: list[ImageInput]) -> dict[bytes, torch.Tensor]:
        """Each image's embeddings [num_tokens, D] by digest (decoded images, or cached)."""
        return self.images.embeddings(images)


@dataclass
class _Waiting:
    images: list[ImageInput]
    future: asyncio.Future[list[torch.Tensor]]


@dataclass(frozen=True)
class EncoderLoad:
    num_running: int  # requests whose images the tower runs now
    num_waiting: int  # requests queued behind them


class AsyncImageEncoder:
    """``engine`` for the event loop; see the module. ``start()`` on the loop, ``stop()`` at the
    end (queued requests then fail with EncoderClosedError)."""

    def __init__(self, engine: ImageEncodeEngine, batch_images: int, pause_s: float = 0.0) -> None:
        self.engine = engine
        self.batch_images = batch_images
        self.pause_s = pause_s  # tests: before each run, so that they can act while it waits
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="image-encode")
        self._queue: list[_Waiting] = []
        self._num_running = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @property
    def is_turning(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="image-encode")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for waiting in self._queue:
            if not waiting.future.done():
                waiting.future.set_exception(EncoderClosedError("the encoder is stopping"))
        self._queue.clear()
        self._thread.shutdown(wait=False, cancel_futures=True)

    def load(self) -> EncoderLoad:
        return EncoderLoad(self._num_running, len(self._queue))

    async def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The embeddings of ``images`` (decoded), in order. Cancelling the caller drops them
        from the queue (or ignores them once encoded). Raises what the tower raises."""
        if not self.is_turning or self._wake is None:
            raise EncoderClosedError("the encoder is not running")
        future: asyncio.Future[list[torch.Tensor]] = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiting(list(images), future))
        self._wake.set()
        return await future

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._take()
                if not batch:
                    continue
                self._num_running = len(batch)
                try:
                    await self._encode(loop, batch)
                finally:
                    self._num_running = 0

    def _take(self) -> list[_Waiting]:
        """The requests of the next run, in arrival order: whole requests up to
        ``batch_images`` images (at least one request); those whose callers left dropped."""
        batch: list[_Waiting] = []
        num_images = 0
        while self._queue:
            waiting = self._queue[0]
            if waiting.future.done():
                self._queue.pop(0)
                continue
            if batch and num_images + len(waiting.images) > self.batch_images:
                break
            batch.append(self._queue.pop(0))
            num_images += len(waiting.images)
        return batch

    async def _encode(self, loop: asyncio.AbstractEventLoop, batch: list[_Waiting]) -> None:
        """One run of the tower for ``batch``; if it fails, each request alone (so that one
        request's failure is only its own)."""
        images = [image for waiting in batch for image in waiting.images]
        if self.pause_s > 0:
            await asyncio.sleep(self.pause_s)
        try:
            out = await loop.run_in_executor(self._thread, self.engine.embeddings, images)
        except Exception as error:
            if len(batch) > 1:
                for waiting in batch:
                    await self._encode(loop, [waiting])
                return
            if not batch[0].future.done():
                batch[0].future.set_exception(error)
            return
        for waiting in batch:
            if not waiting.future.done():
                waiting.future.set_result([out[image.digest] for image in waiting.images])


class EncoderClosedError(RuntimeError):
    """The encoder takes no images (stopping, or not started)."""
