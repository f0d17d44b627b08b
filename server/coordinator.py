"""The coordinator: DeepInfer's public HTTP API (`deepinfer coordinator`).

    client ──HTTP/SSE──▶ coordinator app ──NodeBackend (server/routing.py)──▶ nodes
                          error_middleware → auth_middleware → handler
                          handler: parse → convert + encode (worker thread) → admit → route
                                   → stream (deepseek-recipe StreamProcessor) → SSE / JSON

Routes (one table, ``_routes``): the OpenAI, Responses and Anthropic APIs under /v1, health and
readiness, Prometheus metrics, and the nodes' /internal/register and /internal/heartbeat.
Soft state only: the node registry (heartbeats), the admission queue, the metrics. Background
work runs in ``cleanup_ctx``: the HTTP session for node clients and the heartbeat reaper.
``serve_coordinator`` runs an app until SIGTERM/SIGINT, then drains it (stop admitting, let
in-flight streams finish up to ``server.drain_timeout_s``, abort the rest) and returns 0.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import signal
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import aiohttp
import msgspec
from aiohttp import web

from deepinfer.config import Config, ServerConfig
from deepinfer.flags import add_config_flags
from deepinfer.server import listen, systemd
from deepinfer.server.access_log import app_runner
from deepinfer.server.admission import AdmissionController
from deepinfer.server.anthropic_api import AnthropicApi
from deepinfer.server.completions import CompletionsApi
from deepinfer.server.conversion import Frontend
from deepinfer.server.errors import ApiError, Handler, error_middleware
from deepinfer.server.metrics import CONTENT_TYPE, CoordinatorMetrics
from deepinfer.server.openai_api import OpenAIApi
from deepinfer.server.protocol import NodeHeartbeat, NodeRegistration
from deepinfer.server.registry import BackendFactory, NodeEntry, NodeRegistry, UnknownNodeError
from deepinfer.server.routing import NodeBackend, RoutingPolicy
from deepinfer.server.service import CoordinatorService
from deepinfer.tokenizer import tokenizer_json

logger = logging.getLogger(__name__)

CONFIG = web.AppKey("config", ServerConfig)
FRONTEND = web.AppKey("frontend", Frontend)
REGISTRY = web.AppKey("registry", NodeRegistry)
SERVICE = web.AppKey("service", CoordinatorService)
METRICS = web.AppKey("metrics", CoordinatorMetrics)
HTTP_SESSION = web.AppKey("http_session", aiohttp.ClientSession)

_DEFAULT_SERVED_MODEL_NAME = "deepinfer-tiny"  # the built-in model's name
_M = TypeVar("_M", NodeRegistration, NodeHeartbeat)


def create_coordinator_app(
    config: ServerConfig,
    *,
    tokenizer_path: str | Path,
    served_model_name: str,
    model_type: str = "deepseek_v4",
    backends: Sequence[NodeBackend] = (),
    max_model_len: int | None = None,
    backend_factory: BackendFactory | None = None,
    policy: RoutingPolicy | None = None,
    export_vllm_names: bool = True,
) -> web.Application:
    """The coordinator's aiohttp app.

    ``backends`` are static nodes (e.g. ``deepinfer serve``'s in-process node), always in
    rotation, with context limit ``max_model_len``. Nodes may also register over HTTP; their
    backends come from ``backend_factory(url)`` (default: ``NodeClient`` with
    ``config.node_token`` on a shared session). ``policy`` picks a node per request (default:
    least loaded). ``model_type`` is the checkpoint's (``deepseek_v4`` | ``deepseek_v41``).
    ``export_vllm_names``: ``metrics.export_vllm_names``.
    """
    if backends and max_model_len is None:
        raise ValueError("max_model_len is required with static backends")
    app = web.Application(
        middlewares=[error_middleware, _auth_middleware], client_max_size=config.max_body_bytes
    )
    frontend = Frontend(
        tokenizer_path,
        served_model_name,
        model_type=model_type,
        default_thinking_mode=config.default_thinking_mode,
        image_url_allowlist=config.image_url_allowlist,
    )
    registry = NodeRegistry(
        config.heartbeat_timeout_s, backend_factory or _node_client_factory(app, config), policy
    )
    for i, backend in enumerate(backends):
        assert max_model_len is not None
        registry.add_static(f"static-{i}", backend, max_model_len)
    admission = AdmissionController(
        config.max_running_requests,
        config.max_queued_requests,
        config.max_queued_prompt_tokens,
        config.retry_after_s,
    )
    metrics = CoordinatorMetrics(served_model_name, export_vllm_names=export_vllm_names)
    metrics.bind_gauges(
        lambda: admission.num_running,
        lambda: admission.num_waiting,
        lambda: len(registry.ready_nodes()),
    )
    service = CoordinatorService(registry, admission, metrics)
    app[CONFIG] = config
    app[FRONTEND] = frontend
    app[REGISTRY] = registry
    app[SERVICE] = service
    app[METRICS] = metrics
    timeout = config.request_timeout_s
    app.add_routes(
        _routes(
            OpenAIApi(frontend, service, timeout),
            CompletionsApi(frontend, service, timeout),
            AnthropicApi(frontend, service, timeout),
        )
    )
    app.cleanup_ctx.append(_http_session_ctx)
    app.cleanup_ctx.append(_heartbeat_reaper_ctx)
    return app


def _routes(openai: OpenAIApi, completions: CompletionsApi, anthropic: AnthropicApi) -> list:
    return [
        web.post("/v1/chat/completions", openai.chat_completions),
        web.post("/v1/responses", openai.responses),
        web.post("/v1/completions", completions.completions),
        web.post("/v1/messages", anthropic.messages),
        web.post("/v1/messages/count_tokens", anthropic.count_tokens),
        web.get("/v1/models", openai.models),
        web.get("/health", _health),
        web.get("/ready", _ready),
        web.get("/metrics", _metrics),
        web.post("/internal/register", _register),
        web.post("/internal/heartbeat", _heartbeat),
    ]


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


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """/v1/* needs one of ``server.api_keys`` (when set); /internal/* needs the node token."""
    config = request.app[CONFIG]
    if request.path.startswith("/v1/") and config.api_keys:
        if not _key_matches(_presented_key(request), config.api_keys):
            raise ApiError(
                401,
                "Authentication failed: a valid API key is required "
                "(Authorization: Bearer <key> or x-api-key: <key>)",
                code="invalid_api_key",
            )
    elif (
        request.path.startswith("/internal/")
        and config.node_token
        and not _key_matches(_presented_key(request), [config.node_token])
    ):
        raise ApiError(401, "Authentication failed: wrong or missing node token")
    return await handler(request)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    """200 once a node is in rotation and while not draining; load balancers route on it.
    ``nodes_not_ready`` says why each registered node out of rotation is not used."""
    service = request.app[SERVICE]
    ready = service.registry.ready_nodes()
    ready_ids = {n.node_id for n in ready}
    nodes = service.registry.nodes
    not_ready = {n.node_id: _why_not_ready(n) for n in nodes if n.node_id not in ready_ids}
    body = {"num_ready_nodes": len(ready), "nodes_not_ready": not_ready}
    if service.admission.is_draining:
        return web.json_response({"status": "draining", **body}, status=503)
    if not ready:
        return web.json_response({"status": "no node ready", **body}, status=503)
    return web.json_response({"status": "ready", **body})


def _why_not_ready(node: NodeEntry) -> str:
    if node.role != "mixed":
        return f"role {node.role}: no traffic until prefill/decode disaggregation lands"
    if not node.is_ready:
        return "missed heartbeats"
    return "draining"


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


# ---- internal: node registration and heartbeats ----------------------------------------------


async def _decode_node_message(request: web.Request, kind: type[_M]) -> _M:
    """msgpack (the nodes' encoding, server/protocol.py) or JSON, by Content-Type."""
    raw = await request.read()
    try:
        if request.content_type == "application/json":
            return msgspec.json.decode(raw, type=kind)
        return msgspec.msgpack.decode(raw, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ApiError(400, f"Invalid {kind.__name__}: {e}") from None


async def _register(request: web.Request) -> web.Response:
    """Refuse a node of another model (409); accept a prefill/decode one with a warning: it
    gets no traffic until prefill/decode disaggregation lands, and /ready says so."""
    registration = await _decode_node_message(request, NodeRegistration)
    served = request.app[FRONTEND].served_model_name
    if registration.model and registration.model != served:
        message = (
            f"node {registration.node_id} serves {registration.model!r} but this coordinator "
            f"serves {served!r}: refused (set the node's server.served_model_name)"
        )
        logger.warning("%s", message)
        raise ApiError(409, message)
    if registration.role != "mixed":
        logger.warning(
            "node %s has role %r: registered, but it gets no traffic until prefill/decode "
            "disaggregation lands (run it with --role mixed)",
            registration.node_id,
            registration.role,
        )
    try:
        request.app[REGISTRY].register(registration)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    timeout = request.app[CONFIG].heartbeat_timeout_s
    return web.json_response({"node_id": registration.node_id, "heartbeat_timeout_s": timeout})


async def _heartbeat(request: web.Request) -> web.Response:
    heartbeat = await _decode_node_message(request, NodeHeartbeat)
    try:
        request.app[REGISTRY].heartbeat(heartbeat)
    except UnknownNodeError:
        raise ApiError(404, f"Unknown node {heartbeat.node_id!r}; register first") from None
    return web.json_response({"node_id": heartbeat.node_id})


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


async def _heartbeat_reaper_ctx(app: web.Application) -> AsyncIterator[None]:
    registry = app[REGISTRY]

    async def reap() -> None:
        while True:
            await asyncio.sleep(registry.heartbeat_timeout_s / 4)
            registry.expire()

    task = asyncio.get_running_loop().create_task(reap())
    yield
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        logger.debug("heartbeat reaper stopped")


# ---- running: `deepinfer coordinator` -----------------------------------------------------------


async def serve_coordinator(
    app: web.Application,
    host: str,
    port: int,
    *,
    sock: socket.socket | None = None,
    is_healthy: Callable[[], bool] = lambda: True,
) -> int:
    """Serve ``app`` on ``sock`` (bound to host:port; None: bind it here) until SIGTERM or
    SIGINT, then drain it; returns the exit code (0).

    Under systemd it reports readiness, stopping and status, and pings the watchdog while
    ``is_healthy()`` (the event loop turning is health enough for a coordinator alone)."""
    sock = sock or listen.bind(host, port, "server")
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # request on its node even while it waits for its first token.
    runner = app_runner(app, handler_cancellation=True)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logger.info(
        "coordinator serving %s on http://%s:%d", app[FRONTEND].served_model_name, host, port
    )
    systemd.ready()
    systemd.status(f"serving {app[FRONTEND].served_model_name} on http://{host}:{port}")
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
        await runner.cleanup()
    return 0


# What `deepinfer coordinator` reads: [server], and of [model] what names and limits the model.
COORDINATOR_USES = (
    "server",
    "metrics",
    "log",
    "model.path",
    "model.tokenizer",
    "model.max_model_len",
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


def run_coordinator(ns: argparse.Namespace, config: Config) -> int:
    import uvloop

    model_dir = Path(config.model.path) if config.model.path else None
    checkpoint = _read_checkpoint_config(model_dir)
    tokenizer_path = tokenizer_json(model_dir, config.model.tokenizer)
    served = config.server.served_model_name or (
        model_dir.name if model_dir else _DEFAULT_SERVED_MODEL_NAME
    )
    max_model_len = config.model.max_model_len or checkpoint.get("max_position_embeddings")
    if ns.node and max_model_len is None:
        raise ValueError("--node needs the context limit: give --max-model-len or --model")
    return uvloop.run(_run(config, ns.node, tokenizer_path, served, checkpoint, max_model_len))


async def _run(
    config: Config,
    node_urls: list[str],
    tokenizer_path: Path,
    served: str,
    checkpoint: dict,
    max_model_len: int | None,
) -> int:
    from deepinfer.server.node_client import NodeClient

    server = config.server
    backends = [NodeClient(url, token=server.node_token) for url in node_urls]
    app = create_coordinator_app(
        server,
        tokenizer_path=tokenizer_path,
        served_model_name=served,
        model_type=checkpoint.get("model_type", "deepseek_v4"),
        backends=backends,
        max_model_len=max_model_len,
        export_vllm_names=config.metrics.export_vllm_names,
    )
    try:
        return await serve_coordinator(app, server.host, server.port)
    finally:
        for backend in backends:
            await backend.close()  # each owns its HTTP session


def _read_checkpoint_config(model_dir: Path | None) -> dict:
    if model_dir is None:
        return {}
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (--model must be a checkpoint folder)")
    return json.loads(path.read_text(encoding="utf-8"))
