"""Hyper-connection entry (hc_pre) on V4-Flash shapes: the Triton kernels' tile sets, timed.

    bash scripts/gpu_bench.sh benchmarks/hc_tiles.py [--tokens 1,128,8192] [--json PATH]
    bash scripts/gpu_bench.sh benchmarks/hc_tiles.py --post-pre 1,32,128,256 [--mix-blocks 32,64]
    bash scripts/gpu_bench.sh benchmarks/hc_tiles.py --collapse 1,2,32,128

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
    ap.add_argument(
        "--post-pre",
        default="",
        help="instead of the sweep: at these token counts, a sub-layer's exit and the next "
        "entry as hc_post + hc_pre (three launches) and as hc_post_pre (the mix in the exit's "
        "launch) for each HC_POST_MIX_BLOCK_D in --mix-blocks",
    )
    ap.add_argument("--mix-blocks", default="32,64,128")
    ap.add_argument(
        "--collapse",
        default="",
        help="instead of the sweep: at these token counts, a sub-layer's exit and the next "
        "entry (hc_post_pre, block_norm on) with the Sinkhorn in the collapse programs and in "
        "a program of its own (HC_SINKHORN_APART_MAX_TOKENS)",
    )
    ap.add_argument("--json", help="write every figure here")
    ns = ap.parse_args()
    if ns.post_pre or ns.collapse:
        post_pre(ns)
        return
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


def post_pre(ns: argparse.Namespace) -> None:
    """hc_post then hc_pre against hc_post_pre, timed alike (CUDA-graph replays, L2 cleared);
    the fused outputs checked against the unfused ones (new x bitwise, mixes to 1e-4)."""
    setup = make_setup(tiny=False)  # exits without CUDA
    from deepinfer.ops.norm import triton as ours

    bandwidth = copy_bandwidth(setup)
    gen = torch.Generator(device=setup.device).manual_seed(ns.seed)
    mix = (2 + HC) * HC
    fn = torch.randn((mix, HC * DIM), generator=gen, device=setup.device) * (HC * DIM) ** -0.5
    scale = torch.rand(3, generator=gen, device=setup.device)
    base = torch.randn(mix, generator=gen, device=setup.device) * 0.1
    norm = (torch.ones(DIM, device=setup.device), 1e-6)
    hc = (ITERS, EPS, 1e-6)
    blocks = parse_ints(ns.mix_blocks)
    names = ["hc_post + hc_pre", *(f"hc_post_pre d{b}" for b in blocks)]
    if ns.collapse:  # and at one Sinkhorn iteration: how much of the path the 19 others are
        names = ["Sinkhorn in the collapse programs", "Sinkhorn apart"]
        names += [f"{n}, 1 iteration" for n in names]
    rows: list[dict] = []
    payload = {**header(setup), "script": SCRIPT, "bandwidth_Bps": bandwidth, "rows": rows}
    limit, block = ours.HC_POST_MIX_MAX_TOKENS, ours.HC_POST_MIX_BLOCK_D
    apart = ours.HC_SINKHORN_APART_MAX_TOKENS
    for num_tokens in parse_ints(ns.collapse or ns.post_pre):
        x = torch.randn((num_tokens, HC, DIM), generator=gen, device=setup.device).bfloat16()
        out = torch.randn((num_tokens, DIM), generator=gen, device=setup.device).bfloat16()
        post = torch.rand((num_tokens, HC), generator=gen, device=setup.device) * 2
        comb = torch.rand((num_tokens, HC, HC), generator=gen, device=setup.device).softmax(-1)
        runs = [
            functools.partial(
                ours.hc_post_pre, out, x, post, comb, fn, scale, base, iters, *hc[1:],
                block_norm=norm,
            )
            for iters in (hc[0], 1)
        ]  # fmt: skip
        if not ns.collapse:
            ours.HC_POST_MIX_MAX_TOKENS = -1
        references = [[t.float() for t in run()] for run in runs]
        # x read twice and written once, out read, the block input written, fn read once.
        bytes_ = 3 * x.numel() * 2 + 2 * out.numel() * 2 + fn.numel() * 4
        row: dict = {"tokens": num_tokens, "bound_s": bytes_ / bandwidth, "us": {}}
        for index, name in enumerate(names):
            run, reference = runs[0], references[0]
            if ns.collapse:  # the engine's exit and entry, each collapse layout
                ours.HC_SINKHORN_APART_MAX_TOKENS = num_tokens if index % 2 else 0
                run, reference = runs[index // 2], references[index // 2]
            else:
                mix_block = [None, *blocks][index]
                ours.HC_POST_MIX_MAX_TOKENS = -1 if mix_block is None else max(limit, num_tokens)
                ours.HC_POST_MIX_BLOCK_D = mix_block or block
            row["us"][name] = candidate_us(run, reference, 1e-4)
            print(f"  T={num_tokens:5} {name}: {row['us'][name]}")
        ours.HC_POST_MIX_MAX_TOKENS, ours.HC_POST_MIX_BLOCK_D = limit, block
        ours.HC_SINKHORN_APART_MAX_TOKENS = apart
        rows.append(row)
        write_json(ns.json, payload)
        release()
    headers = ["T", "bound µs", *names]
    body = [[r["tokens"], r["bound_s"] * 1e6, *(r["us"][n] for n in names)] for r in rows]
    print()
    print(
        results_block(
            "A sub-layer's exit and the next entry: "
            + ("collapse layouts" if ns.collapse else "three launches or two")
            + " (µs per call)",
            SCRIPT,
            setup,
            [
                f"{device_name(setup)}; x [T, {HC}, {DIM}] bf16, fn [{mix}, {HC * DIM}] fp32, "
                f"{ITERS} Sinkhorn iterations, block_norm on. d: HC_POST_MIX_BLOCK_D. Copy "
                f"bandwidth {bandwidth / 1e12:.3f} TB/s.",
            ],
            [markdown(headers, body)],
        )
    )


if __name__ == "__main__":
    main()
