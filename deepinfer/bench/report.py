"""The benchmark's outputs: the JSON result object and the text table.

Producer: `run_result` / `sweep_result` (from metrics, economics and the run). Consumers:
``serve.py`` (writes the file and prints the table) and ``plots.py``. The schema, key by key, is
documented in ``result_schema.py``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepinfer.bench.client import RequestOutput
from deepinfer.bench.economics import Economics
from deepinfer.bench.metrics import METRIC_TITLES, PERCENTILE_METRICS, BenchMetrics, request_tpot
from deepinfer.bench.result_schema import RESULT_SCHEMA, SCHEMA_VERSION, validate

__all__ = [
    "RESULT_SCHEMA",
    "SCHEMA_VERSION",
    "format_table",
    "percentile_label",
    "run_result",
    "sweep_result",
    "validate",
    "write_json",
]

TOOL = "deepinfer bench serve"


def percentile_label(p: float) -> str:
    """vLLM's spelling: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def _request_entry(out: RequestOutput, origin: float) -> dict[str, Any]:
    return {
        "session": out.session_index,
        "turn": out.turn_index,
        "success": out.success,
        "error": out.error,
        "error_detail": out.error_detail,
        "send_offset_s": out.start_time - origin,
        "ttft_s": out.ttft if out.success else None,
        "ttfct_s": out.ttfct if out.success else None,
        "e2el_s": out.latency if out.success else None,
        "tpot_s": request_tpot(out) if out.success else None,
        "itls_s": list(out.itl),
        "prompt_tokens": out.prompt_tokens,
        "requested_prompt_tokens": out.requested_prompt_tokens,
        "output_tokens": out.output_tokens,
        "requested_output_tokens": out.requested_output_tokens,
        "cached_tokens": out.cached_tokens,
    }


def run_result(
    metrics: BenchMetrics,
    outputs: Sequence[RequestOutput],
    start_time: float,
    info: dict[str, Any],
    percentile_metrics: Sequence[str] = PERCENTILE_METRICS,
    num_accelerators: int | None = None,
    economics: Economics | None = None,
) -> dict[str, Any]:
    """One run as a schema-1 object. ``info`` holds the identity keys (backend, model_id, ...)."""
    m = metrics
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "kind": "run",
        "tool": TOOL,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **info,
        "duration": m.duration_s,
        "completed": m.completed,
        "failed": m.failed,
        "errors_by_status": m.errors_by_status,
        "total_input_tokens": m.total_input_tokens,
        "total_output_tokens": m.total_output_tokens,
        "total_cached_tokens": m.total_cached_tokens,
        "num_missing_usage": m.num_missing_usage,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "num_good_requests": m.num_good_requests,
        "input_throughput": m.input_throughput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
        "concurrency": m.concurrency,
        "per_accelerator": None,
        "cache_hit_rate": m.cache_hit_rate,
        "cache_hit_rate_by_field": m.cache_hit_rate_by_field,
        "mean_prompt_overhead_tokens": m.mean_prompt_overhead_tokens,
        "metrics": {},
        "economics": dataclasses.asdict(economics) if economics is not None else None,
    }
    if num_accelerators:
        result["per_accelerator"] = {
            "num_accelerators": num_accelerators,
            "request_throughput": m.request_throughput / num_accelerators,
            "input_throughput": m.input_throughput / num_accelerators,
            "output_throughput": m.output_throughput / num_accelerators,
            "total_token_throughput": m.total_token_throughput / num_accelerators,
        }
    for name, d in m.distributions.items():
        pct = {percentile_label(p): v for p, v in d.percentiles.items()}
        result["metrics"][name] = {
            "count": d.count,
            "mean_ms": d.mean,
            "median_ms": d.median,
            "std_ms": d.std,
            "percentiles_ms": pct,
        }
        if name in percentile_metrics:
            result[f"mean_{name}_ms"] = d.mean
            result[f"median_{name}_ms"] = d.median
            result[f"std_{name}_ms"] = d.std
            for label, v in pct.items():
                result[f"p{label}_{name}_ms"] = v
    result["requests"] = [_request_entry(o, start_time) for o in outputs]
    return result


def sweep_result(parameter: str, values: Sequence[float], runs: list[dict[str, Any]]) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "sweep",
        "tool": TOOL,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "sweep_parameter": parameter,
        "sweep_values": [v if math.isfinite(v) else "inf" for v in values],
        "runs": runs,
    }


def write_json(result: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: Infinity/NaN are not JSON; a non-finite metric is a bug to surface here.
    path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def _percent(value: float | None) -> str | None:
    return f"{value * 100:.2f} %" if value is not None else None


def _row(label: str, value: Any) -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{label:<40} {text:<10}"


def _rule(title: str, fill: str = "-") -> str:
    return f"{title:{fill}^50}"


def format_table(result: dict[str, Any], percentile_metrics: Sequence[str]) -> str:
    """vLLM's ``Serving Benchmark Result`` block, plus our error, cache and economics lines."""
    r = result
    lines = [
        _rule(" Serving Benchmark Result ", "="),
        _row("Successful requests:", r["completed"]),
        _row("Failed requests:", r["failed"]),
    ]
    lines += [_row(f"  errors ({status}):", n) for status, n in r["errors_by_status"].items()]
    if r["max_concurrency"] is not None:
        lines.append(_row("Maximum request concurrency:", r["max_concurrency"]))
    rate = r["request_rate"]
    lines += [
        _row("Request rate configured (RPS):", rate if isinstance(rate, str) else float(rate)),
        _row("Benchmark duration (s):", r["duration"]),
        _row("Total input tokens:", r["total_input_tokens"]),
        _row("Total generated tokens:", r["total_output_tokens"]),
        _row("Request throughput (req/s):", r["request_throughput"]),
    ]
    if r["request_goodput"] is not None:
        lines.append(_row("Request goodput (req/s):", r["request_goodput"]))
    lines += [
        _row("Input token throughput (tok/s):", r["input_throughput"]),
        _row("Output token throughput (tok/s):", r["output_throughput"]),
        _row("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"]),
        _row("Peak concurrent requests:", r["max_concurrent_requests"]),
        _row("Total Token throughput (tok/s):", r["total_token_throughput"]),
        _row("Concurrency (sum latency / wall):", r["concurrency"]),
        _row("Cached-token hit rate:", _percent(r["cache_hit_rate"])),
        _row("Mean prompt overhead (tokens):", r["mean_prompt_overhead_tokens"]),
    ]
    if r["num_missing_usage"]:
        lines.append(_row("Requests without usage (re-tokenized):", r["num_missing_usage"]))
    if (per := r["per_accelerator"]) is not None:
        lines.append(_rule(f" Per accelerator (x{per['num_accelerators']}) "))
        lines += [
            _row("Request throughput (req/s/acc):", per["request_throughput"]),
            _row("Output token throughput (tok/s/acc):", per["output_throughput"]),
            _row("Total token throughput (tok/s/acc):", per["total_token_throughput"]),
        ]
    for name in percentile_metrics:
        d = r["metrics"][name]
        short = name.upper()
        lines += [
            _rule(METRIC_TITLES[name]),
            _row(f"Mean {short} (ms):", d["mean_ms"]),
            _row(f"Median {short} (ms):", d["median_ms"]),
        ]
        lines += [_row(f"P{p} {short} (ms):", v) for p, v in d["percentiles_ms"].items()]
    if (econ := r["economics"]) is not None:
        lines += _economics_lines(econ)
    lines.append("=" * 50)
    return "\n".join(lines)


def _economics_lines(econ: dict[str, Any]) -> list[str]:
    per_hour = econ["tokens_per_accelerator_hour"]
    lines = [
        _rule(" Economics "),
        _row("Output tokens per accelerator-hour:", per_hour["output"]),
        _row("Input tokens per accelerator-hour:", per_hour["input"]),
        _row("Cost per hour (USD):", econ["cost_per_hour"]),
        _row("Sole cost per M output tokens (USD):", econ["sole_cost_per_m"]["output"]),
        _row("Sole cost per M uncached input (USD):", econ["sole_cost_per_m"]["uncached_input"]),
        _row("Sole cost per M cached input (USD):", econ["sole_cost_per_m"]["cached_input"]),
    ]
    if econ["revenue_per_hour"] is not None:
        weighted = econ["revenue_weighted_cost_per_m"]
        lines += [
            _row("Revenue per hour (USD):", econ["revenue_per_hour"]),
            _row("Rev-weighted cost/M uncached in (USD):", weighted["uncached_input"]),
            _row("Rev-weighted cost/M cached in (USD):", weighted["cached_input"]),
            _row("Rev-weighted cost/M output (USD):", weighted["output"]),
            _row("Implied margin:", _percent(econ["margin"])),
        ]
    return lines
