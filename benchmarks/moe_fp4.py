"""Routed experts on V4-Flash shapes: packed MXFP4 (W4A16, dequantized in registers) vs bf16.

    bash scripts/gpu_bench.sh benchmarks/moe_fp4.py [--tokens 1,8,32,128,512,2048,8192]
        [--json PATH]

256 experts of SwiGLU (hidden 4096, intermediate 2048), top-6 per token, uniform random routing,
as moe_tiles.py. The weights are drawn in bf16 and quantized to MXFP4 (``quantize_mxfp4``); the
bf16 runs use those weights dequantized, so every variant computes the same function. For each
token count:

- ``bf16``: our fused MoE on the dense weights with the engine's tiles (``pick_tile_config``);
- ``grouped_mm``: the dense weights through ``torch._grouped_mm`` (CUTLASS grouped GEMMs: the
  reference implementation of bf16 grouped GEMMs on SM90; moe_tiles.py's ``grouped_mm_moe``);
- ``fp4 <tiles>``: our fused MoE on the packed weights, the engine's tiles and each candidate;
  ``fp4 gemv ...`` candidates run a program a pair (``triton_gemv.py``), and up to 256 pairs
  ``bf16 gemv`` runs those kernels on the dense weights.

Checks in the run: every packed variant is within 2e-2 (relative norm) of the bf16 result on the
same values (exact in registers; only the summation order differs). Timing:
CUDA-graph replays, L2 cleared before each, median (flashmla_vs_triton.py's ``kernel_seconds``).
Bound = max(bytes / copy bandwidth, FLOPs / dense GEMM rate), both measured in the run; bytes =
the weights of every expert the routing hits (bf16: 2 bytes a value; MXFP4: 17/32) + x and out.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from flashmla_vs_triton import candidate_us
from moe_tiles import DIM, INTER, LIMIT, NUM_EXPERTS, TOP_K, grouped_mm_moe
from v4_flash import make_setup, parse_ints, release
from v4_flash_report import (
    copy_bandwidth,
    device_name,
    gemm_rate,
    header,
    markdown,
    results_block,
    table,
    write_json,
)

from deepinfer.ops.moe import quantize_mxfp4

SCRIPT = "moe_fp4.py"

# (block_m, block_n, block_k, group_m, num_warps, num_stages[, fast_math[, bits_upcast[,
# gluon[, ring]]]]); BLOCK_K a multiple of 32; fast_math 1 unless given (0: the upcast's NaN
# handling of scale 255, the slow path); bits_upcast 0 unless given (1: TileConfig.bits_upcast,
# named "... bits"); gluon 0 unless given (1: TileConfig.gluon, gluon.py's tile only); ring 0
# unless given (TileConfig.ring: K steps in flight through shared memory, named "... ringN").
CANDIDATES = [
    (16, 64, 128, 1, 4, 3, 0),
    (16, 64, 128, 1, 4, 3),
    (16, 64, 128, 1, 4, 3, 1, 1),
    (16, 64, 128, 1, 4, 3, 1, 1, 1),
    (16, 128, 128, 1, 8, 3, 1, 1, 1),
    (16, 64, 128, 1, 4, 3, 1, 1, 1, 3),
    (16, 64, 128, 1, 4, 3, 1, 1, 1, 4),
    (16, 64, 256, 1, 4, 3),
    (16, 128, 128, 1, 4, 4),
    (16, 32, 256, 1, 4, 4),
    (32, 64, 128, 8, 4, 3),
    (64, 64, 128, 8, 4, 3),
    (64, 128, 128, 8, 4, 3),
    (128, 128, 64, 8, 8, 3),
    (128, 128, 128, 8, 8, 3),
    (64, 64, 128, 1, 4, 3, 1, 1, 1, 3),
    (128, 128, 128, 1, 8, 3, 1, 1, 1, 3),
]
# A program a pair (triton_gemv.py), GemvConfig's fields: (block_n, block_k, num_warps,
# down_block_n, down_block_k, down_num_warps); the engine's first (benchmarks/moe_gemv.py sweeps
# each kernel alone).
GEMV_CANDIDATES = [
    (32, 256, 4, 8, 1024, 4),
    (16, 256, 4, 16, 256, 4),
    (8, 1024, 4, 8, 1024, 4),
    (16, 512, 4, 16, 512, 4),
]


def mxfp4_experts(setup, gen: torch.Generator) -> list:
    """[(packed, dense bf16)] for w1, w2, w3 of the V4-Flash experts: N(0, 0.02) weights in
    bf16, quantized to MXFP4; the dense ones are the packed values (the same function)."""

    def experts(rows: int, cols: int):
        dense = torch.randn(NUM_EXPERTS, rows, cols, generator=gen, device=setup.device) * 0.02
        packed = quantize_mxfp4(dense.bfloat16())
        del dense
        return packed, packed.dequantize().bfloat16()

    w1, w3, w2 = experts(INTER, DIM), experts(INTER, DIM), experts(DIM, INTER)
    release()
    return [w1, w2, w3]


def decode_batch(setup, gen: torch.Generator, num_tokens: int, experts: list, ours) -> tuple:
    """(x [T, D] bf16, topk_ids, topk_weights, bf16 output, packed output) of a uniform random
    routing through ``mxfp4_experts``' weights by ``ours`` (ops.moe.triton) with the engine's
    tiles; the packed output is checked within 2e-2 of the dense one (the same function)."""
    (p1, w1), (p2, w2), (p3, w3) = experts
    x = torch.randn((num_tokens, DIM), generator=gen, device=setup.device).bfloat16()
    scores = torch.rand((num_tokens, NUM_EXPERTS), generator=gen, device=setup.device)
    topk_ids = scores.topk(TOP_K, dim=-1).indices
    topk_weights = torch.rand((num_tokens, TOP_K), generator=gen, device=setup.device)
    dense_out = ours.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT)
    packed_out = ours.fused_moe(x, p1, p2, p3, topk_ids, topk_weights, LIMIT)
    diff = ((packed_out.float() - dense_out.float()).norm() / dense_out.float().norm()).item()
    assert diff < 2e-2, f"packed vs dense on the dequantized weights: rel diff {diff:.2e}"
    return x, topk_ids, topk_weights, dense_out, packed_out


def _name(config: object) -> str:
    tiles = tuple(vars(config).values())
    if type(config).__name__ == "GemvConfig":
        return "gemv {}x{} w{} down {}x{} w{}".format(*tiles)
    name = "{}x{}x{} g{} w{} s{}".format(*tiles) + " nan-checked" * (not config.fast_math)
    name += " bits" * config.bits_upcast + " gluon" * config.gluon
    return name + f" ring{config.ring}" * bool(config.ring)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tokens", default="1,8,32,128,512,2048,8192")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument(
        "--tiles",
        help="candidates instead of the built-in list: m,n,k,group,warps,stages[,"
        "fast_math[,bits_upcast[,gluon[,ring]]]];... (BLOCK_K a multiple of 32)",
    )
    ap.add_argument(
        "--gemv",
        help="a-program-a-pair candidates instead of the built-in list: "
        'block_n,block_k,warps,down_block_n,down_block_k,down_warps;... ("": none)',
    )
    ns = ap.parse_args()
    candidates = CANDIDATES
    if ns.tiles:
        candidates = [tuple(parse_ints(t)) for t in ns.tiles.split(";") if t.strip()]
    gemv_candidates = GEMV_CANDIDATES
    if ns.gemv is not None:
        gemv_candidates = [tuple(parse_ints(t)) for t in ns.gemv.split(";") if t.strip()]
    setup = make_setup(tiny=False)  # exits without CUDA
    from deepinfer.ops.moe import triton as ours

    bandwidth, rate = copy_bandwidth(setup), gemm_rate(setup)
    print(f"{device_name(setup)}: copy {bandwidth / 1e12:.3f} TB/s, GEMM {rate / 1e12:.1f} TFLOP/s")
    gen = torch.Generator(device=setup.device).manual_seed(ns.seed)

    experts = mxfp4_experts(setup, gen)
    (p1, w1), (p2, w2), (p3, w3) = experts
    w13_t = torch.cat([w1, w3], dim=1).transpose(1, 2)  # [E, D, 2I]
    w2_t = w2.transpose(1, 2)  # [E, I, D]
    rows: list[dict] = []
    payload = {**header(setup), "script": SCRIPT, "bandwidth_Bps": bandwidth, "rows": rows}
    for num_tokens in parse_ints(ns.tokens):
        x, topk_ids, topk_weights, dense_out, packed_out = decode_batch(
            setup, gen, num_tokens, experts, ours
        )
        chosen = ours.pick_tile_config(num_tokens * TOP_K, x.dtype, packed=True)
        hit = int(torch.unique(topk_ids).numel())
        values = hit * 3 * DIM * INTER
        io = 2 * num_tokens * DIM * 2
        flops = 2 * 3 * DIM * INTER * num_tokens * TOP_K
        row: dict = {"tokens": num_tokens, "experts_hit": hit, "us": {}}
        row["bf16_bound_s"] = max((values * 2 + io) / bandwidth, flops / rate)
        row["fp4_bound_s"] = max((values * 17 / 32 + io) / bandwidth, flops / rate)
        reference = [dense_out]
        runs = {
            "bf16": functools.partial(ours.fused_moe, x, w1, w2, w3, topk_ids, topk_weights, LIMIT),
            "grouped_mm": functools.partial(grouped_mm_moe, x, w13_t, w2_t, topk_ids, topk_weights),
            "fp4": functools.partial(ours.fused_moe, x, p1, p2, p3, topk_ids, topk_weights, LIMIT),
        }
        configs = [ours.TileConfig(*t) for t in candidates]
        configs += [ours.GemvConfig(*t) for t in gemv_candidates]
        for config in configs:
            runs[f"fp4 {_name(config)}"] = functools.partial(
                ours.fused_moe, x, p1, p2, p3, topk_ids, topk_weights, LIMIT, config=config
            )
        # the dense weights through a program a pair, for scale
        if num_tokens * TOP_K <= 256 and gemv_candidates:
            config = ours.GemvConfig(*gemv_candidates[0])
            runs["bf16 gemv"] = functools.partial(
                ours.fused_moe, x, w1, w2, w3, topk_ids, topk_weights, LIMIT, config=config
            )
        for name, run in runs.items():
            row["us"][name] = candidate_us(run, reference, 2e-2)
            print(f"  T={num_tokens:5} {name}: {row['us'][name]}")
        swept = {
            n: v for n, v in row["us"].items() if n.startswith("fp4 ") and isinstance(v, float)
        }
        row["chosen"] = _name(chosen)
        row["best"] = min(swept, key=swept.get) if swept else None
        rows.append(row)
        write_json(ns.json, payload)
        del x, topk_ids, topk_weights, dense_out, packed_out, reference, runs
        release()

    headers = ["T", "experts hit", "bf16 µs", "grouped_mm µs", "fp4 µs (engine tiles)",
               "fp4 best µs", "best tiles", "bf16 / fp4", "grouped_mm / fp4",
               "bf16 bound µs", "fp4 bound µs", "fp4 / its bound"]  # fmt: skip
    body = []
    for r in rows:
        us = r["us"]

        def num(name: str, us=us) -> float | None:
            return us.get(name) if isinstance(us.get(name), float) else None

        best = num(r["best"]) if r["best"] else None
        fp4 = min(v for v in (num("fp4"), best) if v is not None) if (num("fp4") or best) else None
        body.append([
            r["tokens"], r["experts_hit"], num("bf16") or "—", num("grouped_mm") or "—",
            num("fp4") or "—", best or "—", r["best"] or "—",
            num("bf16") / num("fp4") if num("bf16") and num("fp4") else None,
            num("grouped_mm") / num("fp4") if num("grouped_mm") and num("fp4") else None,
            r["bf16_bound_s"] * 1e6, r["fp4_bound_s"] * 1e6,
            fp4 / (r["fp4_bound_s"] * 1e6) if fp4 else None,
        ])  # fmt: skip
    print()
    print(table(headers, body))
    print()
    print(
        results_block(
            "Routed experts: packed MXFP4 (W4A16) vs bf16 (µs per call)",
            SCRIPT,
            setup,
            [
                f"{device_name(setup)}; {NUM_EXPERTS} experts, top-{TOP_K}, hidden {DIM}, "
                f"intermediate {INTER}, uniform random routing; bf16 runs on the dequantized "
                "MXFP4 weights (the same function; every packed result was checked within 2e-2 "
                "of bf16's in the run). Bound: max(bytes / copy "
                f"bandwidth, FLOPs / GEMM rate) ({bandwidth / 1e12:.3f} TB/s, "
                f"{rate / 1e12:.1f} TFLOP/s measured). 'fp4 / its bound' uses the faster of "
                "the engine's tiles and the best candidate.",
            ],
            [markdown(headers, body)],
        )
    )


if __name__ == "__main__":
    main()
