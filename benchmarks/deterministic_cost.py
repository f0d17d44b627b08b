"""What deterministic mode costs: throughput with `kernel.deterministic` on vs off (CPU, built-in
model, same run).

    python benchmarks/deterministic_cost.py [--threads 2]

Prefill: one 512-token prompt (1 output token). Decode: 8 requests of 16 prompt tokens, 32
output tokens each. Prefix caching off (the same prompts are timed repeatedly).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model.tiny import ensure_tiny_model


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(3, 128000) for _ in range(n - 1)]


def _time(llm: LLM, prompts: list[list[int]], params: SamplingParams, repeats: int) -> float:
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    folder = ensure_tiny_model(0)
    prefill = [_prompt(0, 512)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    decode = [_prompt(i + 1, 16) for i in range(8)]
    many = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = {}
    for mode in (False, True):
        llm = LLM(model=folder, device="cpu", enable_prefix_caching=False, deterministic=mode)
        results[mode] = (
            512 / _time(llm, prefill, one, ns.repeats),
            8 * 32 / _time(llm, decode, many, ns.repeats),
        )
    for name, index in (("prefill 512 tokens", 0), ("8 requests x 32 tokens", 1)):
        off, on = results[False][index], results[True][index]
        print(f"{name}: {off:8.1f} tok/s normal, {on:8.1f} deterministic ({on / off:.3f}x)")


if __name__ == "__main__":
    main()
