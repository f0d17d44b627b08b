"""What cache-aware routing buys, through the server: 4 registered nodes behind
`deepinfer coordinator`, once per routing policy, on workloads that share prefixes; and one
node alone on the same workload (every prefix meets every earlier one there: the hit rate
routing cannot beat with these caches).

    python3 -P benchmarks/cache_routing.py          # the built-in model, CPU, 1 thread a node

Every server is a real process; each setup gets fresh ones (cold caches). `deepinfer bench
serve` drives each workload: ``shared-prefix`` (SGLang's generated-shared-prefix: groups of
questions under one long system prompt, in random order) and ``multi-turn`` (conversations whose
turns carry the history). Printed per setup and workload: the cached-token rate the API
reported, TTFT p50/p99, requests per node, the router's predicted vs the nodes' reported cached
tokens, the load guard's choices, and the widest load spread seen between the nodes (each
node's running + waiting requests, sampled every 50 ms) against the guard's bound.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from serve_graphs import _free_port, _get

from deepinfer.config import RoutingConfig

WORKLOADS = {
    "shared-prefix": [
        "--dataset-name", "shared-prefix", "--shared-prefix-num-groups", "8",
        "--shared-prefix-prompts-per-group", "6", "--shared-prefix-system-len", "1024",
        "--shared-prefix-question-len", "64", "--shared-prefix-output-len", "8",
        "--num-prompts", "48", "--max-concurrency", "8",
    ],
    "multi-turn": [
        "--dataset-name", "multi-turn", "--multi-turn-num-conversations", "16",
        "--multi-turn-turns", "4", "--multi-turn-user-len", "192",
        "--multi-turn-output-len", "24", "--num-prompts", "64", "--max-concurrency", "8",
        "--ignore-eos",
    ],
}  # fmt: skip


class Fleet:
    """A coordinator and ``num_nodes`` registered nodes of the built-in model."""

    def __init__(self, policy: str, num_nodes: int, out: Path, routing: dict[str, str]) -> None:
        self.port, internal = _free_port(), _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "DEEPINFER_ROUTING_POLICY": policy,
            "DEEPINFER_NODE_COORDINATOR_INTERNAL_URL": f"http://127.0.0.1:{internal}",
            "DEEPINFER_CACHE_HOST_TIER_GIB": "0",
            **{f"DEEPINFER_ROUTING_{k.upper()}": v for k, v in routing.items()},
        }
        cli = [sys.executable, "-P", "-m", "deepinfer.cli"]
        self.logs = []
        self.processes = []
        self.node_urls = []
        self._start(
            [*cli, "coordinator", "--port", str(self.port), "--internal-port", str(internal)],
            env, out / f"{policy}-coordinator.log",
        )  # fmt: skip
        for i in range(num_nodes):
            port = _free_port()
            self.node_urls.append(f"http://127.0.0.1:{port}")
            node_env = {**env, "DEEPINFER_NODE_NODE_ID": f"node{i}"}
            self._start(
                [*cli, "node", "--device", "cpu", "--num-threads", "1", "--port", str(port)],
                node_env, out / f"{policy}-node{i}.log",
            )  # fmt: skip
        deadline = time.monotonic() + 300
        while True:
            status, text = _get(self.base + "/ready")
            if status == 200 and json.loads(text)["num_ready_nodes"] == num_nodes:
                break
            assert time.monotonic() < deadline, f"{num_nodes} nodes never ready: {text}"
            assert all(p.poll() is None for p in self.processes), "a server exited"
            time.sleep(0.2)

    def _start(self, argv: list[str], env: dict, log: Path) -> None:
        handle = log.open("wb")
        self.logs.append(handle)
        self.processes.append(subprocess.Popen(argv, env=env, stdout=handle, stderr=handle))

    def _node_sums(self, names: tuple[str, ...]) -> list[float]:
        """Per node: the sum of these samples (a family's counters: its ``_total``)."""
        sums = []
        for url in self.node_urls:
            _, text = _get(url + "/metrics")
            samples = (s for f in text_string_to_metric_families(text) for s in f.samples)
            sums.append(sum(s.value for s in samples if s.name in names))
        return sums

    def node_loads(self) -> list[float]:
        """Requests running and waiting on each node."""
        return self._node_sums(("deepinfer_num_requests_running", "deepinfer_num_requests_waiting"))

    def node_requests(self) -> list[int]:
        """Requests each node finished."""
        return [int(n) for n in self._node_sums(("deepinfer_finished_requests_total",))]

    def router(self) -> dict[str, dict[str, float]]:
        _, text = _get(self.base + "/metrics")
        out: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(text):
            if not family.name.startswith("deepinfer_router_"):
                continue
            for s in family.samples:
                name = s.name + (f"[{s.labels['source']}]" if "source" in s.labels else "")
                node = s.labels.get("node", "")
                out.setdefault(name, {})[node] = out.get(name, {}).get(node, 0) + s.value
        return out

    def stop(self) -> None:
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for handle in self.logs:
            handle.close()


class LoadSampler(threading.Thread):
    """The widest spread of the nodes' loads, and samples where the guard's bound is passed."""

    def __init__(self, fleet: Fleet, guard: RoutingConfig) -> None:
        super().__init__(daemon=True)
        self.fleet, self.guard = fleet, guard
        self.max_spread = 0.0
        self.num_samples = self.num_over_guard = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            loads = self.fleet.node_loads()
            least, most = min(loads), max(loads)
            self.max_spread = max(self.max_spread, most - least)
            self.num_samples += 1
            g = self.guard
            if most - least > g.balance_abs_requests and most > g.balance_ratio * least:
                self.num_over_guard += 1
            time.sleep(0.05)


def run_setup(policy: str, num_nodes: int, workload: str, ns: argparse.Namespace) -> dict:
    cost = ns.request_cost_tokens
    routing = {} if cost is None else {"request_cost_tokens": str(cost)}
    fleet = Fleet(policy, num_nodes, ns.out, routing)
    name = f"{policy}-{num_nodes}-{workload}"
    try:
        sampler = LoadSampler(fleet, RoutingConfig())
        sampler.start()
        command = [
            sys.executable, "-P", "-m", "deepinfer.cli", "bench", "serve", "--base-url",
            fleet.base, *WORKLOADS[workload], "--seed", "3", "--save-result", "--result-dir",
            str(ns.out), "--result-filename", f"{name}.json", "--disable-tqdm",
        ]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        sampler.done.set()
        sampler.join()
        result = json.loads((ns.out / f"{name}.json").read_text())
        router = fleet.router()
        per_node = fleet.node_requests()
    finally:
        fleet.stop()
    predicted = "deepinfer_router_predicted_cached_tokens_total"
    return {
        "setup": f"{num_nodes} x {policy}" if num_nodes > 1 else "1 node",
        "workload": workload,
        "completed": result["completed"],
        "failed": result.get("failed", 0),
        "hit_rate": result["cache_hit_rate"],
        "ttft_p50": result.get("median_ttft_ms"),
        "ttft_p99": result.get("p99_ttft_ms"),
        "per_node": "/".join(map(str, per_node)),
        "predicted": sum(router.get(f"{predicted}[index]", {}).values()),
        "in_flight": sum(router.get(f"{predicted}[in_flight]", {}).values()),
        "reported": sum(router.get("deepinfer_router_reported_cached_tokens_total", {}).values()),
        "mispredicted": sum(
            router.get("deepinfer_router_mispredicted_requests_total", {}).values()
        ),
        "guarded": sum(router.get("deepinfer_router_guarded_choices_total", {}).values()),
        "max_spread": sampler.max_spread,
        "over_guard": f"{sampler.num_over_guard}/{sampler.num_samples}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--policies", default="round_robin,least_loaded,cache_aware")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--out", type=Path, default=Path("/tmp/cache_routing"))
    parser.add_argument("--one-node", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--request-cost-tokens", type=int, default=None, help="routing.request_cost_tokens"
    )
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for workload in ns.workloads.split(","):
        if ns.one_node:
            rows.append(run_setup("least_loaded", 1, workload, ns))
        for policy in ns.policies.split(","):
            rows.append(run_setup(policy, ns.nodes, workload, ns))
            print(json.dumps(rows[-1]), flush=True)
    columns = [
        "workload", "setup", "completed", "failed", "hit_rate", "ttft_p50", "ttft_p99",
        "per_node", "predicted", "in_flight", "reported", "mispredicted", "guarded",
        "max_spread", "over_guard",
    ]  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = []
        for c in columns:
            v = row[c]
            cells.append(
                f"{v:.3f}" if c == "hit_rate" else f"{v:.1f}" if isinstance(v, float) else str(v)
            )
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
