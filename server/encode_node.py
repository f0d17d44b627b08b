"""An encode node (`deepinfer node --role encode`): the vision tower alone, for other nodes.

    POST /internal/encode   msgpack EncodeRequest -> stream of frames: Reserved (the images are
                            queued; the request's node joins the pair), Encoded (embeddings
                            ready: the coordinator tells that node to collect), HandedOff (it
                            has them); a StreamError if it fails (server/image_transfer.py)
    GET  /health, /ready, /metrics   as a node's (server/node.py)

Images of requests that arrive together run through the tower together (AsyncImageEncoder, up
to ``node.encode_batch_images``); its embeddings cache (``cache.image_embedding_mib``, keyed by
the images' digests) encodes a repeated image once. The node registers with the coordinator as
role "encode"; the coordinator sends it the images of requests for the model it serves
(server/encoding.py) and encodes on the serving nodes themselves while none is in rotation.
``DEEPINFER_TEST_ENCODE_PAUSE_S`` (tests only) pauses this long before each run of the tower.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from deepinfer.config import Config
from deepinfer.engine.image_encoder import AsyncImageEncoder, ImageEncodeEngine
from deepinfer.server import listen, systemd
from deepinfer.server.access_log import app_runner
from deepinfer.server.image_transfer import encode_frames
from deepinfer.server.kv_transfer import KVTransfers
from deepinfer.server.node import (
    CONFIG,
    LOAD,
    METRICS,
    NODE_CONFIG,
    REGISTRATION,
    TRANSFERS,
    check_token,
    error_response,
    health,
    metrics_text,
    node_identity,
    registration_ctx,
    served_model_name,
    stream_frames,
    transfers_ctx,
)
from deepinfer.server.node_metrics import NodeMetrics
from deepinfer.server.protocol import EncodeRequest, NodeLoad, NodeRegistration, decode

logger = logging.getLogger(__name__)

ENCODER = web.AppKey("encoder", AsyncImageEncoder)

_PAUSE_ENV = "DEEPINFER_TEST_ENCODE_PAUSE_S"  # tests only: a pause before each tower run
_MAX_BODY_BYTES = 256 * 2**20  # a request's images: server.max_request_image_bytes and more


def create_encode_app(encoder: AsyncImageEncoder, config: Config) -> web.Application:
    """The encode node's app; its cleanup_ctx starts and stops ``encoder`` (and registration
    when ``node.coordinator_internal_url`` is set)."""
    node_id, url = node_identity(config.node)
    model_name = served_model_name(config)
    max_model_len = encoder.engine.max_model_len

    def load() -> NodeLoad:
        now = encoder.load()
        return NodeLoad(
            num_running=now.num_running,
            num_waiting=now.num_waiting,
            is_healthy=encoder.is_turning,
        )

    metrics = NodeMetrics(
        node_id, model_name, max_model_len, load, export_vllm_names=config.metrics.export_vllm_names
    )
    metrics.watch_images(encoder.engine.stats)
    app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[check_token])
    app[ENCODER] = encoder
    app[CONFIG] = config
    app[NODE_CONFIG] = config.node
    app[METRICS] = metrics
    app[LOAD] = load
    app[REGISTRATION] = NodeRegistration(
        node_id=node_id,
        url=url,
        role="encode",
        model=model_name,
        max_model_len=max_model_len,
        max_num_seqs=config.node.encode_batch_images,
    )
    observer = metrics.watch_transfers()
    app[TRANSFERS] = KVTransfers(config.kv_transfer, True, observer, encoder.engine.device)
    app.cleanup_ctx.append(_encoder_ctx)
    app.cleanup_ctx.append(transfers_ctx)
    app.cleanup_ctx.append(registration_ctx)
    app.add_routes(
        [
            web.post("/internal/encode", encode),
            web.get("/health", health),
            web.get("/ready", ready),
            web.get("/metrics", metrics_text),
        ]
    )
    return app


async def encode(request: web.Request) -> web.StreamResponse:
    try:
        message = decode(await request.read(), EncodeRequest)
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(413, "", e.text or "request body too large")
    except msgspec.DecodeError as e:
        return error_response(400, "", str(e))
    frames = encode_frames(request.app[ENCODER], request.app[TRANSFERS], message)
    return await stream_frames(request, message.request_id, frames)


async def ready(request: web.Request) -> web.Response:
    if not request.app[ENCODER].is_turning:
        return web.Response(status=503, text="encoder not running\n")
    return web.Response(text="ready\n")


async def _encoder_ctx(app: web.Application) -> AsyncIterator[None]:
    app[ENCODER].start()
    yield
    await app[ENCODER].stop()


async def serve_encode_node(config: Config) -> int:
    """Load the tower, serve on node.host:node.port until SIGTERM/SIGINT; in-flight requests
    get ``node.drain_timeout_s`` to finish."""
    loop = asyncio.get_running_loop()
    sock = listen.bind(config.node.host, config.node.port, "node")  # before the weights load
    systemd.status("loading the vision tower")
    engine = await loop.run_in_executor(None, ImageEncodeEngine, config)
    pause_s = float(os.environ.get(_PAUSE_ENV, "0") or 0)
    encoder = AsyncImageEncoder(engine, config.node.encode_batch_images, pause_s)
    app = create_encode_app(encoder, config)
    runner = app_runner(
        app, handler_cancellation=True, shutdown_timeout=config.node.drain_timeout_s
    )
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    logger.info("encode node %r serving on %s", app[REGISTRATION].node_id, app[REGISTRATION].url)
    systemd.ready()
    systemd.status(f"encoding on {app[REGISTRATION].url}")
    try:
        async with systemd.watchdog(lambda: encoder.is_turning):
            await stop.wait()
            systemd.stopping()
            logger.info("stopping: no new connections; in-flight requests get %.0f s",
                        config.node.drain_timeout_s)  # fmt: skip
            await site.stop()
    finally:
        await runner.cleanup()  # waits for the handlers (the drain), then stops the encoder
    logger.info("encode node %r stopped", app[REGISTRATION].node_id)
    return 0
