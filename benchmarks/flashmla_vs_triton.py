"""Sparse decode attention on V4-Flash shapes: FlashMLA's SM90 kernel (FP8 KV) vs our Triton one.

    bash scripts/build_flashmla.sh && export PYTHONPATH=/tmp/flashmla-site:$PYTHONPATH
    bash scripts/gpu_bench.sh benchmarks/flashmla_vs_triton.py [--cases 1,8,32,64,128,256,64x2]
        [--context 16384] [--json PATH]

Shapes (v4_flash.V4_FLASH): 64 query heads of 512, one shared KV row per key, a sink per head.
Every query token lists the 128 window slots of its request and 512 distinct compressed entries
of its request's context / 4 (a CSA layer at --context tokens), all valid. A case "B" is B
requests of one query token, "BxS" of S (the second is an MTP draft token).

- FlashMLA (ops/attention/flashmla.py ``sparse_decode``): the window rows as its main cache
  (page blocks of 256) and the compressed rows as its extra cache (blocks of 64), both in its V4
  FP8 layout (584 bytes a row), q [B, S, 64, 512]; its scheduling plan is built once per case and
  reused, as an engine would once per step for every layer.
- Ours (ops/attention/triton.py ``sparse_attention``): the same rows in bf16 (the values the FP8
  cache dequantizes to, 1024 bytes a row), the same index lists, q flattened to [B * S, 64, 512].

Timing: each call is captured in a CUDA graph (warm-up on a side stream first, as
v4_flash_report.graph_time does), and its replays are timed by triton.testing.do_bench (median),
which clears the L2 cache before every replay: the figures are kernel time with the KV cold, as
FlashMLA's own benchmark measures them (its figures in BENCH.md: splitkv + combine kernels, 8 GB
memset between runs). A call whose capture fails is timed eager the same way, and the table's
notes say so. ``rel diff`` = ||ours - FlashMLA|| / ||FlashMLA|| on the same inputs.

Bound = bytes / copy bandwidth measured in the run (v4_flash_report.copy_bandwidth): q and the
output in bf16 plus every distinct KV row the step lists (584 or 1024 bytes); the split-KV
partials each kernel writes and merges are not counted. TFLOP/s: 2 x 64 heads x (512 + 512) per
listed key. Without flash_mla (or off SM90) only ours runs, against BENCH.md's FlashMLA figures.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import V4_FLASH, Setup, make_setup, release
from v4_flash_report import (
    copy_bandwidth,
    device_name,
    header,
    markdown,
    ratio,
    results_block,
    table,
    write_json,
)

from deepinfer.ops.attention import flashmla

SCRIPT = "flashmla_vs_triton.py"
NUM_HEADS = V4_FLASH["num_attention_heads"]  # 64
DIM = V4_FLASH["head_dim"]  # 512
WINDOW = V4_FLASH["sliding_window"]  # 128
TOPK = V4_FLASH["index_topk"]  # 512
CSA_RATIO = V4_FLASH["compress_rates"]["compressed_sparse_attention"]  # 4
WINDOW_BLOCK, POOL_BLOCK = 256, 64  # FlashMLA's page blocks, as in its V4 benchmark cases
TRITON_ROW_BYTES = 2 * DIM

# FlashMLA measured on the H200 (BENCH.md "Kernel anchors"): µs by (batch, query tokens), 64
# heads, window 128 + compressed top-512, 16K context.
BENCH_FLASHMLA_US = {
    (1, 1): 14.5,
    (8, 1): 16.0,
    (16, 1): 19.0,
    (32, 1): 26.8,
    (64, 1): 46.3,
    (128, 1): 50.2,
    (256, 1): 93.0,
    (64, 2): 49.7,
}


@dataclass(frozen=True)
class Case:
    batch: int
    s_q: int

    @property
    def num_q(self) -> int:
        return self.batch * self.s_q

    def __str__(self) -> str:
        return f"{self.batch}" if self.s_q == 1 else f"{self.batch}x{self.s_q}"


def parse_cases(text: str) -> list[Case]:
    cases = []
    for item in filter(None, (v.strip() for v in text.split(","))):
        batch, _, s_q = item.partition("x")
        cases.append(Case(int(batch), int(s_q or 1)))
    return cases


@dataclass
class Inputs:
    """One case's tensors on the device; rows are bf16 values an FP8 cache represents exactly."""

    q: torch.Tensor  # [B, S, H, D] bf16
    sinks: torch.Tensor  # [H] fp32
    window_rows: torch.Tensor  # [B * 128, D] bf16
    window_idx: torch.Tensor  # [B, S, 128] int32
    pool_rows: torch.Tensor  # [B * context / 4, D] bf16
    pool_idx: torch.Tensor  # [B, S, 512] int32
    window_cache: torch.Tensor  # FlashMLA's packed views of the same rows
    pool_cache: torch.Tensor


def make_inputs(case: Case, context: int, device: torch.device, seed: int) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    b, s = case.batch, case.s_q
    pool_per_request = context // CSA_RATIO
    assert pool_per_request >= TOPK, f"context {context}: {pool_per_request} entries < {TOPK}"

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device)

    window_cache = flashmla.pack_kv_cache(randn(b * WINDOW, DIM), WINDOW_BLOCK)
    pool_cache = flashmla.pack_kv_cache(randn(b * pool_per_request, DIM), POOL_BLOCK)
    requests = torch.arange(b, device=device).view(b, 1, 1)
    window_idx = requests * WINDOW + torch.arange(WINDOW, device=device).expand(b, s, WINDOW)
    picks = torch.rand((b, s, pool_per_request), generator=gen, device=device).argsort(dim=-1)
    pool_idx = requests * pool_per_request + picks[..., :TOPK]
    return Inputs(
        q=randn(b, s, NUM_HEADS, DIM).bfloat16(),
        sinks=randn(NUM_HEADS),
        window_rows=flashmla.unpack_kv_cache(window_cache, b * WINDOW),
        window_idx=window_idx.int(),
        pool_rows=flashmla.unpack_kv_cache(pool_cache, b * pool_per_request),
        pool_idx=pool_idx.int(),
        window_cache=window_cache,
        pool_cache=pool_cache,
    )


def kernel_seconds(fn: Callable[[], object]) -> tuple[float, str]:
    """(median seconds of ``fn``, how it was timed): CUDA-graph replays with the L2 cache cleared
    before each (do_bench); eager calls the same way where the capture fails (what failed is said).
    """
    from triton.testing import do_bench

    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    main.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as error:  # a failed capture means "time it eager": reported, not raised
        torch.cuda.set_stream(main)
        torch.cuda.synchronize()
        why = f"eager ({type(error).__name__}: {str(error).strip().splitlines()[0][:200]})"
        return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3, why
    seconds = do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / 1e3
    del graph
    return seconds, "graph"


def candidate_us(
    fn: Callable[[], object], reference: Sequence[torch.Tensor], tolerance: float
) -> float | str:
    """µs of ``fn`` (kernel_seconds) once each of its outputs (a tensor or a tuple of them) is
    within ``tolerance`` (relative norm) of ``reference``'s; else why it could not run. A tile
    set that fails to compile, to launch or to match is a finding of a sweep, not a crash."""
    try:
        outputs = fn()
        outputs = outputs if isinstance(outputs, (tuple, list)) else [outputs]
        for out, ref in zip(outputs, reference, strict=True):
            diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            assert diff < tolerance, f"rel diff {diff:.2e} from the reference"
        seconds, _ = kernel_seconds(fn)
    except Exception as error:  # reported in the table, not raised
        torch.cuda.synchronize()
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return seconds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "--cases", default="1,8,32,64,128,256,64x2", help="B or BxS (S query tokens a request)"
    )
    ap.add_argument("--context", type=int, default=16384, help="tokens of context a request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every figure here")
    ns = ap.parse_args()
    cases = parse_cases(ns.cases)
    setup = make_setup(tiny=False)  # exits without CUDA
    from deepinfer.ops.attention import triton as ours

    has_flashmla, why = flashmla.is_available(setup.device)
    print(f"FlashMLA: {why}")
    bandwidth = copy_bandwidth(setup)
    print(f"{device_name(setup)}: copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)")
    rows: list[dict] = []
    payload = {
        **header(setup),
        "script": SCRIPT,
        "context": ns.context,
        "flashmla": why,
        "bandwidth_Bps": bandwidth,
        "rows": rows,
    }
    scale = DIM**-0.5
    for case in cases:
        x = make_inputs(case, ns.context, setup.device, ns.seed)
        q_flat = x.q.view(case.num_q, NUM_HEADS, DIM)
        sources = [
            (x.window_rows, x.window_idx.view(case.num_q, WINDOW)),
            (x.pool_rows, x.pool_idx.view(case.num_q, TOPK)),
        ]

        def run_ours(q_flat=q_flat, sources=sources, x=x) -> torch.Tensor:
            return ours.sparse_attention(q_flat, sources, x.sinks, scale)

        ours_s, ours_timing = kernel_seconds(run_ours)
        row = {
            "batch": case.batch,
            "s_q": case.s_q,
            "keys": WINDOW + TOPK,
            "ours_s": ours_s,
            "ours_timing": ours_timing,
        }
        flashmla_s = rel_diff = flashmla_timing = None
        if has_flashmla:
            metadata = flashmla.decode_metadata()

            def run_flashmla(x=x, metadata=metadata) -> torch.Tensor:
                return flashmla.sparse_decode(
                    x.q,
                    x.window_cache,
                    x.window_idx,
                    x.sinks,
                    scale,
                    extra_cache=x.pool_cache,
                    extra_indices=x.pool_idx,
                    metadata=metadata,
                )

            reference = run_flashmla().float()
            diff = run_ours().float().view_as(reference) - reference
            rel_diff = (diff.norm() / reference.norm()).item()
            flashmla_s, flashmla_timing = kernel_seconds(run_flashmla)
        bench_us = BENCH_FLASHMLA_US.get((case.batch, case.s_q)) if ns.context == 16384 else None
        distinct = sum(int(torch.unique(i[i >= 0]).numel()) for i in (x.window_idx, x.pool_idx))
        q_out_bytes = 2 * case.num_q * NUM_HEADS * DIM * 2
        row.update(
            flashmla_s=flashmla_s,
            flashmla_timing=flashmla_timing,
            bench_flashmla_s=bench_us and bench_us * 1e-6,
            rel_diff=rel_diff,
            distinct_rows=distinct,
            flashmla_bytes=q_out_bytes + distinct * flashmla.BYTES_PER_TOKEN,
            ours_bytes=q_out_bytes + distinct * TRITON_ROW_BYTES,
            flops=2 * NUM_HEADS * case.num_q * (WINDOW + TOPK) * (DIM + DIM),
        )
        row["flashmla_bound_s"] = row["flashmla_bytes"] / bandwidth
        row["ours_bound_s"] = row["ours_bytes"] / bandwidth
        rows.append(row)
        shown = "—" if flashmla_s is None else f"{flashmla_s * 1e6:.1f} us ({flashmla_timing})"
        print(f"  {case!s:>6}: ours {ours_s * 1e6:.1f} us ({ours_timing}), FlashMLA {shown}")
        write_json(ns.json, payload)
        del x, q_flat, sources, run_ours
        release()
    report(rows, setup, bandwidth, ns, why)


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e6


def report(
    rows: list[dict], setup: Setup, bandwidth: float, ns: argparse.Namespace, why: str
) -> None:
    headers = [
        "batch",
        "q tokens",
        "FlashMLA µs",
        "BENCH.md FlashMLA µs",
        "ours µs",
        "ours/FlashMLA",
        "ours/BENCH.md",
        "rel diff",
        "FlashMLA MB",
        "ours MB",
        "FlashMLA bound µs",
        "ours bound µs",
        "FlashMLA/bound",
        "ours/bound",
        "FlashMLA TFLOP/s",
        "ours TFLOP/s",
    ]
    body = [
        [
            r["batch"],
            r["s_q"],
            _us(r["flashmla_s"]),
            _us(r["bench_flashmla_s"]),
            _us(r["ours_s"]),
            ratio(r["ours_s"], r["flashmla_s"]),
            ratio(r["ours_s"], r["bench_flashmla_s"]),
            r["rel_diff"],
            r["flashmla_bytes"] / 1e6,
            r["ours_bytes"] / 1e6,
            _us(r["flashmla_bound_s"]),
            _us(r["ours_bound_s"]),
            ratio(r["flashmla_s"], r["flashmla_bound_s"]),
            ratio(r["ours_s"], r["ours_bound_s"]),
            None if r["flashmla_s"] is None else r["flops"] / r["flashmla_s"] / 1e12,
            r["flops"] / r["ours_s"] / 1e12,
        ]
        for r in rows
    ]
    timings = "; ".join(
        sorted({r[k] for r in rows for k in ("ours_timing", "flashmla_timing") if r[k]})
    )
    print()
    print(table(headers, body))
    print()
    print(
        results_block(
            "Sparse decode attention, FlashMLA (FP8 KV) vs our Triton kernel (bf16 KV)",
            SCRIPT,
            setup,
            [
                f"V4-Flash shapes: {NUM_HEADS} heads of {DIM}, window {WINDOW} + compressed "
                f"top-{TOPK} of context/{CSA_RATIO} at context {ns.context}, a sink per head. "
                f"FlashMLA: {why}.",
                "CUDA-graph replays timed by triton.testing.do_bench (median, L2 cleared before "
                f"each); timed as: {timings}. Bound = (q + out + distinct KV rows) bytes / copy "
                f"bandwidth measured in the run ({bandwidth / 1e12:.3f} TB/s); FP8 rows 584 B, "
                "bf16 rows 1024 B.",
            ],
            [markdown(headers, body)],
        )
    )


if __name__ == "__main__":
    main()
