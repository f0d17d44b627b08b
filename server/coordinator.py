"""The coordinator: DeepInfer's public HTTP API (`deepinfer coordinator`).

    client ──HTTP/SSE──▶ public app (server.host:port) ──NodeBackend (server/routing.py)──▶ nodes
                          error_middleware → auth (API keys) → handler
                          handler: parse → prepare (preparation pool) → admit → route
                                   → stream (deepseek-recipe StreamProcessor) → SSE / JSON
    node ──msgpack──▶ internal app (server.internal_host:internal_port)
                          error_middleware → auth (node token) → /internal/register, /heartbeat,
                          /cache_events, /cache_snapshot (the router's cache index)

Two apps on two listeners, sharing one registry, service and metrics: the public one serves the
OpenAI, Responses and Anthropic APIs under /v1 and vLLM's /tokenize, /detokenize, /version and
/ping; the internal one is the nodes' control plane and never answers on the public port (there
/internal/* is a 404). Both serve /health, /ready and /metrics, the public one only while
``server.public_observability``; ``server.metrics_key`` guards /metrics on both. Soft state
only: the node registry (heartbeats), the admission queue, the stored Responses, the metrics.
Background work runs in ``cleanup_ctx``: the HTTP session for node clients, the node monitor
(heartbeat expiry, probes), the preparation pool. ``serve_coordinator`` runs both apps until
SIGTERM/SIGINT, then drains (stop admitting, let in-flight streams finish up to
``server.drain_timeout_s``, abort the rest) and returns 0.

One file of ~630 lines: it assembles both apps (routes, middlewares, start-up and shutdown of
the registry, service and node clients); each handler's work lives in the modules it calls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import importlib.metadata
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import aiohttp
import msgspec
from aiohttp import web

from deepinfer.config import Config, RoutingConfig, SchedulerConfig, ServerConfig
from deepinfer.flags import add_config_flags
from deepinfer.model.families import image_expansion, model_type_of, read_config
from deepinfer.server import listen, systemd
from deepinfer.server.access_log import app_runner
from deepinfer.server.admission import AdmissionController
from deepinfer.server.anthropic_api import AnthropicApi
from deepinfer.server.completions import CompletionsApi
from deepinfer.server.conversion import Frontend
from deepinfer.server.errors import ApiError, Handler, error_middleware
from deepinfer.server.images import ImageLimits
from deepinfer.server.metrics import CONTENT_TYPE, CoordinatorMetrics
from deepinfer.server.openai_api import OpenAIApi
from deepinfer.server.preparation import PreparationPool, read_body
from deepinfer.server.protocol import (
    MESSAGE_CONTENT_TYPE,
    CacheEventBatch,
    CacheSnapshot,
    CacheSync,
    NodeHeartbeat,
    NodeLease,
    NodeRegistration,
)
from deepinfer.server.registry import (
    BackendFactory,
    IdentityConflictError,
    NodeRegistry,
    RegistryFullError,
    UnknownNodeError,
    WrongLeaseError,
)
from deepinfer.server.response_store import ResponseStore
from deepinfer.server.routing import NodeBackend, NodeEntry, RoutingPolicy, make_policy
from deepinfer.server.service import CoordinatorService
from deepinfer.server.tokenization import TokenizationApi
from deepinfer.tokenizer import tokenizer_json

logger = logging.getLogger(__name__)

CONFIG = web.AppKey("config", ServerConfig)
FRONTEND = web.AppKey("frontend", Frontend)
REGISTRY = web.AppKey("registry", NodeRegistry)
SERVICE = web.AppKey("service", CoordinatorService)
METRICS = web.AppKey("metrics", CoordinatorMetrics)
HTTP_SESSION = web.AppKey("http_session", aiohttp.ClientSession)
INTERNAL_APP = web.AppKey("internal_app", web.Application)

_DEFAULT_SERVED_MODEL_NAME = "deepinfer-tiny"  # the built-in model's name
try:
    _VERSION = importlib.metadata.version("deepinfer")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
    _VERSION = "unknown"
_METRICS_PATHS = ("/metrics",)
_METRICS_KEY_MESSAGE = (
    "Authentication failed: a valid metrics key is required "
    "(Authorization: Bearer <server.metrics_key>)"
)
_MAX_NODE_MESSAGE_BYTES = 1 << 20  # a registration or heartbeat is a few hundred bytes
# A cache snapshot: ~9 bytes a block (some 7 million blocks).
_MAX_CACHE_MESSAGE_BYTES = 64 << 20
_M = TypeVar("_M", NodeRegistration, NodeHeartbeat, CacheEventBatch, CacheSnapshot)
_OTHER_ROLE = {"prefill": "decode", "decode": "prefill"}


def create_coordinator_app(
    config: ServerConfig,
    *,
    tokenizer_path: str | Path,
    served_model_name: str,
    model_type: str = "deepseek_v4",
    checkpoint: dict | None = None,
    backends: Sequence[NodeBackend] = (),
    roles: Sequence[str] = (),
    max_model_len: int | None = None,
    max_num_seqs: int = SchedulerConfig.max_num_seqs,
    backend_factory: BackendFactory | None = None,
    policy: RoutingPolicy | None = None,
    routing: RoutingConfig | None = None,
    observability: Sequence[web.RouteDef] = (),
    export_vllm_names: bool = True,
) -> web.Application:
    """The coordinator's public app; its internal app (the nodes' control plane) is
    ``app[INTERNAL_APP]``.

    ``backends`` are static nodes (e.g. ``deepinfer serve``'s in-process node), always in
    rotation, with context limit ``max_model_len`` and ``max_num_seqs`` requests at once each;
    ``roles`` their roles (mixed | prefill | decode | encode; default: all mixed).
    Nodes may also register on the internal app; their backends come from
    ``backend_factory(url)`` (default: ``NodeClient`` with ``config.node_token`` on a shared
    session). ``policy`` picks a node per request (default: ``routing``'s, [routing]).
    ``model_type`` is the checkpoint's (``deepseek_v4`` | ``deepseek_v41``); ``checkpoint`` its
    config.json when known (for the routing keys of prompts with images). ``observability``
    are more routes served beside /health, /ready and /metrics. ``export_vllm_names``:
    ``metrics.export_vllm_names``.
    """
    if backends and max_model_len is None:
        raise ValueError("max_model_len is required with static backends")
    app = web.Application(
        middlewares=[error_middleware, _public_auth_middleware],
        client_max_size=config.max_body_bytes,
    )
    frontend = Frontend(
        tokenizer_path,
        served_model_name,
        model_type=model_type,
        default_thinking_mode=config.default_thinking_mode,
        default_max_tokens=config.default_max_tokens,
        image_limits=ImageLimits.of(config),
        expand_images=image_expansion(checkpoint) if checkpoint else None,
    )
    registry = NodeRegistry(
        config.heartbeat_timeout_s,
        backend_factory or _node_client_factory(app, config),
        policy or make_policy(routing or RoutingConfig()),
        probe_timeout_s=max(config.node_probe_interval_s, 1.0),
        max_nodes=config.max_registered_nodes,
    )
    roles = list(roles) or ["mixed"] * len(backends)
    assert len(roles) == len(backends), "one role per static backend"
    for i, (backend, role) in enumerate(zip(backends, roles, strict=True)):
        assert max_model_len is not None
        registry.add_static(f"static-{i}", backend, max_model_len, max_num_seqs, role)
    admission = AdmissionController(
        config.max_running_requests,
        config.max_queued_requests,
        config.max_queued_prompt_tokens,
        config.retry_after_s,
        capacity=registry.max_num_seqs,
    )
    preparation = PreparationPool(
        admission,
        config.num_prepare_threads,
        config.max_preparing_bytes,
        config.max_body_bytes,
        config.body_read_timeout_s,
    )
    metrics = CoordinatorMetrics(served_model_name, export_vllm_names=export_vllm_names)
    registry.pair_observer = metrics.pair_request
    metrics.bind_router(registry.cache_index, registry.policy)
    metrics.bind_gauges(
        lambda: admission.num_running,
        lambda: admission.num_waiting,
        lambda: len(registry.serving_nodes()),
    )
    service = CoordinatorService(registry, admission, metrics, preparation)
    response_store = ResponseStore(int(config.response_store_mib * 2**20))
    app[CONFIG] = config
    app[FRONTEND] = frontend
    app[REGISTRY] = registry
    app[SERVICE] = service
    app[METRICS] = metrics
    timeout = config.request_timeout_s
    app.add_routes(
        _api_routes(
            OpenAIApi(frontend, service, timeout, response_store),
            CompletionsApi(frontend, service, timeout),
            AnthropicApi(frontend, service, timeout),
            TokenizationApi(frontend, service),
        )
    )
    observability_routes = [*_observability_routes(), *observability]
    if config.public_observability:
        app.add_routes(observability_routes)
    app[INTERNAL_APP] = _create_internal_app(app, observability_routes)
    app.cleanup_ctx.append(_http_session_ctx)
    app.cleanup_ctx.append(_node_monitor_ctx)
    app.cleanup_ctx.append(_preparation_ctx)
    return app


def _create_internal_app(
    public: web.Application, observability_routes: Sequence[web.RouteDef]
) -> web.Application:
    """The nodes' control plane, on the public app's registry, service and metrics."""
    internal = web.Application(
        middlewares=[error_middleware, _internal_auth_middleware],
        client_max_size=_MAX_CACHE_MESSAGE_BYTES,
    )
    internal[CONFIG] = public[CONFIG]
    internal[FRONTEND] = public[FRONTEND]
    internal[REGISTRY] = public[REGISTRY]
    internal[SERVICE] = public[SERVICE]
    internal[METRICS] = public[METRICS]
    internal.add_routes(
        [
            web.post("/internal/register", _register),
            web.post("/internal/heartbeat", _heartbeat),
            web.post("/internal/cache_events", _cache_events),
            web.post("/internal/cache_snapshot", _cache_snapshot),
            *observability_routes,
        ]
    )
    return internal


def _api_routes(
    openai: OpenAIApi,
    completions: CompletionsApi,
    anthropic: AnthropicApi,
    tokenization: TokenizationApi,
) -> list:
    return [
        web.post("/v1/chat/completions", openai.chat_completions),
        web.post("/v1/responses", openai.responses),
        web.get("/v1/responses/{response_id}", openai.get_response),
        web.post("/v1/completions", completions.completions),
        web.post("/v1/messages", anthropic.messages),
        web.post("/v1/messages/count_tokens", anthropic.count_tokens),
        web.get("/v1/models", openai.models),
        web.get("/v1/models/{model:.+}", openai.model),
        web.post("/tokenize", tokenization.tokenize),
        web.post("/detokenize", tokenization.detokenize),
        web.get("/version", _version),
        web.get("/ping", _ping),
        web.post("/ping", _ping),
    ]


def _observability_routes() -> list[web.RouteDef]:
    return [web.get("/health", _health), web.get("/ready", _ready), web.get("/metrics", _metrics)]


# ---- middleware, health, metrics -------------------------------------------------------------


def _presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def _key_matches(presented: str | None, accepted: Sequence[str]) -> bool:
    if presented is None:
        return False
    # Constant-time comparison against every key, so timing does not reveal a prefix.
    matches = [hmac.compare_digest(presented.encode(), key.encode()) for key in accepted]
    return any(matches)


def _require_key(request: web.Request, accepted: Sequence[str], error: ApiError) -> None:
    """Raises ``error`` unless the request presents one of ``accepted`` (none: open)."""
    if accepted and not _key_matches(_presented_key(request), accepted):
        raise error


def _metrics_keys(config: ServerConfig) -> tuple[str, ...]:
    return (config.metrics_key,) if config.metrics_key else ()


def _auth_middleware(
    prefixes: tuple[str, ...],
    accepted: Callable[[ServerConfig], Sequence[str]],
    message: str,
    code: str | None,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """Paths under ``prefixes`` need one of ``accepted(config)`` (when there are any); /metrics
    needs the metrics key (when set)."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        config = request.app[CONFIG]
        if request.path in _METRICS_PATHS:
            _require_key(request, _metrics_keys(config), ApiError(401, _METRICS_KEY_MESSAGE))
        elif request.path.startswith(prefixes):
            _require_key(request, accepted(config), ApiError(401, message, code=code))
        return await handler(request)

    return check


# /tokenize and /detokenize do a client's work outside /v1, so they need a client key too.
_public_auth_middleware = _auth_middleware(
    ("/v1/", "/tokenize", "/detokenize"),
    lambda config: config.api_keys,
    "Authentication failed: a valid API key is required "
    "(Authorization: Bearer <key> or x-api-key: <key>)",
    "invalid_api_key",
)
_internal_auth_middleware = _auth_middleware(
    ("/internal/",),
    lambda config: (config.node_token,) if config.node_token else (),
    "Authentication failed: wrong or missing node token",
    None,
)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ping(request: web.Request) -> web.Response:
    """vLLM's (and SageMaker's) liveness probe: 200, no body."""
    return web.Response()


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": _VERSION})


async def _ready(request: web.Request) -> web.Response:
    """200 once a node is in rotation and while not draining; load balancers route on it.
    ``nodes_not_ready`` says why each registered node out of rotation is not used."""
    service = request.app[SERVICE]
    ready = service.registry.serving_nodes()
    ready_ids = {n.node_id for n in ready}
    nodes = service.registry.nodes
    encoders = {n.node_id for n in service.registry.ready_nodes() if n.role == "encode"}
    not_ready = {
        n.node_id: _why_not_ready(n)
        for n in nodes
        if n.node_id not in ready_ids and n.node_id not in encoders
    }
    instances_down = service.registry.instances_not_ready()
    for node in nodes:
        if node.node_id in not_ready and node.is_in_rotation and node.instance in instances_down:
            not_ready[node.node_id] = f"instance {node.instance}: {instances_down[node.instance]}"
    body = {
        "num_ready_nodes": len(ready),
        "num_encode_nodes": len(encoders),
        "nodes_not_ready": not_ready,
    }
    if instances_down:
        body["instances_not_ready"] = instances_down
    if service.admission.is_draining:
        return web.json_response({"status": "draining", **body}, status=503)
    if not ready:
        return web.json_response({"status": "no node ready", **body}, status=503)
    return web.json_response({"status": "ready", **body})


def _why_not_ready(node: NodeEntry) -> str:
    if node.is_in_rotation and node.role in _OTHER_ROLE:
        return f"role {node.role}: no {_OTHER_ROLE[node.role]} node is in rotation to pair with"
    if not node.is_ready:
        return "missed heartbeats"
    if not node.is_responsive:
        return "unreachable or not ready when last asked: probed until it answers"
    if not node.load.is_healthy:
        return "its engine failed (see the node's log)"
    return "draining"


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


# ---- internal: node registration and heartbeats ----------------------------------------------


def _is_json(request: web.Request) -> bool:
    return request.content_type == "application/json"


async def _decode_node_message(
    request: web.Request, kind: type[_M], max_bytes: int = _MAX_NODE_MESSAGE_BYTES
) -> _M:
    """msgpack (the nodes' encoding, server/protocol.py) or JSON, by Content-Type."""
    if (request.content_length or 0) > max_bytes:
        raise ApiError(413, f"A {kind.__name__} is at most {max_bytes} bytes")
    raw = await read_body(request, request.app[CONFIG].body_read_timeout_s)
    if len(raw) > max_bytes:
        raise ApiError(413, f"A {kind.__name__} is at most {max_bytes} bytes")
    try:
        if _is_json(request):
            return msgspec.json.decode(raw, type=kind)
        return msgspec.msgpack.decode(raw, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ApiError(400, f"Invalid {kind.__name__}: {e}") from None


def _node_reply(request: web.Request, message: msgspec.Struct) -> web.Response:
    """``message`` in the encoding the node spoke."""
    if _is_json(request):
        return web.Response(body=msgspec.json.encode(message), content_type="application/json")
    return web.Response(body=msgspec.msgpack.encode(message), content_type=MESSAGE_CONTENT_TYPE)


async def _register(request: web.Request) -> web.Response:
    """Refuse a node of another model (409). A prefill or decode node serves in pairs (with a
    node of the other role); /ready says when it has none."""
    registration = await _decode_node_message(request, NodeRegistration)
    served = request.app[FRONTEND].served_model_name
    if registration.model and registration.model != served:
        message = (
            f"node {registration.node_id} serves {registration.model!r} but this coordinator "
            f"serves {served!r}: refused (set the node's server.served_model_name)"
        )
        logger.warning("%s", message)
        raise ApiError(409, message)
    try:
        entry = request.app[REGISTRY].register(registration)
    except (IdentityConflictError, RegistryFullError, ValueError) as e:
        status = {IdentityConflictError: 409, RegistryFullError: 503}.get(type(e), 400)
        logger.warning(
            "registration of node %r (%s) from %s refused: %s",
            registration.node_id,
            registration.url,
            request.remote,
            e,
        )
        raise ApiError(status, f"Registration refused: {e}") from None
    timeout = request.app[CONFIG].heartbeat_timeout_s
    lease = NodeLease(node_id=entry.node_id, lease_id=entry.lease_id, heartbeat_timeout_s=timeout)
    return _node_reply(request, lease)


async def _heartbeat(request: web.Request) -> web.Response:
    heartbeat = await _decode_node_message(request, NodeHeartbeat)
    with _lease_errors(request, "heartbeat", heartbeat.node_id):
        request.app[REGISTRY].heartbeat(heartbeat)
    return web.json_response({"node_id": heartbeat.node_id})


async def _cache_events(request: web.Request) -> web.Response:
    """A node's cache events (server/cache_index.py): applied, or a snapshot asked for."""
    batch = await _decode_node_message(request, CacheEventBatch, _MAX_CACHE_MESSAGE_BYTES)
    registry = request.app[REGISTRY]
    with _lease_errors(request, "cache events", batch.node_id):
        registry.holder(batch.node_id, batch.lease_id)
    applied = registry.cache_index.apply(batch.node_id, batch.first_seq, batch.events)
    sync = CacheSync(needs_snapshot=True) if applied is None else CacheSync(applied_seq=applied)
    return _node_reply(request, sync)


async def _cache_snapshot(request: web.Request) -> web.Response:
    snapshot = await _decode_node_message(request, CacheSnapshot, _MAX_CACHE_MESSAGE_BYTES)
    registry = request.app[REGISTRY]
    with _lease_errors(request, "cache snapshot", snapshot.node_id):
        registry.holder(snapshot.node_id, snapshot.lease_id)
    if not registry.cache_index.load(snapshot.node_id, snapshot.seq, snapshot.held):
        raise ApiError(409, f"Node {snapshot.node_id!r} registered without a cache layout")
    return _node_reply(request, CacheSync(applied_seq=snapshot.seq))


@contextlib.contextmanager
def _lease_errors(request: web.Request, what: str, node_id: str) -> Iterator[None]:
    """A message from an unknown node is a 404 (register first), one without the node's
    current lease a 403."""
    try:
        yield
    except UnknownNodeError:
        raise ApiError(404, f"Unknown node {node_id!r}; register first") from None
    except WrongLeaseError:
        logger.warning(
            "%s for node %r from %s refused: not its registration's lease",
            what,
            node_id,
            request.remote,
        )
        raise ApiError(
            403, f"This {what} does not carry node {node_id!r}'s lease; register"
        ) from None


# ---- background work --------------------------------------------------------------------------


def _node_client_factory(app: web.Application, config: ServerConfig) -> BackendFactory:
    def make(url: str) -> NodeBackend:
        try:
            from deepinfer.server.node_client import NodeClient
        except ImportError as e:
            raise ValueError(f"cannot reach nodes over HTTP: {e}") from e
        return NodeClient(url, token=config.node_token, session=app[HTTP_SESSION])

    return make


async def _http_session_ctx(app: web.Application) -> AsyncIterator[None]:
    # No total timeout: a generate stream lasts as long as the request.
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=10))
    app[HTTP_SESSION] = session
    yield
    await app[SERVICE].wait_background()  # aborts still being sent
    await session.close()


async def _preparation_ctx(app: web.Application) -> AsyncIterator[None]:
    yield
    app[SERVICE].preparation.close()


async def _node_monitor_ctx(app: web.Application) -> AsyncIterator[None]:
    """Every ``server.node_probe_interval_s`` (or a quarter of the heartbeat timeout, if
    shorter): registered nodes whose heartbeats stopped leave rotation; static and unresponsive
    nodes are probed (out of rotation, or back in)."""
    config, registry = app[CONFIG], app[REGISTRY]
    interval = min(config.node_probe_interval_s, config.heartbeat_timeout_s / 4)

    async def monitor() -> None:
        while True:
            await asyncio.sleep(interval)
            registry.expire()
            await registry.probe()

    task = asyncio.get_running_loop().create_task(monitor(), name="deepinfer-node-monitor")
    yield
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        logger.debug("node monitor stopped")


# ---- running: `deepinfer coordinator` -----------------------------------------------------------


async def serve_coordinator(
    app: web.Application,
    *,
    sock: socket.socket | None = None,
    internal_sock: socket.socket | None = None,
    is_healthy: Callable[[], bool] = lambda: True,
) -> int:
    """Serve ``app`` on ``server.host:port`` and its internal app on
    ``server.internal_host:internal_port`` until SIGTERM or SIGINT, then drain; returns the exit
    code (0). ``sock`` / ``internal_sock``: those addresses bound already (before a model loads,
    so that a busy port fails at once); None: bound here.

    Under systemd it reports readiness, stopping and status, and pings the watchdog while
    ``is_healthy()`` (the event loop turning is health enough for a coordinator alone)."""
    config = app[CONFIG]
    sock = sock or listen.bind(config.host, config.port, "server")
    internal_sock = internal_sock or bind_internal(config)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # request on its node even while it waits for its first token.
    runner = app_runner(app, handler_cancellation=True)
    internal_runner = app_runner(app[INTERNAL_APP], handler_cancellation=True)
    await runner.setup()
    await internal_runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        await web.SockSite(internal_runner, internal_sock).start()
        name = app[FRONTEND].served_model_name
        where = f"http://{config.host}:{config.port}"
        internal = f"http://{config.internal_host}:{config.internal_port}"
        logger.info("coordinator serving %s on %s, nodes register on %s", name, where, internal)
        await _serve_until_signal(app, is_healthy, f"serving {name} on {where}")
    finally:
        await internal_runner.cleanup()
        await runner.cleanup()
    return 0


def bind_internal(config: ServerConfig) -> socket.socket:
    """The internal listener's socket, bound (server/listen.py)."""
    return listen.bind(config.internal_host, config.internal_port, "server", "internal_")


async def _serve_until_signal(
    app: web.Application, is_healthy: Callable[[], bool], status: str
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    systemd.ready()
    systemd.status(status)
    try:
        async with systemd.watchdog(is_healthy):
            await stop.wait()
            systemd.stopping()
            systemd.status(f"draining: in-flight requests get {app[CONFIG].drain_timeout_s:.0f} s")
            logger.info("shutting down: draining")
            drained = await app[SERVICE].drain(app[CONFIG].drain_timeout_s)
            logger.info("drain %s", "complete" if drained else "timed out; the rest was aborted")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


# What `deepinfer coordinator` reads: [server], and of [model] what names and limits the model.
COORDINATOR_USES = (
    "server",
    "routing",
    "metrics",
    "log",
    "model.path",
    "model.tokenizer",
    "model.max_model_len",
    "scheduler.max_num_seqs",  # what a static --node is taken to run at once
)


def add_coordinator_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per config key the coordinator reads (deepinfer/flags.py), and ``--node``."""
    add_config_flags(parser, COORDINATOR_USES)
    parser.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="URL",
        help="a node's internal API URL, always in rotation (repeatable); nodes may also register",
    )
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-node",
            action="append",
            default=[],
            metavar="URL",
            help=f"a {role} node's internal API URL (repeatable): prefill and decode nodes serve "
            "in pairs, each request's cache handed from one to the other",
        )
    parser.add_argument(
        "--encode-node",
        action="append",
        default=[],
        metavar="URL",
        help="an encode node's internal API URL (repeatable): it encodes requests' images for "
        "the nodes that run them",
    )


def run_coordinator(ns: argparse.Namespace, config: Config) -> int:
    import uvloop

    model_dir = Path(config.model.path) if config.model.path else None
    checkpoint = _read_checkpoint_config(model_dir)
    tokenizer_path = tokenizer_json(model_dir, config.model.tokenizer)
    served = config.server.served_model_name or (
        model_dir.name if model_dir else _DEFAULT_SERVED_MODEL_NAME
    )
    text = checkpoint.get("text_config") or checkpoint  # V4.1 nests the text model's keys
    max_model_len = config.model.max_model_len or text.get("max_position_embeddings")
    static = [(url, role) for role in ("mixed", "prefill", "decode", "encode")
              for url in getattr(ns, "node" if role == "mixed" else f"{role}_node")]  # fmt: skip
    if static and max_model_len is None:
        raise ValueError("static nodes need the context limit: give --max-model-len or --model")
    return uvloop.run(_run(config, static, tokenizer_path, served, checkpoint, max_model_len))


async def _run(
    config: Config,
    static: list[tuple[str, str]],
    tokenizer_path: Path,
    served: str,
    checkpoint: dict,
    max_model_len: int | None,
) -> int:
    from deepinfer.server.node_client import NodeClient

    server = config.server
    backends = [NodeClient(url, token=server.node_token) for url, _ in static]
    app = create_coordinator_app(
        server,
        tokenizer_path=tokenizer_path,
        served_model_name=served,
        model_type=model_type_of(checkpoint),
        checkpoint=checkpoint,
        backends=backends,
        roles=[role for _, role in static],
        max_model_len=max_model_len,
        export_vllm_names=config.metrics.export_vllm_names,
        routing=config.routing,
        # --node nodes are taken to run this config's [scheduler] max_num_seqs.
        max_num_seqs=config.scheduler.max_num_seqs,
    )
    try:
        return await serve_coordinator(app)
    finally:
        for backend in backends:
            await backend.close()  # each owns its HTTP session


def _read_checkpoint_config(model_dir: Path | None) -> dict:
    if model_dir is None:
        return {}
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (--model must be a checkpoint folder)")
    return read_config(path)
