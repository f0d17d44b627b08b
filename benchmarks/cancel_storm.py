"""A cancel storm against a real `deepinfer serve` (the built-in model on the CPU): clients that
give up at random points while two long streams keep the engine stepping; the server's RSS
before and after, its gauges once idle, and a good request answered after the storm.

    python benchmarks/cancel_storm.py [--requests 1000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from deepinfer.bench.storm import run_storm


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ns = ap.parse_args()
    port, internal_port = _free_port(), _free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "serve.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
        with log.open("wb") as out:
            server = subprocess.Popen(
                [sys.executable, "-m", "deepinfer.cli", "serve", "--device", "cpu", "--port",
                 str(port), "--internal-port", str(internal_port)],
                env=env, cwd=folder, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            while not _ready(base + "/ready"):
                if server.poll() is not None:
                    print(log.read_text(errors="replace")[-3000:])
                    return 1
                time.sleep(0.2)
            rss_before = _rss_mib(server.pid)
            started = time.monotonic()
            result = asyncio.run(
                run_storm(
                    base, "deepinfer-tiny", num_requests=ns.requests, concurrency=ns.concurrency
                )
            )
            seconds = time.monotonic() - started
            rss_after = _rss_mib(server.pid)
            crashed = "engine loop crashed" in log.read_text(errors="replace")
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"requests: {ns.requests} at concurrency {ns.concurrency}, {seconds:.1f} s")
    print(
        f"cancelled {result.num_cancelled}, completed {result.num_completed}, failed "
        f"{result.num_failed}; long streams ok {result.num_long_ok}/2"
    )
    print(f"idle gauges: {result.idle_gauges}")
    print(f"good request after: HTTP {result.good_status}, {len(result.good_text)} characters")
    print(f"server RSS: {rss_before:.0f} MiB before, {rss_after:.0f} MiB after")
    print(f"engine loop crashed: {crashed}")
    return 0 if result.good_status == 200 and not crashed else 1


if __name__ == "__main__":
    sys.exit(main())
