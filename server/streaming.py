"""Streaming assembly: token deltas -> deepseek-recipe StreamProcessor -> SSE events or one body.

    CoordinatorService.generate --TokenDelta--> StreamProcessor.push(InferenceChunk.*)
        --recipe events (chat chunks / Responses events / Messages events)-->
        stream: one SSE write per engine step | non-stream: *Response.accumulate -> JSON body

The recipe owns the text side: detokenization, reasoning (``<think>``) and DSML tool-call
parsing, stop strings, finish reasons and usage. Its first input is a ``ready`` chunk carrying
the prompt usage, sent with the first delta, which is when the node has told us how many prompt
tokens came from its cache. A Responses request's response objects also pass through its
StoredTurn (server/response_store.py), which echoes ``previous_response_id`` and stores the last.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import deepseek_recipe as recipe
from aiohttp import web

from deepinfer.outputs import FinishReason
from deepinfer.server.conversion import ApiKind, Frontend, Prepared
from deepinfer.server.errors import (
    ApiError,
    ErrorFlavor,
    internal_error,
    sse_error_event,
    timeout_error,
)
from deepinfer.server.protocol import ImageData, TokenDelta
from deepinfer.server.response_store import ResponseStore, StoredTurn
from deepinfer.server.service import ApiRequest, CoordinatorService
from deepinfer.server.sse import SSEStream, dumps, format_event

logger = logging.getLogger(__name__)

_FINISH_REASONS = {
    FinishReason.STOP: recipe.InferenceFinishReason.Stop,
    FinishReason.LENGTH: recipe.InferenceFinishReason.Length,
}
_REQUEST_CLASSES: dict[ApiKind, Any] = {
    ApiKind.CHAT: recipe.ChatCompletionRequest,
    ApiKind.RESPONSES: recipe.ResponsesRequest,
    ApiKind.MESSAGES: recipe.MessagesRequest,
}
_RESPONSE_CLASSES: dict[ApiKind, Any] = {
    ApiKind.CHAT: recipe.ChatCompletionResponse,
    ApiKind.RESPONSES: recipe.ResponsesResponse,
    ApiKind.MESSAGES: recipe.MessagesResponse,
}
FLAVORS = {
    ApiKind.CHAT: ErrorFlavor.OPENAI,
    ApiKind.RESPONSES: ErrorFlavor.RESPONSES,
    ApiKind.MESSAGES: ErrorFlavor.ANTHROPIC,
}
# Responses events that carry the response object; the final ones end it.
_FINAL_RESPONSE_EVENTS = ("response.completed", "response.incomplete")
_RESPONSE_EVENTS = ("response.created", "response.in_progress", *_FINAL_RESPONSE_EVENTS)
# Output tokens decoded, beyond the last delta, to tell which stop string matched.
_STOP_LOOKBACK_TOKENS = 32


def make_processor(
    frontend: Frontend, prepared: Prepared, response_id: str
) -> recipe.StreamProcessor:
    conversation_request = prepared.conversation_request
    generator = _REQUEST_CLASSES[prepared.kind].chunk_generator(
        conversation_request, response_id, prepared.model
    )
    if prepared.kind is ApiKind.RESPONSES:
        generator = generator.with_namespace_tool_map(prepared.namespace_tool_map or {})
        if prepared.echo is not None:
            generator = generator.with_echo(prepared.echo)
    return recipe.StreamProcessor(generator, prepared.parsing_options, frontend.recipe_tokenizer)


def _recipe_logprobs(
    delta: TokenDelta, num_top: int
) -> list[tuple[float, list[tuple[int, float]]]] | None:
    """The node's ``{token_id: logprob}`` per token (chosen token included) -> the recipe's
    ``(chosen logprob, top alternatives)`` per token."""
    if delta.logprobs is None:
        return None
    out = []
    for token_id, entries in zip(delta.token_ids, delta.logprobs, strict=True):
        top = sorted(entries.items(), key=lambda item: -item[1])[:num_top]
        out.append((entries.get(token_id, top[0][1] if top else 0.0), top))
    return out


async def recipe_events(
    service: CoordinatorService,
    frontend: Frontend,
    req: ApiRequest,
    processor: recipe.StreamProcessor,
    stop_sequences: list[str],
) -> AsyncIterator[list[Any]]:
    """The recipe's events per engine step (an empty list when a step produced no text yet)."""
    num_top = req.sampling.logprobs or 0
    recent_ids: list[int] = []
    try:
        async with aclosing(service.generate(req)) as deltas:
            is_first = True
            async for delta in deltas:
                events: list[Any] = []
                if is_first:
                    is_first = False
                    usage = recipe.PromptUsage(
                        prompt_tokens=delta.num_prompt_tokens or req.num_prompt_tokens,
                        prompt_cache_hit_tokens=delta.num_cached_tokens,
                    )
                    events += processor.push(recipe.InferenceChunk.ready(prompt_usage=usage))
                token_ids = _text_token_ids(delta, frontend.tokenizer.eos_token_id)
                if token_ids:
                    logprobs = _recipe_logprobs(delta, num_top)
                    if logprobs is not None:
                        logprobs = logprobs[: len(token_ids)]
                    chunk = recipe.InferenceChunk.tokens(token_ids, logprobs)
                    events += processor.push(chunk)
                    recent_ids = recent_ids[-_STOP_LOOKBACK_TOKENS:] + token_ids
                if processor.finished:  # a stop string matched in this step's text
                    yield events  # the client's answer is complete; then end it on the node
                    if delta.finish_reason is None:
                        stop = _matched_stop(frontend, stop_sequences, recent_ids)
                        await service.finish_stopped(req, stop)
                    return
                if delta.finish_reason == FinishReason.ABORT:
                    raise ApiError(503, "The request was aborted by its node", retry_after=1)
                if delta.finish_reason is not None:
                    reason = _FINISH_REASONS.get(delta.finish_reason)
                    if reason is None:
                        logger.warning(
                            "request %s: unknown finish reason %r from node %s",
                            req.request_id,
                            delta.finish_reason,
                            req.node.node_id if req.node is not None else None,
                        )
                        raise internal_error(502, req.request_id)
                    events += processor.push(recipe.InferenceChunk.finish(reason))
                    events += processor.finish()
                yield events
    except RuntimeError:  # the processor failed to decode or parse
        logger.exception("stream processing failed for %s", req.request_id)
        raise internal_error(500, req.request_id) from None
    finally:
        if not processor.finished:
            processor.close()


def _text_token_ids(delta: TokenDelta, eos_token_id: int | None) -> list[int]:
    """The delta's tokens without the one that stopped it: the node reports EOS or a stop token
    id as the last output token (as vLLM does), but it is not part of the answer's text."""
    ids = delta.token_ids
    if delta.finish_reason == FinishReason.STOP and ids:
        last = ids[-1]
        if (delta.stop_reason is None and last == eos_token_id) or delta.stop_reason == last:
            return ids[:-1]
    return ids


def _matched_stop(frontend: Frontend, stops: list[str], recent_ids: list[int]) -> str | None:
    """Which stop string ended the text: the earliest one in the latest output (ties: the first
    listed), as the recipe's matcher decides."""
    if len(stops) <= 1:
        return stops[0] if stops else None
    text = frontend.tokenizer.decode(recent_ids, skip_special_tokens=False)
    found = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
    return min(found)[2] if found else None


async def respond(
    request: web.Request,
    service: CoordinatorService,
    frontend: Frontend,
    prepared: Prepared,
    req: ApiRequest,
    timeout: float,
    turn: StoredTurn | None = None,
) -> web.StreamResponse:
    """Run the request and answer: SSE when it asked for a stream, else one JSON body. A
    Responses ``turn`` gets the response objects sent (server/response_store.py)."""
    processor = make_processor(frontend, prepared, req.request_id)
    stops = list(prepared.parsing_options.stop_sequences)
    events = recipe_events(service, frontend, req, processor, stops)
    if prepared.stream:
        return await _stream(request, prepared.kind, events, timeout, turn)
    return await _collect(prepared, req, events, timeout, turn)


def _format_event(event: Any, response_cls: Any, turn: StoredTurn | None) -> str:
    """One recipe event as SSE; a Responses turn echoes its previous_response_id on the
    response objects and finishes with the last one."""
    name = response_cls.sse_event_name(event)
    data = event.to_json()
    is_final = name in _FINAL_RESPONSE_EVENTS
    if turn is not None and (is_final or (name in _RESPONSE_EVENTS and turn.previous_response_id)):
        payload = json.loads(data)
        if is_final:
            turn.finish(payload["response"])
        else:
            turn.echo(payload["response"])
        data = dumps(payload)
    return format_event(data, name)


async def _stream(
    request: web.Request,
    kind: ApiKind,
    events: AsyncIterator[list[Any]],
    timeout: float,
    turn: StoredTurn | None,
) -> web.StreamResponse:
    response_cls = _RESPONSE_CLASSES[kind]
    sse = SSEStream(request)
    try:
        async with asyncio.timeout(timeout), aclosing(events):
            async for step in events:
                text = "".join(_format_event(e, response_cls, turn) for e in step)
                await sse.write(text, len(step))
        done = response_cls.sse_done_data()
        await sse.write(format_event(done) if done is not None else "", 0)
        await sse.close()
    except TimeoutError:
        await write_stream_error(sse, FLAVORS[kind], timeout_error(timeout))
    except ApiError as e:
        await write_stream_error(sse, FLAVORS[kind], e)
    except ConnectionResetError:
        logger.info("client disconnected from %s", request.path)
    return sse.response


async def write_stream_error(sse: SSEStream, flavor: ErrorFlavor, err: ApiError) -> None:
    """End a stream with ``err``: as an HTTP error if nothing was sent yet, else as an event."""
    if not sse.is_prepared:
        raise err
    try:
        await sse.write_raw(sse_error_event(err, flavor, sse.num_events))
        await sse.close()
    except ConnectionResetError:
        logger.info("client disconnected before the error event was sent")


async def _collect(
    prepared: Prepared,
    req: ApiRequest,
    events: AsyncIterator[list[Any]],
    timeout: float,
    turn: StoredTurn | None,
) -> web.Response:
    collected: list[Any] = []
    try:
        async with asyncio.timeout(timeout), aclosing(events):
            async for step in events:
                collected.extend(step)
    except TimeoutError:
        raise timeout_error(timeout) from None
    response = _RESPONSE_CLASSES[prepared.kind](
        req.request_id,
        prepared.model,
        int(time.time()),
        req.num_prompt_tokens,
        req.num_cached_tokens,
    )
    for event in collected:
        response.accumulate(event)
    text = response.to_json()
    if turn is not None:
        payload = json.loads(text)
        turn.finish(payload)
        text = dumps(payload)
    return web.Response(text=text, content_type="application/json")


# ---- the shared handler body of /v1/chat/completions, /v1/responses and /v1/messages ----------


_ID_PREFIXES = {ApiKind.CHAT: "chatcmpl-", ApiKind.RESPONSES: "resp_", ApiKind.MESSAGES: "msg_"}


async def serve_recipe_request(
    request: web.Request,
    kind: ApiKind,
    frontend: Frontend,
    service: CoordinatorService,
    timeout: float,
    store: ResponseStore | None = None,
) -> web.StreamResponse:
    """parse -> convert + encode (preparation pool) -> submit -> stream. Responses go through
    ``store`` (previous_response_id in, the response object out)."""
    arrival_time = time.monotonic()
    turn = None
    if store is None:
        prepared = await service.prepare(
            request, lambda body, limit: frontend.prepare(kind, frontend.parse_json(body), limit)
        )
    else:  # the store lives on the event loop: parse on the pool, continue here, then prepare
        parsed = await service.prepare(request, lambda body, limit: frontend.parse_json(body))
        body, turn = store.begin(parsed)
        prepared = await asyncio.to_thread(frontend.prepare, kind, body, service.context_limit())
    images = prepared.images
    req = ApiRequest(
        request_id=f"{_ID_PREFIXES[kind]}{uuid.uuid4().hex}",
        endpoint=kind.value,
        prompt_token_ids=prepared.prompt_token_ids,
        sampling=prepared.sampling,
        constraint=prepared.constraint,
        cache_salt=prepared.cache_salt,
        images=[
            ImageData(data=i.data, width=i.width, height=i.height) for i in prepared.images.images
        ],
        num_image_positions=images.num_extra_tokens,
        routing_token_ids=prepared.routing_token_ids,
        routing_images=prepared.routing_images,
        arrival_time=arrival_time,
    )
    return await respond(request, service, frontend, prepared, req, timeout, turn)
