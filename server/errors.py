"""API errors: one typed exception at the HTTP boundary, mapped to a status and an error body.

Every failure a client can cause or see is an ``ApiError`` by the time it reaches the handler's
edge; ``error_middleware`` turns it into an OpenAI-shaped body
(``{"error": {"message", "type", "param", "code"}}``) or, under ``/v1/messages``, an
Anthropic-shaped one (``{"type": "error", "error": {"type", "message"}}``). Streams that already
sent their headers report the same error as one SSE event (``sse_error_event``).

What goes wrong inside (a node unreachable or failing, a bug) reaches the client as a stable
message and a request id (``internal_error``); the details (node, URL, exception) are logged
under that id, never sent.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from enum import Enum

from aiohttp import web

from deepinfer.server.sse import dumps, format_event

logger = logging.getLogger(__name__)


class ErrorFlavor(Enum):
    OPENAI = "openai"  # Chat Completions, Completions, models, internal
    RESPONSES = "responses"  # OpenAI bodies; its stream has a typed `error` event
    ANTHROPIC = "anthropic"  # /v1/messages, /v1/messages/count_tokens


# Anthropic's error `type` per status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}

# OpenAI's error `type` per status when the raiser gives none.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """A request failed with an HTTP status and a message meant for the client.

    ``retry_after`` (seconds) becomes a ``Retry-After`` header (429 and 503).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _OPENAI_TYPES.get(status, "internal_error" if status >= 500 else "")
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r})"


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_request_error")


def timeout_error(timeout: float) -> ApiError:
    return ApiError(
        504, f"The request timed out after {timeout:g} s (server.request_timeout_s)", code="timeout"
    )


_INTERNAL_MESSAGES = {
    500: "The server failed to process the request",
    502: "The inference node failed to process the request",
    503: "No inference node could take the request; retry shortly",
    504: "The inference node did not answer in time",
}


def internal_error(status: int, request_id: str) -> ApiError:
    """A failure inside the service, as clients see it: the status, a stable message and the
    request id under which the log holds the details."""
    status = status if status in _INTERNAL_MESSAGES else 502
    message = f"{_INTERNAL_MESSAGES[status]} (request id {request_id})"
    return ApiError(status, message, retry_after=1 if status == 503 else None)


def openai_body(err: ApiError) -> dict:
    return {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }


def anthropic_body(err: ApiError) -> dict:
    kind = _ANTHROPIC_TYPES.get(
        err.status, "api_error" if err.status >= 500 else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_body(err: ApiError, flavor: ErrorFlavor) -> dict:
    return anthropic_body(err) if flavor is ErrorFlavor.ANTHROPIC else openai_body(err)


def error_response(err: ApiError, flavor: ErrorFlavor) -> web.Response:
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return web.json_response(error_body(err, flavor), status=err.status, headers=headers)


def sse_error_event(err: ApiError, flavor: ErrorFlavor, sequence_number: int = 0) -> bytes:
    """The error as the last event of a stream whose headers (200) are already sent.

    OpenAI's clients raise on a ``data:`` message holding ``error``; Anthropic's and the
    Responses API's streams carry a named ``error`` event.
    """
    if flavor is ErrorFlavor.ANTHROPIC:
        return format_event(dumps(anthropic_body(err)), "error").encode()
    if flavor is ErrorFlavor.RESPONSES:
        event = {
            "type": "error",
            "code": err.code or err.type,
            "message": err.message,
            "param": err.param,
            "sequence_number": sequence_number,
        }
        return format_event(dumps(event), "error").encode()
    return format_event(dumps(openai_body(err))).encode()


def flavor_of(path: str) -> ErrorFlavor:
    if path.startswith("/v1/messages"):
        return ErrorFlavor.ANTHROPIC
    if path.startswith("/v1/responses"):
        return ErrorFlavor.RESPONSES
    return ErrorFlavor.OPENAI


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place where exceptions become HTTP statuses and error bodies.

    A refusal that left the body unread (429 before reading it, 413) ends the connection after
    aiohttp's lingering read of the rest (so that a client still sending gets the answer, not a
    reset); a 408 (the body came too slowly) ends it at once: lingering would wait on the same
    slow client."""
    response = await _handle(request, handler)
    if response.status >= 400 and not request.content.at_eof():
        response.force_close()
        if response.status == 408:
            await response.prepare(request)
            await response.write_eof()
            request.protocol.force_close()  # the answer is written; the transport flushes it
    return response


async def _handle(request: web.Request, handler: Handler) -> web.StreamResponse:
    flavor = flavor_of(request.path)
    try:
        return await handler(request)
    except ApiError as e:
        if e.status in (500, 502):  # ours or a node's fault; 503/504 are load and timeouts
            logger.warning("%s %s -> %d: %s", request.method, request.path, e.status, e.message)
        return error_response(e, flavor)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # aiohttp's own refusals (unknown route, wrong method, body over client_max_size).
        # aiohttp's default text is "<status>: <reason>"; a specific one says more.
        message = e.text if e.text and not e.text.startswith(str(e.status)) else e.reason
        err = ApiError(e.status, message, code="request_too_large" if e.status == 413 else None)
        response = error_response(err, flavor)
        if e.status == 405 and "Allow" in e.headers:
            response.headers["Allow"] = e.headers["Allow"]
        return response
    except Exception:
        error_id = f"err-{uuid.uuid4().hex}"
        logger.exception("unhandled error %s in %s %s", error_id, request.method, request.path)
        return error_response(internal_error(500, error_id), flavor)
