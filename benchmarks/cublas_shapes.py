"""cuBLAS's blockwise FP8 GEMM (``torch._scaled_mm``, DeepSeek's recipe) against our kernel on
every FP8 linear of a model, with and without a SwiGLU input: which shapes cuBLAS gets right.

    bash scripts/gpu_bench.sh benchmarks/cublas_shapes.py [--model DIR] [--rows 720]

Without --model: the quantized tiny checkpoint (make_tiny_model(quantized=True)), every linear
FP8. For each ``Fp8Linear`` (shared weights once): x [rows, in] bf16 N(0, 1) (and an ``up`` of
the same shape for the SwiGLU input, limit 10) through ``ops/linear/triton.scaled_mm_blockwise``
(what ``cublas_fp8_linear`` calls, without its whole-block check) against ``fp8_linear``: the
relative difference, or cuBLAS's refusal. CUDA only.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a checkpoint folder (default: the quantized tiny model)")
    ap.add_argument("--rows", type=int, default=720, help="x's rows (prefill-sized: > 64)")
    ns = ap.parse_args()
    from deepinfer import LLM
    from deepinfer.model.layers import Fp8Linear
    from deepinfer.model.tiny import make_tiny_model
    from deepinfer.ops.linear import triton as fp8_triton

    folder = ns.model or make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=1, quantized=True)
    llm = LLM(model=folder, device="cuda", dtype="bfloat16", max_model_len=1024,
              gpu_memory_utilization=0.1, fp8_weights=True, fp8_min_weights=0)  # fmt: skip
    model = llm.engine.executor.model
    seen: set[int] = set()
    print("| linear | N x K | block | x | cuBLAS against ours |")
    print("|---|---|---|---|---|")
    for name, module in model.named_modules():
        if not isinstance(module, Fp8Linear) or module.weight.data_ptr() in seen:
            continue
        seen.add(module.weight.data_ptr())
        gen = torch.Generator(device="cuda").manual_seed(len(seen))
        x = torch.randn(ns.rows, module.in_features, generator=gen, device="cuda").bfloat16()
        up = torch.randn(x.shape, generator=gen, device="cuda").bfloat16()
        for label, swiglu in (("plain", None), ("swiglu", (up, 10.0))):
            weight, scale_w = module.weight, module.scale
            ours = fp8_triton.fp8_linear(x, weight, scale_w, module.block, swiglu=swiglu)
            try:
                out = fp8_triton.scaled_mm_blockwise(x, weight, scale_w, swiglu)
                diff = ((out.float() - ours.float()).norm() / ours.float().norm()).item()
                answer = f"rel diff {diff:.2e}"
            except RuntimeError as error:
                answer = f"refused: {str(error).strip().splitlines()[0][:70]}"
            shape = f"{module.out_features} x {module.in_features}"
            print(f"| {name} | {shape} | {tuple(module.block)} | {label} | {answer} |")


if __name__ == "__main__":
    main()
