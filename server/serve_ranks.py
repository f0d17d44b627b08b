"""`deepinfer serve --data-parallel-size N`: the coordinator here, each rank a node process.

    deepinfer serve (this process): public API + internal listener (the coordinator)
      ├─ deepinfer node, rank 0   ─┐ lock-step group (deepinfer/parallel/), rendezvous on a port
      ├─ deepinfer node, rank 1    │ picked here; each registers with the coordinator as rank r
      └─ ...                      ─┘ of instance "<address>:<port>", on port node.port + r

Each rank node gets this config as a file (mode 0600: it holds the node token), with its rank,
its port and the coordinator's internal URL filled in, and no DEEPINFER_* variables (the file
holds their resolved values). The coordinator routes to the instance only while every rank is
in rotation. SIGTERM: the coordinator drains first (the ranks finish what is in flight), then
every rank gets SIGTERM and they stop together. A rank that dies ends its instance: the others'
engines fail their requests and exit, and ``/ready`` names the instance; nothing restarts it
here (under systemd, the ranks' units restart; deploy/README.md).
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from deepinfer.config import SECTIONS, Config, env_var, to_toml
from deepinfer.model.families import model_type_of, read_config
from deepinfer.model.tiny import ensure_tiny_model
from deepinfer.parallel.group import with_rendezvous_port
from deepinfer.server import listen
from deepinfer.server.node import served_model_name
from deepinfer.tokenizer import tokenizer_json

logger = logging.getLogger(__name__)


class RankNodes:
    """This host's rank node processes of one instance."""

    def __init__(self, config: Config) -> None:
        parallel = config.parallel
        self.folder = Path(tempfile.mkdtemp(prefix="deepinfer-ranks-"))
        self.processes: list[subprocess.Popen] = []
        for i in range(parallel.num_local_ranks):
            rank = parallel.data_parallel_rank + i
            rank_config = dataclasses.replace(
                config,
                parallel=dataclasses.replace(parallel, data_parallel_rank=rank),
                node=dataclasses.replace(
                    config.node,
                    port=config.node.port + i,
                    node_id=config.node.node_id and f"{config.node.node_id}-rank{rank}",
                ),
            )
            path = self.folder / f"rank-{rank}.toml"
            path.touch(mode=0o600)
            path.write_text(to_toml(rank_config))
            command = [sys.executable, "-m", "deepinfer.cli", "node", "--config", str(path)]
            process = subprocess.Popen(
                command, env=_without_config_variables(), preexec_fn=_die_with_parent
            )
            logger.info(
                "rank %d: node process %d on port %d", rank, process.pid, config.node.port + i
            )
            self.processes.append(process)

    async def watch(self) -> None:
        """Log each rank node that exits while serving (its instance is down from then on)."""
        reported: set[int] = set()
        while len(reported) < len(self.processes):
            for process in self.processes:
                if process.pid not in reported and process.poll() is not None:
                    reported.add(process.pid)
                    logger.error(
                        "rank node %d exited with status %s: its instance is down until its "
                        "ranks are started again",
                        process.pid,
                        process.returncode,
                    )
            await asyncio.sleep(0.5)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM to every rank (they drain and stop together), SIGKILL past ``timeout_s``."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for process in self.processes:
            while process.poll() is None and loop.time() < deadline:
                await asyncio.sleep(0.1)
            if process.poll() is None:
                logger.error("rank node %d did not stop in %.0f s: killed", process.pid, timeout_s)
                process.kill()
                process.wait()
            logger.info("rank node %d exited with status %s", process.pid, process.returncode)
        for path in self.folder.iterdir():
            path.unlink()
        self.folder.rmdir()


def _without_config_variables() -> dict[str, str]:
    """This environment without DEEPINFER_<SECTION>_<KEY> variables (the file holds them)."""
    config_prefixes = tuple(env_var(section, "") for section in SECTIONS)
    return {k: v for k, v in os.environ.items() if not k.startswith(config_prefixes)}


def _die_with_parent() -> None:
    """Linux: the rank gets SIGTERM if this process dies (a kill -9 of serve leaves no ranks)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def rank_config(config: Config) -> Config:
    """What every rank runs: the checkpoint folder (the built-in one built here, once), the
    served name, a rendezvous port, and the coordinator's internal listener to register with."""
    model_path = config.model.path or str(ensure_tiny_model(config.model.tiny_model_seed))
    server = config.server
    host = "127.0.0.1" if server.internal_host in ("0.0.0.0", "::", "") else server.internal_host
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, path=model_path),
        server=dataclasses.replace(server, served_model_name=served_model_name(config)),
        parallel=with_rendezvous_port(config.parallel),
        node=dataclasses.replace(
            config.node, coordinator_internal_url=f"http://{host}:{server.internal_port}"
        ),
    )


async def serve_ranks(config: Config) -> int:
    """The coordinator with this host's ranks as registered nodes, until SIGTERM."""
    from deepinfer.server.coordinator import (
        bind_internal,
        create_coordinator_app,
        serve_coordinator,
    )

    sock = listen.bind(config.server.host, config.server.port, "server")
    internal_sock = bind_internal(config.server)
    ranks_config = rank_config(config)
    model_dir = Path(ranks_config.model.path or "")
    app = create_coordinator_app(
        ranks_config.server,
        tokenizer_path=tokenizer_json(model_dir, config.model.tokenizer),
        served_model_name=ranks_config.server.served_model_name or "",
        model_type=model_type_of(read_config(model_dir)),
        export_vllm_names=config.metrics.export_vllm_names,
        routing=config.routing,  # which rank takes a request
    )
    ranks = RankNodes(ranks_config)
    watcher = asyncio.create_task(ranks.watch())
    try:
        return await serve_coordinator(app, sock=sock, internal_sock=internal_sock)
    finally:
        watcher.cancel()
        await ranks.stop(config.node.drain_timeout_s + 20.0)
