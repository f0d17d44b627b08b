"""A node's side of prefill/decode hand-offs: its pairs, its transfers, and both streams' frames.

    coordinator                     decode node                       prefill node
    POST /internal/decode ───────▶  reserve blocks + a slot
      (hand_off: key, transfer id)  (503 when there is no room)
                        ◀─Reserved─  its pairs' store: store_host:store_port
    POST /internal/generate (hand_off: the route and that store) ──▶ joins the pair (lazily,
                                                                     beside the prompt's steps)
                                                                     the prompt, in chunks; the
                                                                     first token is sampled; the
           ◀─TokenDelta(first token)────────────────────────────────  state is copied out and its
    POST /internal/collect ──────▶  recv(transfer id) ◀══ pair ═══   blocks freed; send(transfer id)
                                    checked, written into the
           ◀─TokenDelta ... ─────── reservation, decoded on           ─HandedOff─▶ (stream ends)

Who pushes: the prefill node, as soon as the first token is sampled. The decode node posts its
receive only when the coordinator passes on that the first token came (``collect``), so that no
receive waits for a prompt to be computed: every wait on a pair is then bounded by
``kv_transfer.lease_s`` (the pair's operation timeout).

When each side frees what it holds:

- prefill node: the request's blocks and slot right after its first token (its state is copied
  out between two steps; the full blocks stay in its prefix cache); the copy once it is sent,
  or when sending fails: the decode node died or went away (at once), or did not collect within
  the lease.
- decode node: the reservation becomes the request's (freed when it finishes, like any other),
  or goes back at once on an abort, a disconnect, a failed transfer or a state that does not fit.
  Its receive may still run on (bounded by the lease) into memory of its own, never the cache's.
- a pair on which a transfer failed is closed on that side (a half-sent message may sit in it);
  the coordinator uses a new pair key after any failure, so a fresh group is built lazily.

A pair's group is named by the coordinator's key and the decode node process's incarnation (in
its Reserved frame), so a restarted decode node is never reached through its former process's
pair; the coordinator renews the keys of a node that registers again or comes back into
rotation, which covers a restarted prefill node. At most ``max_pairs`` pairs are kept; beyond
that the least recently used one that no transfer uses is closed.

The client sees one stream (the coordinator joins the two: server/pairing.py): its first token
from the prefill node, the rest from the decode node; a failure at any point ends it with an
error event, and every hand-off ends done, failed, aborted or timed out on both nodes.

``DEEPINFER_TEST_TRANSFER_PAUSE_S`` (tests only) pauses this long after each chunk a node sends,
so that tests can act while a transfer is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from deepinfer.config import KVTransferConfig
from deepinfer.engine.async_engine import AsyncEngine, EngineClosedError
from deepinfer.engine.handoff import HandOffExport, RequestState, pack_state, unpack_state
from deepinfer.images import ImageInput
from deepinfer.parallel.transfer import PairTransport, TransferError
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.scheduler import NoRoomError
from deepinfer.server import listen
from deepinfer.server.node_stream import engine_token_deltas, token_deltas
from deepinfer.server.protocol import (
    GenerateRequest,
    HandedOff,
    HandOffRoute,
    Reserved,
    TokenDelta,
)
from deepinfer.server.routing import NodeError

logger = logging.getLogger(__name__)

_PAUSE_ENV = "DEEPINFER_TEST_TRANSFER_PAUSE_S"
_MAX_THREADS = 64  # transfers and pair joins in flight per node


class TransferObserver(Protocol):
    """Metrics hooks (server/node_metrics.py), called from transfer threads."""

    def transfer_started(self, direction: str) -> None: ...

    def transfer_done(self, direction: str, path: str, num_bytes: int, seconds: float) -> None:
        """``path``: "host" (host memory and gloo) or "ipc" (CUDA IPC on a shared GPU)."""

    def transfer_failed(self, direction: str, reason: str) -> None: ...


@dataclass(eq=False)
class _Pair:
    """One pair's group, joined in a transfer thread (``future``), and its transfers in use."""

    key: str
    future: Future[PairTransport]
    num_in_use: int = 0
    closed: bool = False


class KVTransfers:
    """A node's pairs and transfers. ``hosts_store``: this node hosts its pairs' store and is
    rank 0 of each pair (a decode node, and an encode node: server/image_transfer.py); the
    others (prefill and mixed nodes) join pairs on their peers' stores. Start with ``await
    start()`` (a host opens its store there), end with ``close()``. Pairs are joined and
    transfers run in a pool of threads (gloo's calls block); the event loop only awaits them."""

    def __init__(
        self,
        config: KVTransferConfig,
        hosts_store: bool,
        observer: TransferObserver | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.hosts_store = hosts_store
        self.observer = observer
        # The GPU this node offers its pairs for CUDA IPC (a peer on the same GPU takes it).
        on_gpu = device is not None and device.type == "cuda"
        self.ipc_device = device if on_gpu and config.path == "auto" else None
        self.store_address: tuple[str, int] = ("", 0)  # a host's, once started
        self.incarnation = secrets.token_hex(4)  # this process's: in its pairs' names
        self._pool = ThreadPoolExecutor(_MAX_THREADS, thread_name_prefix="kv-transfer")
        self._store: dist.Store | None = None  # a decode node's pairs' store (it hosts it)
        self._pairs: OrderedDict[str, _Pair] = OrderedDict()  # by key, least recent first
        self._lock = threading.Lock()  # _pairs and their use counts, across threads
        self._collects: dict[str, asyncio.Event] = {}  # decode: hand-offs awaiting collect

    async def start(self) -> None:
        if not self.hosts_store:
            return
        loop = asyncio.get_running_loop()
        self._store = await loop.run_in_executor(self._pool, self._open_store)
        self.store_address = (listen.advertised_host(self.config.store_host), self._store.port)
        logger.info("pairs' store for hand-offs on %s:%d", *self.store_address)

    def _open_store(self) -> dist.Store:
        return dist.TCPStore(
            self.config.store_host,
            self.config.store_port,
            None,
            is_master=True,
            wait_for_workers=False,
            timeout=_seconds(self.config.lease_s),
        )

    def close(self) -> None:
        with self._lock:
            pairs, self._pairs = list(self._pairs.values()), OrderedDict()
        for pair in pairs:
            self._close(pair)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- pairs ---------------------------------------------------------------------------------

    def join(self, route: HandOffRoute) -> _Pair:
        """The pair of ``route.pair_key``, joined now if it is new (in a transfer thread: this
        returns at once). The store's host is rank 0, on its own store; its peer rank 1."""
        key = self._group_key(route)
        with self._lock:
            pair = self._pairs.get(key)
            if pair is not None:
                self._pairs.move_to_end(key)
                return pair
            pair = _Pair(key, self._pool.submit(self._join, route, key))
            self._pairs[key] = pair
            evicted = self._evict()
        for old in evicted:
            self._close(old)
        return pair

    def _group_key(self, route: HandOffRoute) -> str:
        """The pair's group: the coordinator's key and the store host process's incarnation."""
        incarnation = self.incarnation if self.hosts_store else route.store_incarnation
        return f"{route.pair_key}.{incarnation}"

    def _join(self, route: HandOffRoute, key: str) -> PairTransport:
        timeout_s = self.config.lease_s
        if self.hosts_store:
            assert self._store is not None, "KVTransfers.start() was not awaited"
            store, rank = self._store, 0
        else:
            store, rank = self._client_store(route.store_host, route.store_port), 1
        transport = PairTransport.join(
            store,
            key,
            rank,
            timeout_s=timeout_s,
            chunk_bytes=max(1, int(self.config.chunk_mib * 2**20)),
            ipc_device=self.ipc_device,
        )
        pause_s = float(os.environ.get(_PAUSE_ENV, "0") or 0)
        if pause_s > 0:
            transport.on_chunk = lambda chunk: time.sleep(pause_s)
        path = "CUDA IPC" if transport.shared_gpu is not None else "host memory"
        logger.info(
            "pair %s with %s joined (rank %d, states through %s)", key, route.peer, rank, path
        )
        return transport

    def shares_gpu(self, route: HandOffRoute) -> bool:
        """The route's pair is joined and on a GPU both ends share: a state may stay on the
        device for it (it moves through CUDA IPC)."""
        with self._lock:
            pair = self._pairs.get(self._group_key(route))
        if pair is None or not pair.future.done() or pair.future.exception() is not None:
            return False
        return pair.future.result().shared_gpu is not None

    def _client_store(self, host: str, port: int) -> dist.Store:
        """A connection to a decode node's pairs' store, one per pair (a decode node that
        restarted on the same port is reached anew)."""
        try:
            return dist.TCPStore(host, port, is_master=False, timeout=_seconds(self.config.lease_s))
        except (RuntimeError, ValueError) as error:
            message = f"cannot reach the peer's pairs' store {host}:{port}: {error}"
            raise TransferError(message, "join") from error

    def _evict(self) -> list[_Pair]:
        """Pairs beyond ``max_pairs``, least recently used first, that no transfer uses."""
        evicted = []
        for key in list(self._pairs):
            if len(self._pairs) <= self.config.max_pairs:
                break
            if self._pairs[key].num_in_use == 0:
                evicted.append(self._pairs.pop(key))
        return evicted

    def _drop(self, pair: _Pair) -> None:
        """A transfer on ``pair`` failed: forget it and close it."""
        with self._lock:
            if self._pairs.get(pair.key) is pair:
                del self._pairs[pair.key]
        self._close(pair)

    def _close(self, pair: _Pair) -> None:
        if pair.closed:
            return
        pair.closed = True

        def close(future: Future[PairTransport]) -> None:
            if not future.cancelled() and future.exception() is None:
                future.result().close()

        pair.future.add_done_callback(close)

    # -- transfers -----------------------------------------------------------------------------

    async def send(self, route: HandOffRoute, state: RequestState) -> HandedOff:
        """Prefill node: send ``state`` to the route's decode node. Raises TransferError. A
        cancelled caller leaves the send running (bounded by the lease), not the pair broken."""
        header, parts = pack_state(state)
        num_bytes, seconds = await self.send_parts(route, header, parts)
        return HandedOff(request_id=state.request_id, num_bytes=num_bytes, seconds=seconds)

    async def recv(self, route: HandOffRoute) -> RequestState:
        """Decode node: the route's state from its prefill node. Raises TransferError."""
        header, parts = await self.recv_parts(route)
        try:
            return unpack_state(header, parts)
        except ValueError as error:
            raise TransferError(str(error), "malformed") from error

    async def send_parts(
        self, route: HandOffRoute, header: bytes, parts: list[torch.Tensor]
    ) -> tuple[int, float]:
        """Send one transfer (``header`` and ``parts``) on the route's pair; returns (bytes,
        seconds). Raises TransferError."""

        def send(transport: PairTransport) -> tuple[int, str]:
            checksum = self.config.checksum
            path = transport.send(route.transfer_id, header, parts, checksum_parts=checksum)
            return _num_bytes(header, parts), path

        return await self._run("send", route, send)

    async def recv_parts(self, route: HandOffRoute) -> tuple[bytes, list[torch.Tensor]]:
        """Receive the route's transfer: (header, parts). Raises TransferError."""
        received: list[tuple[bytes, list[torch.Tensor]]] = []

        def recv(transport: PairTransport) -> tuple[int, str]:
            header, parts = transport.recv(route.transfer_id)
            received.append((header, parts))
            on_gpu = transport.shared_gpu is not None and any(p.is_cuda for p in parts)
            return _num_bytes(header, parts), "ipc" if on_gpu else "host"

        await self._run("recv", route, recv)
        return received[0]

    async def _run(
        self,
        direction: str,
        route: HandOffRoute,
        work: Callable[[PairTransport], tuple[int, str]],
    ) -> tuple[int, float]:
        """``work(transport)`` (it returns the bytes it moved and their path) in a transfer
        thread on the route's pair, observed; returns (bytes, seconds). A failure closes the
        pair here."""
        pair = self.join(route)
        with self._lock:
            pair.num_in_use += 1

        def run() -> tuple[int, float]:
            start = time.monotonic()
            if self.observer is not None:
                self.observer.transfer_started(direction)
            try:
                transport = pair.future.result(timeout=self.config.lease_s)
                num_bytes, path = work(transport)
            except Exception as error:
                failure = error
                if not isinstance(error, TransferError):  # the join timed out or failed
                    failure = TransferError(f"pair {route.pair_key}: {error!r}", "join")
                logger.warning(
                    "transfer %d (%s) with %s failed (%s): %s; its pair is closed",
                    route.transfer_id,
                    direction,
                    route.peer,
                    failure.reason,
                    failure,
                )
                if self.observer is not None:
                    self.observer.transfer_failed(direction, failure.reason)
                self._drop(pair)
                if failure is error:
                    raise
                raise failure from error
            seconds = time.monotonic() - start
            if self.observer is not None:
                self.observer.transfer_done(direction, path, num_bytes, seconds)
            return num_bytes, seconds

        future = self._pool.submit(run)
        future.add_done_callback(lambda _: self._release(pair))  # also when it never ran
        return await asyncio.wrap_future(future)

    def _release(self, pair: _Pair) -> None:
        with self._lock:
            pair.num_in_use -= 1

    # -- the receiver's collect signal --------------------------------------------------------

    def expect(self, request_id: str) -> asyncio.Event:
        event = self._collects[request_id] = asyncio.Event()
        return event

    def collect(self, request_id: str) -> bool:
        """The coordinator says the request's sender is sending; False if nothing waits for
        it."""
        event = self._collects.get(request_id)
        if event is None:
            return False
        event.set()
        return True

    def forget(self, request_id: str) -> None:
        self._collects.pop(request_id, None)


def _num_bytes(header: bytes, parts: list[torch.Tensor]) -> int:
    return len(header) + sum(p.numel() * p.element_size() for p in parts)


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


# -- the two streams -------------------------------------------------------------------------------


async def prefill_frames(
    engine: AsyncEngine,
    transfers: KVTransfers,
    message: GenerateRequest,
    params: SamplingParams,
    images: list[ImageInput] | None = None,
) -> AsyncIterator[TokenDelta | HandedOff]:
    """A prefill node's hand-off stream: the prompt's deltas (the last carries the first token),
    then HandedOff once the decode node has the state. A request that ends with its first token
    ends here, with no hand-off. ``images``: as ``token_deltas`` takes them. Raises NodeError
    (502 when the transfer fails)."""
    route = message.hand_off
    assert route is not None
    transfers.join(route)  # joins beside the prompt's steps
    export = HandOffExport(on_device=lambda: transfers.shares_gpu(route))
    async for delta in token_deltas(engine, message, params, hand_off=export, images=images):
        yield delta
    if export.state is None:
        return
    try:
        yield await transfers.send(route, export.state)
    except TransferError as error:
        raise NodeError(502, f"handing the request to {route.peer} failed: {error}") from error


async def decode_frames(
    engine: AsyncEngine,
    transfers: KVTransfers,
    message: GenerateRequest,
    params: SamplingParams,
) -> AsyncIterator[Reserved | TokenDelta]:
    """A decode node's hand-off stream: Reserved, then (once collected, received and checked)
    the request's deltas from its second token on. Raises NodeError: 503 (no room; is_node_failure
    when the engine takes no requests), 400 (too long, id in use), 502 (the transfer failed or
    the state does not fit)."""
    route = message.hand_off
    assert route is not None
    request_id = message.request_id
    try:
        prompt, spans = await engine.expand_images(
            request_id, message.prompt_token_ids, message.image_inputs()
        )
        await engine.reserve_hand_off(request_id, len(prompt))
    except NoRoomError as error:
        raise NodeError(503, f"no room for request {request_id!r} now: {error}") from error
    except ValueError as error:
        raise NodeError(400, str(error)) from error
    except EngineClosedError as error:
        raise NodeError(503, str(error), is_node_failure=True) from error
    collected = transfers.expect(request_id)
    try:
        transfers.join(route)
        host, port = transfers.store_address
        yield Reserved(
            request_id=request_id,
            store_host=host,
            store_port=port,
            incarnation=transfers.incarnation,
        )
        await collected.wait()
        try:
            state = await transfers.recv(route)
        except TransferError as error:
            raise NodeError(502, f"receiving from {route.peer} failed: {error}") from error
        _check_state(state, request_id, prompt)
        deltas = engine_token_deltas(
            engine, request_id, engine.generate_handed_off(state, params, spans)
        )
        async with contextlib.aclosing(deltas):
            try:
                first = await anext(deltas)
            except NodeError as error:
                if error.status != 400:
                    raise
                message_ = f"the state received from {route.peer} does not fit: {error.message}"
                raise NodeError(502, message_) from error
            yield first
            async for delta in deltas:
                yield delta
    finally:
        transfers.forget(request_id)
        # The reservation back if the request never ran (a no-op once it finished; one that
        # runs is aborted by its stream's close anyway).
        engine.abort(request_id)


def _check_state(state: RequestState, request_id: str, prompt_token_ids: list[int]) -> None:
    """The state is the request's: its id, and its prompt as this node expands the request."""
    if state.request_id != request_id or state.prompt_token_ids != prompt_token_ids:
        raise NodeError(502, f"request {request_id!r}: the state received is another request's")
