"""The coordinator's parts alone: admission queue, routing policy, node registry, SSE error
events, and `deepinfer coordinator` exiting 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from coordinator_fakes import TOKENIZER_PATH, FakeBackend

from deepinfer.server.admission import AdmissionController, DrainingError, QueueFullError
from deepinfer.server.errors import ApiError, ErrorFlavor, sse_error_event
from deepinfer.server.protocol import NodeHeartbeat, NodeLoad, NodeRegistration
from deepinfer.server.registry import NodeEntry, NodeRegistry, NoReadyNodeError
from deepinfer.server.routing import LeastLoadedPolicy

# ---- admission -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_admission_is_fifo_bounded_and_cancellable() -> None:
    admission = AdmissionController(
        max_running=1, max_queued_requests=2, max_queued_prompt_tokens=100
    )
    order: list[str] = []
    release_a = asyncio.Event()

    async def run(name: str, num_tokens: int, hold: asyncio.Event | None = None) -> None:
        async with admission.admit(num_tokens):
            order.append(name)
            if hold is not None:
                await hold.wait()

    a = asyncio.create_task(run("a", 10, release_a))
    await asyncio.sleep(0)
    b = asyncio.create_task(run("b", 40))
    c = asyncio.create_task(run("c", 50))
    await asyncio.sleep(0)
    assert (admission.num_running, admission.num_waiting, admission.num_waiting_tokens) == (
        1,
        2,
        90,
    )
    with pytest.raises(QueueFullError, match="2 already waiting"):
        async with admission.admit(1):
            pass
    c.cancel()  # a waiter that gives up leaves the queue and its tokens
    await asyncio.sleep(0)
    assert (admission.num_waiting, admission.num_waiting_tokens) == (1, 40)
    with pytest.raises(QueueFullError, match="40 waiting \\+ 61 in this request"):
        async with admission.admit(61):
            pass
    d = asyncio.create_task(run("d", 60))
    await asyncio.sleep(0)
    release_a.set()
    await asyncio.gather(a, b, d)
    assert order == ["a", "b", "d"]  # slots pass to the oldest waiter
    assert (admission.num_running, admission.num_waiting, admission.num_waiting_tokens) == (0, 0, 0)
    assert await admission.wait_idle(0.1) is True
    admission.start_draining()
    with pytest.raises(DrainingError):
        async with admission.admit(1):
            pass


# ---- routing and the registry -----------------------------------------------------------------


def _entry(node_id: str, inflight: int, running: int, free_blocks: int) -> NodeEntry:
    entry = NodeEntry(node_id, FakeBackend(), max_model_len=1024)
    entry.num_inflight = inflight
    entry.load = NodeLoad(num_running=running, num_free_blocks=free_blocks)
    return entry


def test_least_loaded_policy() -> None:
    policy = LeastLoadedPolicy()
    a, b, c = _entry("a", 3, 0, 10), _entry("b", 0, 2, 10), _entry("c", 1, 2, 50)
    assert policy.select([a, b, c], 100).node_id == "c"  # loads 3, 2, 2: more free blocks wins
    assert policy.select([a, b], 100).node_id == "b"
    assert policy.select([_entry("y", 0, 0, 0), _entry("x", 0, 0, 0)], 1).node_id == "x"


def test_registry_heartbeats_expiry_and_roles() -> None:
    now = [100.0]
    made: list[str] = []

    def factory(url: str) -> FakeBackend:
        made.append(url)
        return FakeBackend()

    registry = NodeRegistry(heartbeat_timeout_s=10.0, backend_factory=factory, clock=lambda: now[0])
    with pytest.raises(NoReadyNodeError):
        registry.max_model_len()
    registry.add_static("static-0", FakeBackend(), 4096)
    registration = NodeRegistration(
        node_id="n1", url="http://n1", role="mixed", model="m", max_model_len=2048
    )
    entry = registry.register(registration)
    registry.register(NodeRegistration(node_id="p", url="http://p", role="prefill", model="m",
                                       max_model_len=99))  # fmt: skip
    assert [n.node_id for n in registry.ready_nodes()] == ["static-0", "n1"]
    assert registry.max_model_len() == 2048
    with registry.select(10) as chosen:
        assert chosen is entry  # both idle: the lower node id
        assert registry.register(registration) is entry  # re-registration keeps the entry...
        assert entry.num_inflight == 1  # ...and the count of requests in flight there
    assert entry.num_inflight == 0
    assert made == ["http://n1", "http://p"]  # same URL: the backend is kept

    now[0] += 10.5
    assert registry.expire() == ["n1", "p"]
    assert [n.node_id for n in registry.ready_nodes()] == ["static-0"]
    registry.heartbeat(NodeHeartbeat(node_id="n1", load=NodeLoad(num_waiting=3)))
    assert entry.is_ready and entry.load.num_waiting == 3
    with pytest.raises(KeyError):
        registry.heartbeat(NodeHeartbeat(node_id="zz", load=NodeLoad()))


# ---- SSE error events ------------------------------------------------------------------------


def test_sse_error_events_exact() -> None:
    err = ApiError(503, "busy", retry_after=1)
    assert sse_error_event(err, ErrorFlavor.OPENAI) == (
        b'data: {"error":{"message":"busy","type":"service_unavailable_error","param":null,'
        b'"code":null}}\n\n'
    )
    assert sse_error_event(err, ErrorFlavor.ANTHROPIC) == (
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
        b'"message":"busy"}}\n\n'
    )
    assert sse_error_event(err, ErrorFlavor.RESPONSES, sequence_number=7) == (
        b'event: error\ndata: {"type":"error","code":"service_unavailable_error",'
        b'"message":"busy","param":null,"sequence_number":7}\n\n'
    )


# ---- the CLI process --------------------------------------------------------------------------


def test_coordinator_process_exits_0_on_sigterm(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--port", str(port), "--tokenizer", str(TOKENIZER_PATH), "--served-model-name", "m"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.cli", "coordinator", "--log-level", "INFO", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        statuses = asyncio.run(_wait_until_serving(port))
        assert statuses == (200, 503)  # alive; not ready without a node
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert "drain complete" in output


async def _wait_until_serving(port: int) -> tuple[int, int]:
    deadline = time.monotonic() + 20
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                base = f"http://127.0.0.1:{port}"
                async with (
                    session.get(f"{base}/health") as health,
                    session.get(f"{base}/ready") as ready,
                ):
                    return health.status, ready.status
            except aiohttp.ClientConnectionError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
