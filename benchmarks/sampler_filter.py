"""Sampler host costs: top-k / top-p from candidates vs a full sort, and seeded uniforms.

    python benchmarks/sampler_filter.py [--batch 32] [--vocab 129280] [--top-p 0.9]

Logits are Gaussian with three spreads: peaked ones (std 4 and 6, where the nucleus closes
within the best 1024 tokens, as with a trained model) and flat ones (std 0.1, the random
built-in model's case, where it does not and the filter falls back to the full sort). Both
functions keep exactly the same tokens (tests/test_sampling.py); this prints their times.
Then the seeded rows' uniforms: one CPU ``torch.Generator`` per row (the former draw, copied to
the device afterwards) against ``keyed_uniforms``, the integer hash made where the logits are.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepinfer.ops.sampling import keyed, nucleus


def _median_ms(fn, device: str, repeats: int = 5) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    gen = torch.Generator().manual_seed(0)
    top_k = torch.zeros(ns.batch, dtype=torch.long, device=ns.device)
    top_p = torch.full((ns.batch,), ns.top_p, device=ns.device)
    print("| logits | full sort ms | candidates ms | speed-up |")
    print("|---|---|---|---|")
    for name, std in (("peaked, std 4", 4.0), ("peaked, std 6", 6.0), ("flat, std 0.1", 0.1)):
        logits = (torch.randn(ns.batch, ns.vocab, generator=gen) * std).to(ns.device)
        times = {
            fn: _median_ms(lambda fn=fn, logits=logits: fn(logits, top_k, top_p), ns.device)
            for fn in (nucleus.sorted_top_k_top_p, nucleus.apply_top_k_top_p)
        }
        full, fast = times[nucleus.sorted_top_k_top_p], times[nucleus.apply_top_k_top_p]
        print(f"| {name} | {full:.1f} | {fast:.1f} | {full / fast:.2f}x |")
    keys = [keyed.seeded_key(seed, 100) for seed in range(ns.batch)]
    key_tensor = torch.tensor(keys, device=ns.device)

    def generators() -> None:
        draws = [torch.rand(ns.vocab, generator=torch.Generator().manual_seed(k)) for k in keys]
        torch.stack(draws).to(ns.device)

    old = _median_ms(generators, ns.device)
    new = _median_ms(lambda: keyed.keyed_uniforms(key_tensor, ns.vocab), ns.device)
    print()
    print("| seeded uniforms | CPU generators + copy ms | keyed hash ms | speed-up |")
    print("|---|---|---|---|")
    print(f"| {ns.batch} rows × {ns.vocab} | {old:.1f} | {new:.1f} | {old / new:.2f}x |")


if __name__ == "__main__":
    main()
