"""Verification steps of speculative decoding on V4-Flash-shaped layers, and the MTP drafter.

    bash scripts/gpu_bench.sh benchmarks/spec_verify.py [--layers csa,hca,swa] [--batch 1,32]
        [--context 4096] [--drafts 0,1,2,3,4,5] [--tau 1.8,2.5,3.5] [--depth 1] [--graph]
        [--json PATH]
    python3 -P benchmarks/spec_verify.py --tiny   # CPU smoke test: shapes shrunk, 3 repeats

Method. A verification step with k drafts is a decode step in which every request feeds k + 1
tokens (its last token and k drafts) at positions ctx .. ctx + k, with logits at all of them:
B(k + 1) rows (``v4_flash.verify_inputs``; k = 0 is the plain decode step). The models are
v4_flash_decode.py's: one per layer type, ``--depth`` layers of random bf16 weights in V4-Flash
shapes, and one with no layers ("outer": embedding, hyper-connection head, final norm, LM head
over the B(k + 1) rows), built one after the other; a cache of random values where the
context's KV would be (no prefill). The context is a multiple of every ratio, so a step closes
no HCA entry and floor((k + 1) / 4) CSA ones. Each step is timed eager, as the engine runs
verification (and every step while MTP drafts), with CUDA events (the host clock on the CPU),
warm-up then median, the index plans kept on the batch; per layer = (model − outer) / depth.
The plans are timed apart on the outer model with a cache of one layer of each type ("plans" =
plans rebuilt every step − kept) and counted once per step. Full depth = 21 CSA + 20 HCA + 2
sliding + outer + plans, extrapolated from the per-layer figures, not measured. Bound = bytes
/ copy bandwidth measured in the run (experts hit counted from the router): the decode step's
HBM bound at k = 0, a lower bound at k > 0 (KV counted once a request, as its last query's).

MTP drafter: one model with no stack layers and its MTP layer served (``mtp_served=1``:
embedding, the layer's sliding-window block and 256 experts, its hc head and norm, LM head) on
a cache of its window ring. Its passes are built as ``mtp.MtpDrafts`` builds them (window-only
plans, one upload): the commit pass over positions ctx − 1 .. ctx + k of every request (k + 2
tokens: all k drafts accepted, the worst case; logits at each request's last) and a chained pass
of one token a request at ctx + k + 1. mtp(k) = commit + (k − 1) chained, each pass its device
time (batch kept) plus its plans (rebuilt every call − kept). Not timed: the gathers of the
stack's hidden rows, the drafts' argmax and read-back, the sampler and the acceptance check.

Projection, from the measured step costs (not a served run): at acceptance length τ (tokens a
step gains per request), tok/s per user = τ / (verify(k) + mtp(k)) for every k with τ <= k + 1,
against 1 / verify(0) without drafts. --graph also times CUDA-graph replays of every step and
pass (not what the engine runs: its eager steps are host-bound at small batches).

Prints per-layer, full-depth, MTP and projection tables, then a RESULTS: block for RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import (
    FAMILY,
    OUTER,
    PLANS,
    Setup,
    add_common_args,
    build_model,
    config_dict,
    each_layer_model,
    experts_hit,
    kernel_config,
    make_setup,
    new_cache,
    parse_ints,
    parse_layers,
    release,
    verify_inputs,
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

from deepinfer.model.batch import ForwardBatch, SeqSpan, flatten
from deepinfer.model.deepseek_v4.args import ModelArgs
from deepinfer.model.deepseek_v4.plan_inputs import CacheGeometry
from deepinfer.model.families import with_serving_options
from deepinfer.ops import select_kernels

SCRIPT = "spec_verify.py"
MTP = "mtp"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--batch", help="batch sizes (default 1,32; --tiny: 1,4)")
    ap.add_argument("--context", help="context lengths (default 4096; --tiny: 64)")
    ap.add_argument("--drafts", default="0,1,2,3,4,5", help="drafts k per request (0: decode)")
    ap.add_argument("--tau", default="1.8,2.5,3.5", help="acceptance lengths to project at")
    ap.add_argument("--graph", action="store_true", help="also time CUDA-graph replays")
    add_common_args(ap, warmup=3, repeats=10)
    if ap.parse_known_args()[0].tiny:  # a smoke test: fewer timed calls unless asked
        ap.set_defaults(warmup=1, repeats=3)
    ns = ap.parse_args()
    setup = make_setup(ns.tiny)
    kinds = parse_layers(ns.layers)
    batches = parse_ints(ns.batch or ("1,4" if ns.tiny else "1,32"))
    contexts = parse_ints(ns.context or ("64" if ns.tiny else "4096"))
    drafts = sorted(set(parse_ints(ns.drafts)))
    taus = [float(v) for v in ns.tau.split(",") if v.strip()]
    if 0 not in drafts or min(drafts) < 0:
        raise SystemExit(f"--drafts: expected counts >= 0 with 0 (the plain step), got {drafts}")
    if min(contexts) < 1:
        raise SystemExit(f"--context: the MTP commit starts at ctx - 1, got {contexts}")

    bandwidth = copy_bandwidth(setup)
    print(f"{device_name(setup)}: copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)")
    rows: list[dict] = []
    mtp_rows: list[dict] = []
    payload = {
        **header(setup),
        "script": SCRIPT,
        "bandwidth_Bps": bandwidth,
        "rows": rows,
        "mtp_rows": mtp_rows,
    }
    no_graph: set[str] = set()

    def measure(kind: str, args, model) -> None:
        for context, batch_size, k in itertools.product(contexts, batches, drafts):
            batch, cache = verify_inputs(args, setup, batch_size, context, k + 1, ns.seed)
            row = {"layer": kind, "batch": batch_size, "context": context, "drafts": k}

            def step(batch=batch, cache=cache) -> object:
                return model(batch, cache)  # plans built on the first call, kept on batch

            def fresh_step(batch=batch, cache=cache) -> object:
                batch.metadata = None
                return model(batch, cache)

            eager, graph = time_step(step, setup, ns, kind, no_graph)
            hit, num_rows = 0.0, batch_size * (k + 1)
            if kind == OUTER:
                rebuilt = median_time(fresh_step, setup, ns.warmup, ns.repeats)
                plans = {"model_s": rebuilt - eager, "graph_model_s": None, "bytes": 0}
                rows.append({**row, "layer": PLANS, "experts_hit": 0, **plans})
            else:
                counts = experts_hit(model, step)
                hit = statistics.mean(counts) if counts else expected_experts_hit(args, num_rows)
            row.update(
                model_s=eager,
                graph_model_s=graph,
                experts_hit=hit,
                bytes=decode_bytes(
                    args,
                    kind,
                    num_rows if kind == OUTER else batch_size,
                    context + k,
                    hit,
                    setup.dtype,
                ),
            )
            rows.append(row)
            shown = "" if graph is None else f", graph {graph * 1e3:.3f} ms"
            print(
                f"  {kind:5} batch {batch_size:4} ctx {context:6} k {k}: "
                f"{eager * 1e3:.3f} ms{shown}"
            )
            del batch, cache, step, fresh_step
            release()
        derive(rows, bandwidth, ns.depth)
        write_json(ns.json, payload)

    kernels = each_layer_model(kinds, ns.depth, ns.backend, setup, ns.seed, measure)
    payload["kernels"] = kernels
    measure_mtp(ns, setup, contexts, batches, [k for k in drafts if k], mtp_rows, no_graph)
    write_json(ns.json, payload)
    report(rows, mtp_rows, kinds, batches, contexts, drafts, taus, setup, kernels, bandwidth, ns)


def time_step(
    step: Callable[[], object], setup: Setup, ns: argparse.Namespace, name: str, no_graph: set
) -> tuple[float, float | None]:
    """Eager median seconds of ``step`` and, with --graph, of its CUDA-graph replays (None once
    a capture of model ``name`` has failed: printed the first time, eager only after)."""
    eager = median_time(step, setup, max(1, ns.warmup), ns.repeats)
    if not ns.graph or name in no_graph:
        return eager, None
    graph, why = graph_time(step, setup, ns.warmup, ns.repeats)
    if graph is None:
        print(f"  {name}: no CUDA graph, eager only: {why}")
        no_graph.add(name)
    return eager, graph


def derive(rows: list[dict], bandwidth: float, depth: int) -> None:
    """Per-layer times (model − outer on the same batch, context and drafts, / depth) and
    bounds; the per-step parts (outer, plans) as measured."""
    key = ("batch", "context", "drafts")
    outer = {tuple(r[k] for k in key): r for r in rows if r["layer"] == OUTER}
    for r in rows:
        r["layer_s"], r["layer_graph_s"] = r["model_s"], r["graph_model_s"]
        base = outer[tuple(r[k] for k in key)]
        if r["layer"] not in (OUTER, PLANS):
            r["layer_s"] = (r["model_s"] - base["model_s"]) / depth
            graphs = (r["graph_model_s"], base["graph_model_s"])
            r["layer_graph_s"] = None if None in graphs else (graphs[0] - graphs[1]) / depth
        r["bound_s"] = r["bytes"] / bandwidth


# ---- the MTP drafter -------------------------------------------------------------------------


def mtp_args(tiny: bool) -> ModelArgs:
    """No stack layers and one MTP layer, served as speculative.method = "mtp" serves it."""
    config = {**config_dict([], tiny), "num_nextn_predict_layers": 1}
    args = FAMILY.parse_args(config)
    return with_serving_options(args, yoco_truncation="off", yoco_keep_tokens=0, mtp_layers=1)


def mtp_batch(
    setup: Setup,
    geometry: CacheGeometry,
    seqs: list[SeqSpan],
    token_ids: list[int],
    logits_indices: list[int],
) -> ForwardBatch:
    """An MTP pass's batch as ``MtpDrafts`` builds it: the window-only plans and the tokens in
    one upload (a plain copy here; the runner's pinned staging there)."""
    host = FAMILY.step_arrays(seqs, token_ids, logits_indices, geometry)
    flat = torch.from_numpy(flatten(host)).to(setup.device)
    return FAMILY.batch_views(flat, host, seqs, geometry)


def mtp_passes(batch_size: int, context: int, k: int) -> dict[str, tuple[list[SeqSpan], list[int]]]:
    """The spans and logits rows of one step's MTP passes after a verification of k drafts at
    ctx .. ctx + k, all accepted: the commit over ctx - 1 .. ctx + k (k + 2 tokens a request,
    logits at its last) and a chained pass of one token a request at ctx + k + 1."""
    n = k + 2
    commit = [SeqSpan(i * n, n, context - 1, i, []) for i in range(batch_size)]
    chained = [SeqSpan(i, 1, context + k + 1, i, []) for i in range(batch_size)]
    return {
        "commit": (commit, [s.offset + n - 1 for s in commit]),
        "chained": (chained, list(range(batch_size))),
    }


def measure_mtp(
    ns: argparse.Namespace,
    setup: Setup,
    contexts: list[int],
    batches: list[int],
    drafts: list[int],
    mtp_rows: list[dict],
    no_graph: set,
) -> None:
    """Each pass of the MTP layer, per context, batch and k >= 1 (``mtp_rows``)."""
    args = mtp_args(setup.tiny)
    kernels = select_kernels(kernel_config(ns.backend), setup.device)
    model = build_model(args, kernels, setup, ns.seed)
    gen = torch.Generator().manual_seed(ns.seed)
    for context, batch_size, k in itertools.product(contexts, batches, drafts):
        cache = new_cache(args, setup, batch_size, context + k + 2, ns.seed)
        # The engine's MTP geometry: the stack's cache without its compression ratios.
        geometry = dataclasses.replace(FAMILY.geometry(args, cache), ratios=(), dense_ratios=())
        for name, (seqs, logits_rows) in mtp_passes(batch_size, context, k).items():
            num_tokens = sum(s.num_tokens for s in seqs)
            token_ids = torch.randint(3, args.vocab_size, (num_tokens,), generator=gen).tolist()
            hidden = torch.randn(num_tokens, args.hc_mult, args.hidden_size, generator=gen)
            hidden = hidden.to(setup.device, setup.dtype)  # [T, hc, D] the stack's streams
            batch = mtp_batch(setup, geometry, seqs, token_ids, logits_rows)

            def step(hidden=hidden, batch=batch, cache=cache) -> object:
                return model.mtp_forward(hidden, batch, cache)  # plans kept

            plan = (geometry, seqs, token_ids, logits_rows)

            def fresh_step(hidden=hidden, cache=cache, plan=plan) -> object:
                return model.mtp_forward(hidden, mtp_batch(setup, *plan), cache)  # plans rebuilt

            eager, graph = time_step(step, setup, ns, MTP, no_graph)
            rebuilt = median_time(fresh_step, setup, ns.warmup, ns.repeats)
            hits = experts_hit(model, step)
            hit = statistics.mean(hits) if hits else expected_experts_hit(args, num_tokens)
            row = {
                "layer": MTP,
                "pass": name,
                "batch": batch_size,
                "context": context,
                "drafts": k,
                "tokens": num_tokens,
                "model_s": eager,
                "graph_model_s": graph,
                "plans_s": rebuilt - eager,
                "experts_hit": hit,
            }
            mtp_rows.append(row)
            shown = "" if graph is None else f", graph {graph * 1e3:.3f} ms"
            print(
                f"  mtp {name:7} batch {batch_size:4} ctx {context:6} k {k}: "
                f"{eager * 1e3:.3f} ms + plans {row['plans_s'] * 1e3:.3f} ms{shown}"
            )
            del batch, hidden, step, fresh_step
        del cache
        release()


def mtp_cost(mtp_rows: list[dict], field: str, **match: int) -> float | None:
    """mtp(k) = commit + (k - 1) chained, each pass ``field`` + its plans; 0 without drafts,
    None where a pass lacks the figure."""
    k = match["drafts"]
    if k == 0:
        return 0.0
    passes = {r["pass"]: r for r in mtp_rows if all(r[n] == v for n, v in match.items())}
    figures = [passes.get(p, {}).get(field) for p in ("commit", "chained")]
    if None in figures:
        return None
    commit, chained = (
        f + passes[p]["plans_s"] for f, p in zip(figures, ("commit", "chained"), strict=True)
    )
    return commit + (k - 1) * chained


# ---- reporting -------------------------------------------------------------------------------

PER_LAYER_HEADERS = [
    "layer",
    "batch",
    "ctx",
    "k",
    "tokens",
    "eager ms",
    "vs k=0",
    "graph ms",
    "experts hit",
    "MB read",
    "bound ms",
    "eager/bound",
]
FULL_HEADERS = [
    "batch",
    "ctx",
    "k",
    "tokens",
    "eager ms",
    "eager / k=0",
    "graph ms",
    "graph / k=0",
    "bound ms",
]
MTP_HEADERS = [
    "batch",
    "ctx",
    "k",
    "commit tokens",
    "commit ms",
    "commit plans ms",
    "chained ms",
    "chained plans ms",
    "experts hit (commit)",
    "mtp(k) ms",
    "mtp(k) / verify(k)",
    "mtp(k) graph ms",
]
PROJECTION_HEADERS = [
    "batch",
    "ctx",
    "τ",
    "k",
    "step ms",
    "tok/s per user",
    "× no drafts",
    "graph step ms",
    "graph tok/s per user",
    "graph × no drafts",
]

Figures = dict[tuple[int, int, int], dict[str, float | None]]  # (ctx, batch, k) -> by name


def full_depth_figures(
    rows: list[dict],
    mtp_rows: list[dict],
    kinds: list[str],
    contexts: list[int],
    batches: list[int],
    drafts: list[int],
    notes: set[str],
) -> Figures:
    """Per (ctx, batch, k): the full-depth verification step (eager, graph, bound;
    extrapolated) and the MTP drafter's cost (eager, graph; measured)."""
    fields = {"eager": "layer_s", "graph": "layer_graph_s", "bound": "bound_s"}
    full: Figures = {}
    for context, batch_size, k in itertools.product(contexts, batches, drafts):
        match = {"batch": batch_size, "context": context, "drafts": k}
        figures = {n: full_depth_from(rows, kinds, f, notes, **match) for n, f in fields.items()}
        figures["mtp"] = mtp_cost(mtp_rows, "model_s", **match)
        figures["mtp_graph"] = mtp_cost(mtp_rows, "graph_model_s", **match)
        full[context, batch_size, k] = figures
    return full


def per_layer_table(rows: list[dict]) -> list[list]:
    at_k0 = {(r["layer"], r["batch"], r["context"]): r for r in rows if r["drafts"] == 0}
    return [
        [
            r["layer"],
            r["batch"],
            r["context"],
            r["drafts"],
            r["batch"] * (r["drafts"] + 1),
            ms(r["layer_s"]),
            ratio(r["layer_s"], at_k0[r["layer"], r["batch"], r["context"]]["layer_s"]),
            ms(r["layer_graph_s"]),
            None if r["layer"] in (OUTER, PLANS) else r["experts_hit"],
            r["bytes"] / 1e6,
            ms(r["bound_s"]),
            None if r["layer"] == PLANS else ratio(r["layer_s"], r["bound_s"]),
        ]
        for r in rows
    ]


def by_k_table(rows: list[dict], drafts: list[int], field: str) -> tuple[list[str], list[list]]:
    """``field`` in ms per layer type, batch and context (rows) and k (columns)."""
    cells = {(r["layer"], r["batch"], r["context"], r["drafts"]): r[field] for r in rows}
    keys = dict.fromkeys((layer, b, c) for layer, b, c, _ in cells)
    body = [[*key, *(ms(cells.get((*key, k))) for k in drafts)] for key in keys]
    return ["layer", "batch", "ctx", *(f"k={k} ms" for k in drafts)], body


def full_table(full: Figures) -> list[list]:
    out = []
    for (context, batch_size, k), f in full.items():
        f0 = full[context, batch_size, 0]
        out.append(
            [
                batch_size,
                context,
                k,
                batch_size * (k + 1),
                ms(f["eager"]),
                ratio(f["eager"], f0["eager"]),
                ms(f["graph"]),
                ratio(f["graph"], f0["graph"]),
                ms(f["bound"]),
            ]
        )
    return out


def mtp_table(mtp_rows: list[dict], full: Figures) -> list[list]:
    out = []
    for (context, batch_size, k), f in full.items():
        passes = {
            r["pass"]: r
            for r in mtp_rows
            if (r["context"], r["batch"], r["drafts"]) == (context, batch_size, k)
        }
        if set(passes) != {"commit", "chained"}:
            continue
        commit, chained = passes["commit"], passes["chained"]
        out.append(
            [
                batch_size,
                context,
                k,
                commit["tokens"],
                ms(commit["model_s"]),
                ms(commit["plans_s"]),
                ms(chained["model_s"]),
                ms(chained["plans_s"]),
                commit["experts_hit"],
                ms(f["mtp"]),
                ratio(f["mtp"], f["eager"]),
                ms(f["mtp_graph"]),
            ]
        )
    return out


def projection_table(full: Figures, taus: list[float]) -> tuple[list[list], list[str]]:
    """Tokens/s per user at each acceptance length τ and every k with τ <= k + 1, after a k = 0
    row (no drafts) per batch and context; and a line per τ naming the best k (eager)."""
    out, best_lines = [], []
    for context, batch_size in dict.fromkeys((c, b) for c, b, _ in full):
        f0 = full[context, batch_size, 0]
        plain, plain_graph = ratio(1.0, f0["eager"]), ratio(1.0, f0["graph"])
        out.append(
            [
                batch_size,
                context,
                1.0,
                0,
                ms(f0["eager"]),
                plain,
                1.0,
                ms(f0["graph"]),
                plain_graph,
                None if plain_graph is None else 1.0,
            ]
        )
        for tau in taus:
            best: tuple[float, int] | None = None
            for (c, b, k), f in full.items():
                if (c, b) != (context, batch_size) or k == 0 or tau > k + 1:
                    continue
                eager, graph = add(f["eager"], f["mtp"]), add(f["graph"], f["mtp_graph"])
                tok_s, tok_s_graph = ratio(tau, eager), ratio(tau, graph)
                out.append(
                    [
                        batch_size,
                        context,
                        tau,
                        k,
                        ms(eager),
                        tok_s,
                        ratio(tok_s, plain),
                        ms(graph),
                        tok_s_graph,
                        ratio(tok_s_graph, plain_graph),
                    ]
                )
                if tok_s is not None and (best is None or tok_s > best[0]):
                    best = (tok_s, k)
            if best is not None and plain is not None:
                best_lines.append(
                    f"batch {batch_size}, ctx {context}, τ {tau}: best k = {best[1]}, "
                    f"{best[0]:.1f} tok/s per user against {plain:.1f} without drafts "
                    f"({best[0] / plain:.2f}x; projected, eager)"
                )
    return out, best_lines


def report(
    rows: list[dict],
    mtp_rows: list[dict],
    kinds: list[str],
    batches: list[int],
    contexts: list[int],
    drafts: list[int],
    taus: list[float],
    setup: Setup,
    kernels: str,
    bandwidth: float,
    ns: argparse.Namespace,
) -> None:
    notes: set[str] = set()
    full = full_depth_figures(rows, mtp_rows, kinds, contexts, batches, drafts, notes)
    projection, best_lines = projection_table(full, taus)
    tables = {
        "Per layer, eager ms by drafts k (measured; k + 1 tokens a request):": by_k_table(
            rows, drafts, "layer_s"
        ),
    }
    if ns.graph:
        tables["Per layer, CUDA-graph replay ms by drafts k (measured):"] = by_k_table(
            rows, drafts, "layer_graph_s"
        )
    tables |= {
        "Per layer (measured; outer = embedding + hc head + norm + LM head over B(k + 1) rows, "
        "per step; plans = the step's index plans, per step):": (
            PER_LAYER_HEADERS,
            per_layer_table(rows),
        ),
        "Full-depth verification step, 21 CSA + 20 HCA + 2 sliding + outer + plans "
        "(extrapolated):": (FULL_HEADERS, full_table(full)),
        "MTP drafter per step (measured: the MTP layer + embedding + LM head; mtp(k) = commit + "
        "(k − 1) chained, plans included):": (MTP_HEADERS, mtp_table(mtp_rows, full)),
        "Tokens/s per user, projected from the step costs above: τ / (verify(k) + mtp(k)), "
        "full depth extrapolated; the k = 0 row is the step without drafts:": (
            PROJECTION_HEADERS,
            projection,
        ),
    }
    for title, (headers, body) in tables.items():
        print(f"\n{title}")
        print(table(headers, body))
    for line in best_lines:
        print(line)
    for context, batch_size in itertools.product(contexts, batches):
        f0 = full[context, batch_size, 0]
        if f0["bound"] and f0["eager"]:
            print(
                f"batch {batch_size}, ctx {context}: decode step without drafts "
                f"{f0['eager'] * 1e3:.2f} ms eager, HBM bound {f0['bound'] * 1e3:.2f} ms = "
                f"{1 / f0['bound']:.1f} tok/s per user at most (full depth, extrapolated)"
            )
    notes_text = f" ({'; '.join(sorted(notes))})" if notes else ""
    print()
    print(
        results_block(
            "speculative verification steps and the MTP drafter, V4-Flash shapes",
            SCRIPT,
            setup,
            [
                f"Model: one model per layer type ({', '.join(kinds)}; {ns.depth} layer(s) each) "
                f"in V4-Flash shapes{' (--tiny)' if setup.tiny else ''}, random weights, "
                "one with no layers (outer) and one with only the MTP layer served; no "
                f"prefill: the cache holds random values for the context. Kernels: {kernels}.",
                "Verification step with k drafts: k + 1 tokens a request, logits at all of them; "
                f"eager (as the engine runs it), median of {ns.repeats} after {ns.warmup} "
                "warm-up. Per layer = (model − outer) / depth; full depth is extrapolated, not "
                f"measured{notes_text}. Bound = bytes / copy bandwidth measured in the run "
                f"({bandwidth / 1e12:.3f} TB/s), a lower bound for k > 0.",
                "MTP: a commit pass of k + 2 tokens a request (all drafts accepted) + (k − 1) "
                "chained passes of one, each with its host plans. Tokens/s per user at "
                "acceptance length τ is projected from these step costs, not served.",
            ],
            [markdown(headers, body) for headers, body in tables.values()],
        )
    )


def add(a: float | None, b: float | None) -> float | None:
    """a + b, None where either is missing."""
    return None if a is None or b is None else a + b


if __name__ == "__main__":
    main()
