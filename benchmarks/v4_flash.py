"""DeepSeek-V4-Flash shapes with fewer layers, and what the V4-Flash benchmarks share.

BENCH.md: a full V4-Flash checkpoint does not fit here; benchmark random weights in the real
shapes (hidden 4096, 64 heads of 512, 256 experts top-6, window 128, CSA 4 / HCA 128, indexer
64 x 128 top-512, YaRN on compressed layers) with fewer layers, and report per-layer figures next
to full-depth extrapolations (43 layers: 2 sliding, 21 CSA, 20 HCA).

Sections: shapes; device, timing and the two ceilings (copy bandwidth, GEMM rate); model and
inputs (``decode_inputs`` / ``prefill_inputs`` are the one place that builds caches and batches:
adapt them when ForwardBatch or KVCache change); bytes and FLOPs per layer; reporting.
``--tiny`` shrinks every shape so that each script runs on the CPU as a smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from deepinfer.config import CacheConfig, KernelConfig
from deepinfer.engine.forward_batch import ForwardBatch, SeqSpan
from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.config import CSA, HCA, SLIDING, ModelArgs
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.tiny import random_weights
from deepinfer.model.weights import expected_shapes, is_fp32_param, is_integer_param
from deepinfer.ops import Kernels, select_kernels

# ---- shapes ----------------------------------------------------------------------------------

FULL_DEPTH = 43

V4_FLASH = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "num_local_experts": 256,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}

# --tiny: every dimension shrunk (CPU smoke tests); HCA pools every 16 tokens so that ~64-token
# contexts have compressed entries of both kinds.
TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
TINY_BLOCK_SIZE = 16

# Short names on the command line. Two parts run once per step whatever the depth: "outer", the
# embedding + hyper-connection head + final norm + LM head (a model with no layers), and "plans",
# the step's index plans built on the host (ForwardBatch.metadata; a model builds them when the
# batch has none, and keeps them on the batch).
LAYER_TYPES = {"csa": CSA, "hca": HCA, "swa": SLIDING}
OUTER = "outer"
PLANS = "plans"
# V4-Flash's 43 layers by type.
FULL_DEPTH_LAYERS = {"csa": 21, "hca": 20, "swa": 2}
assert sum(FULL_DEPTH_LAYERS.values()) == FULL_DEPTH


def config_dict(layer_types: list[str], tiny: bool = False) -> dict[str, Any]:
    """config.json of V4-Flash shapes (or --tiny ones) with these layers (routed MoE on every
    layer; transformers' layer type names)."""
    config = {**V4_FLASH, **(TINY if tiny else {})}
    config["num_hidden_layers"] = len(layer_types)
    config["layer_types"] = list(layer_types)
    config["mlp_layer_types"] = ["moe"] * len(layer_types)
    return config


def write_config(folder: str | Path, layer_types: list[str]) -> Path:
    """A config.json of V4-Flash shapes with these layers (routed MoE on every layer)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_dict(layer_types), indent=2) + "\n")
    return folder


def model_args(kind: str, depth: int, tiny: bool) -> ModelArgs:
    """``depth`` layers of one short layer type (none for ``outer``)."""
    types = [] if kind == OUTER else [LAYER_TYPES[kind]] * depth
    return ModelArgs.from_dict(config_dict(types, tiny))


def add_common_args(
    ap: argparse.ArgumentParser, *, warmup: int, repeats: int, ours: bool = True
) -> None:
    """The arguments every V4-Flash script takes (``ours``: also our backends and depth)."""
    ap.add_argument("--layers", default="csa,hca,swa", help="layer types, one model each")
    if ours:
        ap.add_argument("--backend", default="auto", help="auto | torch_ref | attention=X,moe=Y")
        ap.add_argument("--depth", type=int, default=1, help="layers per model (all of one type)")
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every figure here (v4_flash_hf.py --ours reads ours)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes; CPU/fp32 without CUDA")


def parse_layers(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in LAYER_TYPES]
    if bad:
        raise SystemExit(f"--layers: unknown {bad}; expected a list of {list(LAYER_TYPES)}")
    return kinds


def parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


# ---- device, timing, ceilings ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where and in what the benchmark runs: CUDA + bf16, or (--tiny without CUDA) CPU + fp32."""

    device: torch.device
    dtype: torch.dtype
    tiny: bool
    block_size: int
    ring_margin: int

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def make_setup(tiny: bool) -> Setup:
    cache = CacheConfig()
    block_size = TINY_BLOCK_SIZE if tiny else cache.block_size
    if torch.cuda.is_available():
        return Setup(torch.device("cuda"), torch.bfloat16, tiny, block_size, cache.ring_margin)
    if not tiny:
        raise SystemExit("no CUDA device: V4-Flash shapes need the GPU (--tiny runs on the CPU)")
    return Setup(torch.device("cpu"), torch.float32, tiny, block_size, cache.ring_margin)


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


# ---- model and inputs ------------------------------------------------------------------------


def kernel_config(backend: str) -> KernelConfig:
    """--backend: one name for every op family ("auto", "torch_ref", ...) or per family,
    "attention=NAME,moe=NAME" (families left out stay "auto")."""
    families = [f.name for f in dataclasses.fields(KernelConfig) if f.default == "auto"]
    if "=" not in backend:
        return KernelConfig(**dict.fromkeys(families, backend))
    chosen = dict(pair.split("=", 1) for pair in backend.split(","))
    bad = sorted(set(chosen) - set(families))
    if bad:
        raise SystemExit(f"--backend: unknown op families {bad}; known: {families}")
    return KernelConfig(**chosen)


def describe_kernels(kernels: Kernels) -> str:
    return ", ".join(
        f"{f.name}={getattr(kernels, f.name).__name__.rsplit('.', 1)[-1]}"
        for f in dataclasses.fields(kernels)
    )


def build_model(args: ModelArgs, kernels: Kernels, setup: Setup, seed: int) -> DeepseekV4:
    """Random weights in ``args``' shapes, built as the engine builds a model (meta, assign)."""
    weights = random_weights(args, seed, setup.device, setup.dtype)
    with torch.device("meta"):
        model = DeepseekV4(args, kernels)
    model.load_state_dict(weights, strict=True, assign=True)
    model.init_rope(setup.device)
    return model.eval()


def each_layer_model(
    kinds: list[str],
    depth: int,
    backend: str,
    setup: Setup,
    seed: int,
    measure: Callable[[str, ModelArgs, DeepseekV4], None],
) -> str:
    """Build one model per layer type (``outer`` first: no layers), call ``measure(kind,
    cache_args, model)``, free the model before the next. ``cache_args`` shapes the inputs and
    the cache: the model's own, except for ``outer``, whose cache has one layer of every type
    (so that its step plans are a full model's). Returns the chosen kernels, described."""
    kernels = select_kernels(kernel_config(backend), setup.device)
    every_type = ModelArgs.from_dict(config_dict(list(LAYER_TYPES.values()), setup.tiny))
    for kind in [OUTER, *kinds]:
        args = model_args(kind, depth, setup.tiny)
        model = build_model(args, kernels, setup, seed)
        measure(kind, every_type if kind == OUTER else args, model)
        del model
        release()
    return describe_kernels(kernels)


def new_cache(args: ModelArgs, setup: Setup, num_seqs: int, max_len: int, seed: int) -> KVCache:
    """Room for ``num_seqs`` requests of ``max_len`` tokens (+ spare blocks), every floating
    tensor (paged pools, window rings, compressor state) filled with N(0, 1): never zeros."""
    blocks_per_seq = math.ceil(max_len / setup.block_size)
    cache = KVCache(
        args,
        num_blocks=num_seqs * blocks_per_seq + 8,
        num_slots=num_seqs,
        block_size=setup.block_size,
        ring_margin=setup.ring_margin,
        dtype=setup.dtype,
        device=setup.device,
    )
    gen = torch.Generator(device=setup.device).manual_seed(seed)
    for tensor in _tensors(vars(cache), set()):
        if tensor.is_floating_point() and tensor.numel():
            tensor.normal_(generator=gen)
    return cache


def _tensors(obj: object, seen: set[int]) -> Iterator[torch.Tensor]:
    """Every tensor reachable through dicts, lists, tuples and dataclasses, once each."""
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen.add(id(obj))
            yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), seen)


def _block_ids(
    cache: KVCache, num_seqs: int, max_len: int, gen: torch.Generator
) -> list[list[int]]:
    """Distinct blocks per request, scattered over the pool as a long-running engine's are."""
    per_seq = math.ceil(max_len / cache.block_size)
    order = torch.randperm(cache.num_blocks, generator=gen)[: num_seqs * per_seq].tolist()
    return [order[i * per_seq : (i + 1) * per_seq] for i in range(num_seqs)]


def decode_inputs(
    args: ModelArgs, setup: Setup, batch_size: int, context: int, seed: int
) -> tuple[ForwardBatch, KVCache]:
    """One decode step of ``batch_size`` requests that each hold ``context`` tokens, without a
    prefill: the cache holds random values where the context's KV would be, and every request
    decodes the token at position ``context`` (a multiple of the ratios: no compressed entry is
    closed by this step, as in 3 of 4 CSA steps and 127 of 128 HCA steps).

    Repeating the step is idempotent in shape: it rewrites the same ring row and open-window
    buffer row. Request i owns slot i and its own blocks.
    """
    gen = torch.Generator().manual_seed(seed)
    cache = new_cache(args, setup, batch_size, context + 1, seed)
    tables = _block_ids(cache, batch_size, context + 1, gen)
    seqs = [
        SeqSpan(offset=i, num_tokens=1, start_pos=context, slot=i, block_ids=tables[i])
        for i in range(batch_size)
    ]
    input_ids = torch.randint(3, args.vocab_size, (batch_size,), generator=gen)
    positions = torch.full((batch_size,), context, dtype=torch.int64)
    batch = ForwardBatch(
        input_ids=input_ids.to(setup.device),
        positions=positions.to(setup.device),
        seqs=seqs,
        logits_indices=torch.arange(batch_size, device=setup.device),
    )
    return batch, cache


def prefill_inputs(
    args: ModelArgs, setup: Setup, prompt_len: int, chunk: int, seed: int
) -> tuple[list[ForwardBatch], KVCache]:
    """One request's prompt in chunks of at most ``chunk`` tokens, as the engine schedules it
    under a token budget: successive batches on slot 0 and the same blocks, start_pos growing;
    logits for each chunk's last token."""
    gen = torch.Generator().manual_seed(seed)
    cache = new_cache(args, setup, 1, prompt_len, seed)
    (table,) = _block_ids(cache, 1, prompt_len, gen)
    prompt = torch.randint(3, args.vocab_size, (prompt_len,), generator=gen).to(setup.device)
    batches = []
    for start in range(0, prompt_len, chunk):
        n = min(chunk, prompt_len - start)
        seq = SeqSpan(offset=0, num_tokens=n, start_pos=start, slot=0, block_ids=table)
        batches.append(
            ForwardBatch(
                input_ids=prompt[start : start + n],
                positions=torch.arange(start, start + n, device=setup.device),
                seqs=[seq],
                logits_indices=torch.tensor([n - 1], device=setup.device),
            )
        )
    return batches, cache


def experts_hit(model: torch.nn.Module, step: Callable[[], object]) -> list[int]:
    """Distinct routed experts each MoE layer's router picked in one run of ``step`` (through
    forward hooks on the routers, ours ``*.ffn.gate`` and transformers' ``*.mlp.gate``, whose
    output ends with the expert ids); empty if no router reported (then use
    ``expected_experts_hit``)."""
    counts: list[int] = []

    def hook(_module: torch.nn.Module, _inputs: object, output: object) -> None:
        ids = output[-1] if isinstance(output, tuple) else None
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
            counts.append(int(torch.unique(ids).numel()))

    handles = [
        m.register_forward_hook(hook)
        for n, m in model.named_modules()
        if n.endswith(("ffn.gate", "mlp.gate"))
    ]
    try:
        step()
    finally:
        for handle in handles:
            handle.remove()
    return counts


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


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def layer_weights(args: ModelArgs, layer: int, dtype: torch.dtype) -> LayerWeights:
    dense_bytes = dense_matmul = expert_numel = 0
    prefix = f"layers.{layer}."
    for name, shape in expected_shapes(args).items():
        if not name.startswith(prefix) or is_integer_param(name):
            continue  # the hash router's tid2eid is a lookup, not read whole
        numel = math.prod(shape)
        if ".ffn.experts." in name:
            expert_numel += numel // args.num_experts
            continue
        dense_bytes += numel * (4 if is_fp32_param(name) else _itemsize(dtype))
        if len(shape) == 2 and not name.endswith(".ape"):
            dense_matmul += numel
    return LayerWeights(dense_bytes, dense_matmul, expert_numel * _itemsize(dtype), expert_numel)


def outer_weight_bytes(args: ModelArgs, num_tokens: int, dtype: torch.dtype) -> int:
    """Embedding rows of the batch + hyper-connection head + final norm + LM head."""
    shapes = expected_shapes(args)
    size = _itemsize(dtype)
    head = math.prod(shapes["head.weight"]) * size
    small = sum(math.prod(shapes[n]) * 4 for n in ("hc_head_fn", "hc_head_base", "norm.weight"))
    return head + small + num_tokens * args.hidden_size * size


def decode_kv_bytes(args: ModelArgs, kind: str, context: int, dtype: torch.dtype) -> int:
    """KV one request's decode query reads at position ``context``: the window's ring rows; CSA:
    the top-k compressed entries + every visible indexer key; HCA: every visible entry."""
    size, hd = _itemsize(dtype), args.head_dim
    rows = min(args.sliding_window - 1, context) * hd
    if kind == "csa":
        visible = (context + 1) // args.csa_ratio
        rows += min(args.index_topk, visible) * hd + visible * args.index_head_dim
    elif kind == "hca":
        rows += (context + 1) // args.hca_ratio * hd
    return rows * size


def decode_bytes(
    args: ModelArgs, kind: str, batch: int, context: int, hit: float, dtype: torch.dtype
) -> float:
    """Bytes one decode step of one layer of ``kind`` must read (``outer``: embed/head)."""
    if kind not in LAYER_TYPES:
        return outer_weight_bytes(args, batch, dtype) if kind == OUTER else 0
    w = layer_weights(args, 0, dtype)
    return (
        w.dense_bytes + hit * w.expert_bytes + batch * decode_kv_bytes(args, kind, context, dtype)
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
