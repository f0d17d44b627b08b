"""Admission before work: the preparation pool alone (who gets a thread when, what is refused,
what a cancelled request still holds), and a real coordinator with large count_tokens and chat
bodies in flight answering a small request first, within a stated memory bound."""

from __future__ import annotations

import asyncio
import json
import random
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from coordinator_fakes import TOKENIZER_PATH
from processes import Process, clean_env, free_port

from deepinfer.server.admission import AdmissionController, QueueFullError
from deepinfer.server.preparation import LARGE_BODY_BYTES, PreparationPool

SMALL, LARGE = b"s", b"L" * LARGE_BODY_BYTES


@dataclass
class FakeRequest:
    """What the pool reads of an aiohttp request."""

    body: bytes
    has_length: bool = True

    @property
    def content_length(self) -> int | None:
        return len(self.body) if self.has_length else None

    async def read(self) -> bytes:
        return self.body


class Jobs:
    """Work that records its start and then blocks until released."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._release: dict[str, threading.Event] = {}

    def work(self, name: str):
        self._release[name] = threading.Event()

        def run(body: bytes) -> str:
            self.started.append(name)
            assert self._release[name].wait(5), name
            return name

        return run

    def release(self, name: str) -> None:
        self._release[name].set()


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def _pool(num_threads: int = 2, max_bytes: int = 8 * LARGE_BODY_BYTES) -> PreparationPool:
    admission = AdmissionController(4, 4, 10**6)
    return PreparationPool(admission, num_threads, max_bytes, 2 * LARGE_BODY_BYTES, 1.0)


@pytest.mark.asyncio
async def test_small_requests_pass_large_ones_waiting_for_a_thread() -> None:
    pool, jobs = _pool(), Jobs()

    def submit(name: str, body: bytes) -> asyncio.Task:
        return asyncio.create_task(pool.run(FakeRequest(body), jobs.work(name)))

    large_1 = submit("L1", LARGE)
    await _until(lambda: jobs.started == ["L1"])
    large_2 = submit("L2", LARGE)  # two threads, but large bodies get one of them
    small_1 = submit("s1", SMALL)
    await _until(lambda: jobs.started == ["L1", "s1"])
    small_2 = submit("s2", SMALL)  # both threads busy: it waits, behind L2
    await asyncio.sleep(0.05)
    assert (pool.num_running, pool.num_running_large, pool.num_requests) == (2, 1, 4)
    jobs.release("L1")
    await _until(lambda: jobs.started == ["L1", "s1", "L2"])
    jobs.release("s1")
    await _until(lambda: jobs.started == ["L1", "s1", "L2", "s2"])
    for name in ("L2", "s2"):
        jobs.release(name)
    assert [await t for t in (large_1, small_1, large_2, small_2)] == ["L1", "s1", "L2", "s2"]
    assert (pool.num_running, pool.num_requests, pool.num_bytes) == (0, 0, 0)
    pool.close()


@pytest.mark.asyncio
async def test_a_cancelled_request_keeps_its_thread_until_its_work_returns() -> None:
    pool, jobs = _pool(num_threads=1), Jobs()
    running = asyncio.create_task(pool.run(FakeRequest(SMALL), jobs.work("a")))
    await _until(lambda: jobs.started == ["a"])
    waiting = asyncio.create_task(pool.run(FakeRequest(SMALL), jobs.work("b")))
    await asyncio.sleep(0.01)
    waiting.cancel()  # a waiter that gives up leaves the queue at once
    running.cancel()  # a running one cannot stop its thread
    await asyncio.gather(running, waiting, return_exceptions=True)
    assert (pool.num_running, pool.num_requests) == (1, 1)
    jobs.release("a")
    await _until(lambda: pool.num_running == 0)
    assert (pool.num_requests, pool.num_bytes, jobs.started) == (0, 0, ["a"])
    pool.close()


@pytest.mark.asyncio
async def test_refused_before_reading() -> None:
    """By bytes (Content-Length, or max_body_bytes without one) and by the admission queue's
    room, counting the requests still being prepared."""
    pool, jobs = _pool(max_bytes=3 * LARGE_BODY_BYTES - 1), Jobs()
    first = asyncio.create_task(pool.run(FakeRequest(LARGE), jobs.work("a")))
    await _until(lambda: jobs.started == ["a"])
    with pytest.raises(
        QueueFullError,
        match=r"1048576 \+ 2097152 in this request > server.max_preparing_bytes = 3145727$",
    ):
        await pool.run(FakeRequest(LARGE, has_length=False), jobs.work("x"))
    small = [
        asyncio.create_task(pool.run(FakeRequest(SMALL), jobs.work(f"s{i}"))) for i in range(7)
    ]
    await _until(lambda: pool.num_requests == 8)  # 4 running + 4 queued fit
    with pytest.raises(QueueFullError, match="8 running, waiting or being prepared"):
        await pool.run(FakeRequest(SMALL), jobs.work("y"))
    for name in ["a", *(f"s{i}" for i in range(7))]:
        jobs.release(name)
    await asyncio.gather(first, *small)
    assert "x" not in jobs.started and "y" not in jobs.started
    pool.close()


# ---- a real coordinator ------------------------------------------------------------------------

NUM_LARGE = 6  # more than the default executor's threads on a 2-core machine (cpu + 4)
LARGE_MB = 1.2
# The coordinator's peak RSS grew by 177 MiB (one 1.2 MB prompt tokenizing at a time); with
# the six at once, before the preparation pool, by 408 MiB.
MAX_RSS_GROWTH_MIB = 300


def _http_request(path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def test_a_small_request_completes_before_large_ones(tmp_path: Path) -> None:
    port, internal_port, dead_port = free_port(), free_port(), free_port()
    coordinator = Process.start(
        ["coordinator", "--port", str(port), "--internal-port", str(internal_port),
         "--tokenizer", str(TOKENIZER_PATH), "--served-model-name", "m",
         "--node", f"http://127.0.0.1:{dead_port}", "--max-model-len", "1048576"],
        # No probe in the test's time: the dead node stays in rotation until the chat finds it
        # unreachable.
        clean_env(DEEPINFER_SERVER_NODE_PROBE_INTERVAL_S="600",
                  DEEPINFER_SERVER_HEARTBEAT_TIMEOUT_S="2400"),
        tmp_path / "coordinator.log", tmp_path,
    )  # fmt: skip
    try:
        coordinator.wait_for(f"http://127.0.0.1:{port}/ready")
        rng = random.Random(0)
        words = ["alpha", "river", "stone", "cloud", "数据", "内容"]
        text = " ".join(rng.choice(words) for _ in range(int(LARGE_MB * 1e6 / 6)))
        large = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
        small = {**large, "messages": [{"role": "user", "content": "hi"}]}
        count_tokens = "/v1/messages/count_tokens"
        requests = [(f"count_tokens-{i}", count_tokens, large) for i in range(NUM_LARGE - 1)]
        requests.append(("chat", "/v1/chat/completions", large))
        rss_before = coordinator.peak_rss_mib()
        selector = selectors.DefaultSelector()
        for name, path, body in requests:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(_http_request(path, json.dumps(body).encode()))
            selector.register(sock, selectors.EVENT_READ, [name, b""])
        # Every large body is at the server; then the small request.
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(_http_request(count_tokens, json.dumps(small).encode()))
        selector.register(sock, selectors.EVENT_READ, ["small", b""])
        finished: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + 120
        while len(finished) < len(requests) + 1:
            assert time.monotonic() < deadline, finished
            for key, _ in selector.select(timeout=1.0):
                chunk = key.fileobj.recv(65536)
                key.data[1] += chunk
                if not chunk:  # Connection: close, the answer is complete
                    selector.unregister(key.fileobj)
                    key.fileobj.close()
                    finished.append((key.data[0], key.data[1]))
        rss_growth = coordinator.peak_rss_mib() - rss_before
    finally:
        coordinator.stop()
    assert finished[0][0] == "small", [name for name, _ in finished]
    answers = dict(finished)
    assert answers["small"].split(b"\r\n", 1)[0] == b"HTTP/1.1 200 OK"
    assert answers["small"].endswith(b'{"input_tokens": 84}')
    for i in range(NUM_LARGE - 1):
        assert answers[f"count_tokens-{i}"].startswith(b"HTTP/1.1 200 OK")
    # The chat was tokenized and admitted, then its node could not be reached: the client
    # hears neither the node's URL nor the error, only the request id the log has them under.
    head, _, body = answers["chat"].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503")
    message = json.loads(body)["error"]["message"]
    assert str(dead_port) not in message and "Error" not in message
    request_id = message.removesuffix(")").rsplit(" ", 1)[1]
    assert f"request {request_id} failed on node static-0: 503 node http://127.0.0.1" in (
        coordinator.log
    )
    assert rss_growth < MAX_RSS_GROWTH_MIB, rss_growth
