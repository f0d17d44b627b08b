"""Streamed tokens/s the coordinator sustains per core, with a fast fake model behind a real node.

    python benchmarks/coordinator_throughput.py [--concurrency 64] [--requests 256]

Three processes: a real node (`create_node_app` + AsyncEngine + the real scheduler) whose model is
a fake executor that emits a token per request per step without computing anything; the real
coordinator (`deepinfer coordinator --node ...`, recipe conversion, detokenizing StreamProcessor,
SSE) pinned to one core; and this script's streaming client. Figures: streamed tokens/s (from
`usage`), the coordinator's CPU seconds (utime + stime from /proc), and tokens per coordinator
CPU-second, i.e. per core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import aiohttp

FAKE_TOKEN = 1601  # a plain word piece, so the stream carries text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_fake_node(port: int) -> None:
    """The node process: real node app and scheduler, a model that only emits tokens."""
    import uvloop
    from aiohttp import web

    from deepinfer.config import Config
    from deepinfer.engine.async_engine import AsyncEngine
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.scheduler.output import ModelRunnerOutput, SchedulerOutput
    from deepinfer.server.node import create_node_app

    class FastExecutor:
        num_blocks, num_slots, num_snapshots = 65536, 512, 0
        max_model_len, vocab_size, eos_token_id = 8192, 129280, 1
        cache_salt, replay_tokens = b"fake", 0

        def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
            tokens = {s.request_id: [FAKE_TOKEN] for s in out.scheduled if s.do_sample}
            return ModelRunnerOutput(sampled_token_ids=tokens)

    overrides = {
        "node": {"port": port},
        "scheduler": {"max_num_seqs": 512, "max_num_batched_tokens": 65536},
        "cache": {"enable_prefix_caching": False},
    }
    config = Config.load(overrides=overrides, environ={})
    engine = AsyncEngine(LLMEngine(config, executor=FastExecutor()))
    uvloop.run(web._run_app(create_node_app(engine, config), host="127.0.0.1", port=port))


async def _one(session: aiohttp.ClientSession, url: str, output_len: int) -> int:
    body = {
        "model": "deepinfer-tiny",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "thinking": {"type": "disabled"},
    }
    tokens = 0
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def _client(base: str, concurrency: int, requests: int, output_len: int) -> int:
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def bounded() -> int:
            async with sem:
                return await _one(session, f"{base}/v1/chat/completions", output_len)

        return sum(await asyncio.gather(*(bounded() for _ in range(requests))))


def wait_ready(url: str, proc: subprocess.Popen, seconds: float = 120) -> None:
    import urllib.request

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(url)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--coordinator-core", type=int, default=1)
    ns = ap.parse_args()
    node_port, coord_port = free_port(), free_port()
    env = {**os.environ, "DEEPINFER_LOG_LEVEL": "WARNING"}
    node = subprocess.Popen(
        [sys.executable, __file__, "_node", str(node_port)], env=env, stdout=subprocess.DEVNULL
    )
    coordinator = subprocess.Popen(
        ["taskset", "-c", str(ns.coordinator_core), sys.executable, "-m", "deepinfer.cli",
         "coordinator", "--node", f"http://127.0.0.1:{node_port}", "--port", str(coord_port),
         "--internal-port", str(free_port()), "--max-model-len", "8192"],
        env=env,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{node_port}/ready", node)
        base = f"http://127.0.0.1:{coord_port}"
        wait_ready(f"{base}/ready", coordinator)
        asyncio.run(_client(base, 4, 8, 16))  # warm-up
        cpu0, t0 = _cpu_seconds(coordinator.pid), time.perf_counter()
        tokens = asyncio.run(_client(base, ns.concurrency, ns.requests, ns.output_len))
        wall, cpu = time.perf_counter() - t0, _cpu_seconds(coordinator.pid) - cpu0
    finally:
        for proc in (coordinator, node):
            proc.terminate()
            proc.wait(timeout=60)
    print(f"streamed {tokens} tokens in {wall:.2f} s: {tokens / wall:,.0f} tok/s")
    print(
        f"coordinator CPU {cpu:.2f} s ({cpu / wall:.0%} of one core): "
        f"{tokens / cpu:,.0f} streamed tokens per coordinator CPU-second"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_node":
        run_fake_node(int(sys.argv[2]))
    else:
        main()
