"""`deepinfer sim`: its arithmetic on tiny traces worked out by hand, the real policies and
block manager under it, replication, and the command line."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest

from deepinfer.bench.datasets import TraceRecord
from deepinfer.bench.sim import FleetSpec, SpeedModel, replicate, simulate
from deepinfer.cli import main
from deepinfer.config import RoutingConfig

# 1 ms a prompt token; a decode step takes 10 ms alone, 16 ms with two requests.
SPEED = SpeedModel(
    prefill_ms_per_token=1.0, prefill_fixed_ms=0.0, decode_points=((1, 10.0), (2, 16.0))
)


def _spec(**kw) -> FleetSpec:
    return FleetSpec(
        **{"num_nodes": 1, "block_tokens": 4, "capacity_blocks": 64, "speed": SPEED, **kw}
    )


def _record(t: float, n_in: int, n_out: int, *ids: int) -> TraceRecord:
    return TraceRecord(timestamp_ms=t, input_length=n_in, output_length=n_out, hash_ids=ids)


def test_a_prefix_hit_and_its_times() -> None:
    trace = [_record(0, 9, 3, 1, 2, 3), _record(100, 9, 2, 1, 2, 4)]
    r = simulate(trace, _spec(), "least_loaded")
    # First: 9 ms of prefill (TTFT 9), then 2 steps of 10 ms: done at 29, TPOT 10.
    # Second: its first 2 full blocks (tokens 0-7; the 9th is always computed) are cached:
    # 1 token of prefill, first token at 101 (TTFT 1), one step: done at 111.
    assert r["hit_rate"] == pytest.approx(8 / 18)
    assert (r["ttft_p50_ms"], r["tpot_p50_ms"]) == (pytest.approx(5.0), pytest.approx(10.0))
    assert r["ttft_p99_ms"] == pytest.approx(9 - 0.01 * 8)  # numpy's linear percentile of 1, 9
    assert r["output_throughput"] == pytest.approx(5 / 0.111)
    assert r["load_imbalance"] == 1.0


def test_decode_steps_slow_down_with_the_batch() -> None:
    trace = [_record(0, 4, 4, 1), _record(0, 4, 3, 2)]
    r = simulate(trace, _spec(), "least_loaded")
    # Prefills one at a time: first tokens at 4 and 8. The first decodes alone for 4 ms
    # (0.4 of a step), then both at 16 ms a step: the second's 2 steps end at 40, the first's
    # last 0.6 step alone at 46. TPOT: (46 - 4) / 3 = 14 and (40 - 8) / 2 = 16.
    assert r["ttft_p50_ms"] == pytest.approx(6.0)
    assert r["tpot_p50_ms"] == pytest.approx(15.0)
    assert r["tpot_p99_ms"] == pytest.approx(14 + 2 * 0.99)
    assert r["output_throughput"] == pytest.approx(7 / 0.046)


def test_policies_and_lru_eviction_to_the_host_tier() -> None:
    # Two prompts of one document, then two of another, then the first again.
    doc_a, doc_b = (1, 2, 3), (5, 6, 7)
    trace = [
        _record(0, 13, 2, *doc_a, 4), _record(100, 13, 2, *doc_a, 9),
        _record(200, 13, 2, *doc_b, 8), _record(300, 13, 2, *doc_b, 10),
        _record(400, 13, 2, *doc_a, 11),
    ]  # fmt: skip
    two = _spec(num_nodes=2)
    # Round robin: node0 gets 0, 2, 4 and node1 gets 1, 3: only the last hits (doc_a on node0).
    assert simulate(trace, two, "round_robin")["hit_rate"] == pytest.approx(12 / 65)
    # Cache-aware: every repeat finds its document (3 full blocks = 12 tokens) where it went.
    cache_aware = simulate(trace, two, "cache_aware")
    assert cache_aware["hit_rate"] == pytest.approx(36 / 65)
    # One node with room for 5 blocks (a request holds 4): doc_b's requests evict doc_a's
    # blocks; with a host tier that keeps them, the last request still finds all 3.
    small = _spec(capacity_blocks=5)
    assert simulate(trace, small, "least_loaded")["hit_rate"] == pytest.approx(24 / 65)
    with_host = _spec(capacity_blocks=5, host_capacity_blocks=8)
    assert simulate(trace, with_host, "least_loaded")["hit_rate"] == pytest.approx(36 / 65)


def test_replicated_copies_are_independent() -> None:
    trace = [_record(10 * i, 13, 2, 1, 2, 3, 100 + i) for i in range(6)]
    copies = replicate(trace, 3, seed=1)
    assert len(copies) == 18
    assert [c.timestamp_ms for c in copies] == sorted(c.timestamp_ms for c in copies)
    namespaces = [{h // 106 for h in c.hash_ids} for c in copies]  # ids span 0..105
    assert all(len(ns) == 1 for ns in namespaces)
    assert sorted(ns.pop() for ns in namespaces) == [0] * 6 + [1] * 6 + [2] * 6
    assert max(c.timestamp_ms for c in copies) < 2 * 50  # offsets within the trace's span
    # Copies share nothing: one unlimited node hits each copy exactly as the trace alone.
    roomy = _spec(capacity_blocks=1024)
    one = simulate(trace, roomy, "least_loaded")["hit_rate"]
    assert one == pytest.approx(5 * 12 / (6 * 13))
    assert simulate(copies, roomy, "least_loaded")["hit_rate"] == pytest.approx(one)
    assert replicate(trace, 3, seed=1) == copies and replicate(trace, 3, seed=2) != copies


def test_the_command_line(tmp_path: Path, capsys, monkeypatch) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000 * i, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3 + i]}
        for i in range(8)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sim.json"
    assert main(["sim", "--trace", str(trace), "--nodes", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["policies"]) == {"round_robin", "least_loaded", "cache_aware"}
    for figures in result["policies"].values():
        assert {"hit_rate", "load_imbalance", "ttft_p50_ms", "ttft_p99_ms"} <= set(figures)
    assert result["policies"]["cache_aware"]["hit_rate"] == pytest.approx(7 * 1024 / (8 * 1100))
    assert "| cache_aware |" in capsys.readouterr().out
    assert main(["sim", "--trace", str(trace), "--nodes", "2", "--policies", "fastest"]) == 2
    assert "'fastest' is not one of" in capsys.readouterr().err

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["sim", "--trace", str(trace), "--nodes", "2", "--plot-dir", str(tmp_path)]) == 2
    assert "pip install 'deepinfer[test]'" in capsys.readouterr().err


@pytest.mark.parametrize("num_nodes, span_ms", [(12, 3000), (150, 60_000)])
@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "cache_aware"])
def test_the_shortlist_chooses_as_the_whole_fleet_does(
    policy: str, num_nodes: int, span_ms: int
) -> None:
    """The simulator hands each policy the few nodes that can win; the choices are those the
    policy makes over every node, on a busy fleet (shared prefixes, the guard at work,
    evictions, a host tier) and on a mostly idle one (ties among more than 64 nodes: the ring
    walk): every request lands on the same node with the same hit."""
    rng = __import__("random").Random(11)
    docs = [tuple(range(100 * d, 100 * d + rng.randint(0, 3))) for d in range(30)]
    trace = []
    for i in range(600):
        doc = rng.choice(docs)
        tail = rng.randint(1, 3)
        ids = (*doc, *range(10_000 + 10 * i, 10_000 + 10 * i + tail))
        n_in = 4 * len(ids) - rng.randint(0, 3)
        trace.append(_record(rng.uniform(0, span_ms), n_in, rng.randint(1, 30), *ids))
    trace.sort(key=lambda r: r.timestamp_ms)
    spec = _spec(num_nodes=num_nodes, capacity_blocks=40, host_capacity_blocks=6)
    routed_fast: list = []
    routed_full: list = []
    # Pure cache affinity and a tight guard: the guard has work on the busy fleet.
    routing = RoutingConfig(request_cost_tokens=0, balance_abs_requests=2)
    fast = simulate(trace, spec, policy, routing, shortlist=True, routed=routed_fast)
    full = simulate(trace, spec, policy, routing, shortlist=False, routed=routed_full)
    assert routed_fast == routed_full
    if policy == "cache_aware":
        assert full["hit_rate"] > 0.2
        assert (full["guarded"] > 0) == (num_nodes == 12)
    assert {k: v for k, v in fast.items() if k != "run_seconds"} == {
        k: v for k, v in full.items() if k != "run_seconds"
    }
