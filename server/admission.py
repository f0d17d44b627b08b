"""Admission control: a bounded queue in front of the nodes.

    request ──admit()──▶ running (a slot is free)              ──release──▶ next waiter runs
                    └──▶ waiting (FIFO; bounded by requests and by queued prompt tokens)
                    └──▶ refused: QueueFullError (429 + Retry-After), DrainingError (503)

At most ``max_running`` requests are in flight to the nodes; beyond that, requests wait here in
arrival order, so that an overload shows up as fast 429s instead of unbounded queues and
timeouts (users' complaint: vLLM #49445, SGLang #33858). A slot freed by a finishing request is
handed directly to the oldest waiter, so a newcomer cannot overtake the queue.

Limits left None follow ``capacity()``, what the ready nodes run at once (their
``max_num_seqs`` summed): as many running, and as many again waiting. More running than the
nodes run would only queue on the nodes, out of sight of this queue and its 429s.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass


class AdmissionError(Exception):
    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class QueueFullError(AdmissionError):
    """The waiting queue is full (by requests or by prompt tokens): HTTP 429."""


class DrainingError(AdmissionError):
    """The server is shutting down and admits nothing new: HTTP 503."""


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future[None]
    num_prompt_tokens: int


@dataclass
class Admission:
    """A request's pass: ``queue_time`` is how long it waited for its slot (seconds)."""

    queue_time: float


class AdmissionController:
    def __init__(
        self,
        max_running: int | None,
        max_queued_requests: int | None,
        max_queued_prompt_tokens: int,
        retry_after_s: int = 1,
        capacity: Callable[[], int] = lambda: 0,
    ) -> None:
        self._max_running = max_running
        self._max_queued_requests = max_queued_requests
        self._capacity = capacity
        self.max_queued_prompt_tokens = max_queued_prompt_tokens
        self.retry_after_s = retry_after_s
        self.num_running = 0
        self.num_waiting_tokens = 0
        self.is_draining = False
        self._waiters: deque[_Waiter] = deque()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def max_running(self) -> int:
        return self._max_running if self._max_running is not None else self._capacity()

    @property
    def max_queued_requests(self) -> int:
        if self._max_queued_requests is not None:
            return self._max_queued_requests
        return self.max_running

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def check_room(self, num_preparing: int = 0) -> None:
        """Raises QueueFullError when every running and waiting place is taken, counting
        ``num_preparing`` requests that are still being prepared for admission."""
        num_admitted = self.num_running + self.num_waiting + num_preparing
        limit = self.max_running + self.max_queued_requests
        if num_admitted >= limit:
            raise QueueFullError(
                f"Too many requests: {num_admitted} running, waiting or being prepared "
                f"(server.max_running_requests + server.max_queued_requests = {limit})",
                self.retry_after_s,
            )

    @asynccontextmanager
    async def admit(self, num_prompt_tokens: int) -> AsyncIterator[Admission]:
        """Hold a running slot for the block; wait for one in the bounded queue if needed.

        Raises QueueFullError or DrainingError at once instead of queueing.
        """
        if self.is_draining:
            raise DrainingError("The server is shutting down; retry on another replica", 5)
        start = time.monotonic()
        if self.num_running < self.max_running and not self._waiters:
            self.num_running += 1
        else:
            await self._wait_for_slot(num_prompt_tokens)
        self._idle.clear()
        try:
            yield Admission(queue_time=time.monotonic() - start)
        finally:
            self._release()

    async def _wait_for_slot(self, num_prompt_tokens: int) -> None:
        max_queued_requests = self.max_queued_requests
        if len(self._waiters) >= max_queued_requests:
            raise QueueFullError(
                f"Too many requests: {len(self._waiters)} already waiting "
                f"(server.max_queued_requests = {max_queued_requests})",
                self.retry_after_s,
            )
        if self.num_waiting_tokens + num_prompt_tokens > self.max_queued_prompt_tokens:
            raise QueueFullError(
                f"Too many queued prompt tokens: {self.num_waiting_tokens} waiting + "
                f"{num_prompt_tokens} in this request > server.max_queued_prompt_tokens = "
                f"{self.max_queued_prompt_tokens}",
                self.retry_after_s,
            )
        waiter = _Waiter(asyncio.get_running_loop().create_future(), num_prompt_tokens)
        self._waiters.append(waiter)
        self.num_waiting_tokens += num_prompt_tokens
        self._idle.clear()
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                # The slot was handed over just as we were cancelled: pass it on.
                self._release()
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
                self.num_waiting_tokens -= num_prompt_tokens
                self._update_idle()
            raise

    def _release(self) -> None:
        """Hand the slot to the oldest waiter, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            self.num_waiting_tokens -= waiter.num_prompt_tokens
            if waiter.future.done():  # cancelled while waiting; its task cleans up nothing more
                continue
            waiter.future.set_result(None)  # the slot moves over: num_running is unchanged
            return
        self.num_running -= 1
        self._update_idle()

    def _update_idle(self) -> None:
        if self.num_running == 0 and not self._waiters:
            self._idle.set()

    def start_draining(self) -> None:
        self.is_draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing runs or waits; return False when ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
