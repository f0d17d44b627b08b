"""What prefill/decode disaggregation buys, through the server: one prefill + one decode node
against two mixed nodes behind `deepinfer coordinator`, on a mixed workload (long prompts
arriving while other requests decode), with each hand-off's bytes and seconds read from the
nodes' /metrics.

    python3 -P benchmarks/pd_serve.py --tiny            # the built-in model, CPU, 1 thread a node
    python3 -P benchmarks/pd_serve.py [--layers swa,csa,hca,csa]   # V4-Flash-shaped layers,
        random bf16, all nodes on one GPU (bash scripts/gpu_bench.sh benchmarks/pd_serve.py)

Every server is a real process. Two `deepinfer bench serve` clients run at once against each
setup: the decode stream (short prompts, long outputs, --decode-concurrency at a time) and the
long prompts (--long-len tokens in, 16 out, --long-rate a second, Poisson). Printed per setup:
the decode stream's ITL and TPOT, the long prompts' TTFT (p50, p99), output tok/s; for the pair,
the hand-offs' mean size and time and their rate against this machine's copy rates (host
memcpy; on a GPU also device to host and device to device), measured in the same run. On a GPU
the pair runs twice: its hand-offs through CUDA IPC (the default for two nodes on one GPU) and
through host memory (`--kv-transfer-path host`, as between machines).
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


def _bench_command(base: str, name: str, ns: argparse.Namespace, kind: str) -> list[str]:
    if kind == "decode":
        shape = ["--random-input-len", "128", "--random-output-len", str(ns.decode_len),
                 "--max-concurrency", str(ns.decode_concurrency),
                 "--num-prompts", str(ns.decode_prompts), "--request-rate", "inf"]  # fmt: skip
    else:
        shape = ["--random-input-len", str(ns.long_len), "--random-output-len", "16",
                 "--num-prompts", str(ns.long_prompts), "--request-rate", str(ns.long_rate),
                 "--seed", "1"]  # fmt: skip
    return [
        sys.executable, "-P", "-m", "deepinfer.cli", "bench", "serve", "--base-url", base,
        "--dataset-name", "random", "--ignore-eos", *shape, "--save-result",
        "--result-dir", str(ns.out), "--result-filename", f"{name}_{kind}.json", "--disable-tqdm",
    ]  # fmt: skip


def _run_workload(base: str, name: str, ns: argparse.Namespace) -> dict[str, dict]:
    """Both clients at once; their results by kind."""
    clients = {
        kind: subprocess.Popen(_bench_command(base, name, ns, kind), stdout=subprocess.DEVNULL)
        for kind in ("decode", "long")
    }
    for kind, client in clients.items():
        assert client.wait() == 0, f"bench serve ({kind}) failed"
    return {k: json.loads((ns.out / f"{name}_{k}.json").read_text()) for k in clients}


def _samples(base: str) -> dict:
    _, text = _get(base + "/metrics")
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("deepinfer_kv_transfer"):
                key = (s.name, s.labels.get("direction"), s.labels.get("reason"))
                out[key] = out.get(key, 0.0) + s.value  # the bytes: summed over the paths
                if "path" in s.labels and s.value:
                    out["paths"] = {*out.get("paths", ()), s.labels["path"]}
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
            self.common = ["--model", str(model_dir), "--gpu-memory-utilization", "0.45"]
            self.env["DEEPINFER_MODEL_RANDOM_WEIGHTS"] = "true"
        self.running: list[subprocess.Popen] = []

    def start(self, name: str, *args: str) -> None:
        log = (self.ns.out / f"{name}.log").open("wb")
        argv = [sys.executable, "-P", "-m", "deepinfer.cli", *args]
        self.running.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=log))

    def cluster(self, roles: tuple[str, str], path: str) -> tuple[str, dict[str, str]]:
        """Two nodes of ``roles`` (hand-offs on ``path``: kv_transfer.path) and a coordinator
        over them; (its URL, the nodes' URLs)."""
        self.env["DEEPINFER_KV_TRANSFER_PATH"] = path
        nodes, flags = {}, []
        for i, role in enumerate(roles):
            port = _free_port()
            name = f"{role}{i}"
            nodes[name] = f"http://127.0.0.1:{port}"
            self.start(name, "node", *self.common, "--role", role, "--port", str(port))
            flags += ["--node" if role == "mixed" else f"--{role}-node", nodes[name]]
        port = _free_port()
        limit = str(self.ns.max_model_len)
        self.start("coordinator", "coordinator", "--port", str(port), "--internal-port",
                   str(_free_port()), "--max-model-len", limit, *flags)  # fmt: skip
        coordinator = f"http://127.0.0.1:{port}"
        self.wait(*nodes.values(), coordinator)
        return coordinator, nodes

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


def _row(setup: str, results: dict[str, dict]) -> tuple:
    d, long = results["decode"], results["long"]
    return (setup, d["completed"] + long["completed"], d["failed"] + long["failed"],
            d["metrics"]["itl"]["median_ms"], d["metrics"]["itl"]["percentiles_ms"]["99"],
            d["metrics"]["tpot"]["median_ms"], long["metrics"]["ttft"]["median_ms"],
            long["metrics"]["ttft"]["percentiles_ms"]["99"],
            d["output_throughput"] + long["output_throughput"])  # fmt: skip


def _copy_gbps(source: str, target: str) -> float:
    """A 256 MiB copy from ``source`` to ``target`` ("cpu" or "cuda"; host memory pinned when the
    other end is the GPU), best of 5, GB/s."""
    pinned = "cuda" in (source, target)
    a, b = (torch.empty(256 << 20, dtype=torch.uint8, device=d, pin_memory=pinned and d == "cpu")
            for d in (source, target))  # fmt: skip
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        b.copy_(a)
        if pinned:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return a.numel() / best / 1e9


def _hand_offs(setup: str, sent: dict, received: dict, copies: dict[str, float]) -> str:
    count = sent[("deepinfer_kv_transfer_seconds_count", "send", None)]
    num_bytes = sent[("deepinfer_kv_transfer_bytes_total", "send", None)]
    seconds = sent[("deepinfer_kv_transfer_seconds_sum", "send", None)]
    recv_seconds = received[("deepinfer_kv_transfer_seconds_sum", "recv", None)]
    same = received[("deepinfer_kv_transfer_bytes_total", "recv", None)] == num_bytes
    rate = num_bytes / seconds / 1e9
    against = ", ".join(f"{rate / v:.3f} of {k} ({v:.1f} GB/s)" for k, v in copies.items())
    return (
        f"{setup}: {count:.0f} hand-offs through {'+'.join(sorted(sent.get('paths', ())))}, "
        f"{num_bytes / count / 2**20:.2f} MiB each; send {seconds / count * 1e3:.1f} ms (the "
        f"wait for the decode node's collect included), receive "
        f"{recv_seconds / count * 1e3:.1f} ms; {rate:.2f} GB/s sent = {against}; bytes received "
        f"{'equal' if same else 'DIFFER from'} those sent"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the built-in model on the CPU")
    ap.add_argument("--layers", default="swa,csa,hca,csa")
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--decode-len", type=int, default=256)
    ap.add_argument("--decode-concurrency", type=int, default=4)
    ap.add_argument("--decode-prompts", type=int, default=16)
    ap.add_argument("--long-len", type=int, default=8192)
    ap.add_argument("--long-rate", type=float, default=1.0)
    ap.add_argument("--long-prompts", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/pd_serve")))
    ns = ap.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    servers = Servers(ns)
    setups = [
        ("2 mixed", ("mixed", "mixed"), "auto"),
        ("1P + 1D (host)", ("prefill", "decode"), "host"),
    ]
    if not ns.tiny:
        setups.append(("1P + 1D (ipc)", ("prefill", "decode"), "auto"))
    rows, transfers = [], {}
    for setup, roles, path in setups:
        try:
            coordinator, nodes = servers.cluster(roles, path)
            name = setup.replace(" ", "").replace("(", "_").replace(")", "")
            rows.append(_row(setup, _run_workload(coordinator, name, ns)))
            if "prefill0" in nodes:
                transfers[setup] = (_samples(nodes["prefill0"]), _samples(nodes["decode1"]))
        finally:
            servers.stop()

    print(f"decode stream: 128 in / {ns.decode_len} out, {ns.decode_concurrency} at a time, "
          f"{ns.decode_prompts} requests; long prompts: {ns.long_len} in / 16 out, "
          f"{ns.long_rate}/s, {ns.long_prompts} requests")  # fmt: skip
    print("| setup | completed | failed | decode ITL p50 ms | decode ITL p99 ms | "
          "decode TPOT p50 ms | long TTFT p50 ms | long TTFT p99 ms | output tok/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| {} | {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.1f} | {:.1f} | {:.0f} |".format(*row))
    copies = {"host memcpy": _copy_gbps("cpu", "cpu")}
    if torch.cuda.is_available():
        copies["device to pinned host"] = _copy_gbps("cuda", "cpu")
        copies["device to device"] = _copy_gbps("cuda", "cuda")
    failures = {}
    for setup, (sent, received) in transfers.items():
        print(_hand_offs(setup, sent, received, copies))
        failures |= {
            (setup, *k): v
            for k, v in {**sent, **received}.items()
            if k != "paths" and "failures" in k[0] and v
        }
    print(f"failures: {failures or 0}")
    return 0 if not failures and all(r[2] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
