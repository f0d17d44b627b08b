"""DeepSeek-V4-Flash shapes with fewer layers, and what the V4-Flash benchmarks share.

BENCH.md: a full V4-Flash checkpoint does not fit here; benchmark random weights in the real
shapes (hidden 4096, 64 heads of 512, 256 experts top-6, window 128, CSA 4 / HCA 128, indexer
64 x 128 top-512, YaRN on compressed layers) with fewer layers, and report per-layer figures next
to full-depth extrapolations (43 layers: 2 sliding, 21 CSA, 20 HCA).

Sections: shapes; the device; model and inputs (``decode_inputs`` / ``verify_inputs`` /
``prefill_inputs`` are the one place that builds caches and batches: adapt them when
ForwardBatch or KVCache change).
Timing, the ceilings, bytes and FLOPs per layer and reporting are in v4_flash_report.py.
``--tiny`` shrinks every shape so that each script runs on the CPU as a smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deepinfer.config import CacheConfig, Config, KernelConfig
from deepinfer.engine.cuda_graphs import context_bucket
from deepinfer.engine.weights_loading import convert_experts_to_fp8
from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch, SeqSpan
from deepinfer.model.deepseek_v4.args import CSA, HCA, SLIDING, ModelArgs
from deepinfer.model.deepseek_v4.cache import kv_rows
from deepinfer.model.deepseek_v4.step_plan import CacheGeometry, build_metadata
from deepinfer.model.deepseek_v4.tiny import QUANTIZED_CONFIG
from deepinfer.model.families import load_family
from deepinfer.model.layers import (
    dequantize_small_fp8_linears,
    use_fp8_linears,
    use_mxfp4_experts,
)
from deepinfer.ops import Kernels, select_kernels
from deepinfer.ops.attention.kv_fp8 import Fp8Rows
from deepinfer.ops.linear import FP8_BLOCK

# The model, its weights and its cache, as the engine gets them: through the family table.
FAMILY = load_family("deepseek_v4")

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
    # As the release's config.json: FP8 linears in 128 x 128 ue8m0 blocks, FP4 routed experts
    # (random weights are packed the same way under model.fp4_experts / model.fp8_weights).
    **QUANTIZED_CONFIG,
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
        ap.add_argument(
            "--no-launch-pdl",
            dest="launch_pdl",
            action="store_false",
            help="kernel.launch_pdl = false: no programmatic dependent launch",
        )
        ap.add_argument(
            "--no-side-stream",
            dest="side_stream",
            action="store_false",
            help="kernel.side_stream = false: every launch on one stream",
        )
    ap.add_argument(
        "--block-size",
        type=int,
        help="cache.block_size (default: config.toml's; attention=flashmla takes HCA layers "
        "from 256)",
    )
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


# ---- device ----------------------------------------------------------------------------------


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


def setup_of(ns: argparse.Namespace) -> Setup:
    """make_setup for the parsed ``add_common_args`` (--tiny, --block-size)."""
    setup = make_setup(ns.tiny)
    return dataclasses.replace(setup, block_size=ns.block_size) if ns.block_size else setup


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- model and inputs ------------------------------------------------------------------------


def kernel_config(backend: str, **switches: bool) -> KernelConfig:
    """--backend: one name for every op family ("auto", "torch_ref", ...) or per family,
    "attention=NAME,moe=NAME" (families left out stay "auto"); ``switches``: KernelConfig's
    booleans (``kernel_switches``: --no-launch-pdl, --no-side-stream)."""
    families = [f.name for f in dataclasses.fields(KernelConfig) if f.default == "auto"]
    if "=" not in backend:
        return KernelConfig(**dict.fromkeys(families, backend), **switches)
    chosen = dict(pair.split("=", 1) for pair in backend.split(","))
    bad = sorted(set(chosen) - set(families))
    if bad:
        raise SystemExit(f"--backend: unknown op families {bad}; known: {families}")
    return KernelConfig(**chosen, **switches)


def kernel_switches(ns: argparse.Namespace) -> dict[str, bool]:
    """The kernel config's switches ``add_common_args`` parsed."""
    return {"launch_pdl": ns.launch_pdl, "side_stream": ns.side_stream}


def describe_kernels(kernels: Kernels) -> str:
    """Each family's backend module ("attention=triton, ...") and the switches' values
    ("side_stream=True")."""
    return ", ".join(
        f"{f.name}={_described(getattr(kernels, f.name))}" for f in dataclasses.fields(kernels)
    )


def _described(value: object) -> str:
    if isinstance(value, bool):
        return str(value)
    return type(value).__module__.rsplit(".", 1)[-1]


def build_model(
    args: ModelArgs,
    kernels: Kernels,
    setup: Setup,
    seed: int,
    fp4_experts: bool = False,
    fp8_linears: bool = False,
) -> torch.nn.Module:
    """Random weights in ``args``' shapes, built as the engine builds a model (meta, assign);
    ``fp4_experts``: the routed experts packed MXFP4, as V4-Flash ships them; converted to FP8
    blocks after loading where the MoE backend takes them (``fp8_experts``); ``fp8_linears``:
    the linears V4-Flash ships FP8 kept FP8 (128 x 128 blocks, ``model.fp8_weights``; those
    under ``model.fp8_min_weights`` dense)."""
    block = FP8_BLOCK if fp8_linears else None
    weights = FAMILY.random_weights(
        args, seed, setup.device, setup.dtype, fp8_block=block, fp4_experts=fp4_experts
    )
    if block is not None:  # the small ones dense, as the engine holds them (and as
        # DEEPINFER_MODEL_FP8_MIN_WEIGHTS sets it for a run)
        min_weights = Config.load().model.fp8_min_weights
        dequantize_small_fp8_linears(weights, min_weights, block, setup.dtype)
    with torch.device("meta"):
        model = FAMILY.build_model(args, kernels)
        if block is not None:
            use_fp8_linears(model, weights, block, kernels.linear)
        use_mxfp4_experts(model, weights)
    model.load_state_dict(weights, strict=True, assign=True)
    del weights
    if getattr(kernels.moe, "fp8_experts", False):  # --backend moe=deepgemm, as the engine does
        convert_experts_to_fp8(model)
    FAMILY.init_buffers(model, setup.device)  # as the engine's loader: RoPE, fused projections
    return model.eval()


# Weight variants of the scripts' --experts: dense bf16; routed experts packed MXFP4; and the
# linears the checkpoint ships FP8 kept FP8; and the FP8 KV cache (the scripts that take it).
WEIGHTS = ("bf16", "fp4", "fp4-fp8", "fp4-fp8-kv8")


def weight_flags(variant: str) -> dict[str, bool]:
    """each_layer_model's (and build_model's) weight arguments for a WEIGHTS variant."""
    assert variant in WEIGHTS, f"weights {variant!r}: expected one of {WEIGHTS}"
    return {"fp4_experts": variant != "bf16", "fp8_linears": variant.startswith("fp4-fp8")}


def each_layer_model(
    kinds: list[str],
    depth: int,
    backend: str,
    setup: Setup,
    seed: int,
    measure: Callable[[str, ModelArgs, torch.nn.Module], None],
    fp4_experts: bool = False,
    fp8_linears: bool = False,
    switches: dict[str, bool] | None = None,
) -> str:
    """Build one model per layer type (``outer`` first: no layers), call ``measure(kind,
    cache_args, model)``, free the model before the next. ``cache_args`` shapes the inputs and
    the cache: the model's own, except for ``outer``, whose cache has one layer of every type
    (so that its step plans are a full model's). ``switches``: ``kernel_config``'s. Returns the
    chosen kernels, described."""
    kernels = select_kernels(kernel_config(backend, **(switches or {})), setup.device)
    every_type = ModelArgs.from_dict(config_dict(list(LAYER_TYPES.values()), setup.tiny))
    for kind in [OUTER, *kinds]:
        args = model_args(kind, depth, setup.tiny)
        model = build_model(args, kernels, setup, seed, fp4_experts, fp8_linears)
        measure(kind, every_type if kind == OUTER else args, model)
        del model
        release()
    return describe_kernels(kernels)


def new_cache(
    args: Any,
    setup: Setup,
    num_seqs: int,
    max_len: int,
    seed: int,
    family: Any = FAMILY,
    kv_dtype: str = "auto",
) -> KVCache:
    """Room for ``num_seqs`` requests of ``max_len`` tokens (+ spare blocks), every floating
    tensor (paged pools, window rings, compressor state) filled with N(0, 1): never zeros; with
    ``kv_dtype`` "fp8" (cache.kv_dtype) the packed entries and rings hold N(0, 1) rows packed.
    ``family``: the model family whose cache spec it is (DeepSeek-V4 by default)."""
    blocks_per_seq = math.ceil(max_len / setup.block_size)
    spec = family.cache_spec(
        args,
        block_size=setup.block_size,
        ring_margin=setup.ring_margin,
        max_draft=0,
        kv_dtype=kv_dtype,
    )
    cache = KVCache(
        spec,
        num_blocks=num_seqs * blocks_per_seq + 8,
        num_slots=num_seqs,
        dtype=setup.dtype,
        device=setup.device,
    )
    gen = torch.Generator(device=setup.device).manual_seed(seed)
    for key, tensor in cache.tensors.items():
        if tensor.is_floating_point() and tensor.numel():
            tensor.normal_(generator=gen)
        elif key[1] in ("entries", "ring"):  # packed FP8 rows
            _fill_packed(kv_rows(cache, key, args), gen)
    return cache


def _fill_packed(rows: Fp8Rows, gen: torch.Generator, chunk: int = 1 << 16) -> None:
    """N(0, 1) rows packed into every row of a packed part, ``chunk`` rows at a time."""
    for first in range(0, rows.num_rows, chunk):
        index = torch.arange(first, min(first + chunk, rows.num_rows), device=rows.device)
        values = torch.randn(index.numel(), rows.layout.head_dim, generator=gen, device=rows.device)
        rows.store(index, values)


def _block_ids(
    cache: KVCache, num_seqs: int, max_len: int, gen: torch.Generator
) -> list[list[int]]:
    """Distinct blocks per request, scattered over the pool as a long-running engine's are."""
    per_seq = math.ceil(max_len / cache.block_size)
    order = torch.randperm(cache.num_blocks, generator=gen)[: num_seqs * per_seq].tolist()
    return [order[i * per_seq : (i + 1) * per_seq] for i in range(num_seqs)]


def decode_inputs(
    args: Any,
    setup: Setup,
    batch_size: int,
    context: int,
    seed: int,
    family: Any = FAMILY,
    kv_dtype: str = "auto",
) -> tuple[ForwardBatch, KVCache]:
    """One decode step of ``batch_size`` requests that each hold ``context`` tokens, without a
    prefill: the cache holds random values where the context's KV would be, and every request
    decodes the token at position ``context`` (a multiple of the ratios: no compressed entry is
    closed by this step, as in 3 of 4 CSA steps and 127 of 128 HCA steps).

    Repeating the step is idempotent in shape: it rewrites the same ring row and open-window
    buffer row. Request i owns slot i and its own blocks.
    """
    return verify_inputs(args, setup, batch_size, context, 1, seed, family, kv_dtype)


def graph_plans(batch: ForwardBatch, cache: KVCache) -> None:
    """Give a decode step (``decode_inputs``) the plans a decode graph of the engine replays:
    the entry lists padded to the context bucket of its longest request, and every request's
    candidate windows pooled whether or not they close (``graphed_compress_plan``)."""
    bucket = context_bucket(max(s.end_pos for s in batch.seqs), cache.block_size)
    batch.metadata = build_metadata(batch, CacheGeometry.of(cache), bucket)


def verify_inputs(
    args: Any,
    setup: Setup,
    batch_size: int,
    context: int,
    num_tokens: int,
    seed: int,
    family: Any = FAMILY,
    kv_dtype: str = "auto",
) -> tuple[ForwardBatch, KVCache]:
    """A verification step of speculative decoding, as ``decode_inputs`` builds a decode step
    (``num_tokens`` = 1 is that step): every request holds ``context`` tokens and feeds
    ``num_tokens`` (its last token and num_tokens - 1 drafts) at positions context ..
    context + num_tokens - 1, with logits at every one of them (batch_size * num_tokens rows,
    request by request). The cache is sized for context + num_tokens tokens a request.

    Repeating the step is idempotent in shape: it rewrites the same ring rows, closes the same
    compression windows and keeps the same open-window buffer rows.
    """
    gen = torch.Generator().manual_seed(seed)
    end = context + num_tokens
    cache = new_cache(args, setup, batch_size, end, seed, family, kv_dtype)
    tables = _block_ids(cache, batch_size, end, gen)
    seqs = [
        SeqSpan(
            offset=i * num_tokens,
            num_tokens=num_tokens,
            start_pos=context,
            slot=i,
            block_ids=tables[i],
        )
        for i in range(batch_size)
    ]
    num_rows = batch_size * num_tokens
    input_ids = torch.randint(3, args.vocab_size, (num_rows,), generator=gen)
    positions = torch.arange(context, end, dtype=torch.int64).repeat(batch_size)  # [B * n]
    batch = ForwardBatch(
        input_ids=input_ids.to(setup.device),
        positions=positions.to(setup.device),
        seqs=seqs,
        logits_indices=torch.arange(num_rows, device=setup.device),
    )
    return batch, cache


def prefill_inputs(
    args: Any,
    setup: Setup,
    prompt_len: int,
    chunk: int,
    seed: int,
    family: Any = FAMILY,
    kv_dtype: str = "auto",
) -> tuple[list[ForwardBatch], KVCache]:
    """One request's prompt in chunks of at most ``chunk`` tokens, as the engine schedules it
    under a token budget: successive batches on slot 0 and the same blocks, start_pos growing;
    logits for each chunk's last token. ``kv_dtype``: new_cache's."""
    gen = torch.Generator().manual_seed(seed)
    cache = new_cache(args, setup, 1, prompt_len, seed, family, kv_dtype)
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
