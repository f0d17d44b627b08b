"""The node's internal HTTP API (`deepinfer node`): token ids in, token deltas out.

    POST /internal/generate   msgpack GenerateRequest -> stream of length-prefixed msgpack frames
                              (one TokenDelta per engine step; a StreamError if the request fails)
    POST /internal/abort      msgpack AbortRequest  -> 204
    POST /internal/finish     msgpack FinishRequest -> 204 (a stop string matched on the text side)
    prefill/decode hand-offs (server/kv_transfer.py), by role:
    POST /internal/generate   with ``hand_off`` (a prefill node): the first token's frames, then
                              HandedOff once the decode node has the request's cache
    POST /internal/decode     msgpack GenerateRequest with ``hand_off`` (a decode node): Reserved,
                              then the request's TokenDeltas from its second token on
    POST /internal/generate   with ``images_from`` (a prefill or mixed node): the images'
                              embeddings received from an encode node first, once collected
                              (server/image_transfer.py; an encode node: server/encode_node.py)
    POST /internal/collect    msgpack CollectRequest -> 204 (404: no such hand-off waits here)
    GET  /health              200 while the process runs
    GET  /ready               200 while the engine loop turns and the node is not draining, else 503
    GET  /metrics             Prometheus text format (server/node_metrics.py); with
                              ``server.metrics_key`` set, only with "Authorization: Bearer <key>"

Errors before streaming (bad body, bad sampling options, invalid output constraint, prompt too
long, id in use) are an HTTP 400 (413: body too large; 503: draining) whose body is one msgpack
StreamError; once the stream began, a failure is a StreamError frame and the stream ends. A client
that disconnects aborts its request (the handler is cancelled, or its next write fails), which
frees the request's blocks. With ``server.node_token`` set, every /internal/* call must carry
``Authorization: Bearer <token>`` (else 401), and the node sends it to the coordinator too; a node
bound to an address other than loopback refuses to start without it.

With ``node.coordinator_internal_url`` set the node registers on the coordinator's internal
listener and heartbeats there with the lease its registration got (server/protocol.py NodeLease),
and posts its prefix cache's events there for cache-aware routing (server/cache_events.py).

Handlers only parse -> submit -> stream; the engine steps in its own thread (AsyncEngine), and
server/node_stream.py turns its deltas and errors into the wire's (as for `serve`'s LocalNode).

One file of ~460 lines: the node's routes, their auth and its registration loop share the
app's lifecycle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST

from deepinfer.config import Config, NodeConfig, is_loopback
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.flags import ENGINE_USES, add_config_flags
from deepinfer.kv_cache.events import CacheEventLog
from deepinfer.sampling_params import SamplingParams
from deepinfer.server import listen, systemd
from deepinfer.server.access_log import app_runner
from deepinfer.server.cache_events import CachePublisher
from deepinfer.server.image_transfer import received_images
from deepinfer.server.kv_transfer import KVTransfers, decode_frames, prefill_frames
from deepinfer.server.node_metrics import NodeMetrics
from deepinfer.server.node_stream import node_load, sampling_params_of, token_deltas
from deepinfer.server.protocol import (
    FRAME_CONTENT_TYPE,
    MESSAGE_CONTENT_TYPE,
    AbortRequest,
    CollectRequest,
    FinishRequest,
    GenerateRequest,
    NodeHeartbeat,
    NodeLease,
    NodeLoad,
    NodeRegistration,
    StreamError,
    StreamFrame,
    decode,
    encode,
    encode_frame,
)
from deepinfer.server.routing import NodeError

logger = logging.getLogger(__name__)

ENGINE = web.AppKey("engine", AsyncEngine)
CONFIG = web.AppKey("config", Config)
NODE_CONFIG = web.AppKey("node_config", NodeConfig)
METRICS = web.AppKey("metrics", NodeMetrics)
REGISTRATION = web.AppKey("registration", NodeRegistration)
TRANSFERS = web.AppKey("transfers", KVTransfers)
PUBLISHER = web.AppKey("publisher", CachePublisher)
LOAD = web.AppKey("load", Callable[[], NodeLoad])  # what heartbeats carry

_MAX_BODY_BYTES = 64 * 2**20  # a 1M-token prompt is ~5 MB of msgpack
_MAX_RETRY_S = 30.0


def create_node_app(
    engine: AsyncEngine, config: Config, *, model_name: str | None = None
) -> web.Application:
    """The node app. Its cleanup_ctx starts and stops ``engine`` (and registration when
    ``node.coordinator_internal_url`` is set); its NodeMetrics becomes the engine's observer."""
    node_id, url = node_identity(config.node)
    model_name = model_name or served_model_name(config)
    metrics = observe_engine(engine, config, node_id, model_name)
    app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[check_token])
    app[ENGINE] = engine
    app[CONFIG] = config
    app[NODE_CONFIG] = config.node
    app[METRICS] = metrics
    app[LOAD] = lambda: node_load(engine.load())
    parallel = config.parallel
    app[REGISTRATION] = NodeRegistration(
        node_id=node_id,
        url=url,
        role=config.node.role,
        model=model_name,
        max_model_len=engine.max_model_len,
        max_num_seqs=config.scheduler.max_num_seqs,
        instance_id=instance_id(config) if parallel.data_parallel_size > 1 else "",
        rank=parallel.data_parallel_rank,
        num_ranks=parallel.data_parallel_size,
    )
    _publish_cache_events(app, engine, config.node)
    # Every role takes part in pairs: a prefill node sends caches, a decode node receives
    # them, prefill and mixed nodes receive images' embeddings from encode nodes.
    hosts_store = config.node.role == "decode"
    observer = metrics.watch_transfers()
    device = engine.engine.device
    app[TRANSFERS] = KVTransfers(config.kv_transfer, hosts_store, observer, device)
    app.cleanup_ctx.append(_engine_ctx)
    app.cleanup_ctx.append(transfers_ctx)
    app.cleanup_ctx.append(registration_ctx)
    app.add_routes(
        [
            web.post("/internal/generate", generate),
            web.post("/internal/decode", decode_handed_off),
            web.post("/internal/collect", collect),
            web.post("/internal/abort", abort),
            web.post("/internal/finish", finish),
            web.get("/health", health),
            web.get("/ready", ready),
            web.get("/metrics", metrics_text),
        ]
    )
    return app


def _publish_cache_events(app: web.Application, engine: AsyncEngine, node: NodeConfig) -> None:
    """A registered node tells the coordinator what its prefix cache holds (for routing)."""
    if node.coordinator_internal_url is None or node.cache_event_interval_s == 0:
        return
    events = CacheEventLog(node.max_pending_cache_events)
    layout = engine.engine.publish_cache_events(events)
    if layout is None:
        return  # no prefix caching: nothing to publish
    app[REGISTRATION].cache = layout
    app[PUBLISHER] = CachePublisher(events, node.cache_event_interval_s)
    app[METRICS].watch_cache_events(lambda: events.last_seq)


def node_identity(node: NodeConfig) -> tuple[str, str]:
    """(node_id, the URL the coordinator reaches the node at), defaults filled in."""
    host = listen.advertised_host(node.host)
    if ":" in host:
        host = f"[{host}]"
    node_id = node.node_id or f"{socket.gethostname()}:{node.port}"
    return node_id, node.advertise_url or f"http://{host}:{node.port}"


def instance_id(config: Config) -> str:
    """The lock-step instance a rank belongs to: ``node.instance_id``, else its ranks'
    rendezvous (the same for all of them, different for any other instance)."""
    parallel = config.parallel
    return config.node.instance_id or (
        f"{parallel.data_parallel_address}:{parallel.data_parallel_master_port}"
    )


def served_model_name(config: Config) -> str:
    if config.server.served_model_name:
        return config.server.served_model_name
    return Path(config.model.path).name if config.model.path else "deepinfer-tiny"


def observe_engine(
    engine: AsyncEngine, config: Config, node_id: str, model_name: str
) -> NodeMetrics:
    """The node's metrics, made the engine's observer (used by `node` and `serve`)."""
    metrics = NodeMetrics(
        node_id,
        model_name,
        engine.max_model_len,
        lambda: node_load(engine.load()),
        export_vllm_names=config.metrics.export_vllm_names,
    )
    metrics.watch_cache(engine.engine.cache_stats)
    metrics.watch_graphs(engine.engine.graph_stats)
    metrics.watch_drafts(engine.engine.spec_stats)
    metrics.watch_images(engine.engine.image_stats)
    metrics.watch_ranks(engine.engine.rank_stats)
    engine.observer = metrics
    return metrics


# -- handlers ----------------------------------------------------------------------------------


async def generate(request: web.Request) -> web.StreamResponse:
    """A request, whole; a prefill node's part of a hand-off when it carries ``hand_off``; its
    images' embeddings first received from an encode node when it carries ``images_from``."""
    parsed = await _parse_generate(request)
    if isinstance(parsed, web.Response):
        return parsed
    message, params = parsed
    role = request.app[NODE_CONFIG].role
    if message.hand_off is not None and role != "prefill":
        return _refused_role(message.request_id, role, "a hand-off's prompt")
    if message.images_from is not None and role not in ("prefill", "mixed"):
        return _refused_role(message.request_id, role, "images' embeddings")
    frames = _generate_frames(request.app[ENGINE], request.app[TRANSFERS], message, params)
    return await stream_frames(request, message.request_id, frames)


async def _generate_frames(
    engine: AsyncEngine, transfers: KVTransfers, message: GenerateRequest, params: SamplingParams
) -> AsyncIterator[StreamFrame]:
    images = None
    if message.images_from is not None:
        images = await received_images(transfers, message)
    if message.hand_off is None:
        frames = token_deltas(engine, message, params, images=images)
    else:
        frames = prefill_frames(engine, transfers, message, params, images=images)
    async with contextlib.aclosing(frames):
        async for frame in frames:
            yield frame


async def decode_handed_off(request: web.Request) -> web.StreamResponse:
    """A decode node's part of a hand-off: reserve, collect, decode."""
    parsed = await _parse_generate(request)
    if isinstance(parsed, web.Response):
        return parsed
    message, params = parsed
    role = request.app[NODE_CONFIG].role
    if role != "decode":
        return _refused_role(message.request_id, role, "a handed-off request")
    if message.hand_off is None:
        return error_response(400, message.request_id, "/internal/decode needs a hand_off")
    engine, transfers = request.app[ENGINE], request.app[TRANSFERS]
    frames = decode_frames(engine, transfers, message, params)
    return await stream_frames(request, message.request_id, frames)


async def collect(request: web.Request) -> web.Response:
    try:
        message = decode(await request.read(), CollectRequest)
    except msgspec.DecodeError as e:
        return error_response(400, "", str(e))
    if not request.app[TRANSFERS].collect(message.request_id):
        return error_response(404, message.request_id, "no hand-off of this id waits here")
    return web.Response(status=204)


async def _parse_generate(
    request: web.Request,
) -> tuple[GenerateRequest, SamplingParams] | web.Response:
    try:
        message = decode(await request.read(), GenerateRequest)
        return message, sampling_params_of(message)
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(413, "", e.text or "request body too large")
    except (msgspec.DecodeError, ValueError) as e:
        return error_response(400, "", str(e))


def _refused_role(request_id: str, role: str, what: str) -> web.Response:
    return error_response(400, request_id, f"this node's role is {role}: it takes no {what}")


async def stream_frames(
    request: web.Request, request_id: str, frames: AsyncIterator[StreamFrame]
) -> web.StreamResponse:
    """``frames`` as the response: a NodeError before the first is an error response, after it
    a StreamError frame that ends the stream."""
    async with contextlib.aclosing(frames):
        try:
            first = await anext(frames)
        except NodeError as e:
            return error_response(e.status, request_id, e.message)
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: FRAME_CONTENT_TYPE})
        await response.prepare(request)
        try:
            await response.write(encode_frame(first))
            try:
                async for frame in frames:
                    await response.write(encode_frame(frame))
            except NodeError as e:
                error = StreamError(request_id=request_id, status=e.status, message=e.message)
                await response.write(encode_frame(error))
            await response.write_eof()
        except ConnectionResetError:
            # Without handler cancellation the disconnect shows here; aclosing() aborts.
            logger.info("request %r: the client disconnected", request_id)
        return response


async def abort(request: web.Request) -> web.Response:
    try:
        message = decode(await request.read(), AbortRequest)
    except msgspec.DecodeError as e:
        return error_response(400, "", str(e))
    for request_id in message.request_ids:
        request.app[ENGINE].abort(request_id)
    return web.Response(status=204)


async def finish(request: web.Request) -> web.Response:
    try:
        message = decode(await request.read(), FinishRequest)
    except msgspec.DecodeError as e:
        return error_response(400, "", str(e))
    request.app[ENGINE].finish(message.request_id, message.stop_reason)
    return web.Response(status=204)


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def ready(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine.is_draining:
        return web.Response(status=503, text="draining\n")
    if not engine.is_turning:
        return web.Response(status=503, text="engine loop not turning\n")
    return web.Response(text="ready\n")


async def metrics_text(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={hdrs.CONTENT_TYPE: CONTENT_TYPE_LATEST})


def error_response(status: int, request_id: str, message: str) -> web.Response:
    if status >= 500:
        logger.error("request %r failed: %s", request_id, message)
    body = encode(StreamError(request_id=request_id, status=status, message=message))
    return web.Response(status=status, body=body, content_type=MESSAGE_CONTENT_TYPE)


@web.middleware
async def check_token(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """/internal/* needs server.node_token, /metrics server.metrics_key (each when set)."""
    server = request.app[CONFIG].server
    if request.path.startswith("/internal/"):
        token = server.node_token
    else:
        token = server.metrics_key if request.path == "/metrics" else None
    if token:
        supplied = request.headers.get(hdrs.AUTHORIZATION, "").encode()
        if not hmac.compare_digest(supplied, f"Bearer {token}".encode()):
            response = error_response(401, "", "missing or wrong bearer token")
            response.headers[hdrs.WWW_AUTHENTICATE] = "Bearer"
            return response
    return await handler(request)


# -- background work ---------------------------------------------------------------------------


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    await app[ENGINE].start()
    yield
    await app[ENGINE].stop()


async def transfers_ctx(app: web.Application) -> AsyncIterator[None]:
    transfers = app[TRANSFERS]
    await transfers.start()
    yield
    transfers.close()


async def registration_ctx(app: web.Application) -> AsyncIterator[None]:
    if app[NODE_CONFIG].coordinator_internal_url is None:
        yield
        return
    task = asyncio.create_task(_register_and_heartbeat(app), name="deepinfer-node-heartbeat")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _register_and_heartbeat(app: web.Application) -> None:
    """Register, then heartbeat every ``heartbeat_interval_s`` with the lease the registration
    got; on failure retry with exponential backoff (logged). A heartbeat answered 404 (the
    coordinator forgot us, e.g. it restarted) or 403 (our lease is no longer the node id's)
    registers again. Beside it, the cache publisher (server/cache_events.py) posts the prefix
    cache's events under the current lease. Never raises: the node serves whether or not this
    works."""
    config = app[CONFIG]
    node = config.node
    assert node.coordinator_internal_url is not None
    base = node.coordinator_internal_url.rstrip("/")
    headers = {hdrs.CONTENT_TYPE: MESSAGE_CONTENT_TYPE}
    if config.server.node_token:
        headers[hdrs.AUTHORIZATION] = f"Bearer {config.server.node_token}"
    timeout = aiohttp.ClientTimeout(total=max(5.0, node.heartbeat_interval_s))
    publisher = app.get(PUBLISHER)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        publishing = None
        if publisher is not None:
            publishing = asyncio.create_task(publisher.run(session, base), name="cache-events")
        try:
            await _heartbeats(app, session, base, publisher)
        finally:
            if publishing is not None:
                publishing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await publishing


async def _heartbeats(
    app: web.Application,
    session: aiohttp.ClientSession,
    base: str,
    publisher: CachePublisher | None,
) -> None:
    load, registration, node = app[LOAD], app[REGISTRATION], app[NODE_CONFIG]
    lease: NodeLease | None = None
    backoff_s = node.heartbeat_interval_s
    while True:
        try:
            if lease is not None:
                beat = NodeHeartbeat(
                    node_id=lease.node_id,
                    load=load(),
                    lease_id=lease.lease_id,
                )
                async with session.post(f"{base}/internal/heartbeat", data=encode(beat)) as r:
                    if r.status in (403, 404):
                        logger.warning(
                            "coordinator %s no longer holds this node's lease (%d); registering",
                            base,
                            r.status,
                        )
                        lease = None
                        if publisher is not None:
                            publisher.new_lease(None)
                        continue
                    r.raise_for_status()
            else:
                message = msgspec.structs.replace(registration, load=load())
                async with session.post(f"{base}/internal/register", data=encode(message)) as r:
                    r.raise_for_status()
                    lease = decode(await r.read(), NodeLease)
                logger.info("registered as %r with coordinator %s", lease.node_id, base)
                if publisher is not None:
                    publisher.new_lease(lease)
            backoff_s = node.heartbeat_interval_s
            await asyncio.sleep(node.heartbeat_interval_s)
        except Exception as e:
            # Any failure (network, coordinator, a bug here) is retried, never fatal.
            action = "heartbeat to" if lease is not None else "registration with"
            logger.warning(
                "%s coordinator %s failed (%s); retrying in %.1f s",
                action,
                base,
                describe_failure(e),
                backoff_s,
                exc_info=not isinstance(
                    e, aiohttp.ClientError | TimeoutError | msgspec.DecodeError
                ),
            )
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, _MAX_RETRY_S)


def describe_failure(e: Exception) -> str:
    """What went wrong, without the request: the repr of aiohttp's ClientResponseError carries
    the request's headers, the bearer token among them."""
    if isinstance(e, aiohttp.ClientResponseError):
        return f"HTTP {e.status} {e.message}"
    return f"{type(e).__name__}: {e}"


def check_exposure(config: Config) -> None:
    """A node's /internal/* API runs prompts: bound beyond loopback, it needs the node token.
    Raises ValueError naming the keys."""
    if not is_loopback(config.node.host) and not config.server.node_token:
        raise ValueError(
            f"node.host = {config.node.host!r} is not a loopback address: set server.node_token "
            "(DEEPINFER_SERVER_NODE_TOKEN, the coordinator's too) so that only the coordinator "
            "can use this node, or bind it to 127.0.0.1"
        )


# -- `deepinfer node` --------------------------------------------------------------------------


# What `deepinfer node` reads: the engine's sections, [node], and the model name it registers.
NODE_USES = (
    *ENGINE_USES,
    "node",
    "kv_transfer",
    "metrics",
    "server.served_model_name",
    "server.node_token",
    "server.metrics_key",
)


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per config key the node reads (deepinfer/flags.py)."""
    add_config_flags(parser, NODE_USES)


def run_node(ns: argparse.Namespace, config: Config) -> int:
    """Load the engine, serve on node.host:node.port (uvloop) until SIGTERM/SIGINT, drain."""
    import uvloop

    check_exposure(config)
    return uvloop.run(_serve_node(config))


async def load_engine(config: Config) -> AsyncEngine:
    """Load the model (seconds to minutes) off the event loop, so that a signal still ends the
    process meanwhile, and wrap it for the loop (used by `node` and `serve`)."""
    from deepinfer.engine.llm_engine import LLMEngine

    parallel = config.parallel
    if parallel.data_parallel_size > 1 and not parallel.data_parallel_master_port:
        raise ValueError(
            "a node that is one of several ranks needs parallel.data_parallel_master_port (the "
            "ranks' rendezvous; `serve --data-parallel-size N` picks one for its ranks)"
        )
    systemd.status("loading the model")
    llm_engine = await asyncio.get_running_loop().run_in_executor(None, LLMEngine, config)
    return AsyncEngine(llm_engine, max_step_s=config.node.max_step_s)


async def _serve_node(config: Config) -> int:
    if config.node.role == "encode":
        from deepinfer.server.encode_node import serve_encode_node

        return await serve_encode_node(config)
    loop = asyncio.get_running_loop()
    sock = listen.bind(config.node.host, config.node.port, "node")  # before the weights load
    engine = await load_engine(config)
    app = create_node_app(engine, config)
    runner = app_runner(app, handler_cancellation=True, shutdown_timeout=5.0)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    grouped = engine.engine.lockstep is not None
    watcher = None
    if grouped:
        watcher = asyncio.create_task(_leave_a_broken_group(engine, config.node, stop))
    logger.info("node %r serving on %s", app[REGISTRATION].node_id, app[REGISTRATION].url)
    systemd.ready()
    systemd.status(f"serving on {app[REGISTRATION].url}")
    # A rank steps on, placeholders only, until every rank of its instance has drained.
    stop_timeout_s = config.node.drain_timeout_s + 10.0 if grouped else 10.0
    try:
        # A stuck engine step stops the pings, and systemd restarts the node.
        async with systemd.watchdog(lambda: engine.is_turning):
            await stop.wait()
            systemd.stopping()
            systemd.status(f"draining: in-flight requests get {config.node.drain_timeout_s:.0f} s")
            logger.info(
                "stopping: no new connections; in-flight requests get %.0f s",
                config.node.drain_timeout_s,
            )
            await site.stop()
            await engine.drain(config.node.drain_timeout_s)
            # Aborts what is left, so the handlers end before the runner waits.
            await engine.stop(timeout_s=stop_timeout_s)
    finally:
        if watcher is not None:
            watcher.cancel()
        await runner.cleanup()
    logger.info("node %r stopped", app[REGISTRATION].node_id)
    return 1 if engine.is_broken else 0


async def _leave_a_broken_group(engine: AsyncEngine, node: NodeConfig, stop: asyncio.Event) -> None:
    """A rank whose group ended (a peer died or failed) cannot serve again: once a heartbeat
    has told the coordinator (its engine is no longer healthy), the node stops with status 1, so
    that its unit's restart brings the instance's ranks back together."""
    while not engine.is_broken:
        await asyncio.sleep(0.2)
    logger.error("the rank group ended: stopping after one heartbeat (exit status 1)")
    await asyncio.sleep(node.heartbeat_interval_s)
    stop.set()
