"""Server-sent events: framing and the streaming response.

Framing (https://html.spec.whatwg.org/multipage/server-sent-events.html): an event is optional
``event: NAME`` and one ``data: PAYLOAD`` line, closed by a blank line. Our payloads are one-line
JSON (``json`` escapes newlines), so one ``data:`` line per event. OpenAI's Chat Completions and
Completions streams use unnamed events and end with ``data: [DONE]``; the Responses API and
Anthropic's Messages name every event and have no terminator.

One engine step's events go out in one write, so that a client sees one chunk per step.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    # nginx buffers responses unless told not to; a buffered stream defeats streaming.
    "X-Accel-Buffering": "no",
}


def dumps(payload: Any) -> str:
    """Compact one-line JSON, as deepseek-recipe writes its events."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def format_event(data: str, event: str | None = None) -> str:
    """One SSE event; ``data`` must not contain a newline."""
    assert "\n" not in data, f"SSE data must be one line, got {data[:80]!r}"
    if event is None:
        return f"data: {data}\n\n"
    return f"event: {event}\ndata: {data}\n\n"


DONE = format_event("[DONE]")


class SSEStream:
    """A ``text/event-stream`` response; ``num_events`` counts the events written so far."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._response = web.StreamResponse(status=200, headers=SSE_HEADERS)
        self.num_events = 0

    @property
    def is_prepared(self) -> bool:
        return self._response.prepared

    @property
    def response(self) -> web.StreamResponse:
        return self._response

    async def prepare(self) -> None:
        if not self._response.prepared:
            await self._response.prepare(self._request)

    async def write(self, text: str, num_events: int) -> None:
        """Send ``text`` (already framed events) in one write.

        Raises ConnectionResetError when the client has gone away.
        """
        await self.prepare()
        if text:
            await self._response.write(text.encode())
        self.num_events += num_events

    async def write_raw(self, data: bytes) -> None:
        await self.prepare()
        await self._response.write(data)

    async def close(self) -> None:
        await self.prepare()
        await self._response.write_eof()
