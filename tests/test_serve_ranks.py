"""`deepinfer serve --data-parallel-size 2 --enable-expert-parallel` with real processes: the
coordinator and two rank nodes in lock-step on the CPU (gloo). Same greedy answer as one rank,
requests spread over both ranks, SIGTERM drains both, kill -9 of a rank ends its instance."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from processes import Process, clean_env, free_port, http_status
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.asyncio

MODEL = "deepinfer-tiny"
ENGINE_FLAGS = ["--device", "cpu", "--num-threads", "1", "--max-model-len", "4096"]
QUESTION = [{"role": "user", "content": "Name three colours."}]
NO_THINKING = {"thinking": {"type": "disabled"}}


def _free_ports(n: int) -> int:
    """A first port p with p .. p + n - 1 all free now."""
    while True:
        base = free_port()
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue


class Serve:
    """One `deepinfer serve` (and its rank nodes) with its ports and an openai client."""

    def __init__(self, folder: Path, name: str, *extra: str) -> None:
        self.port, self.internal_port = free_port(), free_port()
        self.node_port = _free_ports(2)
        env = clean_env(OMP_NUM_THREADS="1", DEEPINFER_NODE_PORT=str(self.node_port))
        args = ["serve", "--port", str(self.port), "--internal-port", str(self.internal_port)]
        self.process = Process.start([*args, *ENGINE_FLAGS, *extra], env, folder / name, folder)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        self.process.wait_for(f"{self.url}/ready", 200, timeout_s=120)

    def rank_pid(self, rank: int) -> int:
        found = re.search(rf"rank {rank}: node process (\d+)", self.process.log)
        assert found, self.process.log
        return int(found.group(1))

    def rank_metrics(self, rank: int) -> dict[str, float]:
        import urllib.request

        url = f"http://127.0.0.1:{self.node_port + rank}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name + "".join(
                    f",{k}={v}"
                    for k, v in sorted(sample.labels.items())
                    if k in ("kind", "finished_reason")
                )
                out[key] = out.get(key, 0.0) + sample.value
        return out

    async def answer(self, max_tokens: int = 24) -> str:
        """The official openai client's greedy chat answer (a client per call: each test has
        its own event loop)."""
        async with openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="k", max_retries=0
        ) as client:
            reply = await client.chat.completions.create(
                model=MODEL,
                messages=QUESTION,
                temperature=0,
                max_tokens=max_tokens,
                extra_body=NO_THINKING,
            )
        return reply.choices[0].message.content or ""

    async def stream(self, prompt: str, max_tokens: int) -> tuple[int, str | None, str]:
        """(completion tokens from the usage chunk, finish reason, the error event or "")."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        tokens, finish, error = 0, None, ""
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.url}/v1/completions", json=body) as r,
        ):
            async for line in r.content:
                text = line.decode().strip()
                if not text.startswith("data: ") or text == "data: [DONE]":
                    continue
                event = json.loads(text.removeprefix("data: "))
                if "error" in event:
                    error = event["error"]["message"]
                elif event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    finish = choice.get("finish_reason") or finish
        return tokens, finish, error

    def stop(self) -> None:
        self.process.stop()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve_ranks")


@pytest.fixture(scope="module")
def one_rank(folder: Path) -> Iterator[Serve]:
    serve = Serve(folder, "one.log")
    serve.wait_ready()
    yield serve
    serve.stop()


@pytest.fixture
def two_ranks(folder: Path, request) -> Iterator[Serve]:
    serve = Serve(folder, f"{request.node.name}.log", "--data-parallel-size", "2",
                  "--enable-expert-parallel")  # fmt: skip
    serve.wait_ready()
    yield serve
    if serve.process.popen.poll() is None:
        serve.process.popen.kill()
        serve.process.popen.wait()


async def test_two_ranks_answer_as_one_spread_requests_and_drain_together(one_rank, two_ranks):
    assert await two_ranks.answer() == await one_rank.answer()
    # Concurrent requests go to both ranks (least loaded rank of the one instance).
    await asyncio.gather(*(two_ranks.answer(max_tokens=12) for _ in range(6)))
    finished = [
        two_ranks.rank_metrics(r)["deepinfer_finished_requests_total,finished_reason=length"]
        for r in (0, 1)
    ]
    assert sum(finished) == 7 and min(finished) >= 1, finished
    steps = [two_ranks.rank_metrics(r) for r in (0, 1)]
    forward = "deepinfer_lockstep_steps_total,kind=forward"
    assert all(s[forward] > 0 for s in steps)
    # SIGTERM with two streams in flight: both complete, then both ranks stop together.
    streams = [asyncio.create_task(two_ranks.stream(f"Count {i}", 60)) for i in range(2)]
    await asyncio.sleep(1.0)
    two_ranks.process.popen.send_signal(signal.SIGTERM)
    results = await asyncio.wait_for(asyncio.gather(*streams), 60)
    assert [(n, f, e) for n, f, e in results] == [(60, "length", ""), (60, "length", "")]
    assert await asyncio.to_thread(two_ranks.process.popen.wait, 60) == 0
    log = two_ranks.process.log
    assert len(re.findall(r"rank node \d+ exited with status 0", log)) == 2, log


async def test_killing_a_rank_ends_its_instance_with_error_events(two_ranks):
    streams = [asyncio.create_task(two_ranks.stream(f"Go {i}", 4000)) for i in range(2)]
    await asyncio.sleep(2.0)
    killed = time.monotonic()
    os.kill(two_ranks.rank_pid(1), signal.SIGKILL)
    results = await asyncio.wait_for(asyncio.gather(*streams), 30)
    assert all(error and finish is None for _, finish, error in results), results
    assert time.monotonic() - killed < 15
    body = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        async with aiohttp.ClientSession() as session, session.get(f"{two_ranks.url}/ready") as r:
            status, body = r.status, await r.json()
        if status == 503 and body.get("instances_not_ready"):
            break
        await asyncio.sleep(0.2)
    assert status == 503, body
    ((instance, why),) = body["instances_not_ready"].items()
    assert re.fullmatch(r"127\.0\.0\.1:\d+", instance) and "rank" in why, body
    # The surviving rank stops on its own (status 1, for its unit to restart the instance).
    deadline = time.monotonic() + 20
    while "exited with status 1" not in two_ranks.process.log:
        assert time.monotonic() < deadline, two_ranks.process.log
        await asyncio.sleep(0.2)
    assert http_status(f"{two_ranks.url}/health") == 200  # the coordinator serves on


async def test_a_rank_of_another_host_joins_through_the_rendezvous(one_rank, folder: Path):
    """serve runs rank 0 only (data_parallel_size_local 1); rank 1 is a `deepinfer node` of its
    own, as on a second host, joining at the rendezvous port and registering as rank 1."""
    master = free_port()
    parallel = ["--data-parallel-size", "2", "--enable-expert-parallel"]
    parallel += ["--data-parallel-master-port", str(master)]
    serve = Serve(folder, "split.log", *parallel, "--data-parallel-size-local", "1")
    env = clean_env(OMP_NUM_THREADS="1")
    node_args = ["node", "--port", str(serve.node_port + 1), "--data-parallel-rank", "1"]
    node_args += ["--coordinator-internal-url", f"http://127.0.0.1:{serve.internal_port}"]
    node = Process.start([*node_args, *parallel, *ENGINE_FLAGS], env, folder / "rank1.log", folder)
    try:
        serve.wait_ready()
        want = await one_rank.answer()
        # Two at once: the second goes to the other rank (the least loaded one).
        assert await asyncio.gather(serve.answer(), serve.answer()) == [want, want]
        assert serve.rank_metrics(1)["deepinfer_lockstep_steps_total,kind=forward"] > 0
    finally:
        for process in (serve.process, node):  # SIGTERM to the instance: both ranks leave
            process.popen.terminate()
        serve.stop()
        node.stop()
