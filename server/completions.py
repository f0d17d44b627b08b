"""/v1/completions: a raw prompt (text or token ids) continued as is, OpenAI-shaped.

The recipe covers chat-style APIs only, so this endpoint is ours: no chat template, no reasoning
or tool parsing; structured output in vLLM's fields (server/structured_output.py). Its text
side is the engine's own (``deepinfer.tokenizer``): an incremental detokenizer and the
stop-string matcher, which holds back text that could start a stop string.

    body --parse_completion--> prompt ids + SamplingOptions --CoordinatorService.generate-->
        TokenDelta --IncrementalDetokenizer + StopStringMatcher--> text_completion chunks
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from deepinfer.outputs import FinishReason
from deepinfer.server.conversion import Frontend
from deepinfer.server.errors import ApiError, ErrorFlavor, bad_request, timeout_error
from deepinfer.server.protocol import TokenDelta
from deepinfer.server.sampling import build_sampling_options, read_extra_sampling
from deepinfer.server.service import ApiRequest, CoordinatorService
from deepinfer.server.sse import DONE, SSEStream, dumps, format_event
from deepinfer.server.streaming import write_stream_error
from deepinfer.server.structured_output import read_output_constraint
from deepinfer.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

logger = logging.getLogger(__name__)

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_MAX_STOPS = 16
_UNSUPPORTED = {"suffix": None, "echo": False, "best_of": 1, "n": 1}


@dataclass
class CompletionRequest:
    model: str
    prompt_token_ids: list[int]
    stream: bool
    include_usage: bool
    stop: list[str]


def _prompt_ids(prompt: Any, frontend: Frontend, context_limit: int) -> list[int]:
    tokenizer = frontend.tokenizer
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        frontend.check_prompt_chars(len(prompt), context_limit, "prompt")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tokenizer.vocab_size
        for t in prompt
    ):
        ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise bad_request("Only one prompt per request is supported", "prompt")
    else:
        raise bad_request(
            f"Invalid prompt: expected a string or a list of token ids in [0, "
            f"{tokenizer.vocab_size})",
            "prompt",
        )
    if not ids:
        raise bad_request("The prompt is empty", "prompt")
    return ids


def parse_completion(
    frontend: Frontend, body: dict[str, Any], context_limit: int
) -> tuple[CompletionRequest, ApiRequest]:
    """Raises ApiError (4xx) naming the field."""
    model = frontend.check_model(body.get("model"))
    for name, allowed in _UNSUPPORTED.items():
        if body.get(name, allowed) not in (allowed, None):
            raise bad_request(f"{name}={body[name]!r} is not supported", name)
    if "prompt" not in body:
        raise bad_request("Missing required parameter: prompt", "prompt")
    prompt_ids = _prompt_ids(body["prompt"], frontend, context_limit)
    max_tokens = _opt(body, "max_tokens", int, _DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise bad_request(f"Invalid max_tokens value {max_tokens}: must be >= 1", "max_tokens")
    if len(prompt_ids) + max_tokens > context_limit:
        raise bad_request(
            f"This model's maximum context length is {context_limit} tokens. However, you "
            f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
            f"{max_tokens} in the completion). Please reduce the length of the prompt or "
            "completion.",
            "max_tokens",
        )
    temperature = _opt(body, "temperature", float, 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise bad_request("Invalid temperature value, the valid range is [0, 2]", "temperature")
    logprobs = _opt(body, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise bad_request("Invalid logprobs value, the valid range is [0, 20]", "logprobs")
    seed = _opt(body, "seed", int, None)
    if seed is not None and not 0 <= seed < 2**63:
        raise bad_request("Invalid seed value, the valid range is [0, 2^63)", "seed")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("Invalid stop: expected a non-empty string or a list of them", "stop")
    if len(stop) > _MAX_STOPS:
        raise bad_request(f"Invalid stop: at most {_MAX_STOPS} stop strings", "stop")
    stream = _opt(body, "stream", bool, False)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad_request("Invalid stream_options: expected an object", "stream_options")
    include_usage = _opt(
        stream_options, "include_usage", bool, False, "stream_options.include_usage"
    )
    extra = read_extra_sampling(body, frontend.vocab_size)
    sampling = build_sampling_options(
        temperature=temperature,
        top_p=_opt(body, "top_p", float, 1.0),
        seed=seed,
        max_tokens=max_tokens,
        logprobs=logprobs,
        extra=extra,
    )
    completion = CompletionRequest(model, prompt_ids, stream, include_usage, stop)
    req = ApiRequest(
        request_id=f"cmpl-{uuid.uuid4().hex}",
        endpoint="completions",
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        constraint=read_output_constraint(body, None),
        cache_salt=extra.cache_salt,
    )
    return completion, req


def _opt(body: dict[str, Any], name: str, kind: type, default: Any, param: str | None = None):
    value = body.get(name)
    if value is None:
        return default
    is_number = kind is float and isinstance(value, int | float)
    if isinstance(value, bool) is not (kind is bool) or not (isinstance(value, kind) or is_number):
        raise bad_request(
            f"Invalid {param or name}: expected {kind.__name__}, got {value!r}", param or name
        )
    return kind(value)


@dataclass
class _Step:
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class CompletionsApi:
    def __init__(self, frontend: Frontend, service: CoordinatorService, timeout: float) -> None:
        self.frontend = frontend
        self.service = service
        self.timeout = timeout

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival_time = time.monotonic()
        frontend = self.frontend

        def parse(body: bytes, context_limit: int) -> tuple[CompletionRequest, ApiRequest]:
            return parse_completion(frontend, frontend.parse_json(body), context_limit)

        completion, req = await self.service.prepare(request, parse)
        req.arrival_time = arrival_time
        steps = self._steps(completion, req)
        if completion.stream:
            return await self._stream(request, completion, req, steps)
        return await self._collect(completion, req, steps)

    async def _steps(self, completion: CompletionRequest, req: ApiRequest) -> AsyncIterator[_Step]:
        tokenizer = self.frontend.tokenizer
        # The detokenizer reads only the prompt's last few tokens (left context for the first
        # output characters); handing it those spares a copy of a long prompt.
        detokenizer = IncrementalDetokenizer(tokenizer, completion.prompt_token_ids[-16:])
        matcher = StopStringMatcher(completion.stop)
        num_sent = 0  # characters of output text sent so far
        async with aclosing(self.service.generate(req)) as deltas:
            async for delta in deltas:
                if delta.finish_reason == FinishReason.ABORT:
                    raise ApiError(503, "The request was aborted by its node", retry_after=1)
                new_text = detokenizer.push(delta.token_ids)
                check = matcher.check(detokenizer.text, len(new_text))
                finish_reason = FinishReason.STOP if check.is_stopped else delta.finish_reason
                # Text held back as a possible stop-string start is released at the end.
                text = check.text if finish_reason else check.streamable_text
                logprobs = _logprobs(tokenizer, delta, req.sampling.logprobs, num_sent)
                step = _Step(text[num_sent:], logprobs, finish_reason)
                num_sent = len(text)
                if step.text or step.finish_reason or logprobs:
                    yield step
                if check.is_stopped and delta.finish_reason is None:
                    await self.service.finish_stopped(req, check.stop_str)
                if finish_reason:
                    return

    async def _stream(
        self, request: web.Request, completion: CompletionRequest, req: ApiRequest, steps: Any
    ) -> web.StreamResponse:
        sse = SSEStream(request)
        created = int(time.time())
        try:
            async with asyncio.timeout(self.timeout), aclosing(steps):
                async for step in steps:
                    chunk = self._body(completion, req, created, [step], usage=None)
                    if completion.include_usage:
                        chunk["usage"] = None
                    await sse.write(format_event(dumps(chunk)), 1)
            if completion.include_usage:
                chunk = self._body(completion, req, created, [], usage=_usage(req))
                await sse.write(format_event(dumps(chunk)), 1)
            await sse.write(DONE, 0)
            await sse.close()
        except TimeoutError:
            await write_stream_error(sse, ErrorFlavor.OPENAI, timeout_error(self.timeout))
        except ApiError as e:
            await write_stream_error(sse, ErrorFlavor.OPENAI, e)
        except ConnectionResetError:
            # generate() has already aborted the request on its node.
            logger.info("client disconnected from %s", request.path)
        return sse.response

    async def _collect(
        self, completion: CompletionRequest, req: ApiRequest, steps: Any
    ) -> web.Response:
        collected: list[_Step] = []
        try:
            async with asyncio.timeout(self.timeout), aclosing(steps):
                collected = [step async for step in steps]
        except TimeoutError:
            raise timeout_error(self.timeout) from None
        merged = _Step(
            "".join(s.text for s in collected),
            _merge_logprobs([s.logprobs for s in collected if s.logprobs]),
            collected[-1].finish_reason if collected else None,
        )
        body = self._body(completion, req, int(time.time()), [merged], usage=_usage(req))
        return web.json_response(body)

    @staticmethod
    def _body(
        completion: CompletionRequest,
        req: ApiRequest,
        created: int,
        steps: list[_Step],
        usage: dict[str, Any] | None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": req.request_id,
            "object": "text_completion",
            "created": created,
            "model": completion.model,
            "choices": [
                {
                    "index": 0,
                    "text": s.text,
                    "logprobs": s.logprobs,
                    "finish_reason": s.finish_reason,
                }
                for s in steps
            ],
        }
        if usage is not None:
            body["usage"] = usage
        return body


def _usage(req: ApiRequest) -> dict[str, Any]:
    """OpenAI's usage with DeepSeek's cache fields, as the recipe reports them for chat."""
    prompt, cached, output = req.num_prompt_tokens, req.num_cached_tokens, req.num_output_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {"reasoning_tokens": 0},
        "prompt_cache_hit_tokens": cached,
        "prompt_cache_miss_tokens": prompt - cached,
    }


def _logprobs(
    tokenizer: Tokenizer, delta: TokenDelta, num_top: int | None, offset: int
) -> dict[str, Any] | None:
    """The legacy completions form: tokens, token_logprobs, top_logprobs, text_offset."""
    if num_top is None or delta.logprobs is None:
        return None
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token_id, entries in zip(delta.token_ids, delta.logprobs, strict=True):
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        top = sorted(entries.items(), key=lambda item: -item[1])[:num_top]
        out["tokens"].append(token)
        out["token_logprobs"].append(entries.get(token_id))
        out["top_logprobs"].append(
            {tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in top}
        )
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def _merge_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not parts:
        return None
    return {key: [v for part in parts for v in part[key]] for key in parts[0]}
