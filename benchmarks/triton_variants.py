"""How many variants of each Triton kernel a mixed serving workload compiles.

    bash scripts/gpu_bench.sh benchmarks/triton_variants.py [--requests 48] [--seed 0]
    python benchmarks/triton_variants.py --device cpu      # the alignment patterns only

Triton compiles a kernel once per combination of its constexprs and of what it specialises its
other arguments on (an int equal to 1 or a multiple of 16, a pointer 16-byte aligned). A
variant compiled while serving stalls the step that needs it for seconds. The workload: the
tiny checkpoint (bf16 on CUDA, fp32 on the CPU), requests of random prompt and output lengths
through a small token budget, so that prefill chunks, mixed steps and decode steps of many
sizes run. Prints, per backend op, how many sets of misaligned tensor arguments its calls came with
(parameters aside; each set is a compilation of the op's kernels on CUDA; 1 is the fewest)
and the arguments ever misaligned; on CUDA then each kernel's compiled variants (most first), the
total, and the workload's wall time (compilation included).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from deepinfer import LLM, SamplingParams
from deepinfer.model.tiny import make_tiny_model
from deepinfer.ops import Kernels

Pattern = frozenset[str]  # the tensor arguments of a call that are not 16-byte aligned


def tensor_arguments(value: object, where: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors in an op's arguments (through lists, tuples and dataclasses such as
    CompressRows), by where they sit, parameters aside (fixed per module)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return [p for f in fields for p in tensor_arguments(getattr(value, f.name), f".{f.name}")]
    if isinstance(value, list | tuple):
        return [p for i, v in enumerate(value) for p in tensor_arguments(v, f"{where}[{i}]")]
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        return [(where, value)]
    return []


def record_alignment(kernels: Kernels) -> dict[str, set[Pattern]]:
    """Wrap every op of ``kernels``' norm, attention and MoE backends (the RoPE tables aside) to
    record which of each call's tensor arguments are not 16-byte aligned, by op name: each
    distinct set is a compilation of the op's kernels on CUDA."""
    patterns: dict[str, set[Pattern]] = defaultdict(set)

    def recorded(name: str, op: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            found = tensor_arguments([*args, *kwargs.values()])
            patterns[name].add(frozenset(w for w, t in found if t.numel() and t.data_ptr() % 16))
            return op(*args, **kwargs)

        return call

    for family in ("norm", "attention", "moe"):
        backend = getattr(kernels, family)
        for name in dir(backend):
            op = getattr(backend, name)
            if not name.startswith(("_", "rope_")) and callable(op) and not isinstance(op, type):
                setattr(backend, name, recorded(name, op))
    return patterns


def misaligned(patterns: dict[str, set[Pattern]]) -> dict[str, set[str]]:
    """The arguments each op ever got misaligned (empty: none)."""
    found = {op: set().union(*sets) for op, sets in patterns.items()}
    return {op: where for op, where in found.items() if where}


def compiled_variants() -> dict[str, int]:
    """Compiled variants of every Triton kernel in deepinfer's modules, by qualified name."""
    from triton.runtime.jit import JITFunction

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
    ap.add_argument("--device", default="cuda", help="cpu: the alignment patterns only")
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
    patterns = record_alignment(llm.engine.executor.kernels)
    prompts = [
        [0] + [rng.randrange(3, 128000) for _ in range(rng.randrange(4, 300))]
        for _ in range(ns.requests)
    ]
    params = [SamplingParams(max_tokens=rng.randrange(2, 40), ignore_eos=True) for _ in prompts]
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    bad = misaligned(patterns)
    print("sets of misaligned tensor arguments of each backend op (parameters aside):")
    for op, found in sorted(patterns.items(), key=lambda item: -len(item[1])):
        print(f"{len(found):5}  {op}  misaligned: {sorted(bad.get(op, ())) or 'none'}")
    if ns.device != "cuda":
        return
    counts = compiled_variants()
    print("compiled Triton variants:")
    for name, count in sorted(counts.items(), key=lambda item: -item[1]):
        print(f"{count:5}  {name}")
    print(
        f"total {sum(counts.values())} variants of {len(counts)} kernels; workload {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
