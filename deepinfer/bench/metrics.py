"""Serving metrics from a run's `RequestOutput`s, as BENCH.md and vLLM ``bench serve`` define them.

Producer: `compute_metrics` (after the runner's gather). Consumers: ``economics.py``,
``report.py`` (table, JSON) and ``plots.py``.

- duration: wall time from the first scheduled send to the last response (the runner's clock);
- throughput: completed / duration; input = Σ usage.prompt_tokens / duration;
  output = Σ usage.completion_tokens / duration; total = (input + output) / duration;
- TPOT per request = (E2E − TTFT) / (output_tokens − 1), only when output_tokens > 1;
- ITL pooled over all requests' chunk gaps;
- goodput: requests meeting every given SLO (TPOT counts 0 for ≤ 1 output token) / duration;
- concurrency = Σ E2E of completed requests / duration (SGLang);
- cache hit rate = Σ cached prompt tokens / Σ prompt tokens (per ``prompt_tokens_details`` field
  as well, so tiered caches that report a field per tier get one rate each);
- peak output tok/s from 1-second buckets of chunk arrivals (vLLM), each chunk carrying
  ``output_tokens / num_chunks`` tokens so that the buckets sum to the usage total; peak
  concurrent requests from a sweep line over [send, last token] intervals (vLLM's 1-second
  buckets would count back-to-back requests as concurrent).

Distributions are in milliseconds: mean, median, std and the requested percentiles (numpy's
linear interpolation, as vLLM). Failed requests enter only ``failed`` and ``errors_by_status``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from deepinfer.bench.client import RequestOutput

PERCENTILE_METRICS = ("ttft", "ttfct", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": "Time to First Token",
    "ttfct": "Time to First Content Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Distribution:
    """Summary of one latency metric over requests (or chunk gaps, for ITL), in ms."""

    count: int
    mean: float | None
    median: float | None
    std: float | None
    percentiles: dict[float, float | None]

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> Distribution:
        if not values_s:
            return cls(0, None, None, None, {p: None for p in percentiles})
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        return cls(
            count=len(ms),
            mean=float(ms.mean()),
            median=float(np.median(ms)),
            std=float(ms.std()),
            percentiles={p: float(np.percentile(ms, p)) for p in percentiles},
        )


@dataclass(frozen=True)
class BenchMetrics:
    num_requests: int
    completed: int
    failed: int
    errors_by_status: dict[str, int]
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    num_good_requests: int | None
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    concurrency: float
    cache_hit_rate: float | None
    cache_hit_rate_by_field: dict[str, float]
    mean_prompt_overhead_tokens: float | None
    num_missing_usage: int
    distributions: dict[str, Distribution] = field(default_factory=dict)


def request_tpot(out: RequestOutput) -> float | None:
    """(E2E − TTFT) / (output_tokens − 1) in s, or None for ≤ 1 output token."""
    n = out.output_tokens or 0
    return (out.latency - out.ttft) / (n - 1) if n > 1 else None


def is_good(out: RequestOutput, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every given SLO (vLLM: value ≤ SLO)."""
    values_ms = {
        "ttft": out.ttft * 1000.0,
        "tpot": (request_tpot(out) or 0.0) * 1000.0,
        "e2el": out.latency * 1000.0,
    }
    return all(values_ms[name] <= limit for name, limit in slos_ms.items())


def _peak_output_rate(outputs: Sequence[RequestOutput], origin: float) -> float:
    """Peak output tok/s over 1-second buckets of chunk arrival times (vLLM)."""
    if not outputs:
        return 0.0
    end = max(o.start_time + o.latency for o in outputs)
    tokens = np.zeros(math.ceil(end - origin) + 1)
    for o in outputs:
        per_chunk = (o.output_tokens or o.num_chunks) / max(o.num_chunks, 1)
        times = o.start_time + o.ttft + np.concatenate([[0.0], np.cumsum(o.itl)])
        buckets = (times - origin).astype(np.int64)
        np.add.at(tokens, buckets[(buckets >= 0) & (buckets < len(tokens))], per_chunk)
    return float(tokens.max())


def _peak_concurrency(outputs: Sequence[RequestOutput]) -> int:
    """Most requests in flight at one instant (a sweep line over send and last-token times)."""
    # At equal times an end sorts before a start (-1 < +1): back-to-back requests are not both
    # counted.
    events = sorted(
        [(o.start_time, 1) for o in outputs] + [(o.start_time + o.latency, -1) for o in outputs]
    )
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def compute_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    percentiles: Sequence[float] = (90.0, 99.0),
    goodput_slos_ms: dict[str, float] | None = None,
    start_time: float | None = None,
) -> BenchMetrics:
    """Aggregate a run. ``start_time`` is the run's ``perf_counter`` origin (for the peaks)."""
    assert duration_s > 0, f"duration must be positive, got {duration_s}"
    done = [o for o in outputs if o.success]
    failed = [o for o in outputs if not o.success]
    errors = Counter(o.error or "unknown" for o in failed)
    total_in = sum(o.prompt_tokens or 0 for o in done)
    total_out = sum(o.output_tokens or 0 for o in done)
    total_cached = sum(o.cached_tokens for o in done)
    detail_sums: Counter[str] = Counter()
    for o in done:
        detail_sums.update(o.prompt_tokens_details)
    overheads = [
        o.prompt_tokens - o.requested_prompt_tokens for o in done if o.prompt_tokens is not None
    ]
    num_good = None
    if goodput_slos_ms:
        num_good = sum(is_good(o, goodput_slos_ms) for o in done)
    origin = start_time if start_time is not None else min((o.start_time for o in done), default=0)
    tpots = [t for t in (request_tpot(o) for o in done) if t is not None]
    samples = {
        "ttft": [o.ttft for o in done],
        "ttfct": [o.ttfct for o in done if o.ttfct is not None],
        "tpot": tpots,
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    return BenchMetrics(
        num_requests=len(outputs),
        completed=len(done),
        failed=len(failed),
        errors_by_status=dict(sorted(errors.items())),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        total_cached_tokens=total_cached,
        request_throughput=len(done) / duration_s,
        input_throughput=total_in / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        request_goodput=None if num_good is None else num_good / duration_s,
        num_good_requests=num_good,
        max_output_tokens_per_s=_peak_output_rate(done, origin),
        max_concurrent_requests=_peak_concurrency(done),
        concurrency=sum(o.latency for o in done) / duration_s,
        cache_hit_rate=total_cached / total_in if total_in else None,
        cache_hit_rate_by_field={
            k: v / total_in for k, v in sorted(detail_sums.items()) if total_in
        },
        mean_prompt_overhead_tokens=float(np.mean(overheads)) if overheads else None,
        num_missing_usage=sum(not o.has_usage for o in done),
        distributions={m: Distribution.of(v, percentiles) for m, v in samples.items()},
    )


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {SLO_METRICS}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError as e:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from e
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms")
    return slos
