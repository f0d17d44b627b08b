"""Sparse attention tiles on V4-Flash shapes: every candidate tile set of our Triton kernel, timed.

    bash scripts/gpu_bench.sh benchmarks/attention_tiles.py [--cases 1,8,32,64,128,256,1024p]
        [--context 16384] [--kv bf16,fp8] [--json PATH]

A case "B" is B decode tokens of B requests; "Np" is one request's prefill chunk of N query
tokens. Every query token lists 128 window rows and 512 compressed entries of its request's
context / 4 (a CSA layer), as in flashmla_vs_triton.py, whose inputs and timing (CUDA-graph
replays, L2 cleared before each, median) this reuses. For each case: every tile set's µs, the
fastest, and ``attention_config``'s choice (what the engine runs) against the fastest. A tile
set that fails to compile or launch (shared memory) is reported, not raised. ``--kv fp8`` reads
the same rows packed (cache.kv_dtype = "fp8": FlashMLA's blocks, ``kv_fp8.Fp8Rows``), whose
kernel walks source by source and dequantizes in registers.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from flashmla_vs_triton import DIM, NUM_HEADS, TOPK, WINDOW, Case, candidate_us, make_inputs
from v4_flash import make_setup, release
from v4_flash_report import device_name, header, markdown, results_block, table, write_json

SCRIPT = "attention_tiles.py"


def candidates() -> list[tuple[int, int, int, int]]:
    """(block_h, block_n, num_warps, num_stages): 64-head wgmma tiles, and the 32-head mma.sync
    tiles the kernel used before."""
    wide = [(64, n, 8, stages) for n in (16, 32, 64) for stages in (1, 2, 3)]
    return [*wide, (32, 32, 8, 2), (32, 64, 8, 2), (32, 64, 8, 3), (32, 32, 4, 2)]


def parse_case(text: str) -> Case:
    if text.endswith("p"):
        return Case(batch=1, s_q=int(text[:-1]))
    return Case(batch=int(text), s_q=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--cases", default="1,8,32,64,128,256,1024p,4096p")
    ap.add_argument("--context", type=int, default=16384, help="tokens of context a request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv", default="bf16", help="bf16 and/or fp8 (packed rows)")
    ap.add_argument("--json", help="write every figure here")
    ns = ap.parse_args()
    setup = make_setup(tiny=False)  # exits without CUDA
    from deepinfer.ops.attention import flashmla
    from deepinfer.ops.attention import triton as ours
    from deepinfer.ops.attention.kv_fp8 import Fp8Rows

    def packed(cache: torch.Tensor) -> Fp8Rows:
        return Fp8Rows.of(cache.view(torch.uint8).squeeze(2), flashmla.LAYOUT)

    tiles = candidates()
    rows: list[dict] = []
    payload = {**header(setup), "script": SCRIPT, "context": ns.context, "rows": rows}
    scale = DIM**-0.5
    kinds = [v.strip() for v in ns.kv.split(",")]
    cases = [
        (t, kv) for t in filter(None, (v.strip() for v in ns.cases.split(","))) for kv in kinds
    ]
    for text, kv in cases:
        case = parse_case(text)
        x = make_inputs(case, ns.context, setup.device, ns.seed)
        q = x.q.view(case.num_q, NUM_HEADS, DIM)
        window, pool = x.window_rows, x.pool_rows
        if kv == "fp8":
            window, pool = packed(x.window_cache), packed(x.pool_cache)
        sources = [
            (window, x.window_idx.view(case.num_q, WINDOW)),
            (pool, x.pool_idx.view(case.num_q, TOPK)),
        ]
        chosen = ours.attention_config(q.dtype, NUM_HEADS, case.num_q, packed=kv == "fp8")
        dense = [(x.window_rows, sources[0][1]), (x.pool_rows, sources[1][1])]
        reference = ours.sparse_attention(q, dense, x.sinks, scale).float()
        row: dict = {"case": text, "kv": kv, "chosen": list(vars(chosen).values()), "us": {}}
        for block_h, block_n, warps, stages in tiles:
            config = ours.AttentionConfig(block_h, block_n, warps, stages)
            name = f"{block_h}x{block_n} w{warps} s{stages}"

            run = functools.partial(
                ours.sparse_attention, q, sources, x.sinks, scale, config=config
            )
            row["us"][name] = candidate_us(run, [reference], 1e-2)
            print(f"  {text:>6} {kv} {name}: {row['us'][name]}")
        timed = {k: v for k, v in row["us"].items() if isinstance(v, float)}
        best = min(timed, key=timed.get)
        chosen_name = f"{chosen.block_h}x{chosen.block_n} w{chosen.num_warps} s{chosen.num_stages}"
        row.update(best=best, best_us=timed[best], chosen_us=timed.get(chosen_name))
        rows.append(row)
        write_json(ns.json, payload)
        del x, q, sources, reference
        release()

    names = [f"{h}x{n} w{w} s{s}" for h, n, w, s in tiles]
    headers = ["case", "kv", *names, "fastest", "chosen / fastest"]
    body = [
        [
            r["case"],
            r["kv"],
            *[r["us"].get(n) if isinstance(r["us"].get(n), float) else "—" for n in names],
            r["best"],
            None if r["chosen_us"] is None else r["chosen_us"] / r["best_us"],
        ]
        for r in rows
    ]
    print()
    print(table(headers, body))
    print()
    print(
        results_block(
            "Sparse attention tile sweep (µs per call)",
            SCRIPT,
            setup,
            [
                f"{device_name(setup)}; V4-Flash shapes: {NUM_HEADS} heads of {DIM}, window "
                f"{WINDOW} + compressed top-{TOPK} at context {ns.context}; kv: bf16 rows, or fp8 "
                "(the same values packed, 584 bytes a row). Tiles: "
                "heads x keys a program, warps, pipeline stages.",
            ],
            [markdown(headers, body)],
        )
    )


if __name__ == "__main__":
    main()
