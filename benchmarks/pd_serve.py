"""Prefill/decode hand-off through the server: the same workload against `deepinfer serve` (one
mixed node) and against `deepinfer coordinator --prefill-node --decode-node` over two nodes,
with each hand-off's bytes and seconds read from the nodes' /metrics.

    python3 -P benchmarks/pd_serve.py --tiny            # the built-in model, CPU, 1 thread a node
    python3 -P benchmarks/pd_serve.py [--layers swa,csa,hca,csa]   # V4-Flash-shaped layers,
        random bf16, both nodes on one GPU (bash scripts/gpu_bench.sh benchmarks/pd_serve.py)

Every server is a real process; the workload is `deepinfer bench serve --dataset-name random
--ignore-eos` at each --concurrency. Printed: TTFT, ITL and output tok/s of both setups, the
hand-offs' mean size and time, their rate against this machine's host copy bandwidth (measured
in the same run), and the transfers' failures (0 expected). On one GPU the two nodes share the
device, so this shows what the hand-off costs, not what disaggregation buys (that needs nodes on
their own accelerators: the second part of the work).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from serve_graphs import _free_port, _get
from v4_flash import LAYER_TYPES, write_config


def _bench(base: str, concurrency: int, name: str, ns: argparse.Namespace) -> dict:
    command = [
        sys.executable, "-P", "-m", "deepinfer.cli", "bench", "serve", "--base-url", base,
        "--dataset-name", "random", "--random-input-len", str(ns.input_len),
        "--random-output-len", str(ns.output_len), "--ignore-eos",
        "--max-concurrency", str(concurrency), "--num-prompts", str(ns.num_prompts),
        "--request-rate", "inf", "--save-result", "--result-dir", str(ns.out),
        "--result-filename", f"{name}.json", "--disable-tqdm",
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads((ns.out / f"{name}.json").read_text())


def _samples(base: str) -> dict:
    _, text = _get(base + "/metrics")
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("deepinfer_kv_transfer"):
                key = (s.name, s.labels.get("direction"), s.labels.get("reason"))
                out[key] = out.get(key, 0.0) + s.value
    return out


class Servers:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.env = {**os.environ, "DEEPINFER_MODEL_MAX_MODEL_LEN": str(ns.max_model_len)}
        if ns.tiny:
            self.common = ["--device", "cpu", "--num-threads", "1"]
        else:
            layers = [LAYER_TYPES[name] for name in ns.layers.split(",")]
            model_dir = write_config(ns.out / "v4-flash-shaped", layers)
            self.common = ["--model", str(model_dir), "--gpu-memory-utilization", "0.4"]
            self.env["DEEPINFER_MODEL_RANDOM_WEIGHTS"] = "true"
        self.running: list[subprocess.Popen] = []

    def start(self, name: str, *args: str) -> None:
        log = (self.ns.out / f"{name}.log").open("wb")
        argv = [sys.executable, "-P", "-m", "deepinfer.cli", *args]
        self.running.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=log))

    def wait(self, *bases: str) -> None:
        deadline = time.monotonic() + 600
        for base in bases:
            while _get(base + "/ready")[0] != 200:
                assert all(p.poll() is None for p in self.running), "a server exited: see logs"
                assert time.monotonic() < deadline, f"{base} never ready"
                time.sleep(0.5)

    def stop(self) -> None:
        for process in self.running:
            process.terminate()
        for process in self.running:
            process.wait(timeout=60)
        self.running = []


def _row(setup: str, concurrency: int, r: dict) -> tuple:
    m = r["metrics"]
    return (setup, concurrency, r["completed"], r["failed"], m["ttft"]["median_ms"],
            m["ttft"]["percentiles_ms"]["99"], m["itl"]["median_ms"],
            m["itl"]["percentiles_ms"]["99"], r["output_throughput"])  # fmt: skip


def _host_copy_gbps() -> float:
    """A 256 MiB host-to-host copy: this machine's memcpy rate (GB/s), best of 5."""
    a = torch.empty(256 << 20, dtype=torch.uint8)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - start)
    return a.numel() / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the built-in model on the CPU")
    ap.add_argument("--layers", default="swa,csa,hca,csa")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/pd_serve")))
    ns = ap.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    servers = Servers(ns)
    levels = [int(c) for c in ns.concurrency.split(",")]
    rows = []

    port = _free_port()
    serve = f"http://127.0.0.1:{port}"
    servers.start("serve", "serve", *servers.common, "--port", str(port),
                  "--internal-port", str(_free_port()))  # fmt: skip
    try:
        servers.wait(serve)
        rows += [_row("mixed", c, _bench(serve, c, f"mixed_c{c}", ns)) for c in levels]
    finally:
        servers.stop()

    ports = {role: _free_port() for role in ("prefill", "decode", "coordinator")}
    nodes = {role: f"http://127.0.0.1:{ports[role]}" for role in ("prefill", "decode")}
    for role in ("decode", "prefill"):
        servers.start(role, "node", *servers.common, "--role", role, "--port", str(ports[role]))
    coordinator = f"http://127.0.0.1:{ports['coordinator']}"
    servers.start("coordinator", "coordinator", "--port", str(ports["coordinator"]),
                  "--internal-port", str(_free_port()), "--max-model-len", str(ns.max_model_len),
                  "--prefill-node", nodes["prefill"], "--decode-node", nodes["decode"])  # fmt: skip
    try:
        servers.wait(nodes["decode"], nodes["prefill"], coordinator)
        rows += [_row("P/D", c, _bench(coordinator, c, f"pd_c{c}", ns)) for c in levels]
        sent, received = _samples(nodes["prefill"]), _samples(nodes["decode"])
    finally:
        servers.stop()

    print(f"{ns.input_len} in / {ns.output_len} out, {ns.num_prompts} prompts a level")
    print("| setup | c | completed | failed | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
          "ITL p99 ms | output tok/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| {} | {} | {} | {} | {:.1f} | {:.1f} | {:.2f} | {:.2f} | {:.0f} |".format(*row))
    count = sent[("deepinfer_kv_transfer_seconds_count", "send", None)]
    num_bytes = sent[("deepinfer_kv_transfer_bytes_total", "send", None)]
    seconds = sent[("deepinfer_kv_transfer_seconds_sum", "send", None)]
    recv_seconds = received[("deepinfer_kv_transfer_seconds_sum", "recv", None)]
    failures = {k: v for k, v in {**sent, **received}.items() if "failures" in k[0] and v}
    copy = _host_copy_gbps()
    rate = num_bytes / seconds / 1e9
    same = received[("deepinfer_kv_transfer_bytes_total", "recv", None)] == num_bytes
    print(
        f"hand-offs: {count:.0f}, {num_bytes / count / 2**20:.2f} MiB each; send "
        f"{seconds / count * 1e3:.1f} ms (the wait for the decode node's collect included), "
        f"receive {recv_seconds / count * 1e3:.1f} ms; {rate:.2f} GB/s sent = "
        f"{rate / copy:.3f} of this host's copy rate ({copy:.1f} GB/s); bytes received "
        f"{'equal' if same else 'DIFFER from'} those sent; failures: {failures or 0}"
    )
    return 0 if not failures and all(r[3] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
