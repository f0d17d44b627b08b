"""Pure parts of ``deepinfer bench serve``: SSE parsing, metrics, arrivals, economics, schema."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest

from deepinfer.bench.arrivals import arrival_offsets, trace_offsets
from deepinfer.bench.client import RequestInput, RequestOutput, SSEParser, build_payload
from deepinfer.bench.economics import Prices, compute_economics
from deepinfer.bench.metrics import compute_metrics, parse_goodput
from deepinfer.bench.report import format_table, run_result
from deepinfer.bench.result_schema import validate

# ---- SSE ---------------------------------------------------------------------------------


def test_sse_parser_splits_events_across_reads_and_ignores_comments() -> None:
    parser = SSEParser()
    assert parser.feed(b': keep-alive\n\ndata: {"a"') == []
    assert parser.feed(b": 1}\n\r\ndata: x\ndata: y\n\nevent: e\nid: 3\ndata:z\n\n") == [
        '{"a": 1}',
        "x\ny",  # a multi-line event joins its data lines with "\n"
        "z",  # the space after "data:" is optional
    ]
    assert parser.feed(b"data: [DONE]") == []
    assert parser.finish() == ["[DONE]"]  # an event cut off by the end of the stream


def test_payload_fields() -> None:
    chat = RequestInput(
        url="u",
        backend="openai-chat",
        model="m",
        max_tokens=5,
        messages=[{"role": "user", "content": "hi"}],
        ignore_eos=True,
    )
    assert build_payload(chat) == {
        "model": "m",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.0,
        "ignore_eos": True,
        "min_tokens": 5,
    }
    plain = RequestInput(url="u", backend="openai", model="m", max_tokens=3, prompt="p")
    assert build_payload(plain)["prompt"] == "p" and "ignore_eos" not in build_payload(plain)


# ---- metrics -----------------------------------------------------------------------------

_ORIGIN = 100.0


def _outputs() -> list[RequestOutput]:
    def ok(start: float, ttft: float, itl: list[float], n_out: int, n_in: int, cached: int,
           requested: int, ttfct: float | None = None) -> RequestOutput:  # fmt: skip
        return RequestOutput(
            success=True,
            start_time=_ORIGIN + start,
            ttft=ttft,
            ttfct=ttfct,
            itl=itl,
            latency=ttft + sum(itl),
            num_chunks=len(itl) + 1,
            prompt_tokens=n_in,
            output_tokens=n_out,
            cached_tokens=cached,
            prompt_tokens_details={"cached_tokens": cached},
            has_usage=True,
            requested_prompt_tokens=requested,
        )

    return [
        ok(0.0, 0.10, [0.02, 0.02, 0.02], n_out=4, n_in=100, cached=40, requested=90, ttfct=0.12),
        ok(0.1, 0.30, [0.05], n_out=3, n_in=50, cached=10, requested=43),
        ok(1.0, 0.20, [], n_out=1, n_in=10, cached=0, requested=8),
        RequestOutput(start_time=_ORIGIN + 1.2).fail("500", "boom"),
        RequestOutput(start_time=_ORIGIN + 1.3).fail("timeout"),
    ]


def test_metrics_exact() -> None:
    m = compute_metrics(_outputs(), 2.0, (50, 90, 99), {"ttft": 250, "tpot": 30}, _ORIGIN)
    assert (m.num_requests, m.completed, m.failed) == (5, 3, 2)
    assert m.errors_by_status == {"500": 1, "timeout": 1}
    assert (m.total_input_tokens, m.total_output_tokens, m.total_cached_tokens) == (160, 8, 50)
    assert (m.request_throughput, m.input_throughput) == (1.5, 80.0)
    assert (m.output_throughput, m.total_token_throughput) == (4.0, 84.0)
    assert m.cache_hit_rate == 50 / 160
    assert m.cache_hit_rate_by_field == {"cached_tokens": 50 / 160}
    assert m.mean_prompt_overhead_tokens == pytest.approx((10 + 7 + 2) / 3, rel=1e-12)
    # Good: #0 (TTFT 100 ms, TPOT 20 ms) and #2 (one token: TPOT counts 0); #1 has TTFT 300 ms.
    assert m.num_good_requests == 2 and m.request_goodput == 1.0
    assert m.concurrency == pytest.approx((0.16 + 0.35 + 0.20) / 2.0, rel=1e-12)
    # Second 0: #0's 4 chunks (1 token each) + #1's 2 chunks (1.5 tokens each); second 1: #2.
    # In flight: #0 [0, 0.16] overlaps #1 [0.1, 0.45]; #2 [1.0, 1.2] overlaps nothing.
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests) == (7.0, 2)
    d = m.distributions
    assert d["tpot"].count == 2  # only requests with > 1 output token
    assert d["tpot"].mean == pytest.approx((20 + 25) / 2, rel=1e-9)
    assert d["itl"].count == 4 and d["itl"].median == pytest.approx(20, rel=1e-9)
    assert d["itl"].percentiles[90] == pytest.approx(np.percentile([20, 20, 20, 50], 90))
    assert d["ttft"].mean == pytest.approx(200, rel=1e-9)
    assert d["ttfct"].count == 1 and d["ttfct"].mean == pytest.approx(120, rel=1e-9)
    assert d["e2el"].percentiles[50] == pytest.approx(200, rel=1e-9)


def test_no_completed_request_gives_nulls_not_nans() -> None:
    outs = [RequestOutput().fail("connection")]
    m = compute_metrics(outs, 1.0, (99,))
    result = run_result(m, outs, 0.0, _info())
    assert result["metrics"]["ttft"] == {
        "count": 0,
        "mean_ms": None,
        "median_ms": None,
        "std_ms": None,
        "percentiles_ms": {"99": None},
    }
    assert result["cache_hit_rate"] is None and validate(result) == []
    assert "errors (connection):" in format_table(result, ["ttft"])


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "e2el:2.5"]) == {"ttft": 500.0, "e2el": 2.5}
    for bad in (["ttft=5"], ["itl:5"], ["tpot:x"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


# ---- arrivals ----------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_match_rate_and_burstiness(burstiness: float) -> None:
    rate, n = 8.0, 20_000
    offsets = np.asarray(arrival_offsets(n, rate, burstiness, np.random.default_rng(0)))
    gaps = np.diff(np.concatenate([[0.0], offsets]))
    assert offsets[-1] == pytest.approx(n / rate, rel=1e-12)  # rescaled to span exactly N/rate
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # Gamma(shape k) has CV 1/sqrt(k); 5 % covers the sampling error at 20k gaps.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrivals_inf_and_errors() -> None:
    rng = np.random.default_rng(0)
    assert arrival_offsets(3, math.inf, 1.0, rng) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 2.0, math.inf, rng) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(3, 1.0, 0.0, rng)


def test_trace_offsets() -> None:
    assert trace_offsets([5.0, 5.1, 5.4, 5.6], math.inf) == pytest.approx([0, 0.1, 0.4, 0.6])
    # Mean gap 0.2 s (5 req/s) rescaled to 10 req/s.
    assert trace_offsets([5.0, 5.1, 5.4, 5.6], 10.0) == pytest.approx([0, 0.05, 0.2, 0.3])


# ---- economics ---------------------------------------------------------------------------


def test_economics_known_numbers() -> None:
    base = compute_metrics(_outputs(), 2.0)
    m = dataclasses.replace(
        base,
        input_throughput=1000.0,
        output_throughput=500.0,
        total_token_throughput=1500.0,
        cache_hit_rate=0.5,
    )
    e = compute_economics(m, 2, 3.0, Prices(1.0, 0.1, 4.0))
    cost_s = 6.0 / 3600
    assert e.cost_per_hour == 6.0
    assert e.tokens_per_s["cached_input"] == 500.0 and e.tokens_per_s["uncached_input"] == 500.0
    assert e.tokens_per_accelerator_hour["output"] == pytest.approx(900_000)
    assert e.sole_cost_per_m["output"] == pytest.approx(cost_s / 500 * 1e6)
    assert e.sole_cost_per_m["cached_input"] == pytest.approx(cost_s / 500 * 1e6)
    revenue_s = (500 * 1.0 + 500 * 0.1 + 500 * 4.0) / 1e6
    assert e.revenue_per_hour == pytest.approx(revenue_s * 3600)
    assert e.margin == pytest.approx(1 - cost_s / revenue_s)
    ratio = cost_s / revenue_s
    assert e.revenue_weighted_cost_per_m["output"] == pytest.approx(4.0 * ratio)
    assert e.revenue_weighted_cost_per_m["input"] == pytest.approx(0.55 * ratio)
    # Revenue-weighted costs add back up to the cluster cost.
    total = sum(
        e.tokens_per_s[k] * e.revenue_weighted_cost_per_m[k] / 1e6
        for k in ("uncached_input", "cached_input", "output")
    )
    assert total == pytest.approx(cost_s)
    no_price = compute_economics(m, 2)
    assert no_price.margin is None and no_price.sole_cost_per_m["output"] is None


# ---- schema ------------------------------------------------------------------------------


def _info() -> dict:
    return {
        "backend": "openai-chat",
        "base_url": "http://x",
        "endpoint": "/v1/chat/completions",
        "model_id": "m",
        "tokenizer_id": "t",
        "dataset_name": "random",
        "config": {},
        "num_prompts": 1,
        "num_sessions": 1,
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": None,
        "seed": 0,
        "ignore_eos": False,
        "goodput_slos_ms": {},
        "percentiles": [99.0],
    }


def test_schema_rejects_what_it_should() -> None:
    outs = _outputs()
    result = run_result(compute_metrics(outs, 2.0), outs, _ORIGIN, _info())
    assert validate(result) == []
    assert validate({k: v for k, v in result.items() if k != "duration"}) == [
        '$: "duration" is a required property'
    ]
    assert validate(result | {"completed": 3.5}) == ['$.completed: 3.5 is not of type "integer"']
    # A bool is not an integer.
    assert validate(result | {"failed": True}) == ['$.failed: true is not of type "integer"']
    assert validate(result | {"concurrency": math.nan, "cache_hit_rate": math.inf}) == [
        "$.concurrency: nan is not a finite number",
        "$.cache_hit_rate: inf is not a finite number",
    ]
    bad_request = result["requests"][0] | {"itls_s": ["x"]}
    assert validate(result | {"requests": [bad_request]}) == [
        '$.requests[0].itls_s[0]: "x" is not of type "number"'
    ]


def test_bench_package_is_torch_free() -> None:
    code = (
        "import sys, deepinfer.bench.serve, deepinfer.bench.plots; sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
