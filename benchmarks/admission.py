"""Admission before work, measured on real processes: a stall, slow bodies, an overload.

    python benchmarks/admission.py [--large-mb 10] [--num-count-tokens 8] [--num-chats 2]

Two processes on the default config: a node (`deepinfer node`, the built-in tiny model on the
CPU) and the coordinator in front of it (`deepinfer coordinator --node URL`, context limit
``--max-model-len``, default 1,048,576 as V4-Flash's, so that large prompts are tokenized
rather than refused by length). Three scenarios, in this order:

1. stall: ``--num-count-tokens`` /v1/messages/count_tokens and ``--num-chats``
   /v1/chat/completions bodies of ``--large-mb`` MB each in flight at once, then, 0.5 s later,
   one small chat (16 tokens). Figures: the small chat's latency, when the large ones
   finished, and the coordinator's peak RSS (VmHWM) before and after.
2. slow bodies: ``--num-slow`` connections that promise 1,000 body bytes and send 10. Figure:
   how many the coordinator answered (by status) and closed within ``--slow-wait-s`` seconds
   (its body read timeout is set to 2 s through DEEPINFER_SERVER_BODY_READ_TIMEOUT_S, which
   older code ignores; a 429 refused before reading ends after aiohttp's 10 s lingering read).
3. overload: ``--num-overload`` concurrent 16-token chats. Figures: answered 200 / 429 (and
   whether each 429 had Retry-After), the slowest and the median 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import aiohttp
from coordinator_throughput import free_port, wait_ready  # benchmarks/ is on sys.path

SMALL_CHAT = {
    "model": "deepinfer-tiny",
    "messages": [{"role": "user", "content": "Say hi."}],
    "max_tokens": 16,
    "ignore_eos": True,
    "thinking": {"type": "disabled"},
}
_WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "light", "数据", "内容"]


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def _large_text(num_bytes: int) -> str:
    rng = random.Random(0)
    words = []
    size = 0
    while size < num_bytes:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word.encode()) + 1
    return " ".join(words)


async def _timed_post(
    session: aiohttp.ClientSession, url: str, body: bytes, t0: float
) -> tuple[int, float]:
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        return r.status, time.perf_counter() - t0


async def stall(base: str, ns: argparse.Namespace) -> dict:
    text = _large_text(int(ns.large_mb * 1e6))
    messages = [{"role": "user", "content": text}]
    count_body = json.dumps({"model": "deepinfer-tiny", "max_tokens": 16, "messages": messages})
    count_body = count_body.encode()
    chat_body = json.dumps({**SMALL_CHAT, "messages": messages}).encode()
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        t0 = time.perf_counter()
        large = [
            asyncio.create_task(
                _timed_post(session, f"{base}/v1/messages/count_tokens", count_body, t0)
            )
            for _ in range(ns.num_count_tokens)
        ] + [
            asyncio.create_task(_timed_post(session, f"{base}/v1/chat/completions", chat_body, t0))
            for _ in range(ns.num_chats)
        ]
        await asyncio.sleep(0.5)
        t_small = time.perf_counter()
        status, done = await _timed_post(
            session, f"{base}/v1/chat/completions", json.dumps(SMALL_CHAT).encode(), t_small
        )
        results = await asyncio.gather(*large)
    return {
        "small_chat": (status, round(done, 3)),
        "large": sorted((s, round(t, 2)) for s, t in results),
    }


def slow_bodies(port: int, ns: argparse.Namespace) -> dict:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    socks = []
    for _ in range(ns.num_slow):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head + b'{"model": ')
        socks.append(s)
    time.sleep(ns.slow_wait_s)
    num_closed, statuses = 0, {}
    for s in socks:
        s.setblocking(False)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
            num_closed += 1  # recv returned b"": closed by the server
        except BlockingIOError:
            pass
        if data:
            status = data.split(b" ", 2)[1].decode()
            statuses[status] = statuses.get(status, 0) + 1
        s.close()
    return {"connections": ns.num_slow, "closed_by_server": num_closed, "statuses": statuses}


async def overload(base: str, ns: argparse.Namespace) -> dict:
    timeout = aiohttp.ClientTimeout(total=1800)
    body = json.dumps(SMALL_CHAT).encode()

    async def one(session: aiohttp.ClientSession) -> tuple[int, float, bool]:
        t0 = time.perf_counter()
        headers = {"Content-Type": "application/json"}
        async with session.post(f"{base}/v1/chat/completions", data=body, headers=headers) as r:
            await r.read()
            return r.status, time.perf_counter() - t0, "Retry-After" in r.headers

    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        results = await asyncio.gather(*(one(session) for _ in range(ns.num_overload)))
    ok = [t for s, t, _ in results if s == 200]
    refused = [r for r in results if r[0] == 429]
    return {
        "num_200": len(ok),
        "num_429": len(refused),
        "num_429_with_retry_after": sum(1 for r in refused if r[2]),
        "other": sorted({s for s, _, _ in results} - {200, 429}),
        "slowest_200_s": round(max(ok), 2) if ok else None,
        "median_200_s": round(statistics.median(ok), 2) if ok else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--large-mb", type=float, default=10.0)
    ap.add_argument("--num-count-tokens", type=int, default=8)
    ap.add_argument("--num-chats", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=1048576)
    ap.add_argument("--num-slow", type=int, default=400)
    ap.add_argument("--slow-wait-s", type=float, default=13.0)
    ap.add_argument("--num-overload", type=int, default=400)
    ns = ap.parse_args()
    node_port, port, internal_port = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env |= {
        "DEEPINFER_LOG_LEVEL": "WARNING",
        "DEEPINFER_SERVER_INTERNAL_PORT": str(internal_port),
        "DEEPINFER_SERVER_BODY_READ_TIMEOUT_S": "2",
    }
    cli = [sys.executable, "-m", "deepinfer.cli"]
    node = subprocess.Popen(
        [*cli, "node", "--device", "cpu", "--port", str(node_port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    coordinator = subprocess.Popen(
        [*cli, "coordinator", "--node", f"http://127.0.0.1:{node_port}", "--port", str(port),
         "--max-model-len", str(ns.max_model_len)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"http://127.0.0.1:{node_port}/ready", node)
        wait_ready(f"{base}/ready", coordinator)
        asyncio.run(overload(base, argparse.Namespace(num_overload=4)))  # warm-up
        rss_before = _peak_rss_mib(coordinator.pid)
        figures = {"stall": asyncio.run(stall(base, ns))}
        figures["stall"]["coordinator_peak_rss_mib"] = (
            round(rss_before),
            round(_peak_rss_mib(coordinator.pid)),
        )
        figures["slow_bodies"] = slow_bodies(port, ns)
        figures["overload"] = asyncio.run(overload(base, ns))
    finally:
        for proc in (coordinator, node):
            proc.terminate()
            proc.wait(timeout=120)
    print(json.dumps(figures, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
