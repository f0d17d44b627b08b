"""The coordinator's side of image encoding on an encode node: a request's images encoded there,
their embeddings handed to the node that runs its prompt (server/image_transfer.py).

    EncodedBackend(encode node, route).generate(request)
      encode node ── /internal/encode (images, route: pair key, transfer id) ──▶ Reserved(store)
      route ──────── /internal/generate (images, images_from: the route + that store) ──▶ ...
                     (a prefill/decode pair: its prefill node receives)
      encode node ◀─ Encoded ─▶ route's node /internal/collect    (it receives now)
      encode node ◀─ HandedOff                                      (it has the embeddings)
      route ───────▶ TokenDelta ... ─▶ the client

The service wraps the route it selected for a request with images in one of these while an
encode node is in rotation (the least loaded), and otherwise sends the request as it is: the
serving node encodes in-process. A failure on the encode node (it died, its stream broke, it
could not send) ends the request with a NodeError naming the encode node, even when the serving
node saw it first (its receive failed): the service takes the encode node out of rotation and
may retry the request (nothing was streamed yet), which then encodes elsewhere. A request
whose images are bad gets the encode node's 400. Closing the stream closes both.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import msgspec

from deepinfer.server.pairing import (
    CLIENT_FAULTS,
    PairKeys,
    node_failed,
    on_node,
    on_node_call,
)
from deepinfer.server.protocol import (
    Encoded,
    EncodeRequest,
    GenerateRequest,
    HandedOff,
    HandOffRoute,
    Reserved,
    StreamFrame,
)
from deepinfer.server.routing import NodeEntry, NodeError

# A receive that failed waits this long to learn whether its encode node failed too (its stream
# breaks at once when its process dies), so that the error names the right node.
_SETTLE_S = 5.0


class EncodedBackend:
    """A NodeBackend over ``route`` (a node or a pair) whose requests' images ``encoder``
    encodes; see the module."""

    def __init__(self, encoder: NodeEntry, route: NodeEntry, keys: PairKeys) -> None:
        self.encoder = encoder
        self.route = route
        self.receiver = route.members[0] if route.members else route  # a pair: prefill node
        self.keys = keys

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamFrame]:
        e, r = self.encoder, self.receiver
        key, transfer_id = self.keys.next(e.node_id, r.node_id)
        route = HandOffRoute(pair_key=key, transfer_id=transfer_id, peer=r.node_id)
        message = EncodeRequest(request_id=request.request_id, images=request.images, route=route)
        e.num_inflight += 1
        try:
            async with contextlib.aclosing(on_node(e, e.backend.encode(message))) as encoding:
                reserved = await anext(encoding)
                if not isinstance(reserved, Reserved):
                    raise node_failed(e, f"node {e.node_id} did not queue the images: {reserved!r}")
                images_from = reserved.route(route, e.node_id)
                sent = asyncio.create_task(self._sent(encoding, request.request_id))
                try:
                    served = self.route.backend.generate(
                        msgspec.structs.replace(request, images_from=images_from)
                    )
                    async with contextlib.aclosing(served) as frames:
                        try:
                            async for frame in _unless_failed(frames, sent):
                                yield frame
                        except NodeError as error:
                            raise await _whose(error, sent) from None
                finally:
                    # Before the encode stream is closed: the task may be iterating it.
                    sent.cancel()
                    with contextlib.suppress(asyncio.CancelledError, NodeError):
                        await sent
        except NodeError as error:
            if error.status not in CLIENT_FAULTS:
                self.keys.renew(e.node_id, r.node_id)
            raise
        finally:
            e.num_inflight -= 1

    async def _sent(self, encoding: AsyncIterator[StreamFrame], request_id: str) -> HandedOff:
        """The encode node's Encoded (then the receiver is told to collect) and HandedOff."""
        e, r = self.encoder, self.receiver
        encoded = await anext(encoding)
        if not isinstance(encoded, Encoded):
            raise node_failed(e, f"node {e.node_id} sent {encoded!r} instead of Encoded")
        await on_node_call(r, r.backend.collect(request_id))  # type: ignore[attr-defined]
        handed_off = await anext(encoding)
        if not isinstance(handed_off, HandedOff):
            raise node_failed(e, f"node {e.node_id} sent {handed_off!r} instead of HandedOff")
        return handed_off

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.route.backend.abort(request_ids)

    async def finish(self, request_id: str, stop_reason: int | str | None) -> None:
        await self.route.backend.finish(request_id, stop_reason)

    async def ready(self) -> bool:
        return await self.route.backend.ready()


async def _unless_failed(
    frames: AsyncIterator[StreamFrame], sent: asyncio.Task
) -> AsyncIterator[StreamFrame]:
    """``frames``, until ``sent`` fails: then its error (the stream is left to be closed)."""
    while True:
        following = asyncio.ensure_future(anext(frames))
        if not sent.done():
            await asyncio.wait((following, sent), return_when=asyncio.FIRST_COMPLETED)
            if sent.done() and sent.exception() is not None and not following.done():
                following.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, NodeError):
                    await following
                raise sent.exception()  # type: ignore[misc]
        try:
            frame = await following
        except StopAsyncIteration:
            return
        yield frame


async def _whose(error: NodeError, sent: asyncio.Task) -> NodeError:
    """The serving node's error, or the encode node's when that one failed too (it usually
    made the receive fail)."""
    if not sent.done():
        await asyncio.wait((sent,), timeout=_SETTLE_S)
    if sent.done() and not sent.cancelled() and isinstance(sent.exception(), NodeError):
        return sent.exception()  # type: ignore[return-value]
    return error
