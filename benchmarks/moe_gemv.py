"""Packed MXFP4 experts at decode, a program a pair: each of the two kernels on its own, by tiles.

    bash scripts/gpu_bench.sh benchmarks/moe_gemv.py [--tokens 1,2,4,8,16,32]
        [--gate "BN,BK,WARPS;..."] [--down "BN,BK,WARPS[,SPLIT];..."] [--baseline PATH]
        [--json PATH]

V4-Flash routed experts as moe_fp4.py (256 experts, top-6, hidden 4096, intermediate 2048,
uniform random routing, bf16 weights quantized to MXFP4). For each token count:

- ``gate_up`` (x -> h) and ``down`` (h -> out) of ``triton_gemv.py``, timed apart for each
  candidate tile (block_n, block_k, num_warps; for down also SPLIT, the most tokens whose slots
  take a program each, default 0), each checked against the engine's tiles' output (1e-3: the
  same values, another summation order); each gate/up tile also on x in h's nibble-major order
  (``nibble_major``, made outside the timing: what the kernel gains from 8-byte x loads);
- the whole call: the engine's pick, the best gate/up + best down candidates, the grouped
  kernels on their decode tiles ("fp4 grouped", the engine's pick from 193 pairs; "fp4 grouped
  bits": with TileConfig.bits_upcast), our bf16
  fused MoE on the dequantized weights (the same function), and with ``--baseline`` a previous
  version of ``triton_gemv.py`` (a file: ``git show REV:ops/moe/triton_gemv.py``) with its own
  tiles;
- the bound: packed bytes of the experts the routing hits (17/32 of a byte a value) over the
  copy bandwidth measured in the run, per kernel and whole.

Timing: CUDA-graph replays, L2 cleared before each, median (flashmla_vs_triton.py's
``kernel_seconds``). The engine's output is checked within 2e-2 of bf16's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from flashmla_vs_triton import candidate_us
from moe_fp4 import decode_batch, mxfp4_experts
from moe_tiles import DIM, INTER, LIMIT, TOP_K
from v4_flash import make_setup, parse_ints, release
from v4_flash_report import (
    copy_bandwidth,
    device_name,
    header,
    load_module,
    markdown,
    table,
    write_json,
)

SCRIPT = "moe_gemv.py"
# (block_n, block_k, num_warps)
GATE_CANDIDATES = "16,512,4;16,256,4;32,256,4;8,512,4;8,1024,4;16,1024,8;32,512,8;8,256,2;4,1024,4"
DOWN_CANDIDATES = (
    "8,1024,4;8,2048,8;4,1024,4;8,1024,4,32;8,2048,4,32;16,1024,4,32;16,2048,8,32;8,512,2,32"
)
# The engine's tiles of the version before this kernel (RESULTS.md 2026-12-05).
BASELINE_TILES = (16, 512, 16, 512, 4)


def _tiles(text: str) -> list[tuple[int, ...]]:
    return [tuple(parse_ints(t)) for t in text.split(";") if t.strip()]


def _name(tiles: tuple[int, ...]) -> str:
    bn, bk, warps, *split = tiles
    return f"{bn}x{bk} w{warps}" + (f" split{split[0]}" if split and split[0] else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tokens", default="1,2,4,8,16,32")
    ap.add_argument("--gate", default=GATE_CANDIDATES, help="BN,BK,WARPS;... for gate/up")
    ap.add_argument("--down", default=DOWN_CANDIDATES, help="BN,BK,WARPS[,SPLIT];... for down")
    ap.add_argument("--baseline", help="a previous triton_gemv.py to time beside this one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every figure here")
    ns = ap.parse_args()
    setup = make_setup(tiny=False)  # exits without CUDA
    from deepinfer.ops.moe import triton as ours
    from deepinfer.ops.moe import triton_gemv as gemv

    baseline = load_module(ns.baseline, "baseline_gemv") if ns.baseline else None
    bandwidth = copy_bandwidth(setup)
    print(f"{device_name(setup)}: copy {bandwidth / 1e12:.3f} TB/s")
    gen = torch.Generator(device=setup.device).manual_seed(ns.seed)

    experts = mxfp4_experts(setup, gen)
    (p1, w1), (p2, w2), (p3, w3) = experts
    rows: list[dict] = []
    payload = {**header(setup), "script": SCRIPT, "bandwidth_Bps": bandwidth, "rows": rows}
    for num_tokens in parse_ints(ns.tokens):
        x, topk_ids, topk_weights, dense_out, out = decode_batch(
            setup, gen, num_tokens, experts, ours
        )
        engine = ours.pick_tile_config(num_tokens * TOP_K, x.dtype, packed=True)
        if not isinstance(engine, gemv.GemvConfig):  # past the engine's pick: its grouped GEMMs
            engine = gemv.GemvConfig(*_tiles(ns.gate)[0], *_tiles(ns.down)[0])  # are "fp4"
        up_in = ((p1.packed, p1.scale), (p3.packed, p3.scale))
        down_in = (p2.packed, p2.scale)
        h = gemv.gate_up(x, *up_in, topk_ids, LIMIT, engine)
        hit = int(torch.unique(topk_ids).numel())
        packed_bytes = hit * DIM * INTER * 17 / 32
        row: dict = {"tokens": num_tokens, "experts_hit": hit, "gate": {}, "down": {}, "us": {}}
        row["bound_us"] = {
            "gate": 2 * packed_bytes / bandwidth * 1e6,
            "down": packed_bytes / bandwidth * 1e6,
            "whole": 3 * packed_bytes / bandwidth * 1e6,
        }
        gate_tiles = {_name(t): t for t in _tiles(ns.gate)}
        down_tiles = {_name(t): (*t, 0)[:4] for t in _tiles(ns.down)}
        x_nibble_major = gemv.nibble_major(x)
        for name, (bn, bk, warps) in gate_tiles.items():
            config = dataclasses.replace(engine, block_n=bn, block_k=bk, num_warps=warps)
            run = functools.partial(gemv.gate_up, x, *up_in, topk_ids, LIMIT, config)
            row["gate"][name] = candidate_us(run, [h], 1e-3)
            run = functools.partial(
                gemv.gate_up, x_nibble_major, *up_in, topk_ids, LIMIT, config, x_nibble_major=True
            )
            row["gate"][f"{name} x nibble-major"] = candidate_us(run, [h], 1e-3)
        for name, (bn, bk, warps, split) in down_tiles.items():
            config = dataclasses.replace(
                engine, down_block_n=bn, down_block_k=bk, down_num_warps=warps,
                down_split_tokens=split,
            )  # fmt: skip
            run = functools.partial(gemv.down, h, down_in, topk_ids, topk_weights, x.dtype, config)
            row["down"][name] = candidate_us(run, [out], 1e-3)
        for part in ("gate", "down"):
            timed = {n: v for n, v in row[part].items() if isinstance(v, float)}
            row[f"best_{part}"] = min(timed, key=timed.get)
            print(f"  T={num_tokens:3} {part}: " + ", ".join(
                f"{n} {v:.1f}" if isinstance(v, float) else f"{n} {v}"
                for n, v in row[part].items()))  # fmt: skip
        best_gate = row["best_gate"].removesuffix(" x nibble-major")  # the input-order tile
        best = gemv.GemvConfig(*gate_tiles[best_gate], *down_tiles[row["best_down"]])
        grouped = ours.pick_tile_config(4096, x.dtype, packed=True)
        grouped_bits = dataclasses.replace(grouped, bits_upcast=True)
        runs = {
            "bf16": functools.partial(ours.fused_moe, x, w1, w2, w3, topk_ids, topk_weights, LIMIT),
            "fp4": functools.partial(ours.fused_moe, x, p1, p2, p3, topk_ids, topk_weights, LIMIT),
            "fp4 best": functools.partial(
                ours.fused_moe, x, p1, p2, p3, topk_ids, topk_weights, LIMIT, config=best
            ),
            "fp4 grouped": functools.partial(  # the grouped kernels' decode tiles
                ours.fused_moe, x, p1, p2, p3, topk_ids, topk_weights, LIMIT, config=grouped
            ),
            "fp4 grouped bits": functools.partial(  # and their bits upcast
                ours.fused_moe, x, p1, p2, p3, topk_ids, topk_weights, LIMIT, config=grouped_bits
            ),
        }
        if baseline is not None:
            weights = ((p1.packed, p1.scale), (p2.packed, p2.scale), (p3.packed, p3.scale))
            runs["baseline"] = functools.partial(
                baseline.decode_moe, x, weights, topk_ids, topk_weights, LIMIT,
                baseline.GemvConfig(*BASELINE_TILES),
            )  # fmt: skip
        for name, run in runs.items():
            row["us"][name] = candidate_us(run, [dense_out], 2e-2)
            print(f"  T={num_tokens:3} {name}: {row['us'][name]}")
        rows.append(row)
        write_json(ns.json, payload)
        del x, topk_ids, topk_weights, dense_out, out, h
        release()

    headers = ["T", "experts hit", "bf16 µs", "previous fp4 µs", "fp4 (engine) µs",
               "fp4 best µs", "fp4 grouped µs", "fp4 grouped bits µs", "bound µs", "bf16 / fp4",
               "previous / fp4", "fp4 / bound",
               "best gate/up (µs, / bound)", "best down (µs, / bound)"]  # fmt: skip
    body = []
    for r in rows:
        us = r["us"]

        def num(name: str, us=us) -> float | None:
            return us.get(name) if isinstance(us.get(name), float) else None

        fp4, bound = num("fp4"), r["bound_us"]
        gate, down = r["gate"][r["best_gate"]], r["down"][r["best_down"]]
        body.append([
            r["tokens"], r["experts_hit"], num("bf16"), num("baseline") or "—", fp4,
            num("fp4 best"), num("fp4 grouped"), num("fp4 grouped bits"), bound["whole"],
            num("bf16") / fp4 if fp4 and num("bf16") else None,
            num("baseline") / fp4 if fp4 and num("baseline") else None,
            fp4 / bound["whole"] if fp4 else None,
            f"{r['best_gate']}: {gate:.1f}, {gate / bound['gate']:.2f}",
            f"{r['best_down']}: {down:.1f}, {down / bound['down']:.2f}",
        ])  # fmt: skip
    print()
    print(table(headers, body))
    print()
    print(markdown(headers, body))


if __name__ == "__main__":
    main()
