"""`deepinfer serve`: the coordinator and one mixed node in one process (the embedded default;
with ``--data-parallel-size N``, the coordinator and N rank node processes: serve_ranks.py).

    HTTP client ──▶ coordinator app (public API, recipe, SSE) ──▶ LocalNode ──▶ AsyncEngine
                                                                  (no HTTP hop)   (engine thread)

LocalNode implements the coordinator's NodeBackend directly on the AsyncEngine, with the same
validation, deltas and errors as the HTTP node (both go through server/node_stream.py).
``/metrics`` holds the coordinator's and the node's series in one scrape (``component`` tells them
apart; server/metrics.py). The coordinator's internal listener runs too, so that remote nodes can
join the in-process one.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import msgspec
from aiohttp import web

from deepinfer.config import Config
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.flags import ENGINE_USES, add_config_flags
from deepinfer.model.families import DEFAULT_MODEL_TYPE, model_type_of, read_config
from deepinfer.server import listen
from deepinfer.server.node import load_engine, node_identity, observe_engine, served_model_name
from deepinfer.server.node_stream import sampling_params_of, token_deltas
from deepinfer.server.protocol import GenerateRequest, TokenDelta
from deepinfer.server.routing import NodeError

logger = logging.getLogger(__name__)


class LocalNode:
    """A NodeBackend over an AsyncEngine in this process."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        try:
            params = sampling_params_of(request)
        except (ValueError, msgspec.ValidationError) as e:
            raise NodeError(400, str(e)) from e
        async with contextlib.aclosing(token_deltas(self.engine, request, params)) as deltas:
            async for delta in deltas:
                yield delta

    async def abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.engine.abort(request_id)

    async def finish(self, request_id: str, stop_reason: int | str | None) -> None:
        self.engine.finish(request_id, stop_reason)

    async def ready(self) -> bool:
        return self.engine.is_turning and not self.engine.is_draining


def create_serve_app(
    engine: AsyncEngine, config: Config, *, tokenizer_path: Path | None = None
) -> web.Application:
    """The coordinator app with this process's engine as its only node. ``tokenizer_path``
    defaults to the model's (an engine built on a test double has none: pass one)."""
    from deepinfer.server.coordinator import METRICS as COORDINATOR_METRICS
    from deepinfer.server.coordinator import create_coordinator_app

    node_id, _ = node_identity(config.node)
    model_name = served_model_name(config)
    metrics = observe_engine(engine, config, node_id, model_name)
    if tokenizer_path is None:
        tokenizer = engine.engine.tokenizer
        assert tokenizer is not None, "serve needs a model with a tokenizer"
        tokenizer_path = tokenizer.path
    model_dir = engine.engine.model_dir
    model_type, checkpoint = DEFAULT_MODEL_TYPE, None
    if model_dir is not None and (model_dir / "config.json").is_file():
        checkpoint = read_config(model_dir)
        model_type = model_type_of(checkpoint)

    app = create_coordinator_app(
        config.server,
        tokenizer_path=tokenizer_path,
        served_model_name=model_name,
        model_type=model_type,
        checkpoint=checkpoint,
        backends=[LocalNode(engine)],
        max_model_len=engine.max_model_len,
        max_num_seqs=config.scheduler.max_num_seqs,
        export_vllm_names=config.metrics.export_vllm_names,
    )
    app[COORDINATOR_METRICS].parts.append(metrics)

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.stop()

    app.cleanup_ctx.append(engine_ctx)
    return app


# What `deepinfer serve` reads: the engine's sections, the public API's, and of [node] what
# its in-process node uses (it has no listener of its own). With --data-parallel-size N its rank
# nodes take the rest of [node] from the file or the environment (ports node.port + rank).
SERVE_USES = (
    *ENGINE_USES, "server", "routing", "metrics", "node.node_id", "node.max_step_s"
)  # fmt: skip


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per config key serve reads (deepinfer/flags.py)."""
    add_config_flags(parser, SERVE_USES)


def run_serve(ns: argparse.Namespace, config: Config) -> int:
    import uvloop

    return uvloop.run(_serve(config))


async def _serve(config: Config) -> int:
    from deepinfer.server.coordinator import bind_internal, serve_coordinator

    if config.parallel.data_parallel_size > 1:
        from deepinfer.server.serve_ranks import serve_ranks

        return await serve_ranks(config)

    # Both listeners are bound before the weights load: a busy port fails at once.
    sock = listen.bind(config.server.host, config.server.port, "server")
    internal_sock = bind_internal(config.server)
    engine = await load_engine(config)
    app = create_serve_app(engine, config)
    # The watchdog follows the in-process engine: a stuck step gets the unit restarted.
    return await serve_coordinator(
        app, sock=sock, internal_sock=internal_sock, is_healthy=lambda: engine.is_turning
    )
