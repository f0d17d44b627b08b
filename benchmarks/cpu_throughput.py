"""CPU throughput of the built-in tiny model: prefill and decode tokens/s, against transformers.

    python benchmarks/cpu_throughput.py [--threads 2] [--prompt-len 1024] [--new 64]

Prints one line per figure. transformers (if installed) runs the same checkpoint, greedy,
batch 1, KV cache on, as the reference implementation; the ratio is ours / theirs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model.tiny import ensure_tiny_model


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(3, 128000) for _ in range(n - 1)]


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    folder = ensure_tiny_model(0)
    # Prefix caching off: the same prompt is timed repeatedly, and this measures computing it.
    llm = LLM(
        model=folder,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=ns.new, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = _prompt(ns.prompt_len, 0)
    llm.generate([prompt], greedy, use_tqdm=False)  # warm-up

    prefill = _timed(lambda: llm.generate([prompt], one, use_tqdm=False), ns.repeats)
    print(f"prefill  {ns.prompt_len} tokens: {ns.prompt_len / prefill:9.0f} tok/s")

    short = _prompt(32, 1)
    t1 = _timed(lambda: llm.generate([short], greedy, use_tqdm=False), ns.repeats)
    t1_prefill = _timed(lambda: llm.generate([short], one, use_tqdm=False), ns.repeats)
    decode_1 = (ns.new - 1) / (t1 - t1_prefill)
    print(f"decode   batch 1:   {decode_1:9.1f} tok/s ({1000 / decode_1:.1f} ms/step)")

    batch = [_prompt(32, 10 + i) for i in range(ns.batch)]
    tb = _timed(lambda: llm.generate(batch, greedy, use_tqdm=False), ns.repeats)
    tb_prefill = _timed(lambda: llm.generate(batch, one, use_tqdm=False), ns.repeats)
    decode_b = ns.batch * (ns.new - 1) / (tb - tb_prefill)
    print(f"decode   batch {ns.batch}:  {decode_b:9.1f} tok/s")

    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        print("transformers not installed: no reference ratio")
        return
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([short])

    def hf_generate(n: int) -> None:
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True)

    hf_generate(4)
    h_all = _timed(lambda: hf_generate(ns.new), ns.repeats)
    h_one = _timed(lambda: hf_generate(1), ns.repeats)
    hf_decode = (ns.new - 1) / (h_all - h_one)
    print(
        f"transformers decode batch 1: {hf_decode:9.1f} tok/s; "
        f"ours / theirs = {decode_1 / hf_decode:.2f}"
    )
    long_ids = torch.tensor([prompt])

    def hf_prefill() -> None:
        with torch.no_grad():
            hf(long_ids, use_cache=False)

    hp = _timed(hf_prefill, ns.repeats)
    print(
        f"transformers prefill {ns.prompt_len}: {ns.prompt_len / hp:9.0f} tok/s; "
        f"ours / theirs = {hp / prefill:.2f}"
    )


if __name__ == "__main__":
    main()
