"""Streaming OpenAI-compatible requests: one `RequestInput` in, one `RequestOutput` out.

Data flow::

    runner --RequestInput--> send_request --POST, stream=true--> server
    server --text/event-stream--> SSEParser --event data--> _on_event --> RequestOutput --> metrics

Timing (BENCH.md; vLLM ``bench serve`` except where BENCH.md is stricter):

- the clock starts just before the POST (after the concurrency semaphore, if any);
- a chunk is *token-bearing* when its first choice has non-empty ``text`` (completions) or a
  delta with non-empty ``content``, ``reasoning_content``/``reasoning`` or ``tool_calls`` (chat).
  Role-only, finish-only and usage-only chunks are not, so they neither start TTFT nor extend E2E;
- TTFT: first token-bearing chunk; TTFCT: first chunk with content, text or a tool call
  (reasoning excluded); ITL: gaps between consecutive token-bearing chunks; E2E: last one;
- token counts come from the last ``usage`` seen (``stream_options.include_usage``);
- SSE comment lines (``:``) are ignored; events are timed when their network read returned.

Failures are returned, never raised: ``error`` is the HTTP status ("500", "429"), "timeout",
"connection", "stream_error" (an ``error`` object inside the stream), "bad_stream" (undecodable
JSON) or "no_tokens" (a 200 stream without a single token-bearing chunk).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

BACKENDS = ("openai-chat", "openai")
_ERROR_DETAIL_CHARS = 500


@dataclass(frozen=True)
class RequestInput:
    """What the runner asks ``send_request`` to send (chat uses ``messages``, else ``prompt``)."""

    url: str
    backend: str
    model: str
    max_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    ignore_eos: bool = False
    temperature: float | None = 0.0
    api_key: str | None = None


@dataclass
class RequestOutput:
    """One request's measured timeline and token counts (times in s; ``start_time`` is
    ``time.perf_counter()`` at send; the runner fills the ``requested_*``/index fields)."""

    success: bool = False
    error: str | None = None
    error_detail: str = ""
    start_time: float = 0.0
    ttft: float = 0.0
    ttfct: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    num_chunks: int = 0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int = 0
    prompt_tokens_details: dict[str, int] = field(default_factory=dict)
    has_usage: bool = False
    content: str = ""
    reasoning: str = ""
    requested_prompt_tokens: int = 0
    requested_output_tokens: int = 0
    session_index: int = 0
    turn_index: int = 0

    def fail(self, error: str, detail: str = "") -> RequestOutput:
        self.success = False
        self.error = error
        self.error_detail = detail[:_ERROR_DETAIL_CHARS]
        return self


class SSEParser:
    """Incremental ``text/event-stream`` parser: bytes in, complete events' data strings out."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        lines = (self._buffer + chunk).split(b"\n")
        self._buffer = lines.pop()  # an incomplete last line waits for the next read
        events: list[str] = []
        for line in lines:
            self._line(line.rstrip(b"\r"), events)
        return events

    def finish(self) -> list[str]:
        """Events left at end of stream (a last event without its blank line)."""
        events: list[str] = []
        if self._buffer:
            self._line(self._buffer.rstrip(b"\r"), events)
            self._buffer = b""
        self._line(b"", events)
        return events

    def _line(self, line: bytes, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(b":"):
            return  # comment / keep-alive
        name, _, value = line.partition(b":")
        if name == b"data":
            self._data.append(value.removeprefix(b" ").decode("utf-8"))


def build_payload(req: RequestInput) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": req.model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if req.backend == "openai-chat":
        payload["messages"] = req.messages
    elif req.backend == "openai":
        payload["prompt"] = req.prompt
    else:
        raise ValueError(f"--backend must be one of {BACKENDS}, got {req.backend!r}")
    if req.temperature is not None:
        payload["temperature"] = req.temperature
    if req.ignore_eos:
        # vLLM extensions: without min_tokens a server may still stop on a stop token id.
        payload["ignore_eos"] = True
        payload["min_tokens"] = req.max_tokens
    return payload


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _on_usage(out: RequestOutput, usage: dict[str, Any]) -> None:
    out.has_usage = True
    out.prompt_tokens = _int(usage.get("prompt_tokens"))
    out.output_tokens = _int(usage.get("completion_tokens"))
    details = usage.get("prompt_tokens_details") or {}
    out.prompt_tokens_details = {
        k: v for k, v in ((k, _int(v)) for k, v in details.items()) if v is not None
    }
    # OpenAI: prompt_tokens_details.cached_tokens; DeepSeek's API: prompt_cache_hit_tokens.
    cached = out.prompt_tokens_details.get("cached_tokens")
    if cached is None:
        cached = _int(usage.get("prompt_cache_hit_tokens"))
    out.cached_tokens = cached or 0


class _StreamError(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def _on_event(out: RequestOutput, data: str, now: float, is_chat: bool) -> None:
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as e:
        raise _StreamError("bad_stream", f"{e}: {data[:200]}") from e
    if not isinstance(obj, dict):
        raise _StreamError("bad_stream", data[:200])
    if obj.get("error"):
        raise _StreamError("stream_error", json.dumps(obj["error"])[:_ERROR_DETAIL_CHARS])
    if usage := obj.get("usage"):
        _on_usage(out, usage)
    choices = obj.get("choices")
    if not choices:
        return
    choice = choices[0]
    if is_chat:
        delta = choice.get("delta") or {}
        content = delta.get("content") or ""
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        has_content = bool(content) or bool(delta.get("tool_calls"))
    else:
        content = choice.get("text") or ""
        reasoning = ""
        has_content = bool(content)
    if not (has_content or reasoning):
        return
    elapsed = now - out.start_time
    if out.num_chunks == 0:
        out.ttft = elapsed
    else:
        out.itl.append(elapsed - out.latency)
    if has_content and out.ttfct is None:
        out.ttfct = elapsed
    out.latency = elapsed
    out.num_chunks += 1
    out.content += content
    out.reasoning += reasoning


async def send_request(session: aiohttp.ClientSession, req: RequestInput) -> RequestOutput:
    """Send one streaming request and time it; every failure comes back as ``error``."""
    headers = {"Authorization": f"Bearer {req.api_key}"} if req.api_key else {}
    payload = build_payload(req)
    out = RequestOutput(requested_output_tokens=req.max_tokens)
    is_chat = req.backend == "openai-chat"
    out.start_time = time.perf_counter()
    try:
        async with session.post(req.url, json=payload, headers=headers) as response:
            if response.status != 200:
                return out.fail(str(response.status), await response.text())
            parser = SSEParser()
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                for data in parser.feed(chunk):
                    if data.strip() != "[DONE]":
                        _on_event(out, data, now, is_chat)
            now = time.perf_counter()
            for data in parser.finish():
                if data.strip() != "[DONE]":
                    _on_event(out, data, now, is_chat)
    except _StreamError as e:
        return out.fail(e.kind, str(e))
    except TimeoutError as e:  # aiohttp's ServerTimeoutError is a TimeoutError too
        return out.fail("timeout", repr(e))
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        return out.fail("connection", repr(e))
    except aiohttp.ClientError as e:
        logger.warning("request failed with an unexpected client error: %r", e)
        return out.fail("client_error", repr(e))
    if out.num_chunks == 0:
        return out.fail("no_tokens", f"usage={out.output_tokens}")
    out.success = True
    return out


async def first_model_id(session: aiohttp.ClientSession, base_url: str, api_key: str | None) -> str:
    """The first ``id`` of ``GET {base_url}/v1/models`` (vLLM's default for ``--model``)."""
    url = f"{base_url}/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(url, headers=headers) as response:
            if response.status != 200:
                body = (await response.text())[:_ERROR_DETAIL_CHARS]
                raise ValueError(f"GET {url} returned {response.status}: {body}")
            body = await response.json()
    except aiohttp.ClientError as e:
        raise ValueError(f"cannot list models at {url}: {e!r}; pass --model") from e
    models = body.get("data") if isinstance(body, dict) else None
    if not models:
        raise ValueError(f"GET {url} lists no models; pass --model")
    return str(models[0]["id"])
