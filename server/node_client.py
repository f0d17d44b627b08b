"""NodeClient: the coordinator's side of a node's internal API (server/node.py).

    async with NodeClient("http://127.0.0.1:8100", token=token) as node:
        async for delta in node.generate(GenerateRequest(...)):   # TokenDelta per engine step
            ...                                                   # the last has finish_reason
        await node.finish(request_id, stop_reason="\\n\\n")       # a stop string matched
        node.decode(request) / node.collect(request_id)           # hand-offs (server/pairing.py)
        node.encode(EncodeRequest(...))                           # an encode node's part

Every failure surfaces as server/routing.py's ``NodeError(status, message)``: the node's
StreamError (a refused request: 400, 401, 413, 503; a failed step: 500), an HTTP error, or the
node being unreachable (503) or cutting the stream short (502). Closing or cancelling the
consumer of ``generate`` closes the HTTP response, so the node sees the disconnect and aborts the
request there (calling ``abort`` as well is harmless).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import aiohttp
import msgspec
from aiohttp import hdrs

from deepinfer.server.protocol import (
    MESSAGE_CONTENT_TYPE,
    AbortRequest,
    CollectRequest,
    EncodeRequest,
    FinishRequest,
    FrameReader,
    GenerateRequest,
    HandedOff,
    Reserved,
    StreamError,
    StreamFrame,
    TokenDelta,
    encode,
)
from deepinfer.server.routing import NodeError

__all__ = ["NodeClient", "NodeError"]

logger = logging.getLogger(__name__)

# Streams last as long as generation does: no total limit, only on connecting and on silence
# between frames (a prefill of a long prompt sends nothing for a while).
_STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=600.0)
_CALL_TIMEOUT = aiohttp.ClientTimeout(total=10.0)


class NodeClient:
    """One node's internal API; implements server/routing.py's NodeBackend.

    ``session`` None: the client owns one (closed by ``close``)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {hdrs.CONTENT_TYPE: MESSAGE_CONTENT_TYPE}
        if token is not None:
            self._headers[hdrs.AUTHORIZATION] = f"Bearer {token}"
        self._session = session
        self._owns_session = session is None

    async def __aenter__(self) -> NodeClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta | HandedOff]:
        """Stream the request's TokenDeltas until the one with ``finish_reason`` (a prefill
        node's part of a hand-off: or until its HandedOff)."""
        async for frame in self._frames("/internal/generate", request):
            yield frame

    async def decode(self, request: GenerateRequest) -> AsyncIterator[Reserved | TokenDelta]:
        """A decode node's part of a hand-off: Reserved, then TokenDeltas until the last."""
        async for frame in self._frames("/internal/decode", request):
            yield frame

    async def collect(self, request_id: str) -> None:
        """Tell a decode node that the prefill node is sending ``request_id``'s cache (or a
        prefill or mixed node that an encode node is sending its images' embeddings)."""
        await self._call("/internal/collect", encode(CollectRequest(request_id=request_id)))

    async def encode(self, request: EncodeRequest) -> AsyncIterator[StreamFrame]:
        """An encode node's part (server/image_transfer.py): Reserved, Encoded, HandedOff."""
        async for frame in self._frames("/internal/encode", request):
            yield frame

    async def _frames(self, path: str, request: msgspec.Struct) -> AsyncIterator[StreamFrame]:
        response = await self._post(path, encode(request), _STREAM_TIMEOUT)
        is_done = False
        try:
            if response.status != 200:
                raise await _error_from(response)
            reader = FrameReader()
            async for chunk in response.content.iter_any():
                try:
                    frames = reader.feed(chunk)
                except msgspec.DecodeError as e:
                    raise NodeError(502, f"node {self.base_url}: malformed frame: {e}") from e
                for frame in frames:
                    if isinstance(frame, StreamError):
                        raise NodeError(frame.status, frame.message)
                    is_done = isinstance(frame, HandedOff) or (
                        isinstance(frame, TokenDelta) and frame.finish_reason is not None
                    )
                    yield frame
                    if is_done:
                        return
            raise NodeError(
                502,
                f"node {self.base_url}: stream ended before the request finished",
                is_node_failure=True,
            )
        except (aiohttp.ClientError, TimeoutError) as e:
            raise NodeError(
                503, f"node {self.base_url}: stream broke: {e!r}", is_node_failure=True
            ) from e
        finally:
            if is_done:
                response.release()
            else:
                # Drop the connection (not back to the pool): this is what the node sees as the
                # client's disconnect, which aborts the request there.
                response.close()

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Unknown or finished ids are ignored by the node."""
        await self._call("/internal/abort", encode(AbortRequest(request_ids=list(request_ids))))

    async def finish(self, request_id: str, stop_reason: int | str | None = None) -> None:
        """End the request with "stop"; its stream's last frame carries ``stop_reason``."""
        message = FinishRequest(request_id=request_id, stop_reason=stop_reason)
        await self._call("/internal/finish", encode(message))

    async def health(self) -> bool:
        return await self._probe("/health")

    async def ready(self) -> bool:
        return await self._probe("/ready")

    # -- plumbing ------------------------------------------------------------------------------

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _post(
        self, path: str, body: bytes, timeout: aiohttp.ClientTimeout
    ) -> aiohttp.ClientResponse:
        post = self._get_session().post
        url = self.base_url + path
        try:
            try:
                return await post(url, data=body, headers=self._headers, timeout=timeout)
            except aiohttp.ServerDisconnectedError:
                # A pooled keep-alive connection the node had closed: no response came, so the
                # node saw at most a disconnect (which aborts there). Once more, on a new one.
                return await post(url, data=body, headers=self._headers, timeout=timeout)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise NodeError(
                503, f"node {self.base_url} unreachable: {e!r}", is_node_failure=True
            ) from e

    async def _call(self, path: str, body: bytes) -> None:
        response = await self._post(path, body, _CALL_TIMEOUT)
        async with response:
            if response.status >= 300:
                raise await _error_from(response)

    async def _probe(self, path: str) -> bool:
        """True on 200; False on any other status or when the node cannot be reached."""
        try:
            async with self._get_session().get(
                self.base_url + path, headers=self._headers, timeout=_CALL_TIMEOUT
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError) as e:
            logger.debug("probe %s%s failed: %r", self.base_url, path, e)
            return False


async def _error_from(response: aiohttp.ClientResponse) -> NodeError:
    """The StreamError body a node sends with a 4xx/5xx, or the status alone."""
    body = await response.read()
    try:
        error = msgspec.msgpack.decode(body, type=StreamError)
    except msgspec.DecodeError:
        text = body.decode(errors="replace")[:500]
        return NodeError(response.status, text or response.reason or "no body")
    # 503: the node's engine failed or the node is draining; either way it takes no requests.
    return NodeError(error.status, error.message, is_node_failure=error.status == 503)
