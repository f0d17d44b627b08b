"""Measuring the V4-Flash benchmarks: timing, the two ceilings (copy bandwidth, GEMM rate),
bytes and FLOPs per layer, and reporting (tables, the RESULTS block, JSON).

The shapes, the setup and the model/inputs live in v4_flash.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import math
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from v4_flash import FULL_DEPTH_LAYERS, LAYER_TYPES, OUTER, PLANS, Setup, release

from deepinfer.config import ModelConfig
from deepinfer.model.deepseek_v4.args import ModelArgs
from deepinfer.model.deepseek_v4.cache import kv_fp8_layout
from deepinfer.model.deepseek_v4.weights import (
    expected_shapes,
    is_fp8_linear,
    is_fp32_param,
    is_integer_param,
)

# ---- timing and ceilings ---------------------------------------------------------------------


def median_time(fn: Callable[[], object], setup: Setup, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn`` after ``warmup`` calls: CUDA events on CUDA (bracketing the host
    time too, where fn syncs), the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    if not setup.is_cuda:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize()
    events = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) / 1e3 for s, e in events)


def graph_time(
    fn: Callable[[], object], setup: Setup, warmup: int, repeats: int
) -> tuple[float | None, str]:
    """(median seconds of a CUDA-graph replay of ``fn``, "") or (None, why the capture failed).

    As torch's docs say: warm up on a side stream, then capture. A host sync inside ``fn``
    (``.item()``, ``.tolist()``, a data-dependent shape) makes the capture fail; the caller
    carries on eager.
    """
    if not setup.is_cuda:
        return None, "CUDA graphs need a CUDA device"
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        main.wait_stream(side)
        with torch.cuda.graph(graph):
            fn()
    except Exception as error:  # any capture failure means "stay eager": reported, not raised
        torch.cuda.set_stream(main)  # a failed capture can leave the capture stream current
        torch.cuda.synchronize()
        del graph
        release()
        return None, f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
    seconds = median_time(graph.replay, setup, warmup, repeats)
    del graph
    release()
    return seconds, ""


def copy_bandwidth(setup: Setup) -> float:
    """HBM bandwidth in bytes/s: a large device-to-device copy, bytes read + written, median."""
    numel = (1 << 30) if setup.is_cuda else (1 << 23)  # 2 GiB of bf16 on CUDA
    src = torch.randn(numel, dtype=setup.dtype, device=setup.device)
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), setup, warmup=3, repeats=20)
    return 2 * src.numel() * src.element_size() / seconds


def gemm_rate(setup: Setup) -> float:
    """Dense GEMM rate in FLOP/s in the model's dtype: a large torch.matmul, median."""
    n = 8192 if setup.is_cuda else 512
    a = torch.randn(n, n, dtype=setup.dtype, device=setup.device)
    b = torch.randn(n, n, dtype=setup.dtype, device=setup.device)
    out = torch.empty(n, n, dtype=setup.dtype, device=setup.device)
    seconds = median_time(lambda: torch.matmul(a, b, out=out), setup, warmup=5, repeats=20)
    return 2 * n**3 / seconds


# ---- bytes and FLOPs -------------------------------------------------------------------------


def expected_experts_hit(args: ModelArgs, num_tokens: int) -> float:
    """E * (1 - (1 - k/E)^T): distinct experts T uniformly routed tokens hit."""
    e, k = args.num_experts, args.num_experts_per_tok
    return e * (1 - (1 - k / e) ** num_tokens)


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """One layer's parameters: everything but the routed experts, and one routed expert."""

    dense_bytes: int
    dense_matmul_params: int  # 2-D weights a token multiplies by (for FLOPs)
    expert_bytes: int
    expert_params: int


FP8_MIN_WEIGHTS = ModelConfig().fp8_min_weights


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def layer_weights(
    args: ModelArgs,
    layer: int,
    dtype: torch.dtype,
    fp4_experts: bool = False,
    fp8_linears: bool = False,
) -> LayerWeights:
    """``fp4_experts``: routed experts packed MXFP4 (half a byte a value + a byte per 32);
    ``fp8_linears``: the linears the checkpoint ships FP8 at a byte a value + an fp32 scale per
    128 x 128 block (those the engine keeps FP8: ``model.fp8_min_weights`` weights or more)."""
    dense_bytes = dense_matmul = expert_numel = 0
    prefix = f"layers.{layer}."
    for name, shape in expected_shapes(args).items():
        if not name.startswith(prefix) or is_integer_param(name):
            continue  # the hash router's tid2eid is a lookup, not read whole
        numel = math.prod(shape)
        if ".ffn.experts." in name:
            expert_numel += numel // args.num_experts
            continue
        if fp8_linears and is_fp8_linear(name) and numel >= FP8_MIN_WEIGHTS:
            dense_bytes += numel + math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128) * 4
        else:
            dense_bytes += numel * (4 if is_fp32_param(name) else _itemsize(dtype))
        if len(shape) == 2 and not name.endswith(".ape"):
            dense_matmul += numel
    expert_bytes = expert_numel * 17 // 32 if fp4_experts else expert_numel * _itemsize(dtype)
    return LayerWeights(dense_bytes, dense_matmul, expert_bytes, expert_numel)


def outer_weight_bytes(args: ModelArgs, num_tokens: int, dtype: torch.dtype) -> int:
    """Embedding rows of the batch + hyper-connection head + final norm + LM head."""
    shapes = expected_shapes(args)
    size = _itemsize(dtype)
    head = math.prod(shapes["head.weight"]) * size
    small = sum(math.prod(shapes[n]) * 4 for n in ("hc_head_fn", "hc_head_base", "norm.weight"))
    return head + small + num_tokens * args.hidden_size * size


def decode_kv_bytes(
    args: ModelArgs, kind: str, context: int, dtype: torch.dtype, kv_fp8: bool = False
) -> int:
    """KV one request's decode query reads at position ``context``: the window's ring rows; CSA:
    the top-k compressed entries + every visible indexer key; HCA: every visible entry.
    ``kv_fp8``: ring rows and entries packed (cache.kv_dtype = "fp8"; the indexer keys not)."""
    size = _itemsize(dtype)
    row = kv_fp8_layout(args).row_bytes if kv_fp8 else args.head_dim * size
    kv_rows = min(args.sliding_window - 1, context)
    index_bytes = 0
    if kind == "csa":
        visible = (context + 1) // args.csa_ratio
        kv_rows += min(args.index_topk, visible)
        index_bytes = visible * args.index_head_dim * size
    elif kind == "hca":
        kv_rows += (context + 1) // args.hca_ratio
    return kv_rows * row + index_bytes


def decode_bytes(
    args: ModelArgs,
    kind: str,
    batch: int,
    context: int,
    hit: float,
    dtype: torch.dtype,
    fp4_experts: bool = False,
    fp8_linears: bool = False,
    kv_fp8: bool = False,
) -> float:
    """Bytes one decode step of one layer of ``kind`` must read (``outer``: embed/head)."""
    if kind not in LAYER_TYPES:
        return outer_weight_bytes(args, batch, dtype) if kind == OUTER else 0
    w = layer_weights(args, 0, dtype, fp4_experts, fp8_linears)
    return (
        w.dense_bytes
        + hit * w.expert_bytes
        + batch * decode_kv_bytes(args, kind, context, dtype, kv_fp8)
    )


def prefill_flops(args: ModelArgs, kind: str, start: int, end: int) -> float:
    """FLOPs of one layer of ``kind`` for the queries at positions start..end-1: 2 x active
    parameters per token (attention projections, compressor/indexer, router, shared expert, k
    routed experts, hyper-connection mixing), QK and PV over the keys each query sees (window +
    CSA top-k or HCA visible entries) and the indexer scores over every visible CSA entry."""
    if kind not in LAYER_TYPES:
        return 0.0
    w = layer_weights(args, 0, torch.bfloat16)
    active = w.dense_matmul_params + args.num_experts_per_tok * w.expert_params
    pos = torch.arange(start, end, dtype=torch.float64)
    keys = torch.clamp(pos + 1, max=args.sliding_window)
    index = torch.zeros_like(pos)
    if kind == "csa":
        visible = torch.div(pos + 1, args.csa_ratio, rounding_mode="floor")
        keys = keys + torch.clamp(visible, max=args.index_topk)
        index = 2 * args.index_n_heads * args.index_head_dim * visible
    elif kind == "hca":
        keys = keys + torch.div(pos + 1, args.hca_ratio, rounding_mode="floor")
    attention = 4 * args.num_heads * args.head_dim * keys
    return 2 * active * (end - start) + float((attention + index).sum())


def full_depth(
    per_layer: dict[str, float | None], per_step: list[float | None]
) -> tuple[float | None, str]:
    """V4-Flash's 43 layers (21 CSA + 20 HCA + 2 sliding) + the once-per-step parts, from
    per-layer figures; None without CSA and HCA figures. A sliding layer not measured counts as an
    HCA one (its superset); the note says so. A per-step part not measured counts as 0."""
    counts, note = dict(FULL_DEPTH_LAYERS), ""
    if per_layer.get("swa") is None and per_layer.get("hca") is not None:
        counts = {"csa": counts["csa"], "hca": counts["hca"] + counts["swa"]}
        note = "sliding counted as HCA"
    if any(per_layer.get(k) is None for k in counts):
        return None, ""
    return sum(n * per_layer[k] for k, n in counts.items()) + sum(filter(None, per_step)), note


def full_depth_from(
    rows: list[dict], kinds: list[str], field: str, notes: set[str], **match: Any
) -> float | None:
    """``full_depth`` of ``field`` over the rows (one per layer type or per-step part) that
    match; None without an outer figure."""
    here = {r["layer"]: r.get(field) for r in rows if all(r.get(k) == v for k, v in match.items())}
    if here.get(OUTER) is None:
        return None
    per_layer = {k: here.get(k) for k in kinds if k in FULL_DEPTH_LAYERS}
    total, note = full_depth(per_layer, [here[OUTER], here.get(PLANS)])
    if note and total is not None:
        notes.add(note)
    return total


# ---- reporting -------------------------------------------------------------------------------


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers, *[[_cell(v) for v in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None where either is missing."""
    return None if a is None or b is None or b == 0 else a / b


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def load_module(path: str | Path, name: str) -> ModuleType:
    """The Python file at ``path`` imported as module ``name`` (a previous version of one of
    ours, timed beside the current one)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"
    return out.stdout.strip()


def device_name(setup: Setup) -> str:
    if setup.is_cuda:
        return torch.cuda.get_device_name(setup.device)
    return f"CPU ({platform.processor() or platform.machine()})"


def command(script: str, setup: Setup) -> str:
    """The command that reproduces this run from the repo root."""
    args = shlex.join(sys.argv[1:])
    if setup.is_cuda:
        return f"bash scripts/gpu_bench.sh benchmarks/{script} {args}".strip()
    return f"python benchmarks/{script} {args}".strip()


def results_block(
    title: str, script: str, setup: Setup, notes: list[str], tables: list[str]
) -> str:
    """Markdown for benchmarks/RESULTS.md: date, device, torch, commit, command, notes, tables."""
    today = datetime.date.today().isoformat()
    precision = str(setup.dtype).removeprefix("torch.")
    lines = [
        "RESULTS:",
        f"## {today} — {title} ({device_name(setup)})",
        "",
        f"- Command ({device_name(setup)}, torch {torch.__version__}, {precision}): "
        f"`{command(script, setup)}`. Commit {git_commit()}.",
        *[f"- {note}" for note in notes],
    ]
    for t in tables:
        lines += ["", t]
    return "\n".join(lines)


def header(setup: Setup) -> dict[str, Any]:
    """What every JSON file starts with."""
    return {
        "date": datetime.date.today().isoformat(),
        "device": device_name(setup),
        "torch": torch.__version__,
        "commit": git_commit(),
        "argv": sys.argv,
        "tiny": setup.tiny,
        "dtype": str(setup.dtype).removeprefix("torch."),
    }


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Written after every measurement, so a run cut short still leaves what it measured."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1) + "\n")
