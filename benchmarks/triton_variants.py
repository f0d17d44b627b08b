"""How many variants of each Triton kernel a mixed serving workload compiles.

    bash scripts/gpu_bench.sh benchmarks/triton_variants.py [--requests 48] [--seed 0]

Triton compiles a kernel once per combination of its constexprs and of what it specialises its
other arguments on (an int equal to 1 or a multiple of 16, a pointer 16-byte aligned). A
variant compiled while serving stalls the step that needs it for seconds. The workload: the
tiny checkpoint on CUDA (bf16), requests of random prompt lengths and output lengths through a
small token budget, so that prefill chunks, mixed steps and decode steps of many sizes run.
Prints each kernel's variant count (most first), the total, and the workload's wall time
(compilation included; Triton's cache is in-process for this count).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from triton.runtime.jit import JITFunction

from deepinfer import LLM, SamplingParams
from deepinfer.model.tiny import make_tiny_model


def variants() -> dict[str, int]:
    """Compiled variants of every Triton kernel in deepinfer's modules, by qualified name."""
    counts = {}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("deepinfer.") or module is None:
            continue
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and value.__module__ == module_name:
                caches = getattr(value, "device_caches", {})
                total = sum(len(cache[0]) for cache in caches.values())
                if total:
                    counts[f"{module_name.removeprefix('deepinfer.')}.{name}"] = total
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test (no Triton kernels)")
    ns = ap.parse_args()
    rng = random.Random(ns.seed)
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=1)
    llm = LLM(
        model=model_dir,
        device=ns.device,
        dtype="bfloat16" if ns.device == "cuda" else "float32",
        block_size=16,
        max_num_batched_tokens=96,
    )
    prompts = [
        [0] + [rng.randrange(3, 128000) for _ in range(rng.randrange(4, 300))]
        for _ in range(ns.requests)
    ]
    params = [SamplingParams(max_tokens=rng.randrange(2, 40), ignore_eos=True) for _ in prompts]
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    counts = variants()
    for name, count in sorted(counts.items(), key=lambda item: -item[1]):
        print(f"{count:5}  {name}")
    print(
        f"total {sum(counts.values())} variants of {len(counts)} kernels; workload {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
