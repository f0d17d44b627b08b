"""FP8 block-scaled linear layers (ops/linear, Triton W8A8) against bf16 cuBLAS, V4-Flash shapes.

    bash scripts/gpu_bench.sh benchmarks/fp8_linear.py [--tokens 1,32,128,4096]
        [--shapes wq_a,wq_b,...] [--json PATH]
    python benchmarks/fp8_linear.py --tiny      # CPU smoke test: shapes / 32, Triton interpreted

Method. For each linear that runs on FP8 weights in V4-Flash (N x K below; the LM head stays
bf16) and each token count M: a weight N(0, 1/K) quantized to e4m3 in 128 x 128 blocks, x bf16
N(0, 1). Timed, as CUDA graph replays of ``--calls`` back-to-back calls (what decode runs; the
per-call figure is the replay time / calls), median of ``--repeats``; with ``--cold``, one call a
replay with the L2 cache cleared before each (``flashmla_vs_triton.kernel_seconds``), as a decode
step meets a layer's weights (back to back, a weight of up to ~25 MB stays in the H100's 50 MB L2,
bf16's as well as e4m3's, and the paths are timed on their latency rather than their bytes); with
``--rotate``, back to back but each call on its own copy of the weight, enough copies to pass
ROTATE_BYTES (every call streams its weight from HBM, as a decode step's layers do, and no call
pays a launch of its own):

- fp8: ``ops.linear.triton.fp8_linear`` (x quantized per token per 128 inputs, then the FP8
  GEMM; one launch at decode, two or three at prefill);
- engine: the Triton backend object's ``fp8_linear``, the engine's path without DeepGEMM (our
  kernel, or cuBLAS's blockwise FP8 where ``use_cublas`` picks it);
- bf16: ``F.linear`` (cuBLAS) on the dequantized weight in bf16, the engine's path without
  ``model.fp8_weights``;
- dense: ``ops.linear.triton.dense_linear`` on that bf16 weight (our GEMM without scales; the
  engine's fused dense projections up to DENSE_MAX_ROWS rows), timed up to 16 rows;
- scaled_mm: ``ops.linear.triton.scaled_mm_blockwise``, ``torch._scaled_mm`` with DeepSeek's
  blockwise recipe (x 1x128 scales from the Triton quantizer, its rows rounded up to 16; W
  128x128 scales; cuBLAS on SM90, CUDA >= 12.9), the engine's cuBLAS path, where torch and
  cuBLAS accept the shape; else the error, shortened. Its relative difference to the Triton
  output is reported (both quantize x identically, so it is the GEMMs' accumulation only);
- deepgemm: ``ops.linear.deepgemm.fp8_linear`` (the Triton quantizer, then DeepSeek's
  ``deep_gemm.fp8_gemm_nt``) when DeepGEMM is available (scripts/build_deepgemm.sh; the
  backend's own probe decides), with its relative difference to the Triton output.

Ceilings: decode (M <= 128) is bound by reading the weight once: bytes = the FP8 weight and its
scales (bf16: the bf16 weight), against --bandwidth (4.25 TB/s, H200). Prefill is bound by the
FP8 tensor cores: 2 M N K flops against --tflops (~1430 dense FP8 TFLOP/s, H200).

Prints a markdown table; --json writes every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import Setup, make_setup, parse_ints, release
from v4_flash_report import graph_time, header, markdown, median_time, ms, ratio, write_json

# (N, K) of the V4-Flash linears on FP8 weights.
SHAPES = {
    "wq_a": (1024, 4096),
    "wq_b": (32768, 1024),
    "wkv": (512, 4096),
    "wo_b": (4096, 8192),
    "shared_w1": (2048, 4096),  # w3 alike
    "shared_w2": (4096, 2048),
    "compressor_wkv": (1024, 4096),  # CSA (2 x 512); wgate alike
    "indexer_wq_b": (8192, 1024),
    "weights_proj": (64, 4096),
    # A CSA layer's projections of x as one GEMM (FusedLinears): wq_a, wkv, the compressor's
    # wkv and wgate, weights_proj and the indexer compressor's two (2 x 128 each).
    "x_proj_csa": (4160, 4096),
    # The other fused GEMMs of a decode step: the shared expert's w1 + w3, and a CSA layer's
    # wq_b with the indexer's.
    "shared_w13": (4096, 4096),
    "wq_b_csa": (40960, 1024),
}
# (groups, N, K) of the grouped linears: wo_a, 8 groups of 1,024 outputs over 4,096 inputs each
# (x [M, 8, 4096]), one launch below GROUPED_SPLIT_ROWS; timed against the bf16 model's einsum.
GROUPED_SHAPES = {"wo_a": (8, 1024, 4096)}
DECODE_MAX_TOKENS = 128
DENSE_BENCH_ROWS = 16  # dense_linear timed up to this many rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", help="M values, tokens per call (default 1,32,128,4096)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"a subset of {list(SHAPES)}")
    ap.add_argument("--calls", type=int, default=20, help="calls per timed CUDA graph replay")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, default=4.25e12, help="HBM bytes/s ceiling")
    ap.add_argument("--tflops", type=float, default=1430.0, help="FP8 tensor-core TFLOP/s")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--cold", action="store_true", help="a call a replay, the L2 cleared before")
    ap.add_argument(
        "--rotate", action="store_true", help="each call of a replay on its own weight copy"
    )
    ap.add_argument("--tiny", action="store_true", help="shapes / 32; CPU + interpreter w/o CUDA")
    ap.add_argument(
        "--tiles",
        help="TileConfig candidates timed besides the engine's pick: block_m,block_n,group_m,"
        "warps,stages,quantize_in_gemm(0/1),max_split_k[,programs_per_sm[,swap_ab(0/1)]];... "
        "(a second table: the best per row)",
    )
    ap.add_argument(
        "--programs-per-sm",
        help="split-K targets (TileConfig.programs_per_sm) timed on the engine's tiles besides "
        "its own, e.g. 2,4,8: a table of the kernel at each",
    )
    ns = ap.parse_args()
    names = [s.strip() for s in ns.shapes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SHAPES and s not in GROUPED_SHAPES]
    if unknown:
        raise SystemExit(
            f"--shapes: unknown {unknown}; known {list(SHAPES)} and {list(GROUPED_SHAPES)}"
        )
    if ns.tiny and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined (imported)
    from deepinfer.ops.linear import torch_ref
    from deepinfer.ops.linear import triton as fp8_triton

    fields = [parse_ints(t) for t in (ns.tiles or "").split(";") if t.strip()]
    candidates = [
        fp8_triton.TileConfig(*f[:5], bool(f[5]), *f[6:8], *map(bool, f[8:9])) for f in fields
    ]
    setup = make_setup(ns.tiny)
    rows: list[dict[str, Any]] = []
    payload = {
        **header(setup),
        "bandwidth": ns.bandwidth,
        "tflops": ns.tflops,
        "cold": ns.cold,
        "rotate": ns.rotate,
        "rows": rows,
    }
    grouped: list[dict[str, Any]] = []
    payload["grouped"] = grouped
    for name in (s for s in names if s in GROUPED_SHAPES):
        grouped += _grouped_rows(name, fp8_triton, torch_ref, candidates, setup, ns)
        release()
        write_json(ns.json, payload)
    for name in (s for s in names if s in SHAPES):
        n, k = SHAPES[name]
        if ns.tiny:
            n, k = max(n // 32, 16), max(k // 32, 128)
        gen = torch.Generator(device=setup.device).manual_seed(n + k)
        w = torch.randn(n, k, generator=gen, device=setup.device) * k**-0.5
        weight, scale = torch_ref.quantize_fp8(w)
        del w
        copies = _copies(weight, scale, torch_ref.dequantize_fp8(weight, scale).to(setup.dtype), ns)
        for m in parse_ints(ns.tokens or ("1,32" if ns.tiny else "1,32,128,4096")):
            x = torch.randn(m, k, generator=gen, device=setup.device).to(setup.dtype)
            row = {"shape": name, "n": n, "k": k, "m": m}
            ours = fp8_triton.fp8_linear(x, weight, scale)
            row |= _measure(x, copies, ours, fp8_triton, setup, ns)
            row["tiles_s"] = _sweep(x, copies, ours, fp8_triton, candidates, setup, ns)
            row["per_sm_s"] = _per_sm_sweep(x, copies, ours, fp8_triton, setup, ns)
            rows.append(row)
            write_json(ns.json, payload)
            print(
                f"{name} M={m}: fp8 {row['fp8_s'] * 1e6:.1f} us, engine "
                f"{row['engine_s'] * 1e6:.1f} us, bf16 {row['bf16_s'] * 1e6:.1f} us"
            )
        del weight, scale, copies
        release()
    if rows:
        print()
        print(_table(rows, ns))
    if candidates and rows:
        print()
        print(_sweep_table(rows, fp8_triton))
    if grouped:
        print()
        print(_grouped_table(grouped, fp8_triton))
    if ns.programs_per_sm:
        print()
        print(_per_sm_table(rows, fp8_triton))


def _grouped_rows(
    name: str,
    fp8_triton: Any,
    torch_ref: Any,
    candidates: list[Any],
    setup: Setup,
    ns: argparse.Namespace,
) -> list[dict[str, Any]]:
    """The figures of a grouped linear at each M: the backend's ``fp8_grouped_linear`` (the
    engine's path), the bf16 einsum on the dequantized weight, a GEMM a group through the
    backend's ``fp8_linear`` (``fp8_linear_per_group``: the engine's path from
    GROUPED_SPLIT_ROWS; cuBLAS's from 65 rows, ours below), and each --tiles candidate through
    ``fp8_grouped_linear(config=...)`` (each checked against the engine's output)."""
    groups, n, k = GROUPED_SHAPES[name]
    if ns.tiny:
        n, k = max(n // 32, 16), max(k // 32, 128)
    gen = torch.Generator(device=setup.device).manual_seed(groups * n + k)
    w = torch.randn(groups * n, k, generator=gen, device=setup.device) * k**-0.5
    weight, scale = torch_ref.quantize_fp8(w)
    w_dense = torch_ref.dequantize_fp8(weight, scale).to(setup.dtype).view(groups, n, k)
    copies = _copies(weight, scale, w_dense, ns)
    del w
    backend = fp8_triton.TritonLinearBackend(setup.device)
    rows = []
    for m in parse_ints(ns.tokens or ("1,32" if ns.tiny else "1,32,128,4096")):
        x = torch.randn(m, groups, k, generator=gen, device=setup.device).to(setup.dtype)
        ours = backend.fp8_grouped_linear(x, weight, scale)
        ref = torch.einsum("tgi,goi->tgo", x, w_dense)
        diff = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
        assert diff < 5e-2, f"{name} M={m}: rel diff {diff:.1e} to the bf16 einsum"
        row: dict[str, Any] = {
            "shape": name, "groups": groups, "n": n, "k": k, "m": m,
            "engine_s": _time(
                lambda o, x=x: backend.fp8_grouped_linear(x, o.weight, o.scale), copies, setup, ns
            ),
            "bf16_s": _time(
                lambda o, x=x: torch.einsum("tgi,goi->tgo", x, o.dense), copies, setup, ns
            ),
            "per_group_s": None if n % fp8_triton.FP8_BLOCK[0] else _checked_time(
                lambda o, x=x: fp8_triton.fp8_linear_per_group(
                    backend.fp8_linear, x, o.weight, o.scale, fp8_triton.FP8_BLOCK
                ),
                copies, ours, "a GEMM a group", setup, ns,
            ),  # a group of whole weight blocks only
            "tiles_s": {
                _tile_name(c): _checked_time(
                    lambda o, x=x, c=c: fp8_triton.fp8_grouped_linear(
                        x, o.weight, o.scale, config=c
                    ),
                    copies, ours, _tile_name(c), setup, ns,
                )
                for c in candidates
            },
        }  # fmt: skip
        rows.append(row)
        engine_us, bf16_us = row["engine_s"] * 1e6, row["bf16_s"] * 1e6
        print(f"{name} M={m}: engine {engine_us:.1f} us, bf16 {bf16_us:.1f} us")
    return rows


def _grouped_table(rows: list[dict[str, Any]], fp8_triton: Any) -> str:
    headers = ["linear", "G x N x K", "M", "engine tiles", "engine µs", "bf16 einsum µs",
               "bf16 / engine", "a GEMM a group µs", "best µs", "best tiles",
               "bf16 / best"]  # fmt: skip
    out = []
    for r in rows:
        times = r["tiles_s"]
        best = min(times, key=times.get) if times else None
        out.append([
            r["shape"], f"{r['groups']} x {r['n']} x {r['k']}", r["m"],
            _grouped_engine_tiles(r, fp8_triton), _us(r["engine_s"]), _us(r["bf16_s"]),
            ratio(r["bf16_s"], r["engine_s"]), _us(r["per_group_s"]), _us(times.get(best)),
            best or "—",
            ratio(r["bf16_s"], times.get(best)),
        ])  # fmt: skip
    return markdown(headers, out)


def _grouped_engine_tiles(row: dict[str, Any], fp8_triton: Any) -> str:
    if fp8_triton.split_groups(row["m"], row["n"], fp8_triton.FP8_BLOCK):
        return "cuBLAS a group"
    return _tile_name(fp8_triton.pick_tile_config(row["m"]))


def _measure(
    x: torch.Tensor,
    copies: list[Operands],
    ours: torch.Tensor,
    fp8_triton: Any,
    setup: Setup,
    ns: argparse.Namespace,
) -> dict[str, Any]:
    """The figures of one (linear, M): times of the three paths, bytes/s, flop/s (``ours``:
    the engine's output, which the other paths are compared with)."""
    m, k = x.shape
    weight, scale, w_dense = copies[0].weight, copies[0].scale, copies[0].dense
    n = weight.shape[0]
    backend = fp8_triton.TritonLinearBackend(setup.device)
    engine = backend.fp8_linear(x, weight, scale)
    diff = ((engine.float() - ours.float()).norm() / ours.float().norm()).item()
    assert diff < 1e-2, f"the backend's path: rel diff {diff:.1e} to the Triton kernel's"
    row: dict[str, Any] = {
        "fp8_s": _time(lambda o: fp8_triton.fp8_linear(x, o.weight, o.scale), copies, setup, ns),
        "engine_s": _time(lambda o: backend.fp8_linear(x, o.weight, o.scale), copies, setup, ns),
        "bf16_s": _time(lambda o: F.linear(x, o.dense), copies, setup, ns),
        "dense_s": None,
    }
    if m <= DENSE_BENCH_ROWS:  # our GEMM on the bf16 weight (FusedLinears' up to DENSE_MAX_ROWS)
        dense = fp8_triton.dense_linear(x, w_dense)
        ref = F.linear(x, w_dense).float()
        diff = ((dense.float() - ref).norm() / ref.norm()).item()
        assert diff < 1e-2, f"dense_linear: rel diff {diff:.1e} to F.linear's"
        row["dense_s"] = _time(lambda o: fp8_triton.dense_linear(x, o.dense), copies, setup, ns)
    row["scaled_mm_s"], row["scaled_mm_note"] = _scaled_mm(x, copies, ours, fp8_triton, setup, ns)
    row["deepgemm_s"], row["deepgemm_note"] = _deepgemm(x, copies, ours, setup, ns)
    row["fp8_bytes_per_s"] = (weight.numel() + scale.numel() * 4) / row["fp8_s"]
    row["bf16_bytes_per_s"] = w_dense.numel() * w_dense.element_size() / row["bf16_s"]
    row["fp8_flops_per_s"] = 2 * m * n * k / row["fp8_s"]
    return row


def _time(
    fn: Callable[[Operands], Any], copies: list[Operands], setup: Setup, ns: argparse.Namespace
) -> float:
    """Seconds per call of ``fn(operands)``: a CUDA graph of ns.calls calls (at least one a
    copy, call i on copies[i % len]) replayed; eager on the CPU (or when the capture fails).
    ``--cold``: a graph of one call, the L2 cleared before each replay."""
    if ns.cold and setup.device.type == "cuda":
        from flashmla_vs_triton import kernel_seconds

        return kernel_seconds(partial(fn, copies[0]))[0]
    num_calls = max(ns.calls, len(copies))

    def calls() -> None:
        for i in range(num_calls):
            fn(copies[i % len(copies)])

    seconds, _ = graph_time(calls, setup, ns.warmup, ns.repeats)
    if seconds is None:
        seconds = median_time(calls, setup, ns.warmup, ns.repeats)
    return seconds / num_calls


@dataclasses.dataclass(frozen=True)
class Operands:
    """One copy of a linear's weight as the timed paths read it: e4m3 with its 128 x 128
    scales, and dequantized in the model dtype."""

    weight: torch.Tensor
    scale: torch.Tensor
    dense: torch.Tensor


# --rotate: copies until the e4m3 weights pass this many bytes, twice the H100's and H200's
# 50 MB L2 (so a call's weight is never left there by the calls before it).
ROTATE_BYTES = 100e6


def _copies(
    weight: torch.Tensor, scale: torch.Tensor, dense: torch.Tensor, ns: argparse.Namespace
) -> list[Operands]:
    """The operands the timed calls cycle through: these, and with --rotate that many more
    copies that together they pass ROTATE_BYTES (off CUDA one more: a smoke test)."""
    first = Operands(weight, scale, dense)
    if not ns.rotate:
        return [first]
    count = max(2, math.ceil(ROTATE_BYTES / weight.numel())) if weight.is_cuda else 2
    return [first] + [
        Operands(weight.clone(), scale.clone(), dense.clone()) for _ in range(count - 1)
    ]


def _tile_name(c: Any) -> str:
    quantize = "q-in" if c.quantize_in_gemm else "q-pass"
    return (
        f"{c.block_m}x{c.block_n} g{c.group_m} w{c.num_warps} s{c.num_stages} {quantize}"
        f" sk{c.max_split_k} sm{c.programs_per_sm}{' swap' if c.swap_ab else ''}"
    )


def _sweep(
    x: torch.Tensor,
    copies: list[Operands],
    ours: torch.Tensor,
    fp8_triton: Any,
    candidates: list[Any],
    setup: Setup,
    ns: argparse.Namespace,
) -> dict[str, float]:
    """Seconds per call of each candidate tile config (each checked against the engine's
    output ``ours``: the same quantized x, so only the accumulation order differs)."""
    times = {}
    for config in candidates:
        times[_tile_name(config)] = _checked_time(
            lambda o, config=config: fp8_triton.fp8_linear(x, o.weight, o.scale, config=config),
            copies, ours, _tile_name(config), setup, ns,
        )  # fmt: skip
    return times


def _checked_time(
    run: Callable[[Operands], torch.Tensor],
    copies: list[Operands],
    ours: torch.Tensor,
    label: str,
    setup: Setup,
    ns: argparse.Namespace,
) -> float:
    """Seconds per call of ``run`` once its output is within 1e-2 of the engine's ``ours``
    (the same quantized x: only the accumulation order may differ)."""
    diff = ((run(copies[0]).float() - ours.float()).norm() / ours.float().norm()).item()
    assert diff < 1e-2, f"{label}: rel diff {diff:.1e} to the engine's output"
    return _time(run, copies, setup, ns)


def _per_sm_sweep(
    x: torch.Tensor,
    copies: list[Operands],
    ours: torch.Tensor,
    fp8_triton: Any,
    setup: Setup,
    ns: argparse.Namespace,
) -> dict[int, float]:
    """Seconds per call of the engine's tiles with each --programs-per-sm split-K target
    (``TileConfig.programs_per_sm``), each checked against the engine's output ``ours``."""
    engine = fp8_triton.pick_tile_config(x.shape[0])
    times = {}
    for per_sm in parse_ints(ns.programs_per_sm or ""):
        config = dataclasses.replace(engine, programs_per_sm=per_sm)
        times[per_sm] = _checked_time(
            lambda o, config=config: fp8_triton.fp8_linear(x, o.weight, o.scale, config=config),
            copies, ours, f"{per_sm} an SM", setup, ns,
        )  # fmt: skip
    return times


def _per_sm_table(rows: list[dict[str, Any]], fp8_triton: Any) -> str:
    values = sorted({v for r in rows for v in r["per_sm_s"]})
    headers = ["linear", "M", "engine an SM", "engine µs"] + [f"{v} an SM µs" for v in values]
    headers += ["best / engine", "bf16 µs"]
    out = []
    for r in rows:
        times = r["per_sm_s"]
        best = min(times.values(), default=r["fp8_s"])
        out.append(
            [r["shape"], r["m"], fp8_triton.pick_tile_config(r["m"]).programs_per_sm]
            + [_us(r["fp8_s"])]
            + [_us(times[v]) if v in times else "—" for v in values]
            + [ratio(best, r["fp8_s"]), _us(r["bf16_s"])]
        )
    return markdown(headers, out)


def _sweep_table(rows: list[dict[str, Any]], fp8_triton: Any) -> str:
    headers = ["linear", "M", "engine tiles", "engine µs", "best µs", "best tiles", "bf16 µs",
               "bf16 / best"]  # fmt: skip
    out = []
    for r in rows:
        best = min(r["tiles_s"], key=r["tiles_s"].get)
        out.append([
            r["shape"], r["m"], _tile_name(fp8_triton.pick_tile_config(r["m"])), _us(r["fp8_s"]),
            _us(r["tiles_s"][best]), best, _us(r["bf16_s"]),
            ratio(r["bf16_s"], r["tiles_s"][best]),
        ])  # fmt: skip
    return markdown(headers, out)


def _scaled_mm(
    x: torch.Tensor,
    copies: list[Operands],
    ours: torch.Tensor,
    fp8_triton: Any,
    setup: Setup,
    ns: argparse.Namespace,
) -> tuple[float | None, str]:
    """(seconds per call, "rel diff to Triton ...") or (None, why torch._scaled_mm refused)."""
    if not setup.is_cuda:
        return None, "needs CUDA"

    def run(o: Operands) -> torch.Tensor:
        return fp8_triton.scaled_mm_blockwise(x, o.weight, o.scale)

    try:
        out = run(copies[0])
    except (RuntimeError, ValueError, NotImplementedError) as error:
        return None, f"{type(error).__name__}: {str(error).strip().splitlines()[0][:120]}"
    diff = ((out.float() - ours.float()).norm() / ours.float().norm()).item()
    return _time(run, copies, setup, ns), f"rel diff to Triton {diff:.1e}"


def _deepgemm(
    x: torch.Tensor,
    copies: list[Operands],
    ours: torch.Tensor,
    setup: Setup,
    ns: argparse.Namespace,
) -> tuple[float | None, str]:
    """(seconds per call, "rel diff to Triton ...") or (None, why DeepGEMM is not available)."""
    from deepinfer.ops.linear import deepgemm

    ok, why = deepgemm.is_available(setup.device)
    if not ok:
        return None, why
    out = deepgemm.fp8_linear(x, copies[0].weight, copies[0].scale)
    diff = ((out.float() - ours.float()).norm() / ours.float().norm()).item()
    return _time(lambda o: deepgemm.fp8_linear(x, o.weight, o.scale), copies, setup, ns), (
        f"rel diff to Triton {diff:.1e}"
    )


def _table(rows: list[dict[str, Any]], ns: argparse.Namespace) -> str:
    headers = [
        "linear",
        "N x K",
        "M",
        "fp8 Triton µs",
        "bf16 cuBLAS µs",
        "bf16 / fp8",
        "dense Triton µs",
        "bf16 / dense",
        "engine µs",
        "bf16 / engine",
        "scaled_mm µs",
        "deepgemm µs",
        "bf16 / deepgemm",
        "fp8 TB/s (% of bound)",
        "bf16 TB/s",
        "fp8 TFLOP/s (% of peak)",
        "scaled_mm",
        "deepgemm",
    ]
    out = []
    for r in rows:
        decode = r["m"] <= DECODE_MAX_TOKENS
        bandwidth = f"{r['fp8_bytes_per_s'] / 1e12:.2f} ({r['fp8_bytes_per_s'] / ns.bandwidth:.0%})"
        flops = f"{r['fp8_flops_per_s'] / 1e12:.0f} ({r['fp8_flops_per_s'] / 1e12 / ns.tflops:.0%})"
        out.append(
            [
                r["shape"],
                f"{r['n']} x {r['k']}",
                r["m"],
                _us(r["fp8_s"]),
                _us(r["bf16_s"]),
                ratio(r["bf16_s"], r["fp8_s"]),
                _us(r["dense_s"]),
                ratio(r["bf16_s"], r["dense_s"]),
                _us(r["engine_s"]),
                ratio(r["bf16_s"], r["engine_s"]),
                _us(r["scaled_mm_s"]),
                _us(r["deepgemm_s"]),
                ratio(r["bf16_s"], r["deepgemm_s"]),
                bandwidth if decode else "—",
                f"{r['bf16_bytes_per_s'] / 1e12:.2f}" if decode else "—",
                flops if not decode else "—",
                r["scaled_mm_note"],
                r["deepgemm_note"],
            ]
        )
    return markdown(headers, out)


def _us(seconds: float | None) -> float | None:
    value = ms(seconds)
    return None if value is None else value * 1e3


if __name__ == "__main__":
    main()
