"""AsyncEngine: the asyncio face of one LLMEngine, for one event loop.

    generate() / abort() / finish()         the loop task               the step thread
    ───────────────────────────────         ─────────────               ───────────────
    command ─▶ applied now when no step ─▶  apply queued commands
               is in flight, else queued    engine.step() ───────────▶  schedule → execute → update
                                            deltas ◀──────────────────  (blocking CPU/device work)
    per-request asyncio.Queue ◀──────────── dispatch

Only one thread touches the scheduler at a time: the step thread while a step runs, the event
loop thread otherwise. Commands (add, abort, finish) therefore run on the loop thread either at
once (no step in flight and nothing queued ahead of them, so order is kept) or between steps.
When there is no work the loop task waits on an event; it never polls.

A request's stream is owned by its ``generate()`` consumer: it is registered when the consumer
starts iterating and removed when the consumer stops, and a consumer that stops before the
request finished (a client disconnect, a cancelled task) aborts it, which frees its blocks.

A rank of a lock-step group (config [parallel]) steps whenever any rank has work: its engine's
steps agree with the others' (engine/llm_engine.py), so with no requests of its own it still
steps while the group has any, and with none anywhere it agrees again every
``parallel.idle_poll_s``. ``stop()`` tells the group it is leaving; the loop ends at the step
where every rank is leaving and none has requests left. A failed step breaks a rank's engine for
good (its peers' collectives failed with it): every open stream ends with an error.

One file of ~500 lines: the loop task, the step thread and the command queue hand the
scheduler to each other, and that hand-off is only readable in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from deepinfer.constraints import ConstraintError
from deepinfer.engine.handoff import HandOffExport, RequestState
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.images import ImageInput, PromptImage, decode_images
from deepinfer.outputs import FinishReason
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.output import RequestOutputDelta
from deepinfer.scheduler.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class EngineClosedError(RuntimeError):
    """The engine is draining or stopped and takes no new requests (HTTP 503)."""


class EngineStepError(RuntimeError):
    """A step failed while this request was in it; the request was aborted (HTTP 500)."""


class EngineObserver(Protocol):
    """Hooks for metrics, called on the event loop thread (producer: AsyncEngine)."""

    def on_scheduled(self, request: Request, queue_time_s: float) -> None:
        """The request was admitted for the first time, ``queue_time_s`` after it arrived."""

    def on_step(
        self, step_time_s: float, deltas: list[RequestOutputDelta], num_scheduled_tokens: int
    ) -> None:
        """One step ran (in the step thread) for ``step_time_s``, produced ``deltas`` and
        scheduled ``num_scheduled_tokens`` (its batch's prefill chunks and decode tokens)."""

    def on_finished(self, request: Request, finish_reason: FinishReason) -> None:
        """The request ended with ``finish_reason`` (ERROR: a step or the engine loop failed).
        Called once per request."""


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds now. Producer: AsyncEngine.load() (event loop thread). Consumers:
    the node's registration, heartbeats and /metrics (as server/protocol.py NodeLoad).
    ``is_draining``: it takes no new requests. ``is_healthy``: its loop turns (``is_turning``)."""

    num_running: int
    num_waiting: int
    num_prefill_tokens: int  # prompt tokens still to compute (waiting and running requests)
    num_free_blocks: int
    num_total_blocks: int
    num_used_slots: int
    is_draining: bool
    is_healthy: bool


_LEFT = None  # queued after a hand-off's last delta: the request left this engine


@dataclass(eq=False)
class _Stream:
    """One generate() consumer. ``queue`` holds deltas, then an exception if the request fails
    (or ``_LEFT`` once a hand-off's state is exported)."""

    request_id: str
    queue: asyncio.Queue[RequestOutputDelta | Exception | None] = field(
        default_factory=asyncio.Queue
    )
    request: Request | None = None  # set once the engine accepted the request
    is_finished: bool = False  # the final delta (or error) is queued, or the consumer left
    hand_off: HandOffExport | None = None  # a prefill-side hand-off: where its state goes


class AsyncEngine:
    """Runs ``engine.step()`` in a dedicated thread and streams deltas to asyncio consumers.

    Start with ``await start()`` (or ``cleanup_ctx``), stop with ``await stop()``. Every method
    must be called on the event loop thread the engine was started on.
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        observer: EngineObserver | None = None,
        max_step_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.observer = observer
        self.max_step_s = max_step_s
        self._streams: dict[str, _Stream] = {}
        self._commands: deque[Callable[[], None]] = deque()
        # Streams whose first admission is not seen yet, in add order (admission is FCFS).
        self._unscheduled: deque[_Stream] = deque()
        self._step_thread: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._no_streams = asyncio.Event()
        self._no_streams.set()
        self._step_started: float | None = None  # monotonic start of the step in flight
        self._is_stopping = False
        self._is_draining = False
        self._is_broken = False
        self._idle_poll_s = engine.config.parallel.idle_poll_s

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        assert self._task is None, "AsyncEngine.start() called twice"
        self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-step")
        self._task = asyncio.create_task(self._run(), name="deepinfer-engine-loop")

    async def drain(self, timeout_s: float) -> None:
        """Take no new requests; wait up to ``timeout_s`` for the open streams to finish."""
        self._is_draining = True
        try:
            await asyncio.wait_for(self._no_streams.wait(), timeout_s)
        except TimeoutError:
            logger.warning(
                "drain: %d requests still open after %.1f s; aborting them",
                len(self._streams),
                timeout_s,
            )

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Abort every request (their streams end with finish_reason "abort"), let the step in
        flight end (up to ``timeout_s``), then stop the loop task and the step thread. A rank
        of a group steps on until every rank stops (within ``timeout_s``)."""
        self._is_draining = True
        for request_id in list(self._streams):
            self.abort(request_id)
        self._is_stopping = True
        self.engine.leaving = True
        self._wakeup.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
            except TimeoutError:
                logger.error("engine loop did not stop within %.1f s; cancelling it", timeout_s)
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        if self._step_thread is not None:
            # wait=False: a step stuck on the device must not hang the process's exit.
            self._step_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def is_turning(self) -> bool:
        """The loop task is alive and not stuck in a step longer than ``max_step_s`` (/ready)."""
        if self._task is None or self._task.done() or self._is_broken:
            return False
        return self._step_started is None or time.monotonic() - self._step_started < self.max_step_s

    @property
    def is_draining(self) -> bool:
        return self._is_draining

    @property
    def is_broken(self) -> bool:
        """A step or the loop failed for good (a rank: its group ended)."""
        return self._is_broken

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def load(self) -> EngineLoad:
        scheduler = self.engine.scheduler
        return EngineLoad(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_prefill_tokens=scheduler.num_prefill_tokens,
            num_free_blocks=scheduler.block_manager.num_free_blocks,
            num_total_blocks=scheduler.block_manager.num_blocks,
            num_used_slots=scheduler.state_slots.num_used_slots,
            is_draining=self._is_draining,
            is_healthy=self.is_turning,
        )

    # -- requests ----------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        *,
        hand_off: HandOffExport | None = None,
        images: Sequence[ImageInput] = (),
    ) -> AsyncIterator[RequestOutputDelta]:
        """Stream a request's deltas; the last one has ``finish_reason`` set.

        ``cache_salt`` isolates the request's prefix-cache entries (per tenant). ``hand_off``:
        the prefill side of a prefill/decode hand-off: once the first token is sampled (and the
        request did not finish with it) the request's state is copied into ``hand_off.state``
        between two steps, its blocks are freed, and the stream ends after that token's delta.
        ``images``: one per image placeholder of the prompt (``LLMEngine.add_request``); they
        are decoded in a worker thread, off the loop and the engine's thread.

        Raises ValueError (bad input, id in use) or EngineClosedError before the first yield, and
        EngineStepError if a step fails with the request in it. Stopping the iteration early
        (break + aclose, cancellation) aborts the request.
        """
        self._check_open()
        compiled_grammar = await self._compile_grammar(sampling_params)
        decoded = await asyncio.to_thread(decode_images, images) if images else []

        def add() -> Request:
            return self.engine.add_request(
                request_id,
                prompt_token_ids,
                sampling_params,
                cache_salt=cache_salt,
                compiled_grammar=compiled_grammar,
                hand_off=hand_off is not None,
                images=decoded,
            )

        async with contextlib.aclosing(self._stream(request_id, add, hand_off)) as deltas:
            async for delta in deltas:
                yield delta

    async def reserve_hand_off(self, request_id: str, num_prompt_tokens: int) -> None:
        """Decode side: keep blocks and a slot for a hand-off on its way, until
        ``generate_handed_off`` takes them or ``abort(request_id)`` gives them back. Raises
        ValueError (too long, id in use, no room now) or EngineClosedError."""
        self._check_open()
        reserved: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def reserve() -> None:
            if reserved.done():  # the caller left before the command ran
                return
            try:
                self.engine.reserve_hand_off(request_id, num_prompt_tokens)
            except ValueError as e:
                reserved.set_exception(e)
                return
            reserved.set_result(None)

        self._submit(reserve)
        try:
            await reserved
        except asyncio.CancelledError:
            self.abort(request_id)  # reserved or not: nothing is kept for a caller gone
            raise

    async def expand_images(
        self, request_id: str, prompt_token_ids: list[int], images: Sequence[ImageInput]
    ) -> tuple[list[int], list[PromptImage]]:
        """``LLMEngine.expand_images`` in a worker thread (it hashes the images' bytes)."""
        if not images:
            return list(prompt_token_ids), []
        return await asyncio.to_thread(
            self.engine.expand_images, request_id, prompt_token_ids, images
        )

    async def generate_handed_off(
        self,
        state: RequestState,
        sampling_params: SamplingParams,
        images: Sequence[PromptImage] = (),
    ) -> AsyncIterator[RequestOutputDelta]:
        """Decode side: continue a request from another engine's state (its reservation's blocks
        and slot if it has one); as ``generate`` from the second output token on. ``images``:
        the prompt's (``expand_images``)."""

        self._check_open()
        compiled_grammar = await self._compile_grammar(sampling_params)

        def add() -> Request:
            return self.engine.import_request(state, sampling_params, compiled_grammar, images)

        async with contextlib.aclosing(self._stream(state.request_id, add, None)) as deltas:
            async for delta in deltas:
                yield delta

    def _check_open(self) -> None:
        if self._is_broken:
            raise EngineClosedError("the engine failed and takes no new requests (see its log)")
        if self._is_draining:
            raise EngineClosedError("the engine is shutting down and takes no new requests")

    async def _stream(
        self, request_id: str, add: Callable[[], Request], hand_off: HandOffExport | None
    ) -> AsyncIterator[RequestOutputDelta]:
        self._check_open()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = _Stream(request_id, hand_off=hand_off)
        self._streams[request_id] = stream
        self._no_streams.clear()
        try:
            added: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._submit(lambda: self._add(stream, add, added))
            await added
            while True:
                item = await stream.queue.get()
                if item is _LEFT:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.is_finished:
                    return
        finally:
            self._close_stream(stream)

    async def _compile_grammar(self, sampling_params: SamplingParams) -> Any:
        """A constrained request's grammar, compiled in the compiler's pool while other requests
        keep stepping. Raises ConstraintError (a ValueError: 400) if invalid or too slow."""
        if sampling_params.constraint is None:
            return None
        future = self.engine.compile_grammar_async(sampling_params)
        compiler = self.engine.grammar_compiler
        assert compiler is not None
        try:
            # shield: a timed-out compile keeps running and lands in the cache for a retry.
            return await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), compiler.timeout_s
            )
        except TimeoutError:
            raise ConstraintError(
                f"compiling the {sampling_params.constraint[0]} grammar took longer than "
                f"{compiler.timeout_s:g} s"
            ) from None

    def abort(self, request_id: str) -> None:
        """Abort a request anywhere (waiting, running); its stream ends with "abort"."""
        self._submit(lambda: self._end(request_id, None))

    def finish(self, request_id: str, stop_reason: int | str | None = None) -> None:
        """End a request with "stop" (a stop string matched on the text side)."""
        self._submit(lambda: self._end(request_id, stop_reason, is_stop=True))

    def get_request(self, request_id: str) -> Request | None:
        """The engine's Request while its generate() stream is open (counts for the wire)."""
        stream = self._streams.get(request_id)
        return None if stream is None else stream.request

    # -- commands (loop thread, never during a step) -----------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        if self._step_started is None and not self._commands:
            command()
        else:
            self._commands.append(command)
        self._wakeup.set()

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            try:
                command()
            except Exception:
                # A command is the scheduler's bookkeeping for one request; if its books no
                # longer add up, _check_or_break stops serving rather than corrupt others.
                logger.exception("an engine command failed")
                self._check_or_break("an engine command failed")

    def _add(
        self, stream: _Stream, add: Callable[[], Request], added: asyncio.Future[None]
    ) -> None:
        # The consumer may have left before the add was applied: its task was cancelled (which
        # cancels ``added`` at once) and may not have run its cleanup yet.
        if stream.is_finished or added.done():
            added.cancel()
            return
        try:
            stream.request = add()
        except ValueError as e:
            added.set_exception(e)
            return
        self._unscheduled.append(stream)
        added.set_result(None)

    def _end(self, request_id: str, stop_reason: int | str | None, is_stop: bool = False) -> None:
        stream = self._streams.get(request_id)
        if is_stop:
            self.engine.finish_requests([request_id], stop_reason)
        else:
            self.engine.abort_requests([request_id])
        if stream is None or stream.is_finished or stream.request is None:
            return
        finish_reason = stream.request.finish_reason
        assert finish_reason is not None, f"request {request_id!r} is unfinished after _end"
        self._finish_stream(stream, finish_reason)
        stream.queue.put_nowait(
            RequestOutputDelta(
                request_id=request_id,
                new_token_ids=[],
                finish_reason=finish_reason,
                stop_reason=stream.request.stop_reason,
            )
        )

    def _close_stream(self, stream: _Stream) -> None:
        """The consumer stopped iterating: forget the stream, abort the request if it runs."""
        del self._streams[stream.request_id]
        if not self._streams:
            self._no_streams.set()
        if stream.is_finished:
            return
        stream.is_finished = True
        request = stream.request
        if request is None:
            return  # never added (or the add is still queued: _add sees is_finished)

        def abort_orphan() -> None:
            if not request.is_finished:
                self.engine.abort_requests([request.request_id])
            self._notify_finished(request, request.finish_reason or FinishReason.ABORT)

        self._submit(abort_orphan)

    def _finish_stream(self, stream: _Stream, finish_reason: FinishReason) -> None:
        stream.is_finished = True
        assert stream.request is not None, f"stream {stream.request_id!r} finished unadded"
        self._notify_finished(stream.request, finish_reason)

    def _notify_finished(self, request: Request, finish_reason: FinishReason) -> None:
        if self.observer is not None:
            self.observer.on_finished(request, finish_reason)

    # -- the loop ----------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as e:
            logger.exception("engine loop crashed; the node is no longer ready")
            self._is_broken = True
            unfinished = [s for s in self._streams.values() if not s.is_finished]
            self._fail_streams(unfinished, f"engine loop crashed: {type(e).__name__}: {e}")

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        grouped = self.engine.lockstep is not None
        # A group of one has no one to wait for: it waits for work like an engine alone.
        polls = grouped and self.engine.lockstep.world_size > 1
        while True:
            self._apply_commands()
            if self._is_stopping and (not polls or self.engine.group_has_left):
                return
            if not self.engine.has_unfinished_requests() and not polls:
                # No await since _apply_commands(), so no command can have been missed.
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if polls and not self._group_busy():
                # Nothing anywhere: agree again after idle_poll_s, or at once on new work here.
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), self._idle_poll_s)
                self._apply_commands()
            self._step_started = time.monotonic()
            try:
                deltas, step_time_s, num_scheduled = await loop.run_in_executor(
                    self._step_thread, self._step
                )
            except Exception as e:
                self._step_started = None
                self._fail_step(e)
                if grouped:
                    self._break_group(e)
                    return
                continue
            step_started, self._step_started = self._step_started, None
            self._observe_admissions(step_started)
            # A rank's idle and placeholder steps ran nothing of its own: not its step times.
            if self.observer is not None and (num_scheduled or deltas or not grouped):
                self.observer.on_step(step_time_s, deltas, num_scheduled)
            self._dispatch(deltas)

    def _group_busy(self) -> bool:
        """A rank of a group: work here, anywhere in the group at the last agreement, or this
        rank leaving (it steps until the others leave too)."""
        engine = self.engine
        return engine.has_unfinished_requests() or engine.group_unfinished or self._is_stopping

    def _break_group(self, error: Exception) -> None:
        """A rank's step failed: its group's collectives are broken, so are its engine's."""
        logger.error("the rank group ended; this engine takes no more requests")
        self._is_broken = True
        self._is_stopping = True
        message = f"the rank group ended: {type(error).__name__}: {error}"
        self._fail_streams([s for s in self._streams.values() if not s.is_finished], message)

    def _step(self) -> tuple[list[RequestOutputDelta], float, int]:
        """Runs in the step thread."""
        start = time.perf_counter()
        deltas = self.engine.step()
        return deltas, time.perf_counter() - start, self.engine.num_scheduled_tokens

    def _dispatch(self, deltas: list[RequestOutputDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None or stream.is_finished:
                continue  # the consumer left; its abort is queued
            stream.queue.put_nowait(delta)
            if delta.finish_reason is not None:
                self._finish_stream(stream, delta.finish_reason)
            elif (
                stream.hand_off is not None
                and self.engine.scheduler.held_request(delta.request_id) is not None
            ):
                self._export(stream)

    def _export(self, stream: _Stream) -> None:
        """A prefill-side hand-off's first token is sampled: copy its state out (no step runs
        now), free its blocks and slot, and end its stream."""
        assert stream.hand_off is not None
        request_id = stream.request_id
        stream.is_finished = True
        try:
            on_device = stream.hand_off.on_device()
            stream.hand_off.state = self.engine.export_request(request_id, on_device)
        except Exception as e:
            logger.exception("exporting hand-off %r failed", request_id)
            stream.queue.put_nowait(EngineStepError(f"exporting the request's state failed: {e}"))
            return
        finally:
            self.engine.release_hand_off(request_id)
        stream.queue.put_nowait(_LEFT)

    def _observe_admissions(self, step_started: float) -> None:
        # Admission is FCFS in add order, so the streams admitted by this step are a prefix.
        while self._unscheduled:
            request = self._unscheduled[0].request
            assert request is not None, "an unscheduled stream has no request"
            if request.status == RequestStatus.WAITING:
                break
            self._unscheduled.popleft()
            was_admitted = not (request.is_finished and request.num_computed_tokens == 0)
            if was_admitted and self.observer is not None:
                self.observer.on_scheduled(request, max(0.0, step_started - request.arrival_time))

    def _fail_step(self, error: Exception) -> None:
        """Fail the requests the step touched (running, or finished inside the partial update);
        waiting requests were not scheduled and keep their place."""
        logger.error("engine step failed; failing the requests in it", exc_info=error)
        failed = [
            s
            for s in self._streams.values()
            if s.request is not None
            and not s.is_finished
            and (s.request.status == RequestStatus.RUNNING or s.request.is_finished)
        ]
        try:
            self.engine.abort_requests([s.request_id for s in failed])
        except Exception:
            logger.exception("aborting the requests of a failed step failed")
        message = f"engine step failed: {type(error).__name__}: {error}"
        self._fail_streams(failed, message)
        self._unscheduled = deque(s for s in self._unscheduled if not s.is_finished)
        self._check_or_break(message)

    def _check_or_break(self, message: str = "engine state is inconsistent") -> None:
        """Check the scheduler's books; when they no longer add up, serving on would corrupt
        other requests: the engine breaks (refuses new requests, /ready 503) and every open
        stream ends with an error."""
        try:
            self.engine.scheduler.check_integrity()
        except Exception:
            logger.exception("engine state is inconsistent; the engine stops serving")
            self._is_broken = True
            self._is_stopping = True
            self._fail_streams([s for s in self._streams.values() if not s.is_finished], message)

    def _fail_streams(self, streams: list[_Stream], message: str) -> None:
        for stream in streams:
            stream.is_finished = True
            if stream.request is not None:
                self._notify_finished(stream.request, FinishReason.ERROR)
            stream.queue.put_nowait(EngineStepError(message))
