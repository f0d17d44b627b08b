"""Routed experts on V4-Flash shapes: our fused MoE's tile sets, and torch's grouped GEMM, timed.

    bash scripts/gpu_bench.sh benchmarks/moe_tiles.py [--tokens 1,8,32,128,512,2048,8192]
        [--json PATH]

256 experts of SwiGLU (hidden 4096, intermediate 2048), top-6 per token, random bf16 weights and
a uniform random routing (6 distinct experts a token). For each token count: every candidate
tile set of ops/moe/triton.py (``fused_moe(..., config=...)``) and, as the reference
implementation, the same experts through ``torch._grouped_mm`` (CUTLASS grouped GEMMs on SM90):
pairs sorted by expert, rows gathered, one grouped GEMM for gate and up, SwiGLU, one for down,
weighted, summed per token. Timing as flashmla_vs_triton.py (CUDA-graph replays, L2 cleared
before each, median).

Bound = max(bytes / copy bandwidth, FLOPs / dense GEMM rate), both measured in the run: bytes =
the weights of every expert the routing hits + x and out; FLOPs = 2 x 3 x D x I per pair.
``pick_tile_config``'s choice (what the engine runs) is reported against the fastest.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from flashmla_vs_triton import candidate_us
from v4_flash import V4_FLASH, make_setup, parse_ints, release
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

from deepinfer.ops.moe import torch_ref

SCRIPT = "moe_tiles.py"
DIM = V4_FLASH["hidden_size"]
INTER = V4_FLASH["moe_intermediate_size"]
NUM_EXPERTS = V4_FLASH["num_local_experts"]
TOP_K = V4_FLASH["num_experts_per_tok"]
LIMIT = V4_FLASH["swiglu_limit"]

# (block_m, block_n, block_k, group_m, num_warps, num_stages)
CANDIDATES = [
    (16, 64, 128, 1, 4, 3),
    (16, 64, 256, 1, 4, 3),
    (16, 128, 128, 1, 4, 3),
    (32, 64, 128, 8, 4, 3),
    (64, 64, 64, 8, 4, 4),
    (64, 128, 64, 8, 4, 3),
    (128, 64, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 3),
    (128, 128, 64, 8, 8, 4),
    (128, 256, 64, 8, 8, 3),
]


def grouped_mm_moe(
    x: torch.Tensor,
    w13_t: torch.Tensor,
    w2_t: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts through torch._grouped_mm. w13_t: [E, D, 2I] (gate then up); w2_t: [E, I, D]."""
    order = topk_ids.flatten().argsort(stable=True)  # pairs by expert
    ids = topk_ids.flatten()
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))  # bincount would ask the host for a size
    offs = counts.cumsum(0).to(torch.int32)
    rows = x[order // TOP_K]  # [P, D]
    gate_up = torch._grouped_mm(rows, w13_t, offs=offs)  # [P, 2I]
    h = torch_ref.swiglu(gate_up[:, :INTER], gate_up[:, INTER:], LIMIT).to(x.dtype)
    down = torch._grouped_mm(h, w2_t, offs=offs)  # [P, D]
    weighted = down.float() * topk_weights.flatten()[order, None]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, order // TOP_K, weighted)
    return out.to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tokens", default="1,8,32,128,512,2048,8192")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every figure here")
    ns = ap.parse_args()
    setup = make_setup(tiny=False)  # exits without CUDA
    from deepinfer.ops.moe import triton as ours

    bandwidth, rate = copy_bandwidth(setup), gemm_rate(setup)
    print(f"{device_name(setup)}: copy {bandwidth / 1e12:.3f} TB/s, GEMM {rate / 1e12:.1f} TFLOP/s")
    gen = torch.Generator(device=setup.device).manual_seed(ns.seed)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=setup.device) * 0.02).bfloat16()

    w1, w3, w2 = (
        randn(NUM_EXPERTS, INTER, DIM),
        randn(NUM_EXPERTS, INTER, DIM),
        randn(NUM_EXPERTS, DIM, INTER),
    )
    w13_t = torch.cat([w1, w3], dim=1).transpose(1, 2)  # [E, D, 2I], D contiguous per column
    w2_t = w2.transpose(1, 2)  # [E, I, D]
    rows: list[dict] = []
    payload = {**header(setup), "script": SCRIPT, "bandwidth_Bps": bandwidth, "rows": rows}
    names = ["{}x{}x{} g{} w{} s{}".format(*c) for c in CANDIDATES]
    for num_tokens in parse_ints(ns.tokens):
        x = torch.randn((num_tokens, DIM), generator=gen, device=setup.device).bfloat16()
        scores = torch.rand((num_tokens, NUM_EXPERTS), generator=gen, device=setup.device)
        topk_ids = scores.topk(TOP_K, dim=-1).indices
        topk_weights = torch.rand((num_tokens, TOP_K), generator=gen, device=setup.device)
        chosen = ours.pick_tile_config(num_tokens * TOP_K, x.dtype)
        reference = ours.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT).float()
        hit = int(torch.unique(topk_ids).numel())
        bytes_ = hit * 3 * DIM * INTER * 2 + 2 * num_tokens * DIM * 2
        flops = 2 * 3 * DIM * INTER * num_tokens * TOP_K
        row: dict = {"tokens": num_tokens, "experts_hit": hit, "us": {}}
        row["bound_s"] = max(bytes_ / bandwidth, flops / rate)

        for name, tiles in zip(names, CANDIDATES, strict=True):
            config = ours.TileConfig(*tiles)
            run = functools.partial(
                ours.fused_moe, x, w1, w2, w3, topk_ids, topk_weights, LIMIT, config=config
            )
            row["us"][name] = candidate_us(run, [reference], 2e-2)
            print(f"  T={num_tokens:5} {name}: {row['us'][name]}")
        run = functools.partial(grouped_mm_moe, x, w13_t, w2_t, topk_ids, topk_weights)
        row["us"]["grouped_mm"] = candidate_us(run, [reference], 2e-2)
        print(f"  T={num_tokens:5} grouped_mm: {row['us']['grouped_mm']}")
        ours_timed = {n: row["us"][n] for n in names if isinstance(row["us"][n], float)}
        best = min(ours_timed, key=ours_timed.get)
        chosen_name = "{}x{}x{} g{} w{} s{}".format(*vars(chosen).values())
        row.update(best=best, best_us=ours_timed[best], chosen_us=ours_timed.get(chosen_name))
        rows.append(row)
        write_json(ns.json, payload)
        del x, scores, topk_ids, topk_weights, reference
        release()

    headers = ["T", "experts hit", "bound µs", *names, "grouped_mm", "fastest ours",
               "chosen / fastest", "fastest / bound", "grouped_mm / fastest"]  # fmt: skip
    body = []
    for r in rows:
        cells = [r["us"].get(n) if isinstance(r["us"].get(n), float) else "—" for n in names]
        gm = r["us"].get("grouped_mm")
        gm = gm if isinstance(gm, float) else None
        body.append([
            r["tokens"], r["experts_hit"], r["bound_s"] * 1e6, *cells, gm or "—", r["best"],
            None if r["chosen_us"] is None else r["chosen_us"] / r["best_us"],
            r["best_us"] / (r["bound_s"] * 1e6), None if gm is None else gm / r["best_us"],
        ])  # fmt: skip
    print()
    print(table(headers, body))
    print()
    print(
        results_block(
            "Fused MoE tile sweep and torch._grouped_mm (µs per call)",
            SCRIPT,
            setup,
            [
                f"{device_name(setup)}; {NUM_EXPERTS} experts, top-{TOP_K}, hidden {DIM}, "
                f"intermediate {INTER}, bf16, uniform random routing. Tiles: block m x n x k, "
                "group, warps, stages. Bound: max(bytes / copy bandwidth, FLOPs / GEMM rate) "
                f"({bandwidth / 1e12:.3f} TB/s, {rate / 1e12:.1f} TFLOP/s measured).",
            ],
            [markdown(headers, body)],
        )
    )


if __name__ == "__main__":
    main()
