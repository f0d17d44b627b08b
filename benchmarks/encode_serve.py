"""What an encode node buys, through the server: image requests and text requests at once
against `deepinfer coordinator` over a mixed node that encodes in-process, and over the same
mixed node with an encode node beside it (`deepinfer node --role encode`).

    bash scripts/gpu_bench.sh benchmarks/encode_serve.py     # all processes on one GPU
    python3 -P benchmarks/encode_serve.py --tiny             # the built-in tiny V4.1, CPU

The model: the built-in tiny DeepSeek-V4.1 text stack with the release's vision tower (ViT 1024
wide, 32 blocks; --tiny: the tiny tower), random weights (bf16 on the GPU): the tower is what
the encode node moves, so it is at full size; the text stack is small, so that what is measured
is where images are encoded, not the prefill. Every server is a real process; on the GPU they
share the one device (the mixed node at gpu_memory_utilization 0.45).

Workload, the same for both setups: --image-clients clients each sending --image-requests chat
requests of --images images (distinct random 640x480 photos: none is cached) and 16 tokens out,
and --text-clients clients sending text requests (a short prompt, --text-tokens out), all at
once. Printed per setup: the image requests' TTFT (p50, p99), the text requests' TTFT and
inter-token latency (p50, p99), images/s; and the encode node's own tower seconds from /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.model.tiny import make_tiny_model

MODEL = "DeepSeek-V4.1-Flash"


def write_model(folder: Path, tiny: bool) -> Path:
    """The tiny V4.1 with the release's vision tower (random weights are drawn at load)."""
    model = make_tiny_model(folder / MODEL, model_type="deepseek_v41")
    if not tiny:
        path = model / "config.json"
        config = json.loads(path.read_text())
        config["vision_config"] = {"patch_size": 14, "downsample_ratio": 3,
                                   "max_image_tokens": 4096}  # fmt: skip
        path.write_text(json.dumps(config, indent=2))
    return model


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Servers:
    def __init__(self, ns: argparse.Namespace, model: Path) -> None:
        self.ns, self.model = ns, model
        self.env = {**os.environ, "DEEPINFER_MODEL_RANDOM_WEIGHTS": "true"}
        device = ["--device", "cpu", "--num-threads", "1"] if ns.tiny else []
        self.node_flags = ["--model", str(model), *device]
        self.running: list[subprocess.Popen] = []

    def start(self, name: str, *args: str) -> None:
        log = (self.ns.out / f"{name}.log").open("wb")
        argv = [sys.executable, "-P", "-m", "deepinfer.cli", *args]
        self.running.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=log))

    async def cluster(self, with_encoder: bool) -> dict[str, str]:
        urls = {}
        for role in ("mixed", "encode") if with_encoder else ("mixed",):
            port = _free_port()
            urls[role] = f"http://127.0.0.1:{port}"
            memory = (
                ["--gpu-memory-utilization", "0.45"] if role == "mixed" and not self.ns.tiny else []
            )
            self.start(role, "node", *self.node_flags, *memory, "--role", role, "--port", str(port))
        port = _free_port()
        urls["coordinator"] = f"http://127.0.0.1:{port}"
        flags = ["--node", urls["mixed"]]
        if with_encoder:
            flags += ["--encode-node", urls["encode"]]
        self.start("coordinator", "coordinator", "--model", str(self.model), "--port", str(port),
                   "--internal-port", str(_free_port()), "--node-probe-interval-s", "0.5",
                   *flags)  # fmt: skip
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 900
            for url in urls.values():
                while True:
                    assert all(p.poll() is None for p in self.running), "a server exited: see logs"
                    assert time.monotonic() < deadline, f"{url} never ready"
                    try:
                        async with session.get(url + "/ready") as response:
                            if response.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.5)
        return urls

    def stop(self) -> None:
        for process in self.running:
            process.terminate()
        for process in self.running:
            process.wait(timeout=60)
        self.running = []


def _photo(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()


async def _chat(session: aiohttp.ClientSession, base: str, content, max_tokens: int) -> dict:
    """One streamed chat request: its TTFT and inter-token gaps (s)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    began = time.monotonic()
    times = []
    async with session.post(base + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            delta = json.loads(line[6:])["choices"]
            if delta and (delta[0]["delta"].get("content") or
                          delta[0]["delta"].get("reasoning_content")):  # fmt: skip
                times.append(time.monotonic())
    assert times, "no tokens"
    return {"ttft": times[0] - began, "gaps": [b - a for a, b in itertools.pairwise(times)]}


async def _workload(base: str, ns: argparse.Namespace, seed: int) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def images(client: int) -> list[dict]:
            out = []
            for r in range(ns.image_requests):
                first = seed + 1000 * client + 10 * r
                content = [{"type": "image_url", "image_url": {"url": _photo(first + i)}}
                           for i in range(ns.images)]  # fmt: skip
                content.append({"type": "text", "text": "What is in these pictures?"})
                out.append(await _chat(session, base, content, 16))
            return out

        async def text(client: int) -> list[dict]:
            return [await _chat(session, base, f"Count to {client * 10 + r}.", ns.text_tokens)
                    for r in range(ns.text_requests)]  # fmt: skip

        began = time.monotonic()
        results = await asyncio.gather(*[images(c) for c in range(ns.image_clients)],
                                       *[text(c) for c in range(ns.text_clients)])  # fmt: skip
        seconds = time.monotonic() - began
    image_runs = [r for rs in results[: ns.image_clients] for r in rs]
    text_runs = [r for rs in results[ns.image_clients :] for r in rs]
    return {"images": image_runs, "text": text_runs, "seconds": seconds}


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3


async def _metrics(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def main_async(ns: argparse.Namespace) -> int:
    model = write_model(ns.out, ns.tiny)
    servers = Servers(ns, model)
    rows = []
    for with_encoder in (False, True):
        try:
            urls = await servers.cluster(with_encoder)
            await _workload(
                urls["coordinator"],
                argparse.Namespace(**{**vars(ns), "image_requests": 1, "text_requests": 1}),
                seed=7,
            )  # warm-up
            run = await _workload(urls["coordinator"], ns, seed=100 if with_encoder else 200)
            tower = await _metrics(urls["encode" if with_encoder else "mixed"])
        finally:
            servers.stop()
        images = [r["ttft"] for r in run["images"]]
        text_ttft = [r["ttft"] for r in run["text"]]
        gaps = [g for r in run["text"] for g in r["gaps"]]
        num_images = len(images) * ns.images
        rows.append((
            "mixed node + encode node" if with_encoder else "mixed node alone",
            _p(images, 50), _p(images, 99), _p(text_ttft, 50), _p(text_ttft, 99),
            _p(gaps, 50), _p(gaps, 99), num_images / run["seconds"],
            tower.get("deepinfer_image_encode_seconds_total", 0.0) * 1e3
            / max(tower.get("deepinfer_images_encoded_total", 1.0), 1.0),
        ))  # fmt: skip
    print(f"{ns.image_clients} image clients x {ns.image_requests} requests of {ns.images} "
          f"images (640x480, distinct), 16 tokens out; {ns.text_clients} text clients x "
          f"{ns.text_requests} requests, {ns.text_tokens} tokens out; all at once")  # fmt: skip
    print("| setup | image TTFT p50 ms | image TTFT p99 ms | text TTFT p50 ms | text TTFT p99 ms "
          "| text ITL p50 ms | text ITL p99 ms | images/s | tower ms per image |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.2f} | {:.2f} | {:.2f} | {:.1f} |"
              .format(*row))  # fmt: skip
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the built-in tiny V4.1 on the CPU")
    ap.add_argument("--image-clients", type=int, default=4)
    ap.add_argument("--image-requests", type=int, default=6)
    ap.add_argument("--images", type=int, default=2)
    ap.add_argument("--text-clients", type=int, default=4)
    ap.add_argument("--text-requests", type=int, default=4)
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/encode_serve")))
    ns = ap.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    return asyncio.run(main_async(ns))


if __name__ == "__main__":
    sys.exit(main())
