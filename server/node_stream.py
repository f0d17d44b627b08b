"""A node's engine in the wire's terms: a request's deltas become TokenDeltas, the engine's errors
NodeErrors, its load a NodeLoad.

    GenerateRequest ──sampling_params_of──▶ SamplingParams
                    ──token_deltas──▶ AsyncEngine.generate ──RequestOutputDelta──▶ TokenDelta
                                        ValueError (bad input, id in use) ─────▶ NodeError(400)
                                        EngineClosedError (draining, failed) ──▶ NodeError(503)
                                        EngineStepError (a step failed) ───────▶ NodeError(500)
    AsyncEngine.load() ──EngineLoad──▶ node_load ──NodeLoad──▶ registration, heartbeat, /metrics

Producer: AsyncEngine (this process). Consumers: the HTTP node (server/node.py, which writes the
deltas as frames, or a NodeError as an error response before the first and as a StreamError frame
after it) and serve's in-process LocalNode (server/serve.py, a NodeBackend that passes both on).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

from deepinfer.engine.async_engine import (
    AsyncEngine,
    EngineClosedError,
    EngineLoad,
    EngineStepError,
)
from deepinfer.engine.handoff import HandOffExport
from deepinfer.images import ImageInput
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.output import RequestOutputDelta
from deepinfer.scheduler.request import Request
from deepinfer.server.protocol import GenerateRequest, NodeLoad, OutputConstraint, TokenDelta
from deepinfer.server.routing import NodeError


def sampling_params_of(message: GenerateRequest) -> SamplingParams:
    """The engine's SamplingParams of a GenerateRequest, its output constraint included. Raises
    ValueError naming the bad field or constraint kind. The grammar itself is compiled by the
    engine (AsyncEngine.generate, off the loop): an invalid schema/regex fails there, also 400."""
    params = message.sampling.to_sampling_params()
    constraint: OutputConstraint | None = message.constraint
    if constraint is None or constraint.kind == "tool_call":
        return params  # auto tool choice is parsed on the text side, not enforced
    return dataclasses.replace(params, constraint=(constraint.kind, constraint.schema))


async def token_deltas(
    engine: AsyncEngine,
    message: GenerateRequest,
    params: SamplingParams,
    hand_off: HandOffExport | None = None,
    images: list[ImageInput] | None = None,
) -> AsyncIterator[TokenDelta]:
    """Stream the request's TokenDeltas, one per engine step; the last has ``finish_reason``
    (or, with ``hand_off``, carries the first token when the request left for a decode node).
    ``images``: the message's, with what came with them (None: ``message.image_inputs()``).

    Raises NodeError before the first delta (400, 503 with ``is_node_failure``, 500) and after it
    (500: a step failed with the request in it). Closing the iterator early aborts the request.
    """
    request_id = message.request_id
    deltas = engine.generate(
        request_id,
        message.prompt_token_ids,
        params,
        message.cache_salt,
        hand_off=hand_off,
        images=message.image_inputs() if images is None else images,
    )
    async for delta in engine_token_deltas(engine, request_id, deltas):
        yield delta


async def engine_token_deltas(
    engine: AsyncEngine, request_id: str, deltas: AsyncIterator[RequestOutputDelta]
) -> AsyncIterator[TokenDelta]:
    """``deltas`` (one of ``engine``'s streams) as TokenDeltas, its errors as NodeErrors."""
    async with contextlib.aclosing(deltas):
        try:
            first = await anext(deltas)
        except ValueError as e:
            raise NodeError(400, str(e)) from e
        except EngineClosedError as e:
            raise NodeError(503, str(e), is_node_failure=True) from e
        except EngineStepError as e:
            raise NodeError(500, str(e)) from e
        engine_request = engine.get_request(request_id)
        assert engine_request is not None, f"request {request_id!r} has no engine request"
        yield token_delta(first, engine_request, True)
        try:
            async for delta in deltas:
                # A hand-off's last delta is its first token's (the request then leaves).
                has_left = engine_request.hand_off and bool(delta.new_token_ids)
                is_last = delta.is_finished or has_left
                yield token_delta(delta, engine_request, is_last)
        except EngineStepError as e:
            raise NodeError(500, str(e)) from e


def token_delta(delta: RequestOutputDelta, request: Request, with_counts: bool) -> TokenDelta:
    """Counts ride on the first and the last frame only (TokenDelta's contract)."""
    return TokenDelta(
        request_id=delta.request_id,
        token_ids=delta.new_token_ids,
        logprobs=delta.new_logprobs,
        prompt_logprobs=delta.new_prompt_logprobs,
        finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
        num_prompt_tokens=request.num_prompt_tokens if with_counts else 0,
        num_cached_tokens=request.num_cached_tokens if with_counts else 0,
    )


def node_load(load: EngineLoad) -> NodeLoad:
    """The engine's load as the coordinator reads it (the same fields)."""
    return NodeLoad(**dataclasses.asdict(load))
