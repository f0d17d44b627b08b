"""Cache-aware routing's view on real processes: a coordinator and two nodes that share a disk
tier, each node with a small device pool and host tier so that hits come from every tier. For
every request the coordinator's predicted hit on the node it chose equals the cached tokens
that node reports (through the API's usage and the router's metrics); a node killed with
``kill -9`` loses its index entries once its heartbeats stop."""

from __future__ import annotations

import json
import random
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from processes import Process, clean_env, free_port
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.model.tiny import make_tiny_model

NODES = ("n1", "n2")


@dataclass
class Fleet:
    public: str
    coordinator: Process
    nodes: dict[str, tuple[Process, str]]  # node id -> (process, its URL)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("cache-routing")
    model = make_tiny_model(tmp / "tiny")
    port, internal = free_port(), free_port()
    env = clean_env(
        XDG_CACHE_HOME=str(tmp / "xdg"),
        DEEPINFER_MODEL_PATH=str(model),
        DEEPINFER_MODEL_DEVICE="cpu",
        DEEPINFER_KERNEL_NUM_THREADS="1",
        DEEPINFER_CACHE_BLOCK_SIZE="16",
        DEEPINFER_CACHE_NUM_BLOCKS="24",
        DEEPINFER_CACHE_HOST_TIER_GIB="0.00005",
        DEEPINFER_CACHE_DISK_TIER_DIR=str(tmp / "shared-disk"),
        DEEPINFER_NODE_COORDINATOR_INTERNAL_URL=f"http://127.0.0.1:{internal}",
        DEEPINFER_NODE_HEARTBEAT_INTERVAL_S="0.5",
        DEEPINFER_SERVER_HEARTBEAT_TIMEOUT_S="2",
        DEEPINFER_ROUTING_POLICY="round_robin",  # every node in turn: cross-node disk hits
    )
    processes: list[Process] = []
    try:
        coordinator = Process.start(
            ["coordinator", "--port", str(port), "--internal-port", str(internal)],
            env, tmp / "coordinator.log", tmp,
        )  # fmt: skip
        processes.append(coordinator)
        nodes = {}
        for node_id in NODES:
            node_port = free_port()
            node_env = {**env, "DEEPINFER_NODE_NODE_ID": node_id}
            process = Process.start(
                ["node", "--port", str(node_port)], node_env, tmp / f"{node_id}.log", tmp
            )
            processes.append(process)
            nodes[node_id] = (process, f"http://127.0.0.1:{node_port}")
        public = f"http://127.0.0.1:{port}"
        coordinator.wait_for(f"{public}/health")
        for process, _ in nodes.values():
            process.wait_for_log("cache snapshot sent to", timeout_s=120)
        yield Fleet(public, coordinator, nodes)
    finally:
        for process in processes:
            process.stop()


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in s.labels.items() if k == "node" or k == "tier")
            )
            out[s.name, labels] = out.get((s.name, labels), 0.0) + s.value  # other labels summed
    return out


def _in_step(fleet: Fleet) -> None:
    """Wait until the coordinator applied every node's newest cache event."""
    deadline = time.monotonic() + 20
    for node_id, (_, url) in fleet.nodes.items():
        while True:
            node_seq = _scrape(url)["deepinfer_cache_event_seq", (("node", node_id),)]
            index_seq = _scrape(fleet.public).get(
                ("deepinfer_router_index_seq", (("node", node_id),))
            )
            if index_seq == node_seq:
                break
            assert time.monotonic() < deadline, f"{node_id}: index at {index_seq}, node {node_seq}"
            time.sleep(0.05)


def _complete(fleet: Fleet, prompt: list[int]) -> int:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    request = urllib.request.Request(
        f"{fleet.public}/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        usage = json.loads(response.read())["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _num_finished(fleet: Fleet) -> float:
    samples = _scrape(fleet.public)
    return sum(v for (n, _), v in samples.items() if n == "deepinfer_finished_requests_total")


def _router_counts(fleet: Fleet, name: str) -> dict[str, float]:
    """A router counter per node (summed over its other labels)."""
    counts: dict[str, float] = {}
    for (n, labels), value in _scrape(fleet.public).items():
        if n == f"{name}_total":
            node = dict(labels)["node"]
            counts[node] = counts.get(node, 0) + value
    return counts


def test_predicted_hits_equal_the_nodes_cached_tokens(fleet: Fleet) -> None:
    rng = random.Random(7)
    system = [rng.randrange(1000, 100_000) for _ in range(120)]
    others = [[rng.randrange(1000, 100_000) for _ in range(250)] for _ in range(3)]
    # Round robin: n1, n2, n1, ... Shared prefixes meet each other's blocks on the shared disk,
    # unrelated prompts push blocks out of the small device pools and host tiers.
    prompts = [
        [*system, 5, 6, 7], system + [8, 9] * 20, others[0], system[:70], others[1],
        [*system, 5, 6, 7], others[2], system[:100] + others[0][:40], others[0][:200], system,
    ]  # fmt: skip
    total_cached = 0
    for prompt in prompts:
        _in_step(fleet)
        before = _router_counts(fleet, "deepinfer_router_predicted_cached_tokens")
        finished = _num_finished(fleet)
        cached = _complete(fleet, prompt)
        deadline = time.monotonic() + 10  # counted once the request's handler has ended
        while _num_finished(fleet) == finished:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        after = _router_counts(fleet, "deepinfer_router_predicted_cached_tokens")
        predicted = sum(after.values()) - sum(before.values())
        assert predicted == cached, (prompt[:4], predicted, cached)
        total_cached += cached
    assert total_cached >= 16 * 10
    reported = _router_counts(fleet, "deepinfer_router_reported_cached_tokens")
    assert reported == _router_counts(fleet, "deepinfer_router_predicted_cached_tokens")
    assert not any(_router_counts(fleet, "deepinfer_router_mispredicted_requests").values())
    # Every tier served: the nodes' own counters by tier.
    tiers = {}
    for _, url in fleet.nodes.values():
        for (name, labels), value in _scrape(url).items():
            if name == "deepinfer_cached_prompt_tokens_total":
                tier = dict(labels)["tier"]
                tiers[tier] = tiers.get(tier, 0) + value
    assert {k for k, v in tiers.items() if v} == {"device", "host", "disk"}, tiers


def test_a_killed_node_loses_its_index_entries(fleet: Fleet) -> None:
    process, _ = fleet.nodes["n2"]
    blocks = _scrape(fleet.public)
    assert blocks.get(("deepinfer_router_index_blocks", (("node", "n2"), ("tier", "device"))))
    process.popen.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 15
    while True:
        samples = _scrape(fleet.public)
        seq = samples.get(("deepinfer_router_index_seq", (("node", "n2"),)))
        device = samples.get(
            ("deepinfer_router_index_blocks", (("node", "n2"), ("tier", "device")))
        )
        if seq == -1 and device == 0:
            break
        assert time.monotonic() < deadline, (seq, device)
        time.sleep(0.1)
    assert _complete(fleet, list(range(1000, 1040))) == 0  # n1 serves alone
