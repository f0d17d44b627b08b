"""PNG plots of benchmark results (read from the schema-1 result objects of ``report.py``).

Producer: `write_plots` (after a run or a sweep). Consumer: people. ``matplotlib.figure.Figure``
renders with the Agg canvas and no pyplot state, so this works headless and in threads.

- ``<stem>_latency_cdf.png``: empirical CDFs of TTFT, ITL and E2E (one line per run);
- ``<stem>_ttft_over_time.png``: TTFT against send time; failed requests as red crosses;
- ``<stem>_throughput_vs_latency.png`` (sweeps): median and p99 TTFT and TPOT against output
  throughput (per accelerator when known), each point labelled with the swept value.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_CDF_METRICS = (("ttft_s", "TTFT"), ("itls_s", "ITL"), ("e2el_s", "E2E latency"))


def _label(run: dict[str, Any]) -> str:
    conc = run["max_concurrency"]
    return f"rate {run['request_rate']}" + (f", conc {conc}" if conc is not None else "")


def _values_ms(run: dict[str, Any], key: str) -> np.ndarray:
    values: list[float] = []
    for req in run["requests"]:
        if not req["success"]:
            continue
        v = req[key]
        if isinstance(v, list):
            values += v
        elif v is not None:
            values.append(v)
    return np.sort(np.asarray(values, dtype=np.float64)) * 1000.0


def plot_latency_cdfs(runs: Sequence[dict[str, Any]], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.5))
    for ax, (key, title) in zip(fig.subplots(1, 3), _CDF_METRICS, strict=True):
        for run in runs:
            ms = _values_ms(run, key)
            if len(ms):
                ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=_label(run))
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction ≤ x")
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        fig.axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_ttft_over_time(run: dict[str, Any], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5))
    ax = fig.subplots()
    ok = [r for r in run["requests"] if r["success"]]
    bad = [r for r in run["requests"] if not r["success"]]
    ax.scatter(
        [r["send_offset_s"] for r in ok], [r["ttft_s"] * 1000.0 for r in ok], s=8, label="TTFT"
    )
    if bad:
        ax.scatter(
            [r["send_offset_s"] for r in bad],
            [0.0] * len(bad),
            marker="x",
            color="red",
            label=f"failed ({len(bad)})",
        )
    ax.set_title(f"TTFT over time ({_label(run)})")
    ax.set_xlabel("send time (s from start)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_throughput_vs_latency(sweep: dict[str, Any], path: Path) -> Path:
    from matplotlib.figure import Figure

    runs = sweep["runs"]
    per_acc = all(r["per_accelerator"] is not None for r in runs)
    xs = [
        r["per_accelerator"]["output_throughput"] if per_acc else r["output_throughput"]
        for r in runs
    ]
    fig = Figure(figsize=(12, 4.5))
    for ax, metric in zip(fig.subplots(1, 2), ("ttft", "tpot"), strict=True):
        for stat, style in (("median", "o-"), ("99", "s--")):
            ys = [
                r["metrics"][metric]["median_ms"]
                if stat == "median"
                else r["metrics"][metric]["percentiles_ms"].get(stat)
                for r in runs
            ]
            pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            if pairs:
                name = "median" if stat == "median" else f"p{stat}"
                ax.plot(*zip(*pairs, strict=True), style, label=f"{name} {metric.upper()}")
        for x, r, value in zip(xs, runs, sweep["sweep_values"], strict=True):
            y = r["metrics"][metric]["median_ms"]
            if y is not None:
                ax.annotate(str(value), (x, y), textcoords="offset points", xytext=(4, 4))
        unit = "tok/s per accelerator" if per_acc else "tok/s"
        ax.set_xlabel(f"output throughput ({unit})")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_title(f"{metric.upper()} vs throughput (sweep over {sweep['sweep_parameter']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def write_plots(result: dict[str, Any], plot_dir: Path, stem: str) -> list[Path]:
    """Every plot that applies to ``result`` (a run or a sweep); returns the files written."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    runs = result["runs"] if result["kind"] == "sweep" else [result]
    paths = [plot_latency_cdfs(runs, plot_dir / f"{stem}_latency_cdf.png")]
    if result["kind"] == "sweep":
        paths.append(
            plot_throughput_vs_latency(result, plot_dir / f"{stem}_throughput_vs_latency.png")
        )
        for i, run in enumerate(runs):
            paths.append(plot_ttft_over_time(run, plot_dir / f"{stem}_ttft_over_time_{i}.png"))
    else:
        paths.append(plot_ttft_over_time(result, plot_dir / f"{stem}_ttft_over_time.png"))
    return paths
