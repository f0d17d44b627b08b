"""The cost of lock-step ranks: collective time per step and the placeholder share.

    python benchmarks/lockstep.py [--ranks 1,2,4] [--requests 16] [--new 32]     # CPU, gloo
    bash scripts/gpu_bench.sh benchmarks/lockstep.py --device cuda                # world size 1

CPU: the built-in tiny model through ``LLM`` with expert parallelism over 1, 2 and 4 rank
processes (one thread each; a group of one runs in this process), greedy, prefix caching off.
Two workloads: "even" (every request the same length) and "tail" (output lengths spread from
new/8 to new: ranks whose requests are done run placeholder steps while the others finish).
Per rank count, the figures are those of the rank with the most collective time:

    agree/step   host time in the per-step agreement (one all_gather of 3 ints)
    moe/step     host time in the MoE layers' all-to-alls (gloo blocks: exact)
    coll. share  (agreement + all-to-all time) / wall time
    placeholder  placeholder steps / steps, the rank with the most
    decode-only  steps where every rank decoded only (what decode graphs could run)

On the CPU the ranks share the machine's cores: with more ranks than cores, the collectives'
time includes waiting for a peer that is descheduled.

CUDA (one GPU: one NCCL rank): the same engine with and without the expert-parallel path
(NCCL group of one, gloo control group, an agreement every step), alternating, decode tokens/s
of each and their ratio: the path's cost where no tokens travel.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer import LLM, SamplingParams


def _prompts(n: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [[0, *torch.randint(3, 128000, (length - 1,), generator=gen).tolist()] for _ in range(n)]


def _params(n: int, new: int, workload: str) -> list[SamplingParams]:
    if workload == "even":
        lengths = [new] * n
    else:
        lengths = [max(1, new // 8 + (new - new // 8) * i // max(1, n - 1)) for i in range(n)]
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]


def _call_stats(llm: LLM, run) -> tuple[list[dict], float, list]:
    """Per rank: one ``run()``'s lock-step figures (LLMEngine.rank_stats), its wall time and
    what it returned."""
    engine = llm.engine
    before = engine.rank_stats() if engine is not None else None
    start = time.perf_counter()
    outs = run()
    wall = time.perf_counter() - start
    if engine is None:
        return llm.ranks.stats, wall, outs
    return [engine.stats_since(before, engine.rank_stats())], wall, outs


def cpu(ns: argparse.Namespace) -> None:
    prompts = _prompts(ns.requests, ns.prompt_len)
    print(f"{ns.requests} requests x {ns.prompt_len} prompt tokens, up to {ns.new} new; CPU")
    print(
        f"{'ranks':>5} {'workload':>8} {'tok/s':>8} {'steps':>6} {'agree/step':>11} "
        f"{'moe/step':>9} {'coll. share':>11} {'placeholder':>11} {'decode-only':>11}"
    )
    rows = []
    for ranks in ns.ranks:
        llm = LLM(
            device="cpu",
            num_threads=1,
            enable_prefix_caching=False,
            max_num_batched_tokens=4096,
            data_parallel_size=ranks,
            enable_expert_parallel=True,
        )
        llm.generate(prompts[:2], _params(2, 4, "even"), use_tqdm=False)  # warm-up
        for workload in ("even", "tail"):
            params = _params(ns.requests, ns.new, workload)
            stats, wall, outs = _call_stats(
                llm, lambda llm=llm, params=params: llm.generate(prompts, params, use_tqdm=False)
            )
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            worst = max(stats, key=lambda s: s["agree_seconds"] + s["exchange_seconds"])
            steps = worst["steps"]
            coll = worst["agree_seconds"] + worst["exchange_seconds"]
            placeholder = max(s["placeholder_steps"] / s["steps"] for s in stats)
            decode_only = worst["decode_only_steps"] / steps
            rows.append((ranks, workload, tokens / wall, steps, coll / wall, placeholder))
            print(
                f"{ranks:>5} {workload:>8} {tokens / wall:>8.1f} {steps:>6} "
                f"{worst['agree_seconds'] / steps * 1e3:>8.3f} ms "
                f"{worst['exchange_seconds'] / steps * 1e3:>6.2f} ms {coll / wall:>10.1%} "
                f"{placeholder:>10.1%} {decode_only:>10.1%}"
            )
        llm.close()
    print("RESULTS:")
    for ranks, workload, rate, steps, share, placeholder in rows:
        print(f"| {ranks} | {workload} | {rate:.1f} | {steps} | {share:.1%} | {placeholder:.1%} |")


def cuda(ns: argparse.Namespace) -> None:
    prompts = _prompts(ns.requests, ns.prompt_len)
    params = _params(ns.requests, ns.new, "even")
    engines = {
        "plain": LLM(device="cuda", enable_prefix_caching=False, gpu_memory_utilization=0.3),
        "expert-parallel (NCCL, 1 rank)": LLM(
            device="cuda",
            enable_prefix_caching=False,
            gpu_memory_utilization=0.3,
            enable_expert_parallel=True,
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for llm in engines.values():
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
    for _ in range(ns.rounds):
        for name, llm in engines.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
    print(
        f"{ns.requests} requests x {ns.prompt_len} prompt tokens, {ns.new} new; {ns.rounds} rounds"
    )
    plain = statistics.median(rates["plain"])
    for name, values in rates.items():
        rate = statistics.median(values)
        print(
            f"{name:>32}: {rate:9.1f} tok/s (median; {min(values):.1f}..{max(values):.1f}); "
            f"ratio to plain {rate / plain:.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--ranks", default="1,2,4", help="CPU: rank counts")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5, help="CUDA: alternating rounds")
    ns = ap.parse_args()
    ns.ranks = [int(r) for r in ns.ranks.split(",")]
    cpu(ns) if ns.device == "cpu" else cuda(ns)


if __name__ == "__main__":
    main()
