"""The MoE router after its GEMM: torch_ref's ~10 ops against the one-launch Triton router.

    bash scripts/gpu_bench.sh benchmarks/moe_router.py [--tokens 1,32,128,512,4096]

V4-Flash's router: 256 experts, top 6, bf16 logits [T, 256], a bias (a top-k layer) or the
token's hash ids (a hash layer). Each is timed as CUDA-graph replays with the L2 cleared before
each (flashmla_vs_triton.kernel_seconds), median µs; a decode step runs one router per MoE
layer (43 in V4-Flash), so the saving a token is 43 x the difference at batch 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from flashmla_vs_triton import kernel_seconds
from v4_flash import make_setup
from v4_flash_report import device_name, markdown, results_block, table

SCRIPT = "moe_router.py"
NUM_EXPERTS, TOP_K, SCALE = 256, 6, 1.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tokens", default="1,32,128,512,4096")
    ap.add_argument(
        "--gate",
        help="also the router with its GEMM (gate_route, up to GATE_MAX_TOKENS tokens) against "
        "cuBLAS then route, at these tiles: GATE_E,GATE_D,warps;... (the module's first)",
    )
    ns = ap.parse_args()
    setup = make_setup(tiny=False)  # exits without CUDA
    from deepinfer.ops.moe import torch_ref
    from deepinfer.ops.moe.triton_router import route

    gen = torch.Generator(device=setup.device).manual_seed(0)
    rows = []
    for num_tokens in (int(v) for v in ns.tokens.split(",") if v.strip()):
        logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen, device=setup.device)
        logits = logits.mul_(3).bfloat16()
        bias = torch.randn(NUM_EXPERTS, generator=gen, device=setup.device) * 0.1
        hashed = torch.rand(num_tokens, NUM_EXPERTS, generator=gen, device=setup.device)
        hash_ids = hashed.argsort(-1)[:, :TOP_K]
        for kind, args in (("top-k", (bias, None)), ("hash", (None, hash_ids))):
            ref_s, _ = kernel_seconds(lambda a=args, x=logits: torch_ref.route(x, *a, TOP_K, SCALE))
            ours_s, how = kernel_seconds(lambda a=args, x=logits: route(x, *a, TOP_K, SCALE))
            rows.append([num_tokens, kind, ref_s * 1e6, ours_s * 1e6, ref_s / ours_s, how])
            print(
                f"  T={num_tokens:5} {kind:5}: torch {ref_s * 1e6:.1f} µs, ours {ours_s * 1e6:.1f}"
            )
    if ns.gate:
        print(_gate_table(ns, setup))
    headers = ["tokens", "layer", "torch_ref µs", "triton µs", "torch / triton", "timed as"]
    print()
    print(table(headers, rows))
    print()
    notes = [
        f"{device_name(setup)}; {NUM_EXPERTS} experts, top {TOP_K}, bf16 logits; median of "
        "CUDA-graph replays, L2 cleared before each."
    ]
    print(
        results_block(
            "MoE router, torch vs one launch", SCRIPT, setup, notes, [markdown(headers, rows)]
        )
    )


def _gate_table(ns: argparse.Namespace, setup: object) -> str:
    """gate_route at each --gate tile against F.linear (cuBLAS) then route, V4-Flash's gate
    [256, 4096] bf16, the tokens of --tokens up to GATE_MAX_TOKENS; the same experts checked."""
    import torch.nn.functional as F

    from deepinfer.ops.moe import triton_router

    device = setup.device  # type: ignore[attr-defined]
    gen = torch.Generator(device=device).manual_seed(1)
    weight = (torch.randn(NUM_EXPERTS, 4096, generator=gen, device=device) * 0.05).bfloat16()
    bias = torch.randn(NUM_EXPERTS, generator=gen, device=device) * 0.1
    module = (triton_router.GATE_E, triton_router.GATE_D, triton_router.GATE_WARPS)
    tiles = [module] + [
        tuple(int(v) for v in t.split(",")) for t in ns.gate.split(";") if t.strip()
    ]
    args = (bias, None, TOP_K, SCALE)
    rows = []
    for num_tokens in (int(v) for v in ns.tokens.split(",") if v.strip()):
        if num_tokens > triton_router.GATE_MAX_TOKENS:
            continue
        x = torch.randn(num_tokens, 4096, generator=gen, device=device).bfloat16()
        ref_s, _ = kernel_seconds(lambda x=x: triton_router.route(F.linear(x, weight), *args))
        ref_ids = triton_router.route(F.linear(x, weight), *args)[1].sort(-1).values
        for tile in tiles:
            ids = triton_router.gate_route(x, weight, *args, tiles=tile)[1].sort(-1).values
            same = bool((ids == ref_ids).all())
            ours_s, _ = kernel_seconds(
                lambda x=x, t=tile: triton_router.gate_route(x, weight, *args, tiles=t)
            )
            rows.append([num_tokens, str(tile), ref_s * 1e6, ours_s * 1e6, ref_s / ours_s, same])
            print(f"  gate T={num_tokens} {tile}: cuBLAS + route {ref_s * 1e6:.1f} µs, "
                  f"ours {ours_s * 1e6:.1f} µs")  # fmt: skip
    headers = ["tokens", "tiles (E, D, warps)", "cuBLAS + route µs", "gate_route µs", "ratio",
               "same experts"]  # fmt: skip
    return markdown(headers, rows)


if __name__ == "__main__":
    main()
