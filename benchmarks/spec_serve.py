"""Speculative decoding through `deepinfer serve`: tokens/s per user at mean acceptance lengths
τ = 1.8, 2.5 and 3.5 against no drafts, on a V4-Flash-shaped model with random weights.

    python3 -P benchmarks/spec_serve.py [--layers swa,csa,hca,csa] [--taus none,1.8,2.5,3.5]
        [--concurrency 1,8] [--num-spec-tokens 4]
        [--out DIR]        (on the device machine: bash scripts/gpu_bench.sh benchmarks/...)
    python3 -P benchmarks/spec_serve.py --tiny   # the built-in model on the CPU (smoke test)

Method. Random weights mean no drafter can guess the model's tokens, so each speculative server
runs a test-only drafter and a test-only acceptance, patched in by a launcher (this file run as
``--launch-server``) before ``deepinfer.cli.main(["serve", ...])`` in the server process:
``LLMEngine._init_drafter`` installs a drafter that proposes as many drafts as the scheduler
allows (the request's last token repeated, up to K = ``--num-spec-tokens``) for every request,
and ``deepinfer.engine.step_outputs.accepted`` keeps ``samples[0]`` and the first j samples after
it, j drawn per verification from a seeded truncated geometric law (each draft kept with
probability a while the ones before it were; a solved per number of drafts n so that
E[j] = τ - 1, or j = n where n <= τ - 1; its uniforms a seeded Weyl sequence, so that the mean
holds within a few runs). The engine runs its whole path: n drafts verified in one forward,
n - j rolled back, j + 1 tokens appended. The output tokens are therefore NOT the model's: the
figures are what the machinery delivers at these acceptance rates, not what any drafter achieves.
``[speculative]`` is still enabled (``--speculative-config '{"method": "ngram",
"num_speculative_tokens": K}'``) so that ``cache.max_draft_tokens`` is sized; the baseline
(τ = none) is the stock `deepinfer serve` without drafts.

For each τ a fresh server (random bf16 weights in V4-Flash shapes via ``model.random_weights``,
as serve_graphs.py), then per concurrency one `deepinfer bench serve` run (random prompts of
fixed length, ``--ignore-eos``, ``--num-warmups`` = concurrency). Per user: 1 / TPOT p50 (TPOT =
(E2E - TTFT) / (output tokens - 1)); ITL is the gap between streamed chunks, one per engine step,
so with drafts it is the verification step's time. The measured τ is 1 + Δaccepted / Δdrafts of
the node's ``deepinfer_spec_decode_*`` counters over the run (warm-ups included). With prefix
caching, drafts stay inside the current block, so steps near a block boundary (and the last
tokens before max_tokens) verify fewer drafts, or none: the speed-up sits a little below τ even
where the step cost did not grow. What the comparison includes, as the engine stands: on a GPU
the baseline's decode steps and the verification steps replay CUDA graphs (graphs of K + 1 rows
a request for the latter, ``DecodeGraphs``); and with a drafter the engine completes each step
before it schedules the next (``Scheduler.needs_sampled_tokens``).
Fewer layers than V4-Flash's 43: the figures are of this depth, not extrapolated.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from serve_graphs import _free_port, _get
from v4_flash import LAYER_TYPES, write_config
from v4_flash_report import git_commit

logger = logging.getLogger("spec_serve")

_SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
# The workload by mode (--tiny: a smoke test on 2 CPU cores, a few short requests, one user).
_DEFAULTS = {
    False: {"input_len": 512, "output_len": 256, "concurrency": "1,8", "prompts_per_user": 5,
            "min_prompts": 8},
    True: {"input_len": 64, "output_len": 48, "concurrency": "1", "prompts_per_user": 3,
           "min_prompts": 3},
}  # fmt: skip
_HEADER = (
    "Test-only drafter and acceptance: the output tokens are not the model's; these are the "
    "figures of what the machinery delivers at these rates."
)


# ---- the server process: the test drafter and acceptance patched in ----------------------------


class RepeatDrafter:
    """Proposes ``max_tokens`` drafts for every request: its last token repeated (the ids do not
    matter: the patched acceptance decides how many are kept)."""

    waits_for_every_step = False  # drafts from the host's tokens, as NgramDrafter

    def propose(self, request, max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        return request.get_token_ids(request.num_tokens - 1, request.num_tokens) * max_tokens


def keep_rate(mean: float, num_drafts: int) -> float:
    """The probability a with a + a^2 + ... + a^n = ``mean`` (n = ``num_drafts``): each draft
    kept with probability a while the ones before it were gives E[j] = ``mean``; 1 where
    ``mean`` >= n."""
    if mean >= num_drafts:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        rate = (low + high) / 2
        if sum(rate**i for i in range(1, num_drafts + 1)) < mean:
            low = rate
        else:
            high = rate
    return (low + high) / 2


class SetAcceptance:
    """Replaces ``step_outputs.accepted``: keeps ``samples[0]`` and the first j samples after it,
    j from a truncated geometric law with E[j] = τ - 1 for each number of drafts n (j = n where
    n <= τ - 1): j = #{i <= n : u < a^i}, so P(j >= i) = a^i. The uniforms u are a Weyl
    sequence (golden-ratio steps from a seeded start) rather than independent draws, so that the
    mean of j reaches τ - 1 within tens of runs (error ~1/N, not ~1/sqrt(N)) and the measured τ
    shows the engine's effects (fewer drafts near a block boundary or max_tokens), not noise."""

    _STEP = (math.sqrt(5) - 1) / 2

    def __init__(self, tau: float, max_drafts: int, seed: int) -> None:
        self.u = random.Random(seed).random()
        self.rates = {n: keep_rate(tau - 1, n) for n in range(1, max_drafts + 1)}

    def __call__(self, drafts: list[int], samples: list[int]) -> list[int]:
        assert len(samples) == len(drafts) + 1, f"{len(samples)} samples for {len(drafts)} drafts"
        if not drafts:
            return samples
        self.u = (self.u + self._STEP) % 1.0
        rate = self.rates[len(drafts)]
        num_kept = sum(self.u < rate**i for i in range(1, len(drafts) + 1))
        return samples[: num_kept + 1]


def launch_server(argv: list[str]) -> int:
    """``--launch-server --tau T --num-spec-tokens K --seed S -- serve ARGS``: `deepinfer serve`
    in this process with the test drafter and acceptance."""
    split = argv.index("--")
    ap = argparse.ArgumentParser(prog="spec_serve.py --launch-server", allow_abbrev=False)
    ap.add_argument("--tau", type=float, required=True)
    ap.add_argument("--num-spec-tokens", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv[:split])

    from deepinfer import cli
    from deepinfer.engine import llm_engine, step_outputs

    acceptance = SetAcceptance(ns.tau, ns.num_spec_tokens, ns.seed)

    def init_test_drafter(self: llm_engine.LLMEngine) -> None:
        assert self.config.speculative.enabled, "the test drafter needs [speculative] enabled"
        self.set_drafter(RepeatDrafter())
        logger.info(
            "spec_serve test drafter: %d drafts a step for every request, kept with "
            "probabilities %s by number of drafts (tau %.2f, seed %d)",
            self.scheduler.max_draft_tokens,
            {n: round(rate, 4) for n, rate in acceptance.rates.items()},
            ns.tau,
            ns.seed,
        )

    llm_engine.LLMEngine._init_drafter = init_test_drafter
    step_outputs.accepted = acceptance
    return cli.main(argv[split + 1 :])


# ---- the benchmark -----------------------------------------------------------------------------


def _metric_sums(base: str) -> dict[str, float]:
    """The node's spec-decode counters (absent before the first verification: 0)."""
    _, text = _get(base + "/metrics")
    names = {f"deepinfer_spec_decode_{key}_total": key for key in _SPEC_COUNTERS}
    sums = dict.fromkeys(_SPEC_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                sums[names[sample.name]] += sample.value
    return sums


def _bench(base: str, name: str, concurrency: int, ns: argparse.Namespace) -> dict:
    filename = f"{name}.json"
    command = [
        sys.executable, "-P", "-m", "deepinfer.cli", "bench", "serve", "--base-url", base,
        "--dataset-name", "random", "--random-input-len", str(ns.input_len),
        "--random-output-len", str(ns.output_len), "--ignore-eos",
        "--max-concurrency", str(concurrency),
        "--num-prompts", str(max(ns.min_prompts, ns.prompts_per_user * concurrency)),
        "--num-warmups", str(concurrency), "--request-rate", "inf", "--seed", str(ns.seed),
        "--save-result", "--result-dir", str(ns.out), "--result-filename", filename,
        "--disable-tqdm",
    ]  # fmt: skip
    print("$", shlex.join(command[2:]), flush=True)
    log_path = ns.out / f"{name}.log"
    with log_path.open("wb") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        print(log_path.read_text(errors="replace")[-4000:])
        raise SystemExit(f"bench serve failed ({done.returncode}); log: {log_path}")
    return json.loads((ns.out / filename).read_text())


def _serve_command(tau: float | None, port: int, ns: argparse.Namespace) -> list[str]:
    args = ["serve", "--port", str(port)]
    if ns.tiny:
        args += ["--device", "cpu"]
    else:
        layers = [LAYER_TYPES[name] for name in ns.layers.split(",")]
        args += ["--model", str(write_config(ns.out / "v4-flash-shaped", layers))]
    if tau is None:
        return [sys.executable, "-P", "-m", "deepinfer.cli", *args]
    spec = {"method": "ngram", "num_speculative_tokens": ns.num_spec_tokens}
    args += ["--speculative-config", json.dumps(spec)]
    own = ["--tau", str(tau), "--num-spec-tokens", str(ns.num_spec_tokens), "--seed", str(ns.seed)]
    launcher = [sys.executable, "-P", str(Path(__file__).resolve()), "--launch-server"]
    return [*launcher, *own, "--", *args]


def _run_server(tau: float | None, ns: argparse.Namespace) -> list[dict]:
    """A fresh server at ``tau`` (None: no drafts) and a bench run per concurrency."""
    label = "none" if tau is None else f"{tau:g}"
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DEEPINFER_MODEL_MAX_MODEL_LEN": str(ns.max_model_len)}
    if not ns.tiny:
        env["DEEPINFER_MODEL_RANDOM_WEIGHTS"] = "true"
    log_path = ns.out / f"serve_tau_{label}.log"
    started = time.monotonic()
    with log_path.open("wb") as log:
        server = subprocess.Popen(_serve_command(tau, port, ns), env=env, stdout=log, stderr=log)
    rows = []
    try:
        while _get(base + "/ready")[0] != 200:
            if server.poll() is not None or time.monotonic() - started > 480:
                print(log_path.read_text(errors="replace")[-4000:])
                raise SystemExit(f"the server (tau {label}) did not get ready; log: {log_path}")
            time.sleep(0.5)
        print(f"tau {label}: server ready in {time.monotonic() - started:.1f} s", flush=True)
        for concurrency in map(int, ns.concurrency.split(",")):
            before = _metric_sums(base)
            result = _bench(base, f"spec_tau_{label}_c{concurrency}", concurrency, ns)
            after = _metric_sums(base)
            counts = {key: after[key] - before[key] for key in _SPEC_COUNTERS}
            m = result["metrics"]
            tpot_ms = m["tpot"]["median_ms"]
            rows.append(
                {
                    "tau": tau,
                    "concurrency": concurrency,
                    "completed": result["completed"],
                    "failed": result["failed"],
                    "num_drafts": int(counts["num_drafts"]),
                    "tau_measured": (
                        1 + counts["num_accepted_tokens"] / counts["num_drafts"]
                        if counts["num_drafts"]
                        else None
                    ),
                    "drafts_per_run": (
                        counts["num_draft_tokens"] / counts["num_drafts"]
                        if counts["num_drafts"]
                        else None
                    ),
                    "tpot_p50_ms": tpot_ms,
                    "itl_p50_ms": m["itl"]["median_ms"],
                    "itl_p99_ms": m["itl"]["percentiles_ms"]["99"],
                    "user_tok_s": 1000.0 / tpot_ms if tpot_ms else math.nan,
                    "output_tok_s": result["output_throughput"],
                }
            )
    finally:
        server.terminate()
        server.wait(timeout=60)
    return rows


def _table(rows: list[dict]) -> str:
    baseline = {r["concurrency"]: r["user_tok_s"] for r in rows if r["tau"] is None}
    lines = [
        "| τ set | users | τ measured | drafts / run | runs verified | TPOT p50 ms | ITL p50 ms "
        "| ITL p99 ms | tok/s per user | speed-up vs none | output tok/s | completed / failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["tau"] or 1.0)):
        base = baseline.get(r["concurrency"])
        speed_up = f"{r['user_tok_s'] / base:.2f}x" if base else "—"
        measured = "1 (no drafts)" if r["tau"] is None else _num(r["tau_measured"], 2)
        lines.append(
            f"| {'none' if r['tau'] is None else r['tau']} | {r['concurrency']} | {measured} | "
            f"{_num(r['drafts_per_run'], 2)} | {r['num_drafts']:,} | {r['tpot_p50_ms']:.2f} | "
            f"{r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | {r['user_tok_s']:.1f} | "
            f"{speed_up} | {r['output_tok_s']:.0f} | {r['completed']} / {r['failed']} |"
        )
    return "\n".join(lines)


def _num(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _device(ns: argparse.Namespace) -> str:
    if ns.tiny:
        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"


def _results_block(rows: list[dict], ns: argparse.Namespace) -> str:
    args = shlex.join(sys.argv[1:])
    if ns.tiny:
        command = f"python3 -P benchmarks/spec_serve.py {args}".strip()
        model, engine = "The built-in tiny model", []
    else:
        command = f"bash scripts/gpu_bench.sh benchmarks/spec_serve.py {args}".strip()
        model = f"{len(ns.layers.split(','))} layers in V4-Flash shapes ({ns.layers}), random bf16"
        engine = [
            "- Decode steps replay CUDA graphs, and so do verification steps (graphs of K + 1 "
            "rows a request); with a drafter each step completes before the next is scheduled. "
            "Figures at this depth, not extrapolated to 43 layers."
        ]
    device = _device(ns)
    return "\n".join(
        [
            "RESULTS:",
            f"## {datetime.date.today().isoformat()} — speculative decoding through `deepinfer "
            f"serve`: tokens/s per user by acceptance length ({device})",
            "",
            f"- Command ({device}, torch {torch.__version__}): `{command}`. Commit {git_commit()}.",
            f"- {model}; K = {ns.num_spec_tokens} drafts a step (`--speculative-config "
            f'\'{{"method": "ngram", "num_speculative_tokens": {ns.num_spec_tokens}}}\'`), '
            f"max_model_len {ns.max_model_len}; `deepinfer bench serve --dataset-name random "
            f"--random-input-len {ns.input_len} --random-output-len {ns.output_len} --ignore-eos "
            f"--request-rate inf --num-warmups C` at concurrency {ns.concurrency}, a fresh "
            "server per τ.",
            f"- {_HEADER} Drafts come from a test-only drafter and the kept count j from a "
            "seeded truncated geometric law with E[j] = τ − 1 (module docstring); τ measured = "
            "1 + accepted / drafts from the node's `deepinfer_spec_decode_*` counters. Per user "
            "= 1 / TPOT p50.",
            *engine,
            "",
            _table(rows),
        ]
    )


def main() -> int:
    if sys.argv[1:2] == ["--launch-server"]:
        return launch_server(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="swa,csa,hca,csa")
    ap.add_argument("--taus", default="none,1.8,2.5,3.5", help="τ values; none: no drafts")
    ap.add_argument("--num-spec-tokens", type=int, default=4, help="K: drafts a step")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--input-len", type=int, help="512 (--tiny: 64)")
    ap.add_argument("--output-len", type=int, help="256 (--tiny: 48)")
    ap.add_argument("--concurrency", help="1,8 (--tiny: 1)")
    ap.add_argument("--prompts-per-user", type=int, help="prompts = this x concurrency: 5 (3)")
    ap.add_argument("--min-prompts", type=int, help="8 (--tiny: 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/spec_serve")))
    ap.add_argument("--tiny", action="store_true", help="the built-in model on the CPU")
    ns = ap.parse_args()
    for key, value in _DEFAULTS[ns.tiny].items():
        if getattr(ns, key) is None:
            setattr(ns, key, value)
    taus = [None if t == "none" else float(t) for t in ns.taus.split(",")]
    for tau in taus:
        if tau is not None and not 1 <= tau <= ns.num_spec_tokens + 1:
            ap.error(f"tau {tau} is out of reach with {ns.num_spec_tokens} drafts a step")
    ns.out.mkdir(parents=True, exist_ok=True)
    print(_HEADER)
    print(
        f"K = {ns.num_spec_tokens} drafts a step; {ns.input_len} in / {ns.output_len} out; "
        f"concurrency {ns.concurrency}; τ {ns.taus}",
        flush=True,
    )
    rows = [row for tau in taus for row in _run_server(tau, ns)]
    print(_table(rows))
    print(_results_block(rows, ns))
    failed = any(r["failed"] for r in rows)
    undrafted = any(r["tau"] is not None and not r["num_drafts"] for r in rows)
    return 2 if failed or undrafted else 0


if __name__ == "__main__":
    sys.exit(main())
