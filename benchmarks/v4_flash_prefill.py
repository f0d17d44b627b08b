"""Prefill tokens/s of V4-Flash-shaped layers against the compute bound (MFU), per layer type.

    bash scripts/gpu_bench.sh benchmarks/v4_flash_prefill.py [--layers csa,hca,swa]
        [--prompt 1024,8192,32768] [--chunk 8192] [--kv auto|fp8] [--unpack-min-tokens N]
        [--experts bf16|fp4|fp4-fp8]
        [--backend auto] [--json PATH]
    python benchmarks/v4_flash_prefill.py --tiny          # CPU smoke test, every shape shrunk

Method. The models of v4_flash_decode.py: one per layer type (``--depth`` layers of it, random
bf16 weights in V4-Flash shapes), built one after the other, plus the no-layer "outer" model.
One request's prompt runs as the engine schedules it under a token budget: successive
ForwardBatches of at most ``--chunk`` tokens on the same slot and blocks, start_pos growing
(``v4_flash.prefill_inputs``); the whole prompt is timed (CUDA events, warm-up, median). Per-layer
time = (model − outer) / depth for the same prompt. As in v4_flash_decode.py, each chunk's index
plans are built on the warm-up run and kept; building them is the per-step part "plans", timed
on the outer model and counted once in the full-depth figure.

Compute bound = FLOPs / dense bf16 GEMM rate measured in the same run (a large torch.matmul).
FLOPs per layer (``v4_flash.prefill_flops``): 2 × active parameters per token (attention
projections, compressor and indexer projections, router, shared expert, 6 routed experts,
hyper-connection mixing) + QK and PV over the keys each query sees (window 128, + CSA
min(512, visible) entries or HCA visible entries) + the indexer's scores over every visible CSA
entry. MFU = bound / measured. Full depth = 21 CSA + 20 HCA + 2 sliding + outer + plans,
extrapolated.

A prompt that runs out of device memory is reported as OOM (try a smaller --chunk) and the run
goes on. Prints a per-layer table, the full-depth table last, then a RESULTS: block.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import (
    OUTER,
    PLANS,
    WEIGHTS,
    add_common_args,
    each_layer_model,
    kernel_switches,
    parse_ints,
    parse_layers,
    prefill_inputs,
    release,
    setup_of,
    weight_flags,
)
from v4_flash_report import (
    device_name,
    full_depth_from,
    gemm_rate,
    header,
    markdown,
    median_time,
    ms,
    prefill_flops,
    ratio,
    results_block,
    table,
    write_json,
)

SCRIPT = "v4_flash_prefill.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--prompt", help="prompt lengths (default 1024,8192,32768; --tiny: 32,64)")
    ap.add_argument("--chunk", type=int, help="tokens per forward (default 8192; --tiny: 16)")
    ap.add_argument("--kv", default="auto", help="cache.kv_dtype: auto (bf16) or fp8 (packed)")
    ap.add_argument(
        "--experts",
        default="bf16",
        choices=WEIGHTS[:3],
        help="weights as v4_flash_decode.py's: dense, routed experts packed MXFP4, and the FP8 "
        "linears kept FP8",
    )
    ap.add_argument(
        "--unpack-min-tokens",
        type=int,
        help="FP8 cache: chunks from this many tokens unpack the rows first (default: the "
        "attention op's UNPACK_MIN_TOKENS; a large value reads them in the kernel)",
    )
    add_common_args(ap, warmup=1, repeats=3)
    ns = ap.parse_args()
    setup = setup_of(ns)
    if ns.unpack_min_tokens is not None:
        from deepinfer.ops.attention import triton as attention

        attention.UNPACK_MIN_TOKENS = ns.unpack_min_tokens
    kinds = parse_layers(ns.layers)
    prompts = parse_ints(ns.prompt or ("32,64" if ns.tiny else "1024,8192,32768"))
    chunk = ns.chunk or (16 if ns.tiny else 8192)

    rate = gemm_rate(setup)
    print(f"{device_name(setup)}: dense GEMM {rate / 1e12:.1f} TFLOP/s ({setup.dtype})")
    rows: list[dict] = []
    payload = {**header(setup), "script": SCRIPT, "gemm_flops": rate, "rows": rows}

    def measure(kind: str, args, model) -> None:
        for prompt_len in prompts:
            batches, cache = prefill_inputs(args, setup, prompt_len, chunk, ns.seed, kv_dtype=ns.kv)
            row = {"kind": "prefill", "layer": kind, "prompt": prompt_len, "chunk": chunk}
            row["flops"] = prefill_flops(args, kind, 0, prompt_len)  # of one layer

            def prefill(batches=batches, cache=cache) -> None:
                for batch in batches:
                    model(batch, cache)  # plans built on the first run, kept on each batch

            def fresh_prefill(batches=batches, cache=cache) -> None:
                for batch in batches:
                    batch.metadata = None
                    model(batch, cache)

            try:
                seconds = median_time(prefill, setup, max(1, ns.warmup), ns.repeats)
                if kind == OUTER:
                    with_plans = median_time(fresh_prefill, setup, ns.warmup, ns.repeats)
                    rows.append({**row, "layer": PLANS, "model_s": with_plans - seconds})
            except torch.OutOfMemoryError as error:
                print(f"  {kind:5} prompt {prompt_len:6}: OOM ({str(error).splitlines()[0]})")
                seconds = None
            rows.append({**row, "model_s": seconds})
            if seconds is not None:
                print(f"  {kind:5} prompt {prompt_len:6}: {seconds * 1e3:.1f} ms")
            del batches, cache, prefill, fresh_prefill
            release()
        derive(rows, rate, ns.depth)
        write_json(ns.json, payload)

    flags = weight_flags(ns.experts)
    kernels = each_layer_model(
        kinds, ns.depth, ns.backend, setup, ns.seed, measure, **flags,
        switches=kernel_switches(ns),
    )  # fmt: skip
    payload["kernels"] = kernels
    write_json(ns.json, payload)
    report(rows, kinds, prompts, chunk, setup, kernels, rate, ns)


def derive(rows: list[dict], rate: float, depth: int) -> None:
    """Per-layer time (model − outer for the same prompt, / depth; the per-step parts as
    measured), tok/s, FLOPs of one layer, bound and MFU."""
    outer = {r["prompt"]: r["model_s"] for r in rows if r["layer"] == OUTER}
    for r in rows:
        r["layer_s"] = r["model_s"]
        if r["layer"] not in (OUTER, PLANS):
            base = outer.get(r["prompt"])
            r["layer_s"] = None if r["model_s"] is None or base is None else r["model_s"] - base
            r["layer_s"] = ratio(r["layer_s"], depth)
        r["tok_per_s"] = ratio(r["prompt"], r["layer_s"])
        r["bound_s"] = r["flops"] / rate
        r["mfu"] = ratio(r["bound_s"], r["layer_s"]) if r["flops"] else None


def report(rows, kinds, prompts, chunk, setup, kernels, rate, ns) -> None:
    per_layer_headers = ["layer", "prompt", "ms", "tok/s", "GFLOP", "bound ms", "MFU %"]
    per_layer = [
        [
            r["layer"],
            r["prompt"],
            ms(r["layer_s"]),
            r["tok_per_s"],
            r["flops"] / 1e9,
            ms(r["bound_s"]),
            None if r["mfu"] is None else 100 * r["mfu"],
        ]
        for r in rows
    ]
    full_headers = ["prompt", "ms", "tok/s", "TFLOP", "bound ms", "MFU %"]
    full, notes = [], set()
    for prompt_len in prompts:
        seconds = full_depth_from(rows, kinds, "layer_s", notes, prompt=prompt_len)
        flops = full_depth_from(rows, kinds, "flops", notes, prompt=prompt_len)
        bound = None if flops is None else flops / rate
        full.append(
            [
                prompt_len,
                ms(seconds),
                ratio(prompt_len, seconds),
                None if flops is None else flops / 1e12,
                ms(bound),
                None if ratio(bound, seconds) is None else 100 * ratio(bound, seconds),
            ]
        )
    print(f"\nPer layer (measured; chunks of {chunk} tokens; outer = embedding + head):")
    print(table(per_layer_headers, per_layer))
    print("\nFull depth, 21 CSA + 20 HCA + 2 sliding + outer + plans (extrapolated):")
    print(table(full_headers, full))
    notes_text = f" ({'; '.join(sorted(notes))})" if notes else ""
    print()
    print(
        results_block(
            "V4-Flash prefill vs the compute bound, per layer type",
            SCRIPT,
            setup,
            [
                f"Model: one model per layer type ({', '.join(kinds)}; {ns.depth} layer(s) each) "
                f"in V4-Flash shapes{' (--tiny)' if setup.tiny else ''}, random weights, and one "
                f"with no layers (outer). One request, chunks of {chunk} tokens; cache.kv_dtype "
                f"{ns.kv}; weights {ns.experts}. Kernels: "
                f"{kernels}.",
                f"Per layer = (model − outer) / depth, median of {ns.repeats} after {ns.warmup} "
                "warm-up. Bound = FLOPs (2 × active parameters + attention + indexer scores) / "
                f"dense GEMM rate measured in the run ({rate / 1e12:.1f} TFLOP/s); MFU = bound / "
                f"measured. Full depth is extrapolated, not measured{notes_text}.",
            ],
            [markdown(per_layer_headers, per_layer), markdown(full_headers, full)],
        )
    )


if __name__ == "__main__":
    main()
