"""Hyper-connection entry (hc_pre) on V4-Flash shapes: the Triton kernels' tile sets, timed.

    bash scripts/gpu_bench.sh benchmarks/hc_tiles.py [--tokens 1,128,8192] [--json PATH]

hc_pre of ops/norm/triton.py on x [T, 4, 4096] bf16 with fp32 mixing weights [24, 16384] and 20
Sinkhorn iterations (V4-Flash), for each candidate of the module's tile attributes: the mix
kernel's tokens and K a program (HC_BLOCK_T, HC_BLOCK_K), the most programs it splits K over
(HC_MAX_SPLIT_K: decode's), one token's K a step on the CUDA cores (HC_ONE_TOKEN_BLOCK_K, 0:
tl.dot) and the Sinkhorn/collapse kernel's warps (HC_SINKHORN_WARPS), and for the module's own
attributes ("current"). Every candidate's output is checked against the current attributes'
(the same arithmetic up to summation order); timing as flashmla_vs_triton.py (CUDA-graph
replays, L2 cleared before each, median). Bound = bytes (x read, the collapsed output written,
fn read once) / copy bandwidth measured in the run.
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
    header,
    markdown,
    results_block,
    table,
    write_json,
)

SCRIPT = "hc_tiles.py"
HC = V4_FLASH["hc_mult"]
DIM = V4_FLASH["hidden_size"]
ITERS = V4_FLASH["hc_sinkhorn_iters"]
EPS = V4_FLASH["hc_eps"]

# (HC_BLOCK_T, HC_BLOCK_K, HC_SINKHORN_WARPS, HC_MAX_SPLIT_K, HC_ONE_TOKEN_BLOCK_K); all
# compile without register spills on sm_90a. The split cap matters where tokens alone do not
# fill the SMs (decode); the last field only at one token (0: the tl.dot path there too).
CANDIDATES = [
    (64, 32, 4, 64, 128),
    (64, 64, 4, 64, 128),
    (128, 32, 4, 64, 128),
    (128, 64, 4, 64, 128),
    (128, 64, 1, 64, 0),
    (128, 64, 1, 128, 0),
    (128, 64, 1, 256, 0),
    (128, 64, 1, 32, 128),
    (128, 64, 1, 64, 128),
    (128, 64, 1, 128, 128),
    (128, 64, 1, 64, 256),
    (128, 64, 1, 128, 64),
    (128, 64, 1, 256, 64),
    (128, 64, 1, 32, 512),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tokens", default="1,128,8192")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--iters",
        default="",
        help="also time the current tiles at these Sinkhorn iteration counts, with IEEE and "
        "approximate division (what they cost)",
    )
    ap.add_argument("--json", help="write every figure here")
    ns = ap.parse_args()
    setup = make_setup(tiny=False)  # exits without CUDA
    from deepinfer.ops.norm import triton as ours

    bandwidth = copy_bandwidth(setup)
    gen = torch.Generator(device=setup.device).manual_seed(ns.seed)
    mix = (2 + HC) * HC
    fn = torch.randn((mix, HC * DIM), generator=gen, device=setup.device) * 0.01
    scale = torch.rand(3, generator=gen, device=setup.device)
    base = torch.randn(mix, generator=gen, device=setup.device) * 0.1
    attrs = ("HC_BLOCK_T", "HC_BLOCK_K", "HC_SINKHORN_WARPS", "HC_MAX_SPLIT_K",
             "HC_ONE_TOKEN_BLOCK_K")  # fmt: skip
    current = tuple(getattr(ours, a) for a in attrs)
    tile_sets = [*CANDIDATES, current]
    names = ["t{} k{} w{} s{} one{}".format(*c) for c in CANDIDATES] + ["current"]
    rows: list[dict] = []
    payload = {**header(setup), "script": SCRIPT, "bandwidth_Bps": bandwidth, "rows": rows}
    for num_tokens in parse_ints(ns.tokens):
        x = torch.randn((num_tokens, HC, DIM), generator=gen, device=setup.device).bfloat16()
        run = functools.partial(ours.hc_pre, x, fn, scale, base, ITERS, EPS, 1e-6)
        reference = [t.float() for t in run()]
        bytes_ = x.numel() * 2 + num_tokens * DIM * 2 + fn.numel() * 4
        row: dict = {"tokens": num_tokens, "bound_s": bytes_ / bandwidth, "us": {}}
        for name, tiles in zip(names, tile_sets, strict=True):
            for attr, value in zip(attrs, tiles, strict=True):
                setattr(ours, attr, value)
            row["us"][name] = candidate_us(run, reference, 1e-2)
            print(f"  T={num_tokens:5} {name}: {row['us'][name]}")
        for attr, value in zip(attrs, current, strict=True):
            setattr(ours, attr, value)
        precise = ours.HC_SINKHORN_PRECISE_DIV
        for iters in parse_ints(ns.iters) if ns.iters else []:
            other = functools.partial(ours.hc_pre, x, fn, scale, base, iters, EPS, 1e-6)
            for division in (True, False):  # IEEE, approximate
                ours.HC_SINKHORN_PRECISE_DIV = division
                us = candidate_us(other, [t.float() for t in other()], 1e-6)
                name = f"{iters} iterations, {'IEEE' if division else 'approximate'} division"
                row.setdefault("us_by_iterations", {})[name] = us
                print(f"  T={num_tokens:5} current, {name}: {us}")
            ours.HC_SINKHORN_PRECISE_DIV = True
            exact = other()[1]
            ours.HC_SINKHORN_PRECISE_DIV = False
            approximate = other()[1]
            error = ((approximate - exact).abs().max() / exact.abs().max()).item()
            row.setdefault("comb_error_approximate", {})[iters] = error
            print(f"  T={num_tokens:5} {iters} iterations: comb approximate vs IEEE {error:.2e}")
        ours.HC_SINKHORN_PRECISE_DIV = precise
        timed = {n: v for n, v in row["us"].items() if isinstance(v, float)}
        row["best"] = min(timed, key=timed.get)
        rows.append(row)
        write_json(ns.json, payload)
        del x, run, reference
        release()

    current_name = "current"
    headers = ["T", "bound µs", *names, "fastest", "current / fastest", "fastest / bound"]
    body = [
        [
            r["tokens"],
            r["bound_s"] * 1e6,
            *[r["us"][n] if isinstance(r["us"][n], float) else "—" for n in names],
            r["best"],
            r["us"][current_name] / r["us"][r["best"]],
            r["us"][r["best"]] / (r["bound_s"] * 1e6),
        ]
        for r in rows
    ]
    print()
    print(table(headers, body))
    print()
    print(
        results_block(
            "hc_pre tile sweep (µs per call)",
            SCRIPT,
            setup,
            [
                f"{device_name(setup)}; x [T, {HC}, {DIM}] bf16, fn [{mix}, {HC * DIM}] fp32, "
                f"{ITERS} Sinkhorn iterations. Tiles: mix tokens (t) and K (k) a program, "
                f"Sinkhorn/collapse warps (w), most K splits (s), one token's K step (one). "
                f"Copy bandwidth {bandwidth / 1e12:.3f} TB/s.",
            ],
            [markdown(headers, body)],
        )
    )


if __name__ == "__main__":
    main()
