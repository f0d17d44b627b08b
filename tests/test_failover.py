"""What clients and dead nodes can do to the service, with real processes where they matter:
a cancel storm against `deepinfer serve`, kill -9 of one of two static nodes behind
`deepinfer coordinator`, and an engine that dies under `serve` or under a registered node."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from coordinator_fakes import TOKENIZER_PATH
from processes import Process, clean_env, free_port, http_status
from prometheus_client.parser import text_string_to_metric_families
from scripted_executor import ScriptedExecutor

from deepinfer.bench.storm import run_storm
from deepinfer.config import CacheConfig, Config, NodeConfig, ServerConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.model.tiny import make_tiny_model
from deepinfer.server.coordinator import INTERNAL_APP, REGISTRY, create_coordinator_app
from deepinfer.server.node import create_node_app
from deepinfer.server.serve import create_serve_app

pytestmark = pytest.mark.asyncio

MODEL = "deepinfer-tiny"


# ---- real processes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / MODEL)


class Processes:
    """The `deepinfer` subcommands one test started (tests/processes.py's Process), logging to
    files in its folder; all killed at the end, so that a failing test leaves no server behind."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.running: list[Process] = []

    def start(self, name: str, *args: str) -> Process:
        env = clean_env(OMP_NUM_THREADS="1")  # the defaults apply: no config.toml in the folder
        process = Process.start(list(args), env, self.folder / f"{name}.log", self.folder)
        self.running.append(process)
        return process

    def logs(self) -> str:
        return "\n".join(f"== {p.log_path.name}\n{p.log[-3000:]}" for p in self.running)

    def wait_ready(self, url: str, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while http_status(url) != 200:
            assert all(p.popen.poll() is None for p in self.running), self.logs()
            assert time.monotonic() < deadline, f"{url} not ready\n{self.logs()}"
            time.sleep(0.2)

    def kill_all(self) -> None:
        for process in self.running:
            if process.popen.poll() is None:
                process.popen.kill()
                process.popen.wait()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    yield procs
    procs.kill_all()


def _samples(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_cancel_storm_leaves_serve_serving(processes: Processes, tiny_dir: Path) -> None:
    """400 clients give up at random points (a fifth before their add can be applied, the
    rest during prefill or decode) while two long streams keep the engine stepping."""
    port = free_port()
    processes.start("serve", "serve", "--model", str(tiny_dir), "--device", "cpu",
                    "--port", str(port), "--internal-port", str(free_port()))  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    processes.wait_ready(base + "/ready")
    result = await asyncio.wait_for(run_storm(base, MODEL, num_requests=400), 180.0)
    assert result.num_cancelled + result.num_completed == 400, (result, processes.logs())
    assert result.num_failed == 0 and result.num_long_ok == 2, (result, processes.logs())
    assert result.idle_gauges == {
        "deepinfer_num_requests_running": 0.0,
        "deepinfer_num_requests_waiting": 0.0,
        "deepinfer_kv_blocks_used": 0.0,
        "deepinfer_state_slots_used": 0.0,
    }
    assert result.good_status == 200 and result.good_text
    assert "engine loop crashed" not in processes.logs()


def _chat(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about the sea"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
        "thinking": {"type": "disabled"},
    }


async def _stream_text(session: aiohttp.ClientSession, url: str, max_tokens: int) -> str:
    async with session.post(url, json=_chat(max_tokens)) as response:
        assert response.status == 200
        return await response.text()


async def test_kill_9_of_one_static_node_fails_over(processes: Processes, tiny_dir: Path) -> None:
    """Node a runs one request at a time, so a second one waits there with no token yet. After
    kill -9 of a: a's open stream ends with an error event, the waiting request is retried on
    b, and every request sent after the kill succeeds."""
    port_a, port_b, port = free_port(), free_port(), free_port()
    common = ("--model", str(tiny_dir), "--device", "cpu")
    node_a = processes.start("node-a", "node", *common, "--port", str(port_a),
                             "--max-num-seqs", "1")  # fmt: skip
    processes.start("node-b", "node", *common, "--port", str(port_b))
    processes.start("coordinator", "coordinator", "--port", str(port),
                    "--internal-port", str(free_port()),
                    "--node", f"http://127.0.0.1:{port_a}", "--node", f"http://127.0.0.1:{port_b}",
                    "--max-model-len", "8192", "--routing-policy", "least_loaded")  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    for url in (f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}", base):
        processes.wait_ready(url + "/ready")
    chat_url = base + "/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for _ in range(100):  # both probed into rotation (a node may have been probed early)
            async with session.get(base + "/ready") as response:
                if (await response.json())["num_ready_nodes"] == 2:
                    break
            await asyncio.sleep(0.1)
        # Least loaded, ties to the lower id: a (static-0), then b, then a again.
        on_a = asyncio.create_task(_stream_text(session, chat_url, 2000))
        await _wait_metric(
            session, f"http://127.0.0.1:{port_a}/metrics", "deepinfer_num_requests_running", 1
        )
        on_b = asyncio.create_task(_stream_text(session, chat_url, 300))
        await _wait_metric(
            session, f"http://127.0.0.1:{port_b}/metrics", "deepinfer_num_requests_running", 1
        )
        queued = asyncio.create_task(_stream_text(session, chat_url, 8))
        await _wait_metric(
            session, f"http://127.0.0.1:{port_a}/metrics", "deepinfer_num_requests_waiting", 1
        )

        node_a.popen.send_signal(signal.SIGKILL)
        node_a.popen.wait()
        text = await _within(on_a, 30.0, processes)
        assert '"error"' in text and "[DONE]" not in text, text[-500:]  # mid-stream: an event
        assert "[DONE]" in await _within(queued, 30.0, processes)  # no token yet: retried on b
        after = [
            asyncio.create_task(session.post(chat_url, json=_chat(4, stream=False)))
            for _ in range(6)
        ]
        for response in await asyncio.gather(*after):
            assert response.status == 200, await response.text()
            assert (await response.json())["choices"][0]["message"]["content"]
        assert "[DONE]" in await on_b
        async with session.get(base + "/metrics") as response:
            samples = _samples(await response.text())
        assert samples["deepinfer_request_retries_total"] == 1.0
        async with session.get(base + "/ready") as response:
            assert (await response.json())["num_ready_nodes"] == 1  # b only: a is probed


async def _within(task: asyncio.Task, timeout_s: float, processes: Processes) -> Any:
    try:
        return await asyncio.wait_for(task, timeout_s)
    except TimeoutError:
        raise AssertionError(f"no answer within {timeout_s} s\n{processes.logs()}") from None


async def _wait_metric(session: aiohttp.ClientSession, url: str, name: str, value: float) -> None:
    for _ in range(600):
        async with session.get(url) as response:
            samples = _samples(await response.text())
        if any(k == name and v == value for k, v in samples.items()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never reached {value} at {url}: {samples}")


# ---- an engine that dies ---------------------------------------------------------------------


def _crash_on_next_step(engine: AsyncEngine) -> None:
    """The next step's observer call raises: the engine loop dies (as an engine bug would)."""
    assert engine.observer is not None

    def crash(step_time_s: float, deltas: object) -> None:
        raise RuntimeError("forced engine failure")

    engine.observer.on_step = crash  # type: ignore[method-assign]


def _scripted_engine(**node: Any) -> tuple[AsyncEngine, Config]:
    config = Config(
        cache=CacheConfig(block_size=16),
        server=ServerConfig(node_probe_interval_s=0.05),
        node=NodeConfig(node_id="n0", **node),
    )
    executor = ScriptedExecutor({}, default_script=list(range(100, 400)), step_delay_s=0.005)
    return AsyncEngine(LLMEngine(config, executor=executor)), config


async def test_engine_failure_under_serve_ends_streams_and_turns_ready_503() -> None:
    engine, config = _scripted_engine()
    server = TestServer(create_serve_app(engine, config, tokenizer_path=TOKENIZER_PATH))
    await server.start_server()
    try:
        async with aiohttp.ClientSession(str(server.make_url(""))) as session:
            assert (await session.get("/ready")).status == 200
            async with session.post("/v1/chat/completions", json=_chat(300)) as response:
                assert response.status == 200
                await response.content.readline()  # streaming
                _crash_on_next_step(engine)
                text = (await response.read()).decode()
            # The client hears a stable message and the request id; the log has the cause.
            assert '"error"' in text and "request id chatcmpl-" in text, text[-300:]
            for _ in range(100):  # the static node is probed every 50 ms
                if (await session.get("/ready")).status == 503:
                    break
                await asyncio.sleep(0.02)
            response = await session.get("/ready")
            assert response.status == 503 and (await response.json())["num_ready_nodes"] == 0
            response = await session.post("/v1/chat/completions", json=_chat(4, stream=False))
            assert response.status == 503
    finally:
        await server.close()


async def test_a_registered_node_whose_engine_fails_leaves_rotation_within_a_heartbeat() -> None:
    coordinator = TestServer(
        create_coordinator_app(
            ServerConfig(heartbeat_timeout_s=30.0),  # expiry cannot be what takes it out
            tokenizer_path=TOKENIZER_PATH,
            served_model_name=MODEL,
        )
    )
    await coordinator.start_server()
    internal = TestServer(coordinator.app[INTERNAL_APP])
    await internal.start_server()
    port = free_port()
    engine, config = _scripted_engine(
        port=port, coordinator_internal_url=str(internal.make_url("")), heartbeat_interval_s=0.05
    )
    node = TestServer(create_node_app(engine, config, model_name=MODEL), port=port)
    await node.start_server()
    registry = coordinator.app[REGISTRY]
    try:
        for _ in range(200):
            if registry.ready_nodes():
                break
            await asyncio.sleep(0.01)
        assert [n.node_id for n in registry.ready_nodes()] == ["n0"]
        async with aiohttp.ClientSession(str(coordinator.make_url(""))) as session:
            async with session.post("/v1/chat/completions", json=_chat(300)) as response:
                await response.content.readline()
                _crash_on_next_step(engine)
                text = (await response.read()).decode()
            assert '"error"' in text and "request id chatcmpl-" in text, text[-300:]
            crashed = time.monotonic()
            while registry.ready_nodes():
                assert time.monotonic() - crashed < 0.5, "still in rotation after 10 heartbeats"
                await asyncio.sleep(0.01)
            assert not registry.nodes[0].load.is_healthy
            response = await session.get("/ready")
            assert response.status == 503
    finally:
        await node.close()
        await internal.close()
        await coordinator.close()
