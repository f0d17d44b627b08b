"""The coordinator's side of a prefill/decode hand-off: one request on a (prefill, decode) pair
of nodes, streamed to the client as if one node served it.

    PairedBackend.generate(request)
      decode node  ── /internal/decode (hand_off: pair key, transfer id) ──▶ Reserved(store)
      prefill node ── /internal/generate (hand_off: the same + that store) ──▶ TokenDelta(s)
                         the first token's delta ─▶ the client, and ─▶ decode node /collect
                     ◀── HandedOff (the decode node has the cache)
      decode node  ◀── TokenDelta ... (second token on) ─▶ the client

A request whose first token ends it (EOS, max_tokens 1) ends on the prefill node; the decode
node's reservation goes back when its stream is closed. Any failure ends the request with a
NodeError naming the node that failed (``NodeError.node``: the service takes that one out of
rotation and may retry a request that got no token yet); closing the stream (client gone,
error, timeout) closes both nodes' streams, which aborts the request on both. The pair's key
names its process group on the nodes (server/kv_transfer.py); after any failure on the pair
the next request uses a new key, so that both nodes build a fresh group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import msgspec

from deepinfer.server.protocol import (
    GenerateRequest,
    HandedOff,
    HandOffRoute,
    Reserved,
    StreamFrame,
    TokenDelta,
)
from deepinfer.server.routing import NodeEntry, NodeError

logger = logging.getLogger(__name__)

CLIENT_FAULTS = (400, 413)  # the request's own fault: the pair is fine


class HandOffNode(Protocol):
    """What a pair needs of its nodes' backends beyond NodeBackend (NodeClient has it)."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[StreamFrame]: ...

    def decode(self, request: GenerateRequest) -> AsyncIterator[StreamFrame]: ...

    async def collect(self, request_id: str) -> None: ...

    async def abort(self, request_ids: Sequence[str]) -> None: ...

    async def finish(self, request_id: str, stop_reason: int | str | None) -> None: ...


# (prefill node id, decode node id, outcome, {phase: seconds}): the coordinator's metrics.
PairObserver = Callable[[str, str, str, dict[str, float]], None]


class PairKeys:
    """Per (prefill, decode) pair: its current key and the last transfer id used on it."""

    def __init__(self) -> None:
        self._keys: dict[tuple[str, str], list] = {}

    def next(self, prefill_id: str, decode_id: str) -> tuple[str, int]:
        entry = self._keys.setdefault((prefill_id, decode_id), [secrets.token_hex(8), 0])
        entry[1] += 1
        return entry[0], entry[1]

    def renew(self, prefill_id: str, decode_id: str) -> None:
        """The pair failed: its next request gets a new key (a new group on both nodes)."""
        self._keys.pop((prefill_id, decode_id), None)

    def renew_node(self, node_id: str) -> None:
        """The node (re)started or came back: every pair of it gets a new key."""
        for pair in [pair for pair in self._keys if node_id in pair]:
            del self._keys[pair]


class PairedBackend:
    """A NodeBackend over two nodes; see the module."""

    def __init__(
        self,
        prefill: NodeEntry,
        decode: NodeEntry,
        keys: PairKeys,
        observer: PairObserver | None = None,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.keys = keys
        self.observer = observer

    def _node(self, entry: NodeEntry) -> HandOffNode:
        return entry.backend  # type: ignore[return-value]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        p, d = self.prefill, self.decode
        key, transfer_id = self.keys.next(p.node_id, d.node_id)
        route = HandOffRoute(pair_key=key, transfer_id=transfer_id, peer=p.node_id)
        clock = _Phases()
        collect: asyncio.Task | None = None
        num_prompt = len(request.prompt_token_ids)
        p.num_prefill_tokens_inflight += num_prompt  # until its first token
        outcome = "aborted"  # the client left, or a timeout or drain closed the stream
        try:
            on_decode = on_node(d, self._node(d).decode(_with(request, route)))
            async with contextlib.aclosing(on_decode) as decoding:
                reserved = await anext(decoding)
                if not isinstance(reserved, Reserved):
                    raise node_failed(d, f"node {d.node_id} did not reserve: {reserved!r}")
                route = reserved.route(route, d.node_id)
                on_prefill = on_node(p, self._node(p).generate(_with(request, route)))
                async with contextlib.aclosing(on_prefill) as prefilling:
                    async for frame in prefilling:
                        if isinstance(frame, HandedOff):
                            clock.mark("transfer")
                            break
                        assert isinstance(frame, TokenDelta), frame
                        if frame.token_ids and num_prompt:
                            clock.mark("prefill")
                            p.num_prefill_tokens_inflight -= num_prompt
                            num_prompt = 0
                        if frame.token_ids and frame.finish_reason is None:
                            # The prefill node sends now: the decode node receives.
                            call = on_node_call(d, self._node(d).collect(request.request_id))
                            collect = asyncio.create_task(call)
                        yield frame
                        if frame.finish_reason is not None:
                            outcome = "prefill_only"  # ended with its first token
                            return
                if collect is None:
                    raise node_failed(p, f"node {p.node_id} handed off before its first token")
                await collect
                outcome = "handed_off"
                async for frame in decoding:
                    assert isinstance(frame, TokenDelta), frame
                    if frame.token_ids:
                        clock.mark("first_decode")
                    yield frame
        except NodeError as error:
            if error.status not in CLIENT_FAULTS:
                self.keys.renew(p.node_id, d.node_id)
            outcome = "failed"
            raise
        finally:
            p.num_prefill_tokens_inflight -= num_prompt
            if collect is not None and not collect.done():
                collect.cancel()
            if self.observer is not None:
                self.observer(p.node_id, d.node_id, outcome, clock.phases)

    async def abort(self, request_ids: Sequence[str]) -> None:
        prefill, decode = self._node(self.prefill), self._node(self.decode)
        await _both(prefill.abort(request_ids), decode.abort(request_ids))

    async def finish(self, request_id: str, stop_reason: int | str | None) -> None:
        """A stop string matched: the request ends where it runs (the decode node), and is
        aborted on the prefill node if it is still there."""
        await _both(
            self._node(self.decode).finish(request_id, stop_reason),
            self._node(self.prefill).abort([request_id]),
        )

    async def ready(self) -> bool:
        answers = await asyncio.gather(self.prefill.backend.ready(), self.decode.backend.ready())
        return all(answers)


class _Phases:
    """Each phase's time, from the previous phase's end (the first: from the start)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.monotonic()

    def mark(self, phase: str) -> None:
        if phase not in self.phases:
            now = time.monotonic()
            self.phases[phase] = now - self._last
            self._last = now


def _with(request: GenerateRequest, route: HandOffRoute) -> GenerateRequest:
    return msgspec.structs.replace(request, hand_off=route)


def node_failed(entry: NodeEntry, message: str) -> NodeError:
    error = NodeError(502, message, is_node_failure=True)
    error.node = entry
    return error


async def on_node(
    entry: NodeEntry, stream: AsyncIterator[StreamFrame]
) -> AsyncIterator[StreamFrame]:
    """``stream``, its NodeErrors naming ``entry``."""
    async with contextlib.aclosing(stream):
        try:
            async for frame in stream:
                yield frame
        except NodeError as error:
            error.node = error.node or entry
            raise


async def on_node_call(entry: NodeEntry, call) -> None:
    try:
        await call
    except NodeError as error:
        error.node = error.node or entry
        raise


async def _both(*calls) -> None:
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, Exception):
            logger.warning("a pair's call failed: %s", result)
