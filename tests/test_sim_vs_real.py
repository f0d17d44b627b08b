"""`deepinfer sim` against the real thing: a Mooncake-style trace replayed with `deepinfer bench
serve` through a coordinator and 2 nodes (the built-in model on the CPU) whose pools are too
small for every document (so the LRU evicts), and the simulator on the same trace and fleet:
their cached-token rates within 2 percentage points. One request is in flight at a time, so
what each finds cached does not hang on the CPU's speed (the simulator's requests, at the
H200's speed, never overlap on this trace). TTFT is printed
next to the simulator's, not compared (the speed model is the H200's)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from processes import Process, clean_env, free_port

from deepinfer.bench.datasets import read_trace
from deepinfer.bench.sim import FleetSpec, simulate

NUM_NODES = 2
NODE_BLOCKS = 40  # 128-token blocks per node: 10 of the trace's 512-token blocks, so LRU evicts
# (the simulator models the nodes' block size: node_block_tokens)


def _trace(path: Path) -> None:
    """40 requests on 8 documents of 1-2 shared blocks each, a unique tail, 0.4 s apart."""
    rng = random.Random(5)
    docs = [tuple(range(10 * d, 10 * d + rng.choice((1, 2)))) for d in range(8)]
    rows = []
    for i in range(40):
        doc = rng.choice(docs)
        tail = rng.randrange(40, 500)
        rows.append({
            "timestamp": 400 * i, "input_length": 512 * len(doc) + tail, "output_length": 2,
            "hash_ids": [*doc, 1000 + i],
        })  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_simulated_hit_rate_matches_the_servers(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    _trace(trace)
    port, internal = free_port(), free_port()
    env = clean_env(
        XDG_CACHE_HOME=str(tmp_path / "xdg"),
        DEEPINFER_NODE_COORDINATOR_INTERNAL_URL=f"http://127.0.0.1:{internal}",
        DEEPINFER_CACHE_NUM_BLOCKS=str(NODE_BLOCKS),
        DEEPINFER_CACHE_HOST_TIER_GIB="0",
        # Requests land by arrival order alone, in both: what is compared is the caches'
        # hits and evictions (cache_aware's ties are broken by hashing the prompt's tokens,
        # which the trace has not: the simulator hashes block ids).
        DEEPINFER_ROUTING_POLICY="round_robin",
    )
    processes = [
        Process.start(["coordinator", "--port", str(port), "--internal-port", str(internal)],
                      env, tmp_path / "coordinator.log", tmp_path)
    ]  # fmt: skip
    try:
        for i in range(NUM_NODES):
            node_env = {**env, "DEEPINFER_NODE_NODE_ID": f"node{i}"}
            args = ["node", "--device", "cpu", "--num-threads", "1", "--port", str(free_port())]
            processes.append(Process.start(args, node_env, tmp_path / f"node{i}.log", tmp_path))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while _ready_nodes(base) < NUM_NODES:
            assert time.monotonic() < deadline, processes[0].log
            time.sleep(0.2)
        subprocess.run(
            [sys.executable, "-m", "deepinfer.cli", "bench", "serve", "--base-url", base,
             "--backend", "openai", "--dataset-name", "trace", "--dataset-path", str(trace),
             "--save-result", "--result-dir", str(tmp_path), "--result-filename", "real.json",
             "--max-concurrency", "1", "--disable-tqdm"],
            check=True, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, timeout=300,
        )  # fmt: skip
    finally:
        for process in processes:
            process.stop()
    real = json.loads((tmp_path / "real.json").read_text())
    assert real["completed"] == 40 and real["num_missing_usage"] == 0
    spec = FleetSpec(num_nodes=NUM_NODES, capacity_blocks=NODE_BLOCKS, node_block_tokens=128)
    sim = simulate(read_trace(trace), spec, "round_robin")
    print(
        f"hit rate: real {real['cache_hit_rate']:.4f}, simulated {sim['hit_rate']:.4f}; "
        f"TTFT p50 ms: real {real['median_ttft_ms']:.0f} (CPU), simulated {sim['ttft_p50_ms']:.0f}"
    )
    assert sim["hit_rate"] > 0.2
    assert abs(real["cache_hit_rate"] - sim["hit_rate"]) <= 0.02


def _ready_nodes(base: str) -> int:
    try:
        with urllib.request.urlopen(f"{base}/ready", timeout=5) as response:
            return json.loads(response.read())["num_ready_nodes"]
    except OSError:
        return 0
