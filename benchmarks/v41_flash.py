"""Decode and prefill per layer of DeepSeek-V4.1-Flash shapes against the HBM and compute bounds.

    bash scripts/gpu_bench.sh benchmarks/v41_flash.py [--batch 1,32,128] [--context 4096,32768]
        [--prompt 8192] [--chunk 8192] [--backend auto] [--json PATH]
    python benchmarks/v41_flash.py --tiny          # CPU smoke test, every shape shrunk

Shapes: the hyper-parameters third-party fixtures report for V4.1-Flash (DeepInfer's notes
§2.1, unverified against the real config.json): hidden 5120, 64 heads of 512 (rope 64),
q_lora 1280, 8 output groups of 1024, window 128, indexer 32 x 128 top-512, candidate blocks
2048 x 8, 384 experts top-6 of 2304 packed FP4, YaRN on compressed layers. Random weights, no
engram (one layer's tables, 384 M rows of 256, do not fit beside the rest) and no drafter layers
(loaded, not run).

Layer kinds, by what a layer computes (V4.1-Flash's 40 layers: count):

    swa        sliding window only                                         2
    c2         C2 source: compressor, index keys, top-k, attention          3
    c2_shared  C2 consumer: window + the source's entries and top-k         15
    c1         C1 source (the YoCo boundary, candidate source)              1
    c1_index   C1 layer with its own top-k over shared keys, candidate-bound 4
    c1_shared  C1 consumer: window + shared entries and top-k               15

Method (as v4_flash_decode.py / v4_flash_prefill.py): one model per measurement, built, timed
and freed in turn; a kind's time is the model with it minus the model without it (a consumer
needs its source: [c2, c2_shared] - [c2]); CUDA events, warm-up, median; the step plans are
built once and kept. Decode bound = bytes / copy bandwidth measured in the run: the layer's
weights but routed experts, the experts the router hit (packed FP4), the window ring, the
compressed entries attention reads (top-512) and, for an index source, every visible index key.
Prefill bound = FLOPs / dense GEMM rate measured in the run: 2 x active parameters per token,
QK and PV over the keys each query sees, the indexer's scores over every visible entry (an index
source). Full depth sums the kinds by count (extrapolated, not measured).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import (
    Setup,
    decode_inputs,
    describe_kernels,
    experts_hit,
    kernel_config,
    make_setup,
    parse_ints,
    prefill_inputs,
    release,
)
from v4_flash_report import (
    copy_bandwidth,
    device_name,
    gemm_rate,
    graph_time,
    header,
    markdown,
    median_time,
    ms,
    ratio,
    results_block,
    table,
    write_json,
)

from deepinfer.model.deepseek_v41.args import ModelArgs
from deepinfer.model.families import load_family
from deepinfer.model.layers import use_mxfp4_experts
from deepinfer.ops import select_kernels

FAMILY = load_family("deepseek_v41")
SCRIPT = "v41_flash.py"

TEXT = {
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "n_routed_experts": 384,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2304,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-20,
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
}
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
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 8,
    "candidate_topk_blocks": 4,
    "candidate_block_size": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
FULL_DEPTH = {"swa": 2, "c2": 3, "c2_shared": 15, "c1": 1, "c1_index": 4, "c1_shared": 15}
# kind -> (the model measured, the model subtracted): layers as (ratio, role) pairs.
MODELS: dict[str, tuple[str, str]] = {
    "swa": ("swa", "outer"),
    "c2": ("c2", "outer"),
    "c2_shared": ("c2+c2_shared", "c2"),
    "c1": ("c1", "outer"),
    "c1_index": ("c1+c1_index", "c1"),
    "c1_shared": ("c1+c1_shared", "c1"),
}


def config(model: str, tiny: bool) -> dict[str, Any]:
    """config.json of one measured model ("outer": no layers; "c1+c1_index": two layers)."""
    kinds = [] if model == "outer" else model.split("+")
    ratios = [0 if k == "swa" else int(k[1]) for k in kinds]
    sources = [0] if kinds and kinds[0] != "swa" else []
    index = sources + [i for i, k in enumerate(kinds) if k == "c1_index"]
    text = {
        **TEXT,
        **(TINY if tiny else {}),
        "num_hidden_layers": len(kinds),
        "compress_ratios": ratios,
        "kv_source_layer_ids": sources,
        "index_source_layer_ids": index,
        "candidate_source_layer_id": 0 if kinds and kinds[0] == "c1" else None,
    }
    return {
        "model_type": "deepseek_v41",
        "text_config": text,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "quantization_config": {"quant_method": "fp8", "expert_dtype": "fp4"},
    }


def build(args: ModelArgs, kernels: Any, setup: Setup, seed: int) -> torch.nn.Module:
    weights = FAMILY.random_weights(
        args, seed, setup.device, setup.dtype, fp8_block=None, fp4_experts=True
    )
    with torch.device("meta"):
        model = FAMILY.build_model(args, kernels)
        use_mxfp4_experts(model, weights)
    model.load_state_dict(weights, strict=True, assign=True)
    FAMILY.init_buffers(model, setup.device)
    return model.eval()


def layer_bytes(model: torch.nn.Module, layer: int) -> tuple[int, int, int]:
    """(bytes of the layer's weights but routed experts, bytes of one routed expert, 2-D weight
    values a token multiplies by but routed experts)."""
    block = model.layers[layer]
    experts = block.ffn.experts
    expert_names = {f"ffn.experts.{n}" for n, _ in experts.named_parameters()}
    dense = matmul = 0
    for name, p in block.named_parameters():
        if name in expert_names:
            continue
        dense += p.numel() * p.element_size()
        if p.dim() == 2 and "embed" not in name:
            matmul += p.numel()
    routed = sum(p.numel() * p.element_size() for p in experts.parameters())
    return dense, routed // experts.shapes["w1"][0], matmul


def kind_costs(args: ModelArgs, model: torch.nn.Module, kind: str) -> dict[str, Any]:
    """What one layer of ``kind`` (the model's last layer) reads and computes, per request."""
    layer = args.num_layers - 1
    dense, per_expert, matmul = layer_bytes(model, layer)
    ratio_ = args.ratio(layer)
    d, hd, i = args.hidden_size, args.head_dim, args.moe_intermediate_size
    return {
        "dense_bytes": dense,
        "expert_bytes": per_expert,
        "active_params": matmul + args.num_experts_per_tok * 3 * d * i,
        "ratio": ratio_,
        "is_index_source": bool(ratio_) and args.index_source(layer) == layer,
        "head_dim": hd,
    }


def decode_bytes(
    args: ModelArgs, c: dict, batch: int, context: int, hit: float, item: int
) -> float:
    kv = (args.sliding_window - 1) * args.head_dim * item
    if c["ratio"]:
        visible = context // c["ratio"]
        kv += min(args.index_topk, visible) * args.head_dim * item
        if c["is_index_source"]:
            kv += visible * args.index_head_dim * item
    return c["dense_bytes"] + hit * c["expert_bytes"] + batch * kv


def prefill_flops(args: ModelArgs, c: dict, prompt: int) -> float:
    pos = torch.arange(prompt, dtype=torch.float64)
    keys = torch.clamp(pos + 1, max=args.sliding_window)
    index = torch.zeros_like(pos)
    if c["ratio"]:
        visible = torch.div(pos + 1, c["ratio"], rounding_mode="floor")
        keys = keys + torch.clamp(visible, max=args.index_topk)
        if c["is_index_source"]:
            index = 2 * args.index_n_heads * args.index_head_dim * visible
    attention = 4 * args.num_heads * args.head_dim * keys
    return 2 * c["active_params"] * prompt + float((attention + index).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--batch", help="decode batch sizes (default 1,32,128; --tiny 1,4)")
    ap.add_argument("--context", help="decode contexts (default 4096,32768; --tiny 64)")
    ap.add_argument("--prompt", help="prefill prompt lengths (default 8192; --tiny 64)")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--kinds", default=",".join(MODELS))
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--graph", action="store_true", help="decode: also time CUDA-graph replays")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true")
    ns = ap.parse_args()
    setup = make_setup(ns.tiny)
    kinds = [k for k in ns.kinds.split(",") if k]
    if set(kinds) - set(MODELS):
        raise SystemExit(f"--kinds: unknown {sorted(set(kinds) - set(MODELS))}")
    batches = parse_ints(ns.batch or ("1,4" if ns.tiny else "1,32,128"))
    contexts = parse_ints(ns.context or ("64" if ns.tiny else "4096,32768"))
    prompts = parse_ints(ns.prompt or ("64" if ns.tiny else "8192"))
    chunk = min(ns.chunk, max(prompts)) if ns.tiny else ns.chunk
    kernels = select_kernels(kernel_config(ns.backend), setup.device)
    bandwidth, rate = copy_bandwidth(setup), gemm_rate(setup)
    item = torch.empty((), dtype=setup.dtype).element_size()
    print(
        f"{device_name(setup)}: copy {bandwidth / 1e12:.3f} TB/s, GEMM {rate / 1e12:.1f} "
        f"TFLOP/s; kernels {describe_kernels(kernels)}"
    )
    payload: dict[str, Any] = {**header(setup), "script": SCRIPT, "rows": []}
    times: dict[tuple[str, str, int, int], float] = {}  # (model, phase, batch|prompt, ctx)
    costs: dict[str, dict] = {}
    hits: dict[tuple[str, int, int], float] = {}
    needed = sorted({m for k in kinds for m in MODELS[k]}, key=lambda m: (m.count("+"), m))
    for name in needed:
        args = ModelArgs.from_dict(config(name, setup.tiny))
        model = build(args, kernels, setup, ns.seed)
        # The model with no layers plans its steps on a cache of both ratios (a full model's).
        cache_args = outer_cache_args(setup.tiny) if name == "outer" else args
        if name != "outer":
            kind = name.split("+")[-1]
            costs[kind] = kind_costs(args, model, kind)
        for context in contexts:
            for batch_size in batches:
                batch, cache = decode_inputs(
                    cache_args, setup, batch_size, context, ns.seed, FAMILY
                )

                def step(batch=batch, cache=cache, model=model) -> object:
                    return model(batch, cache)

                times[name, "decode", batch_size, context] = median_time(
                    step, setup, ns.warmup, ns.repeats
                )
                if ns.graph:
                    graph, why = graph_time(step, setup, ns.warmup, ns.repeats)
                    if graph is None:
                        raise SystemExit(f"{name}: no CUDA graph: {why}")
                    times[name, "graph", batch_size, context] = graph
                if name != "outer":
                    counts = experts_hit(model, step)
                    hits[name.split("+")[-1], batch_size, context] = (
                        counts[-1] if counts else args.num_experts
                    )
                del batch, cache, step
                release()
        for prompt in prompts:
            batches_, cache = prefill_inputs(cache_args, setup, prompt, chunk, ns.seed, FAMILY)

            def run(batches_=batches_, cache=cache, model=model) -> None:
                for b in batches_:
                    model(b, cache)

            times[name, "prefill", prompt, 0] = median_time(run, setup, 1, 3)
            del batches_, cache, run
            release()
        print(f"  measured {name}")
        del model
        release()

    rows = []
    for kind in kinds:
        with_, without = MODELS[kind]
        c = costs[kind]
        for context in contexts:
            for batch_size in batches:
                key = ("decode", batch_size, context)
                t = times[(with_, *key)] - times[(without, *key)]
                hit = hits[kind, batch_size, context]
                bound = decode_bytes(args_of(kind, setup), c, batch_size, context, hit, item)
                bound /= bandwidth
                graph = None
                if ns.graph:
                    key = ("graph", batch_size, context)
                    graph = times[(with_, *key)] - times[(without, *key)]
                row = ["decode", kind, batch_size, context, ms(t), ms(graph), hit, ms(bound)]
                rows.append([*row, ratio(graph or t, bound)])
        for prompt in prompts:
            key = ("prefill", prompt, 0)
            t = times[(with_, *key)] - times[(without, *key)]
            bound = prefill_flops(args_of(kind, setup), c, prompt) / rate
            rows.append(
                ["prefill", kind, prompt, "", ms(t), None, None, ms(bound), ratio(t, bound)]
            )
    headers = "phase|kind|batch / prompt|ctx|eager ms|graph ms|experts hit|bound ms|best / bound"
    headers = headers.split("|")
    full = []
    if set(FULL_DEPTH) <= set(kinds):
        for phase, sizes in (
            ("decode", [(b, c) for c in contexts for b in batches]),
            ("prefill", [(p, "") for p in prompts]),
        ):
            for size, context in sizes:
                mine = [r for r in rows if r[0] == phase and r[2] == size and r[3] == context]
                best = sum(FULL_DEPTH[r[1]] * (r[5] if r[5] is not None else r[4]) for r in mine)
                bound = sum(FULL_DEPTH[r[1]] * r[7] for r in mine)
                outer_phase = "graph" if phase == "decode" and ns.graph else phase
                best += times["outer", outer_phase, size, context or 0] * 1e3
                full.append([phase, size, context, best, bound, ratio(best, bound)])
    payload["rows"] = rows
    payload["full_depth"] = full
    write_json(ns.json, payload)
    print(table(headers, rows))
    full_headers = [
        "phase",
        "batch / prompt",
        "ctx",
        "40 layers + outer ms",
        "bound ms",
        "ms / bound",
    ]
    if full:
        print(table(full_headers, full))
    print()
    print(
        results_block(
            "V4.1-Flash decode and prefill per layer kind vs the bounds",
            SCRIPT,
            setup,
            [
                "Shapes: the reported V4.1-Flash hyper-parameters (unverified), random weights, "
                "routed experts packed FP4, no engram, no drafter; kernels "
                f"{describe_kernels(kernels)}.",
                f"Per kind = model with it − model without it, median of {ns.repeats} (decode, "
                f"{'eager and CUDA-graph replays' if ns.graph else 'eager'}) / "
                f"3 (prefill, chunks of {chunk}). Decode bound = bytes / {bandwidth / 1e12:.3f} "
                f"TB/s copy bandwidth; prefill bound = FLOPs / {rate / 1e12:.1f} TFLOP/s GEMM, "
                "both measured in the run. Full depth (2 swa + 3 c2 + 15 c2_shared + 1 c1 + "
                "4 c1_index + 15 c1_shared + outer) is extrapolated, not measured.",
            ],
            [markdown(headers, rows)] + ([markdown(full_headers, full)] if full else []),
        )
    )


def args_of(kind: str, setup: Setup) -> ModelArgs:
    return ModelArgs.from_dict(config(MODELS[kind][0], setup.tiny))


def outer_cache_args(tiny: bool) -> ModelArgs:
    """A C2 and a C1 source: the cache (and plans) of a model with both ratios."""
    cfg = config("c2+c1", tiny)
    cfg["text_config"].update(
        kv_source_layer_ids=[0, 1], index_source_layer_ids=[0, 1], candidate_source_layer_id=None
    )
    return ModelArgs.from_dict(cfg)


if __name__ == "__main__":
    main()
