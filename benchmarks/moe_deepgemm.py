"""Routed experts on V4-Flash shapes: DeepGEMM's grouped FP8 GEMMs on FP8 experts vs our packed
MXFP4 kernels vs bf16, in one run.

    bash scripts/build_deepgemm.sh && bash scripts/gpu_bench.sh benchmarks/moe_deepgemm.py
        [--tokens 1,8,32,128,512,2048,8192] [--json PATH]        (carry .whl and .deepgemm)

256 experts, top-6, hidden 4096, intermediate 2048, uniform random routing (moe_fp4.py's
``mxfp4_experts`` and ``decode_batch``). The same MXFP4 weights three ways: dequantized to bf16
(our fused MoE, the engine's tiles), packed (the engine's path: a program a pair or grouped), and
converted to FP8 128 x 128 blocks as the loader does for ``kernel.moe = "deepgemm"`` (exact), run
by ``ops/moe/deepgemm.py`` (W8A8: the activations are quantized per token per 128; within 8e-2
of the bf16 result is checked in the run, two e4m3 roundings in a row).

Timing: CUDA-graph replays, L2 cleared before each, median (``kernel_seconds``). Bounds, each
measured in the run: bytes / copy bandwidth, and FLOPs / GEMM rate (bf16: torch.matmul;
FP8: ``deep_gemm.fp8_gemm_nt`` at 8192^3); bytes are the weights of every expert the routing hits
(bf16 2 bytes a value, MXFP4 17/32, FP8 1 + 4/128^2) plus x and out. Memory per layer: packed
3.19 GiB, FP8 6.00 GiB, bf16 12.00 GiB.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from flashmla_vs_triton import candidate_us, kernel_seconds
from moe_fp4 import decode_batch, mxfp4_experts
from moe_tiles import DIM, INTER, LIMIT, NUM_EXPERTS, TOP_K
from v4_flash import make_setup, parse_ints, release
from v4_flash_report import (
    copy_bandwidth,
    device_name,
    gemm_rate,
    header,
    markdown,
    ratio,
    results_block,
    table,
    write_json,
)

from deepinfer.ops import moe

SCRIPT = "moe_deepgemm.py"
FP8_TOLERANCE = 8e-2  # W8A8 against bf16 on the same weights (tests/gpu/test_gpu_deepgemm_moe.py)


def fp8_gemm_rate() -> float:
    """DeepGEMM's FP8 GEMM rate in FLOP/s: 8192^3 with 1 x 128 / 128 x 128 scales, median."""
    import deep_gemm

    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(n // 128, n, device="cuda").t()  # MN-major, as our quantizer writes them
    sb = torch.ones(n // 128, n // 128, device="cuda")
    d = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    seconds, _ = kernel_seconds(lambda: deep_gemm.fp8_gemm_nt((a, sa), (b, sb), d))
    return 2 * n**3 / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tokens", default="1,8,32,128,512,2048,8192")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every figure here")
    ns = ap.parse_args()
    setup = make_setup(tiny=False)  # exits without CUDA
    from deepinfer.ops.moe import triton as ours

    deepgemm = moe.BACKENDS.select("deepgemm", setup.device)  # raises with the reason
    bandwidth, rate, fp8_rate = copy_bandwidth(setup), gemm_rate(setup), fp8_gemm_rate()
    print(
        f"{device_name(setup)}: copy {bandwidth / 1e12:.3f} TB/s, bf16 GEMM "
        f"{rate / 1e12:.1f} TFLOP/s, FP8 GEMM (DeepGEMM) {fp8_rate / 1e12:.1f} TFLOP/s"
    )
    gen = torch.Generator(device=setup.device).manual_seed(ns.seed)
    experts = mxfp4_experts(setup, gen)
    (p1, w1), (p2, w2), (p3, w3) = experts
    f1, f2, f3 = (moe.to_fp8_experts(p) for p in (p1, p2, p3))
    release()

    rows: list[dict] = []
    payload = {**header(setup), "script": SCRIPT, "bandwidth_Bps": bandwidth, "rows": rows}
    payload |= {"gemm_flops": rate, "fp8_gemm_flops": fp8_rate}
    for num_tokens in parse_ints(ns.tokens):
        x, topk_ids, topk_weights, dense_out, _ = decode_batch(
            setup, gen, num_tokens, experts, ours
        )
        hit = int(torch.unique(topk_ids).numel())
        values = hit * 3 * DIM * INTER
        io = 2 * num_tokens * DIM * 2
        flops = 2 * 3 * DIM * INTER * num_tokens * TOP_K
        row: dict = {"tokens": num_tokens, "experts_hit": hit, "us": {}}
        row["bound_us"] = {
            "bf16": max((values * 2 + io) / bandwidth, flops / rate) * 1e6,
            "fp4": max((values * 17 / 32 + io) / bandwidth, flops / rate) * 1e6,
            "fp8": max((values * (1 + 4 / 128**2) + io) / bandwidth, flops / fp8_rate) * 1e6,
        }
        args = (topk_ids, topk_weights, LIMIT)
        runs = {
            "bf16": (functools.partial(ours.fused_moe, x, w1, w2, w3, *args), 2e-2),
            "fp4": (functools.partial(ours.fused_moe, x, p1, p2, p3, *args), 2e-2),
            "fp8": (functools.partial(deepgemm.fused_moe, x, f1, f2, f3, *args), FP8_TOLERANCE),
        }
        for name, (run, tolerance) in runs.items():
            row["us"][name] = candidate_us(run, [dense_out], tolerance)
            print(f"  T={num_tokens:5} {name}: {row['us'][name]}")
        rows.append(row)
        write_json(ns.json, payload)
        del x, topk_ids, topk_weights, dense_out, runs
        release()

    headers = ["T", "experts hit", "bf16 µs", "packed FP4 µs", "DeepGEMM FP8 µs",
               "bf16 / FP8", "FP4 / FP8", "FP4 bound µs", "FP8 bound µs", "FP4 / its bound",
               "FP8 / its bound"]  # fmt: skip
    body = []
    for r in rows:
        us = {k: v if isinstance(v, float) else None for k, v in r["us"].items()}
        bound = r["bound_us"]
        body.append([
            r["tokens"], r["experts_hit"], us["bf16"] or r["us"]["bf16"],
            us["fp4"] or r["us"]["fp4"], us["fp8"] or r["us"]["fp8"],
            ratio(us["bf16"], us["fp8"]), ratio(us["fp4"], us["fp8"]),
            bound["fp4"], bound["fp8"], ratio(us["fp4"], bound["fp4"]),
            ratio(us["fp8"], bound["fp8"]),
        ])  # fmt: skip
    print()
    print(table(headers, body))
    print()
    print(
        results_block(
            "Routed experts: DeepGEMM FP8 vs packed MXFP4 vs bf16 (µs per call)",
            SCRIPT,
            setup,
            [
                f"{device_name(setup)}; {NUM_EXPERTS} experts, top-{TOP_K}, hidden {DIM}, "
                f"intermediate {INTER}, uniform random routing; one set of MXFP4 weights, "
                "dequantized (bf16), packed (FP4) and converted exactly to FP8 blocks (FP8). "
                f"Copy {bandwidth / 1e12:.3f} TB/s, bf16 GEMM {rate / 1e12:.1f} TFLOP/s, "
                f"FP8 GEMM {fp8_rate / 1e12:.1f} TFLOP/s, measured in the run.",
            ],
            [markdown(headers, body)],
        )
    )


if __name__ == "__main__":
    main()
