"""Decode step time of V4-Flash-shaped layers against the HBM bound, per layer type.

    bash scripts/gpu_bench.sh benchmarks/v4_flash_decode.py [--layers csa,hca,swa]
        [--batch 1,8,32,128,256] [--context 4096,32768] [--backend auto] [--graph]
        [--json PATH]
    python benchmarks/v4_flash_decode.py --tiny          # CPU smoke test, every shape shrunk

Method. One model per layer type, each holding ``--depth`` (default 1) layers of that type with
random bf16 weights in V4-Flash shapes, built one after the other and freed in between (a layer
holds ~13.5 GB, mostly its 256 routed experts), plus one model with no layers ("outer": the
embedding, hyper-connection head, final norm and LM head, and the per-forward RoPE tables). A step
is ``model(ForwardBatch, KVCache)`` on a cache that holds random values where the context's KV
would be (no prefill: ``v4_flash.decode_inputs``). Each step is timed with CUDA events, warm-up
then median. Per-layer time = (model − outer) / depth on the same batch and context: the outer
model runs the same embed/norm/head modules, so the difference is the layers. One model per type
keeps memory to one layer at a time and gives each type its own measurement, instead of
differences between [csa], [csa, hca], ... models, which pile up the noise of several runs.

The step's index plans (``ForwardBatch.metadata``, built on the host once per step and shared by
every layer) are built on the warm-up call and kept on the batch, so the timed steps are the
device forward. Building them is timed apart, as a per-step part ("plans" = outer model with the
plans rebuilt every step − outer model with them kept, on a cache with one layer of each type:
a full model's plans), and counted once in the full-depth figure, not once per layer.

Memory bound = bytes the step must read / copy bandwidth measured in the same run. Per layer:
every weight except the routed experts, the routed experts hit (distinct ids the router picked
in the timed step's inputs, counted through a forward hook; E(1-(1-k/E)^B) when no router reports)
and the KV that attention reads (window 127 ring rows of 512; CSA top-512 entries of 512 and
all ctx/4 indexer keys of 128; HCA ctx/128 entries of 512). The sliding-only layer is measured
like the others. Full depth = 21 CSA + 20 HCA + 2 sliding + outer + plans, extrapolated from
the per-layer figures, not measured; at batch 1 its bound is the per-user speed ceiling.

--graph: after the eager timing, capture one step in a CUDA graph (warm-up on a side stream, as
torch's docs say) and time replays. The graphed step has the plans a decode graph of the engine
replays (``cuda_graphs.context_bucket``: the entry lists padded to the context bucket, every
request's candidate windows pooled, whether or not they close), not the eager step's. The eager
path may sync with the host (then the capture fails): the exception is printed once per model
and that model stays eager.

Prints a per-layer table, the full-depth table last, then a RESULTS: block for RESULTS.md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import (
    OUTER,
    PLANS,
    WEIGHTS,
    add_common_args,
    decode_inputs,
    each_layer_model,
    experts_hit,
    graph_plans,
    kernel_switches,
    parse_ints,
    parse_layers,
    release,
    setup_of,
    weight_flags,
)
from v4_flash_report import (
    copy_bandwidth,
    decode_bytes,
    device_name,
    expected_experts_hit,
    full_depth_from,
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

SCRIPT = "v4_flash_decode.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--batch", help="batch sizes (default 1,8,32,128,256; --tiny: 1,4)")
    ap.add_argument("--context", help="context lengths (default 4096,32768; --tiny: 64)")
    ap.add_argument("--graph", action="store_true", help="also time CUDA-graph replays")
    ap.add_argument(
        "--experts",
        default="bf16",
        help="weights: bf16 (dense), fp4 (routed experts packed MXFP4), fp4-fp8 (and the "
        "linears the checkpoint ships FP8 kept FP8), fp4-fp8-kv8 (and the FP8 KV cache, "
        "cache.kv_dtype = fp8), e.g. bf16,fp4,fp4-fp8",
    )
    add_common_args(ap, warmup=2, repeats=5)
    ns = ap.parse_args()
    setup = setup_of(ns)
    kinds = parse_layers(ns.layers)
    batches = parse_ints(ns.batch or ("1,4" if ns.tiny else "1,8,32,128,256"))
    contexts = parse_ints(ns.context or ("64" if ns.tiny else "4096,32768"))
    variants = [v.strip() for v in ns.experts.split(",") if v.strip()]
    if not variants or set(variants) - set(WEIGHTS):
        raise SystemExit(f"--experts: expected some of {WEIGHTS}, got {ns.experts!r}")

    bandwidth = copy_bandwidth(setup)
    print(f"{device_name(setup)}: copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)")
    rows: list[dict] = []
    payload = {**header(setup), "script": SCRIPT, "bandwidth_Bps": bandwidth, "rows": rows}

    variant = variants[0]

    def measure(kind: str, args, model) -> None:
        use_graph = ns.graph
        for context in contexts:
            for batch_size in batches:
                kv_dtype = "fp8" if variant.endswith("kv8") else "auto"
                batch, cache = decode_inputs(
                    args, setup, batch_size, context, ns.seed, kv_dtype=kv_dtype
                )
                row = {
                    "kind": "decode",
                    "layer": kind,
                    "experts": variant,
                    "batch": batch_size,
                    "context": context,
                }

                def step(batch=batch, cache=cache) -> object:
                    return model(batch, cache)  # plans built on the first call, kept on batch

                def fresh_step(batch=batch, cache=cache) -> object:
                    batch.metadata = None
                    return model(batch, cache)

                eager = median_time(step, setup, max(1, ns.warmup), ns.repeats)
                graph = None
                if use_graph:
                    graph_plans(batch, cache)
                    graph, why = graph_time(step, setup, ns.warmup, ns.repeats)
                    if graph is None:
                        print(f"  {kind}: no CUDA graph, eager only: {why}")
                        use_graph = False
                hit, counted = 0.0, True
                if kind == OUTER:
                    with_plans = median_time(fresh_step, setup, ns.warmup, ns.repeats)
                    plans = {"model_s": with_plans - eager, "graph_model_s": None, "bytes": 0}
                    rows.append({**row, "layer": PLANS, "experts_hit": 0, **plans})
                else:
                    counts = experts_hit(model, step)
                    counted = bool(counts)
                    hit = (
                        statistics.mean(counts)
                        if counts
                        else expected_experts_hit(args, batch_size)
                    )
                row.update(
                    model_s=eager,
                    graph_model_s=graph,
                    experts_hit=hit,
                    experts_counted=counted,
                    bytes=decode_bytes(
                        args,
                        kind,
                        batch_size,
                        context,
                        hit,
                        setup.dtype,
                        **weight_flags(variant),
                        kv_fp8=variant.endswith("kv8"),
                    ),
                )
                rows.append(row)
                shown = "" if graph is None else f", graph {graph * 1e3:.3f} ms"
                print(
                    f"  {kind:5} batch {batch_size:4} ctx {context:6}: {eager * 1e3:.3f} ms{shown}"
                )
                del batch, cache, step, fresh_step
                release()
        derive(rows, bandwidth, ns.depth)
        write_json(ns.json, payload)

    for variant in variants:  # measure() reads the variant being built
        flags = weight_flags(variant)
        kernels = each_layer_model(
            kinds, ns.depth, ns.backend, setup, ns.seed, measure, **flags,
            switches=kernel_switches(ns),
        )  # fmt: skip
    payload["kernels"] = kernels
    write_json(ns.json, payload)
    report(rows, kinds, batches, contexts, variants, setup, kernels, bandwidth, ns)


def derive(rows: list[dict], bandwidth: float, depth: int) -> None:
    """Per-layer times (model − outer on the same batch and context, / depth) and bounds; the
    per-step parts (outer, plans) as measured."""
    outer = {(r["batch"], r["context"], r["experts"]): r for r in rows if r["layer"] == OUTER}
    for r in rows:
        r["layer_s"], r["layer_graph_s"] = r["model_s"], r["graph_model_s"]
        base = outer[r["batch"], r["context"], r["experts"]]
        if r["layer"] not in (OUTER, PLANS):
            r["layer_s"] = (r["model_s"] - base["model_s"]) / depth
            if r["graph_model_s"] is not None and base["graph_model_s"] is not None:
                r["layer_graph_s"] = (r["graph_model_s"] - base["graph_model_s"]) / depth
            else:
                r["layer_graph_s"] = None
        r["bound_s"] = r["bytes"] / bandwidth


def report(rows, kinds, batches, contexts, variants, setup, kernels, bandwidth, ns) -> None:
    per_layer_headers = (
        "layer|experts|batch|ctx|eager ms|graph ms|experts hit|MB read|bound ms|eager/bound"
    )
    per_layer = [
        [
            r["layer"],
            r["experts"],
            r["batch"],
            r["context"],
            ms(r["layer_s"]),
            ms(r["layer_graph_s"]),
            None if r["layer"] in (OUTER, PLANS) else r["experts_hit"],
            r["bytes"] / 1e6,
            ms(r["bound_s"]),
            ratio(r["layer_s"], r["bound_s"]),
        ]
        for r in rows
    ]
    full_headers = "experts|batch|ctx|eager ms|graph ms|bound ms|eager/bound|tok/s eager|" + (
        "tok/s graph|tok/s bound"
    )
    full, notes = [], set()
    for variant, context, batch_size in itertools.product(variants, contexts, batches):
        eager, graph, bound = (
            full_depth_from(
                rows, kinds, field, notes, batch=batch_size, context=context, experts=variant
            )
            for field in ("layer_s", "layer_graph_s", "bound_s")
        )
        full.append(
            [
                variant,
                batch_size,
                context,
                ms(eager),
                ms(graph),
                ms(bound),
                ratio(eager, bound),
                ratio(batch_size, eager),
                ratio(batch_size, graph),
                ratio(batch_size, bound),
            ]
        )
    print("\nPer layer (measured; outer = embedding + hc head + norm + LM head, per step):")
    print(table(per_layer_headers.split("|"), per_layer))
    print("\nFull depth, 21 CSA + 20 HCA + 2 sliding + outer + plans (extrapolated):")
    print(table(full_headers.split("|"), full))
    for row in full:
        if row[1] == 1 and row[7] is not None and row[9] is not None:
            print(
                f"{row[0]} experts, batch 1, ctx {row[2]}: per-user ceiling {row[9]:.1f} tok/s "
                f"(HBM bound), measured {row[7]:.1f} tok/s eager = {100 * row[7] / row[9]:.1f}% "
                "of it"
            )
    counted = all(r.get("experts_counted", True) for r in rows)
    hits = "counted from the router" if counted else "from E(1-(1-k/E)^B)"
    notes_text = f" ({'; '.join(sorted(notes))})" if notes else ""
    print()
    print(
        results_block(
            "V4-Flash decode step vs the HBM bound, per layer type",
            SCRIPT,
            setup,
            [
                f"Model: one model per layer type ({', '.join(kinds)}; {ns.depth} layer(s) each) "
                f"in V4-Flash shapes{' (--tiny)' if setup.tiny else ''}, random weights, and one "
                "with no layers (outer); no prefill: the cache holds random values for the "
                f"context. Kernels: {kernels}.",
                f"Per layer = (model − outer) / depth, median of {ns.repeats} after {ns.warmup} "
                f"warm-up. Bound = bytes / copy bandwidth measured in the run "
                f"({bandwidth / 1e12:.3f} TB/s); experts hit {hits}. Full depth is "
                f"extrapolated, not measured{notes_text}.",
            ],
            [
                markdown(per_layer_headers.split("|"), per_layer),
                markdown(full_headers.split("|"), full),
            ],
        )
    )


if __name__ == "__main__":
    main()
