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


if __name__ == "__main__":
    main()
