"""Preparation: the CPU work between a request's arrival and its admission to the nodes.

    handler ──CoordinatorService.prepare──▶ PreparationPool.run(request, work)
        1. admit, before reading anything: a place in the admission queue (requests still
           preparing count as queued) and in the byte budget (the body's Content-Length, or
           ``max_body_bytes`` when it has none)                      else 429, body unread
        2. read the body within ``body_read_timeout_s``             else 408, connection closed
        3. wait for one of the pool's threads: bodies of ``LARGE_BODY_BYTES`` or more take at
           most ``num_threads - 1`` of them, so small requests never wait behind large ones
        4. ``work(body)`` on that thread: parse, convert, render, length check, tokenize

Tokenization (deepseek-recipe, tokenizers) releases the GIL, so the event loop keeps serving
while a large prompt is tokenized. It also takes ~550 bytes per token at its peak (1.1 GB for a
10 MB prompt), freed into the allocator's per-thread arenas: after a large body the thread hands
that memory back to the OS (glibc's malloc_trim), so the peak is one large request's, not one per
thread. A request whose handler is cancelled (the client left) keeps its thread and budget until
its work returns: threads cannot be interrupted, and the bounds must count what really runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web

from deepinfer.server.admission import AdmissionController, QueueFullError
from deepinfer.server.errors import ApiError

T = TypeVar("T")

# About 250K tokens of text, ~0.7 s of tokenizing on one core.
LARGE_BODY_BYTES = 1 << 20


def _malloc_trim() -> Callable[[], None]:
    """glibc's malloc_trim(0), or a no-op where there is none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return lambda: None
    return lambda: trim(0)  # ctypes releases the GIL for the call


_release_freed_memory = _malloc_trim()


def _run_large(work: Callable[[bytes], T], body: bytes) -> T:
    try:
        return work(body)
    finally:
        _release_freed_memory()


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body, or ApiError(408) when it has not arrived within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise ApiError(
            408,
            f"The request body did not arrive within {timeout_s:g} s (server.body_read_timeout_s)",
            code="request_timeout",
        ) from None


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[None]
    is_large: bool


class PreparationPool:
    """A bounded thread pool of its own for request preparation (``num_threads`` threads)."""

    def __init__(
        self,
        admission: AdmissionController,
        num_threads: int,
        max_bytes: int,
        max_body_bytes: int,
        body_read_timeout_s: float,
    ) -> None:
        self.admission = admission
        self.num_threads = num_threads
        self.max_large = max(1, num_threads - 1)
        self.max_bytes = max_bytes
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = body_read_timeout_s
        self.num_requests = 0  # admitted: reading their body, waiting for a thread or running
        self.num_bytes = 0  # the bytes they reserved
        self.num_running = 0
        self.num_running_large = 0
        self._waiters: deque[_Waiter] = deque()
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="deepinfer-prepare")

    async def run(self, request: web.Request, work: Callable[[bytes], T]) -> T:
        """``work(body)`` on a pool thread. Raises QueueFullError (429), ApiError (408, or what
        ``work`` raises), web.HTTPRequestEntityTooLarge (413)."""
        num_bytes = self._admit(request.content_length)
        try:
            body = await read_body(request, self.body_read_timeout_s)
            is_large = len(body) >= LARGE_BODY_BYTES
            await self._acquire_thread(is_large)
        except BaseException:
            self._release(num_bytes)
            raise
        loop = asyncio.get_running_loop()
        if is_large:
            future = loop.run_in_executor(self._executor, _run_large, work, body)
        else:
            future = loop.run_in_executor(self._executor, work, body)

        def done(_: asyncio.Future[T]) -> None:
            self._release_thread(is_large)
            self._release(num_bytes)

        future.add_done_callback(done)
        return await asyncio.shield(future)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _admit(self, content_length: int | None) -> int:
        num_bytes = self.max_body_bytes if content_length is None else content_length
        if num_bytes > self.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.max_body_bytes, actual_size=num_bytes)
        self.admission.check_room(num_preparing=self.num_requests)
        if self.num_bytes + num_bytes > self.max_bytes:
            raise QueueFullError(
                f"Too many request bytes in preparation: {self.num_bytes} + {num_bytes} in this "
                f"request > server.max_preparing_bytes = {self.max_bytes}",
                self.admission.retry_after_s,
            )
        self.num_requests += 1
        self.num_bytes += num_bytes
        return num_bytes

    def _release(self, num_bytes: int) -> None:
        self.num_requests -= 1
        self.num_bytes -= num_bytes

    # ---- threads: small requests pass large ones that wait for a large-request thread -------

    def _fits(self, is_large: bool) -> bool:
        if self.num_running >= self.num_threads:
            return False
        return not is_large or self.num_running_large < self.max_large

    def _take_thread(self, is_large: bool) -> None:
        self.num_running += 1
        self.num_running_large += is_large

    async def _acquire_thread(self, is_large: bool) -> None:
        # Waiters are woken as soon as a thread fits them, so one that fits now has no
        # waiter of its kind ahead of it.
        if self._fits(is_large):
            self._take_thread(is_large)
            return
        waiter = _Waiter(asyncio.get_running_loop().create_future(), is_large)
        self._waiters.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self._release_thread(is_large)  # handed a thread just as it was cancelled
            else:
                self._waiters.remove(waiter)
            raise

    def _release_thread(self, is_large: bool) -> None:
        self.num_running -= 1
        self.num_running_large -= is_large
        for waiter in list(self._waiters):
            if waiter.future.done():  # cancelled; its task removes it
                continue
            if self._fits(waiter.is_large):
                self._waiters.remove(waiter)
                self._take_thread(waiter.is_large)
                waiter.future.set_result(None)
