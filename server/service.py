"""One public request's life on the coordinator, from admission to its last token delta.

    handler --CoordinatorService.prepare(request, work)--> checks that need no work, then the
        body -> work (parse, convert, tokenize) on the preparation pool (server/preparation.py)
    handler --ApiRequest--> CoordinatorService.generate
        admission (bounded queue) -> registry.select (routing policy) -> NodeBackend.generate
        (a request with images while an encode node is in rotation: server/encoding.py)
        <-- TokenDelta per engine step (metrics observed here) -- handler turns them into text

The handler consumes ``generate`` inside ``contextlib.aclosing``. Leaving early for any reason
but a matched stop string (client gone, timeout, error, drain) aborts the request on its node,
so that its KV blocks are freed at once; a stop string ends it with ``finish_stopped``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web

from deepinfer.images import PromptImage
from deepinfer.outputs import FinishReason
from deepinfer.server.admission import AdmissionController, AdmissionError, DrainingError
from deepinfer.server.cache_index import NO_HIT, PrefixHit
from deepinfer.server.encoding import EncodedBackend
from deepinfer.server.errors import ApiError, internal_error
from deepinfer.server.metrics import CoordinatorMetrics
from deepinfer.server.preparation import PreparationPool
from deepinfer.server.protocol import (
    GenerateRequest,
    ImageData,
    OutputConstraint,
    SamplingOptions,
    TokenDelta,
)
from deepinfer.server.registry import NodeRegistry, NoFittingNodeError, NoReadyNodeError
from deepinfer.server.routing import NodeEntry, NodeError, RouteRequest

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Node statuses that describe the request itself (our own validation on the node, e.g. a bad
# sampling option or output schema): their messages reach the client as they are.
_CLIENT_FAULTS = (400, 413)


class ApiRequestStatus(enum.Enum):
    """An ApiRequest's status on the coordinator (the node's engine request has its own,
    deepinfer.scheduler.request.RequestStatus); a finished one's value is its FinishReason."""

    WAITING = "waiting"  # parsed; waiting for an admission slot
    RUNNING = "running"  # sent to a node
    FINISHED_STOPPED = FinishReason.STOP
    FINISHED_LENGTH = FinishReason.LENGTH
    FINISHED_ABORTED = FinishReason.ABORT  # client gone, timeout, drain, or the node aborted it
    FINISHED_ERROR = FinishReason.ERROR

    @property
    def is_finished(self) -> bool:
        return self not in (ApiRequestStatus.WAITING, ApiRequestStatus.RUNNING)


_NODE_FINISH = {
    FinishReason.STOP: ApiRequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: ApiRequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: ApiRequestStatus.FINISHED_ABORTED,
}


@dataclass
class ApiRequest:
    """One public request. Producer: a handler (from ``Frontend.prepare``); consumer:
    ``CoordinatorService``. Times are ``time.monotonic()`` seconds."""

    request_id: str
    endpoint: str  # metrics label: chat_completions | responses | messages | completions
    prompt_token_ids: list[int]  # one placeholder per image
    sampling: SamplingOptions
    constraint: OutputConstraint | None = None
    cache_salt: str | None = None
    images: list[ImageData] = field(default_factory=list)
    num_image_positions: int = 0  # the images' prompt positions beyond one per placeholder
    # The prompt as the node grows it (its images at their positions), for the cache-aware
    # routing keys; None: ``prompt_token_ids``.
    routing_token_ids: list[int] | None = None
    routing_images: list[PromptImage] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    status: ApiRequestStatus = ApiRequestStatus.WAITING
    node: NodeEntry | None = None
    num_cached_tokens: int = 0
    predicted_hit: PrefixHit = NO_HIT  # what the coordinator's cache index expected there
    num_output_tokens: int = 0
    num_deltas: int = 0  # token deltas passed to the handler (a retry needs none)
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.num_image_positions

    @property
    def num_tokens(self) -> int:
        """The most positions the request can take: its prompt and its output limit."""
        return self.num_prompt_tokens + (self.sampling.max_tokens or 1)


class CoordinatorService:
    def __init__(
        self,
        registry: NodeRegistry,
        admission: AdmissionController,
        metrics: CoordinatorMetrics,
        preparation: PreparationPool,
    ) -> None:
        self.registry = registry
        self.admission = admission
        self.metrics = metrics
        self.preparation = preparation
        self._tasks: dict[str, asyncio.Task] = {}  # request id -> its handler's task
        self._background: set[asyncio.Task] = set()

    def context_limit(self) -> int:
        """Raises ApiError(503) when no node is ready (checked before any CPU work)."""
        if self.admission.is_draining:
            self.metrics.rejected("draining")
            raise ApiError(503, "The server is shutting down", retry_after=5)
        try:
            return self.registry.max_model_len()
        except NoReadyNodeError:
            self.metrics.rejected("no_node")
            raise ApiError(
                503, "No inference node is ready; retry shortly", retry_after=5
            ) from None

    async def prepare(self, request: web.Request, work: Callable[[bytes, int], T]) -> T:
        """``work(body, context_limit)`` on the preparation pool, once the request is admitted
        there. Raises ApiError: 503 (draining, no node), 429, 408, 413, or ``work``'s."""
        context_limit = self.context_limit()
        try:
            return await self.preparation.run(request, lambda body: work(body, context_limit))
        except AdmissionError as e:
            raise self._refused(e) from None

    async def generate(self, req: ApiRequest) -> AsyncIterator[TokenDelta]:
        """The request's token deltas; the last one has ``finish_reason``.

        A node that fails before sending anything (unreachable, engine stopped) leaves rotation
        and the request is retried once on another node. Raises ApiError: 429/503 from
        admission or routing, 400 when no node's context fits, the node's status on NodeError.
        """
        task = asyncio.current_task()
        if task is not None:  # so that a drain that times out can cancel it, queued or running
            self._tasks[req.request_id] = task
        try:
            if not self.registry.has_ready_node:  # not a 429: the derived limits are 0 then
                raise NoReadyNodeError("no node is ready")
            async with self.admission.admit(req.num_prompt_tokens) as admission:
                self.metrics.queue_time.observe(admission.queue_time)
                failed_nodes: list[str] = []
                routing_ids = req.routing_token_ids
                route = self.registry.route_request(
                    req.prompt_token_ids if routing_ids is None else routing_ids,
                    req.num_tokens,
                    req.cache_salt,
                    looks_up=req.sampling.prompt_logprobs is None,
                    images=req.routing_images,
                )
                while True:
                    try:
                        generation = self._generate_on_a_node(req, route, failed_nodes)
                        async with aclosing(generation) as deltas:
                            async for delta in deltas:
                                yield delta
                        return
                    except NodeError as e:
                        if not self._retries(req, route, e, failed_nodes):
                            raise
        except AdmissionError as e:
            raise self._refused(e) from None
        except NoReadyNodeError:
            self.metrics.rejected("no_node")
            raise ApiError(
                503, "No inference node is ready; retry shortly", retry_after=5
            ) from None
        except NoFittingNodeError as e:
            raise ApiError(400, str(e), param="max_tokens", code="invalid_request_error") from None
        except NodeError as e:
            node_id = req.node.node_id if req.node is not None else None
            logger.warning(
                "request %s failed on node %s: %d %s", req.request_id, node_id, e.status, e.message
            )
            if req.status is ApiRequestStatus.RUNNING and req.node is not None:
                # Usually already gone there; the abort makes sure its blocks are freed.
                self._send_abort_task(req.node, req.request_id)
            req.status = ApiRequestStatus.FINISHED_ERROR
            if e.status in _CLIENT_FAULTS:
                raise ApiError(e.status, e.message) from None
            raise internal_error(e.status, req.request_id) from None
        finally:
            self._tasks.pop(req.request_id, None)
            if req.status is ApiRequestStatus.RUNNING:  # left early: client gone, timeout, drain
                self._abort(req)
            if req.node is not None:
                self._record_finish(req)

    async def _generate_on_a_node(
        self, req: ApiRequest, route: RouteRequest, exclude: list[str]
    ) -> AsyncIterator[TokenDelta]:
        """Route the request to a node (not in ``exclude``) and stream its deltas there."""
        with self.registry.select(route, exclude) as node:
            req.node = node
            req.predicted_hit = route.hit(node)
            req.status = ApiRequestStatus.RUNNING
            backend = node.backend
            encoder = self.registry.encoder(exclude) if req.images else None
            if encoder is not None:  # else the node encodes them itself
                backend = EncodedBackend(encoder, node, self.registry.pair_keys)
            stream = backend.generate(self._generate_request(req))
            async with aclosing(stream) as deltas:
                async for delta in deltas:
                    self._observe(req, delta)
                    req.num_deltas += 1
                    if delta.finish_reason is not None:
                        req.status = _NODE_FINISH.get(
                            delta.finish_reason, ApiRequestStatus.FINISHED_ERROR
                        )
                    yield delta
                    if req.status.is_finished:
                        return
            raise NodeError(
                502, "The node's stream ended before the request finished", is_node_failure=True
            )

    def _retries(
        self, req: ApiRequest, route: RouteRequest, error: NodeError, failed_nodes: list[str]
    ) -> bool:
        """After a NodeError: take a failed node out of rotation, and say whether the request
        goes to another one (once, and only if the client has been sent nothing yet)."""
        failed = error.node or req.node  # a pair: the one of its nodes that failed
        if not error.is_node_failure or failed is None:
            return False
        self.registry.mark_unresponsive(failed, error.message)
        failed_nodes.append(failed.node_id)
        if req.num_deltas or len(failed_nodes) > 1:
            return False
        if not self.registry.has_candidate(route, failed_nodes):
            return False
        logger.warning(
            "request %s: node %s failed before its first token (%d %s); retrying on another node",
            req.request_id,
            failed.node_id,
            error.status,
            error.message,
        )
        self.metrics.retries.inc()
        return True

    def _refused(self, e: AdmissionError) -> ApiError:
        is_draining = isinstance(e, DrainingError)
        self.metrics.rejected("draining" if is_draining else "queue_full")
        return ApiError(503 if is_draining else 429, e.message, retry_after=e.retry_after)

    async def finish_stopped(self, req: ApiRequest, stop_reason: int | str | None) -> None:
        """A stop string matched on the text side: end the request on its node as stopped."""
        if req.status is not ApiRequestStatus.RUNNING or req.node is None:
            return
        req.status = ApiRequestStatus.FINISHED_STOPPED
        try:
            await req.node.backend.finish(req.request_id, stop_reason)
        except (NodeError, OSError, TimeoutError) as e:
            # The client's answer is complete; the node ends the request on its own anyway.
            logger.warning("finish(%s) on node %s failed: %s", req.request_id, req.node.node_id, e)

    def _generate_request(self, req: ApiRequest) -> GenerateRequest:
        return GenerateRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            constraint=req.constraint,
            cache_salt=req.cache_salt,
            images=req.images,
        )

    def _observe(self, req: ApiRequest, delta: TokenDelta) -> None:
        now = time.monotonic()
        if delta.num_cached_tokens:
            req.num_cached_tokens = delta.num_cached_tokens
        if not delta.token_ids:
            return
        if req.first_token_time is None:
            req.first_token_time = now
            self.metrics.ttft.observe(now - req.arrival_time)
        else:
            self.metrics.itl.observe(now - (req.last_token_time or now))
        req.last_token_time = now
        req.num_output_tokens += len(delta.token_ids)

    def _abort(self, req: ApiRequest) -> None:
        req.status = ApiRequestStatus.FINISHED_ABORTED
        self.metrics.aborts.inc()
        node = req.node
        if node is None:
            return
        logger.info("aborting request %s on node %s", req.request_id, node.node_id)
        self._send_abort_task(node, req.request_id)

    def _send_abort_task(self, node: NodeEntry, request_id: str) -> None:
        # A task of its own: this runs while the handler is being cancelled or closed.
        task = asyncio.get_running_loop().create_task(self._send_abort(node, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    async def _send_abort(node: NodeEntry, request_id: str) -> None:
        try:
            await node.backend.abort([request_id])
        except (NodeError, OSError, TimeoutError) as e:
            logger.warning("abort(%s) on node %s failed: %s", request_id, node.node_id, e)

    def _record_finish(self, req: ApiRequest) -> None:
        m = self.metrics
        if req.last_token_time is not None:
            m.e2e.observe(req.last_token_time - req.arrival_time)
        m.prompt_tokens.inc(req.num_prompt_tokens)
        m.cached_prompt_tokens.inc(req.num_cached_tokens)
        if req.num_deltas and req.node is not None:
            node = req.node.members[0] if req.node.members else req.node  # a pair: its prefill
            m.cache_prediction(node.node_id, req.predicted_hit, req.num_cached_tokens)
        m.generation_tokens.inc(req.num_output_tokens)
        m.finished(req.endpoint, req.status.value if req.status.is_finished else FinishReason.ABORT)

    # ---- shutdown ------------------------------------------------------------------------------

    async def drain(self, timeout: float) -> bool:
        """Stop admitting; let in-flight requests finish for up to ``timeout`` seconds, then
        cancel their handlers (which aborts them on the nodes). True when all finished."""
        self.admission.start_draining()
        logger.info(
            "draining: %d running, %d waiting (up to %.0f s)",
            self.admission.num_running,
            self.admission.num_waiting,
            timeout,
        )
        if await self.admission.wait_idle(timeout):
            return True
        logger.warning("drain timeout: aborting %d in-flight requests", len(self._tasks))
        for task in list(self._tasks.values()):
            task.cancel()
        await self.admission.wait_idle(5.0)
        await self.wait_background()
        return False

    async def wait_background(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
