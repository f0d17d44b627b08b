"""DSpark drafting and verify steps on DeepSeek-V4.1-Flash shapes; fixed vs confidence schedule.

    bash scripts/gpu_bench.sh benchmarks/dspark_verify.py [--batch 1,32] [--context 4096]
        [--tau 3.5] [--mix 1.5,2.5,4.5,5.5] [--graph] [--repeats 10] [--json PATH]
    python3 -P benchmarks/dspark_verify.py --tiny   # CPU smoke test: shapes shrunk, 3 repeats

Shapes: v41_flash.py's (the reported V4.1-Flash hyper-parameters, unverified; random weights,
routed experts packed FP4, no engram) and the drafter of DeepInfer's notes (§2.1, §4): 3 DSpark
layers (sliding window, 128 experts of their own, top-3), block 5, Markov rank 256, noise token
128799 (--tiny: 4 experts top-2, rank 8, token 4).

Method. A verification step with L drafts (L = 0 .. 5; 0 is the plain decode step): each of B
requests feeds L + 1 tokens at positions ctx .. ctx + L, logits at all (``verify_inputs``), on
a cache of random values (no prefill). Per layer kind as v41_flash.py measures it (the model
with it − the model without it; "outer": the model with no layers), each step eager and, with
--graph, as CUDA-graph replays (what the engine runs for decode and verify steps); CUDA events
(the host clock on the CPU), median of --repeats after --warmup, plans kept on the batch;
"plans" = the outer model's step with its plans rebuilt − kept (host work, added to both).
Full depth = 2 swa + 3 c2 + 15 c2_shared + 1 c1 + 4 c1_index + 15 c1_shared + outer + plans,
extrapolated, not measured; "served" adds the main-key write.

Drafter: 3 sliding-window layers (the targets, dspark_target_layer_ids [0, 1, 2]: one side of
the YoCo boundary, as the release's [37, 38, 39]) and the 3 DSpark layers, built served (the
cache has their rings) and not served on the same weights. Main-key write = served − unserved
forward of the same step (stream means, main_proj + main_norm, each layer's wkv + kv_norm +
RoPE, ring writes), and ``_write_main_keys`` alone as a check. Drafting pass =
``DSparkDrafts.run`` after a decode step, eager as the engine runs it (the block plans in one
upload, ``dspark_forward`` over B x 5 rows, the Markov / confidence loop, the read-back); also
``dspark_forward`` alone. Bounds = bytes / copy bandwidth measured in the run. Verify step:
weights but routed experts, the experts the routers hit (FP4), KV read once a request (a lower
bound for L > 0), the LM head. Pass: the same of its 3 layers, the 128 main keys a request and
layer, the LM and Markov heads. Write: its weights, features read, keys written.

Projection (from these step costs, not a served run): step = served verify(T) + pass, T the
step's tokens, verify interpolated linearly between the measured T = B(L + 1) (graph replays
with --graph, else eager). A request accepts each draft with a conditional rate a: "const", all
with 1 + a + .. + a^5 = --tau; "mix", requests cycling through the --mix acceptance lengths.
Confidence head calibrated (confidence = a): verifying k drafts gains 1 + a + .. + a^k tokens.
Modes: no drafts (the plain step, unserved, no pass); fixed 5; confidence (the engine's
``ConfidenceSchedule``), its step cost either "line" (cost_tokens = (intercept + pass) / slope
of the least-squares line of served verify time against T at that batch) or "curve" (the
measured verify + pass points, speculative.verify_cost_curve). Steps run T tokens (graphs per
token count: a what-if) or, with --graph, "graph rows": every request runs the rows of the
smallest graph that holds the step's longest request (DecodeGraphs' row buckets: 1, 2, 4, 6 a
request) and the schedule knows it (as the engine's does with graphs). Tok/s per user = tokens
a request gains per step / step time, mean over requests. Not timed: sampling, acceptance,
scheduling.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import (
    Setup,
    describe_kernels,
    experts_hit,
    kernel_config,
    make_setup,
    parse_ints,
    release,
    verify_inputs,
)
from v4_flash_report import (
    copy_bandwidth,
    device_name,
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
from v41_flash import (
    FAMILY,
    FULL_DEPTH,
    MODELS,
    args_of,
    build,
    config,
    decode_bytes,
    kind_costs,
    outer_cache_args,
)

from deepinfer.engine.cuda_graphs import row_buckets
from deepinfer.engine.staging import PinnedStaging
from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch
from deepinfer.model.deepseek_v41.args import ModelArgs
from deepinfer.model.deepseek_v41.dspark import Block, DSparkDrafts
from deepinfer.model.deepseek_v41.model import CrossLayer, DeepseekV41
from deepinfer.model.families import with_serving_options
from deepinfer.model.layers import use_mxfp4_experts
from deepinfer.ops import Kernels, select_kernels
from deepinfer.scheduler.drafts import ConfidenceSchedule

SCRIPT = "dspark_verify.py"
OUTER, PLANS = "outer", "plans"
BLOCK = 5  # dspark_block_size: the drafts of a step, so L = 0 .. BLOCK
DRAFTS = range(BLOCK + 1)
TARGETS = [0, 1, 2]  # dspark_target_layer_ids: the 3 layers of the drafter's model
DSPARK = {
    "num_nextn_predict_layers": 3,
    "dspark_block_size": BLOCK,
    "dspark_target_layer_ids": TARGETS,
    "dspark_markov_rank": 256,
    "dspark_noise_token_id": 128799,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
}
TINY = {"dspark_markov_rank": 8, "dspark_noise_token_id": 4}
TINY |= {"dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2}
Times = dict[tuple[str, int, int], dict[str, float]]  # (part, batch, L) -> seconds by mode
Table = tuple[list[str], list[list]]


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """What ``DSparkDrafts.run`` reads of a scheduled request: a decode step of one token."""

    request_id: str
    start_pos: int
    state_slot: int
    do_sample: bool = True
    num_draft_tokens: int = 0
    window_floor: int = 0
    num_tokens: int = 1


def timed(fn: Callable[[], object], setup: Setup, ns: argparse.Namespace) -> dict[str, float]:
    """Median seconds of ``fn``: eager and, with --graph, CUDA-graph replays."""
    out = {"eager": median_time(fn, setup, *ns.timing)}
    if ns.graph:
        graph, why = graph_time(fn, setup, ns.warmup, ns.repeats)
        if graph is None:
            raise SystemExit(f"no CUDA graph: {why}")
        out["graph"] = graph
    return out


def rebuilt(model: torch.nn.Module, batch: ForwardBatch, cache: KVCache) -> object:
    """The step with its plans built again (kept on the batch otherwise)."""
    batch.metadata = None
    return model(batch, cache)


def measure_kinds(
    ns: argparse.Namespace, setup: Setup, kernels: Kernels, times: Times, hits: dict, costs: dict
) -> None:
    """v41_flash.py's models one after the other: a verify step of every batch and L on each."""
    needed = sorted({m for pair in MODELS.values() for m in pair}, key=lambda m: (m.count("+"), m))
    for name in needed:
        args = ModelArgs.from_dict(config(name, setup.tiny))
        model = build(args, kernels, setup, ns.seed)
        kind = name.split("+")[-1]
        if name != OUTER:
            costs[kind] = kind_costs(args, model, kind)
        cache_args = outer_cache_args(setup.tiny) if name == OUTER else args
        for b, k in itertools.product(ns.batches, DRAFTS):
            batch, cache = verify_inputs(cache_args, setup, b, ns.context, k + 1, ns.seed, FAMILY)
            step = partial(model, batch, cache)  # plans built on the first call, then kept
            times[name, b, k] = timed(step, setup, ns)
            if name == OUTER:
                fresh = median_time(partial(rebuilt, model, batch, cache), setup, *ns.timing)
                times[PLANS, b, k] = dict.fromkeys(
                    times[name, b, k], fresh - times[name, b, k]["eager"]
                )
            else:
                counts = experts_hit(model, step)
                hits[kind, b, k] = counts[-1] if counts else args.num_experts
            del batch, cache, step
            release()
        print(f"  measured {name}")
        del model
        release()


def build_twins(kernels: Kernels, setup: Setup, seed: int) -> tuple[DeepseekV41, DeepseekV41]:
    """3 target layers and the DSpark layers, served and not served, on one set of random
    weights (built as v41_flash.build builds a model)."""
    cfg = config("swa+swa+swa", setup.tiny)
    cfg["text_config"].update({**DSPARK, **(TINY if setup.tiny else {})})
    args = ModelArgs.from_dict(cfg)
    served = with_serving_options(args, yoco_truncation="off", yoco_keep_tokens=0, dspark=True)
    weights = FAMILY.random_weights(
        served, seed, setup.device, setup.dtype, fp8_block=None, fp4_experts=True
    )
    models = []
    for a in (served, args):
        with torch.device("meta"):
            model = FAMILY.build_model(a, kernels)
            use_mxfp4_experts(model, weights)
        model.load_state_dict(weights, strict=True, assign=True)
        FAMILY.init_buffers(model, setup.device)
        models.append(model.eval())
    return models[0], models[1]


def measure_drafter(
    ns: argparse.Namespace, setup: Setup, kernels: Kernels, times: Times, drafter: dict
) -> DeepseekV41:
    """The main-key write at every batch and L; the drafting pass at every batch."""
    served, plain = build_twins(kernels, setup, ns.seed)
    a = served.args
    for b, k in itertools.product(ns.batches, DRAFTS):
        batch, cache = verify_inputs(a, setup, b, ns.context, k + 1, ns.seed, FAMILY)
        for name, model in (("served", served), ("unserved", plain)):
            times[name, b, k] = timed(partial(model, batch, cache), setup, ns)
        served(batch, cache)  # eager: the batch's RoPE (its plans are kept) for the write alone
        features = torch.randn(b * (k + 1), a.hidden_size, device=setup.device, dtype=setup.dtype)
        cross = CrossLayer(
            features=dict.fromkeys(range(len(TARGETS)), features), feature_batch=batch
        )
        alone = partial(torch.inference_mode()(served._write_main_keys), cross, cache)
        times["write alone", b, k] = {"eager": median_time(alone, setup, *ns.timing)}
        if k == 0:
            drafter[b] = drafting_pass(ns, setup, served, cache, b)
        del batch, cache, cross, alone
        release()
    print("  measured the drafter")
    return served


def drafting_pass(
    ns: argparse.Namespace, setup: Setup, model: DeepseekV41, cache: KVCache, batch: int
) -> dict:
    """``DSparkDrafts.run`` after a decode step of ``batch`` requests at ctx (each kept one token,
    at ctx + 1) and its ``dspark_forward`` alone; the experts each DSpark layer's router hit."""
    staging = PinnedStaging(setup.device, copy_stream=True) if setup.is_cuda else None

    def upload(values: np.ndarray) -> torch.Tensor:  # the runner's: pinned staging on CUDA
        return staging.upload(values) if staging else torch.from_numpy(values).to(setup.device)

    drafts = DSparkDrafts(model, cache, FAMILY.geometry(model.args, cache), BLOCK, upload)
    scheduled = [Scheduled(f"r{i}", ns.context, i) for i in range(batch)]
    kept = {s.request_id: [(3 + 7 * s.state_slot) % model.args.vocab_size] for s in scheduled}
    blocks = [Block(r, i, 0, *kept[r], ns.context + 1) for i, r in enumerate(kept)]
    run = partial(drafts.run, scheduled, None, kept)
    forward = partial(model.dspark_forward, drafts._batch(blocks), cache)
    return {
        "pass_s": median_time(run, setup, *ns.timing),
        "forward_s": median_time(forward, setup, *ns.timing),
        "experts_hit": experts_hit(model, run),
    }


# ---- bytes and figures -----------------------------------------------------------------------


def nbytes(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    params = (p for n, p in module.named_parameters() if not n.startswith(skip))
    return sum(p.numel() * p.element_size() for p in params)


def pass_bytes(model: DeepseekV41, hits: list[int], batch: int, item: int) -> float:
    """A drafting pass's reads: each DSpark layer's weights but routed experts (not main_proj,
    which the write reads, nor the Markov table: rows), the experts hit, its ring's window of
    main keys a request; the LM head."""
    a, total = model.args, float(nbytes(model.head))
    for layer, hit in zip(model.mtp, hits, strict=True):
        experts = layer.ffn.experts
        total += nbytes(layer, ("main_", "markov_head.embed", "ffn.experts."))
        total += hit * nbytes(experts) / experts.shapes["w1"][0]
        total += batch * a.sliding_window * a.head_dim * item
    return total


def write_bytes(model: DeepseekV41, rows: int, item: int) -> float:
    """main_proj, main_norm, each DSpark layer's wkv and kv_norm; features read, keys written."""
    first, a = model.mtp[0], model.args
    weights = [first.main_proj, first.main_norm]
    weights += [m for layer in model.mtp for m in (layer.attn.wkv, layer.attn.kv_norm)]
    per_row = 3 * a.hidden_size + len(model.mtp) * a.head_dim
    return sum(nbytes(m) for m in weights) + rows * per_row * item


def verify_bytes(costs: dict, hits: dict, setup: Setup, b: int, k: int, ctx: int) -> float:
    """The full-depth verify step's: the layers by kind (v41_flash.decode_bytes), the LM head."""
    item = torch.empty((), dtype=setup.dtype).element_size()
    a = args_of("swa", setup)
    total = float(a.vocab_size * a.hidden_size * item)
    for kind, n in FULL_DEPTH.items():
        args = args_of(kind, setup)
        total += n * decode_bytes(args, costs[kind], b, ctx + k, hits[kind, b, k], item)
    return total


def part_time(times: Times, part: str, b: int, k: int, mode: str) -> float:
    """A layer kind's seconds (the model with it − the one without) or a per-step part's."""
    if part not in MODELS:
        return times[part, b, k][mode]
    with_, without = MODELS[part]
    return times[with_, b, k][mode] - times[without, b, k][mode]


def full_depth(times: Times, b: int, k: int, mode: str) -> float:
    counts = {**FULL_DEPTH, OUTER: 1, PLANS: 1}
    return sum(n * part_time(times, part, b, k, mode) for part, n in counts.items())


def write_time(times: Times, b: int, k: int, mode: str) -> float:
    return times["served", b, k][mode] - times["unserved", b, k][mode]


@dataclasses.dataclass(frozen=True)
class Costs:
    """One batch size's step costs (s): the served verify step at T = B(L + 1) tokens (L = 0 ..
    BLOCK), the plain step (unserved, L = 0), the drafting pass."""

    batch: int
    served: list[float]
    plain: float
    drafter: float

    @property
    def tokens(self) -> list[int]:
        return [self.batch * (k + 1) for k in DRAFTS]

    def verify(self, total: int) -> float:
        return float(np.interp(total, self.tokens, self.served))

    @property
    def line(self) -> tuple[float, float]:
        """(intercept s, slope s / token > 0) of served verify time against T."""
        slope, intercept = np.polyfit(self.tokens, self.served, 1)
        return float(intercept), max(float(slope), 1e-12)

    @property
    def cost_tokens(self) -> float:
        """speculative.verify_cost_tokens: a step's fixed cost (verify + pass), in tokens."""
        intercept, slope = self.line
        return max(0.0, (intercept + self.drafter) / slope)

    @property
    def curve(self) -> tuple[tuple[int, float], ...]:
        """speculative.verify_cost_curve: (tokens, ms) of the step, verify + pass (a running
        maximum: the config takes non-decreasing times)."""
        ms = np.maximum.accumulate(1e3 * (np.asarray(self.served) + self.drafter))
        return tuple((t, float(v)) for t, v in zip(self.tokens, ms, strict=True))

    def schedule(self, mode: str) -> ConfidenceSchedule:
        """The engine's schedule of a confidence mode: "line" or "curve" costs; "graph rows":
        the step pays its graph's rows (a batch bucket of this batch, DecodeGraphs' rows)."""
        curve = self.curve if "curve" in mode else ()
        if "graph rows" not in mode:
            return ConfidenceSchedule(self.cost_tokens, curve=curve)
        return ConfidenceSchedule(self.cost_tokens, 0, (self.batch,), ROWS, curve)


def rate_of(tau: float) -> float:
    """The conditional acceptance rate a with 1 + a + .. + a^BLOCK = tau (bisection)."""
    if not 1 <= tau <= BLOCK + 1:
        raise SystemExit(f"acceptance length {tau} is outside [1, {BLOCK + 1}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**j for j in DRAFTS) < tau else (lo, mid)
    return (lo + hi) / 2


ROWS = tuple(row_buckets(BLOCK + 1))  # the graphs' rows a request: 1, 2, 4, 6
CONFIDENCE = ["confidence, line", "confidence, curve"]
GRAPHED = [f"{m}, graph rows" for m in CONFIDENCE]


def project(c: Costs, rates: list[float], mode: str) -> list[float]:
    """[drafts verified a request, tokens a request gains, step s, tok/s per user]: means over
    steps whose requests cycle through ``rates`` (a step starting at each entry)."""
    steps = []
    for s in range(len(rates)):
        mine = [rates[(s + i) % len(rates)] for i in range(c.batch)]
        counts = [0 if mode == "no drafts" else BLOCK] * c.batch
        if mode.startswith("confidence"):
            confidence = {str(i): [a] * BLOCK for i, a in enumerate(mine)}  # calibrated
            counts = list(c.schedule(mode).counts(confidence).values())
        gained = [sum(a**j for j in range(n + 1)) for a, n in zip(mine, counts, strict=True)]
        tokens = c.batch + sum(counts)
        if mode in GRAPHED:  # every request padded to its graph's rows
            tokens = c.batch * next(r for r in ROWS if r > max(counts))
        step = c.plain if mode == "no drafts" else c.verify(tokens) + c.drafter
        steps.append((statistics.mean(counts), statistics.mean(gained), step))
    means = [statistics.mean(column) for column in zip(*steps, strict=True)]
    return [*means, statistics.mean(g / t for _, g, t in steps)]


# ---- reporting -------------------------------------------------------------------------------


def headers(spec: str) -> list[str]:
    return spec.split("|")


def verify_tables(ns: argparse.Namespace, times: Times, modes: list[str]) -> dict[str, Table]:
    tables = {}
    for mode in modes:
        rows = [
            [part, b, *(ms(part_time(times, part, b, k, mode)) for k in DRAFTS)]
            for part in (OUTER, PLANS, *FULL_DEPTH)
            for b in ns.batches
        ]
        title = f"Verify step per layer kind, {mode} ms by drafts verified L (measured):"
        tables[title] = (["part", "batch", *(f"L={k}" for k in DRAFTS)], rows)
    return tables


def step_tables(
    ns: argparse.Namespace,
    setup: Setup,
    bandwidth: float,
    measured: tuple[Times, dict, dict, dict],
    served: DeepseekV41,
    modes: list[str],
) -> tuple[dict[str, Table], dict[int, Costs]]:
    """Full depth, the main-key write, the drafting pass, the fitted line; the costs by batch."""
    times, hits, costs, drafter = measured
    best, item = modes[-1], torch.empty((), dtype=setup.dtype).element_size()
    full, writes, passes, lines, fits = [], [], [], [], {}
    for b in ns.batches:
        plain = full_depth(times, b, 0, best)
        verify = [full_depth(times, b, k, best) + write_time(times, b, k, best) for k in DRAFTS]
        c = fits[b] = Costs(b, verify, plain, drafter[b]["pass_s"])
        for k in DRAFTS:
            n, depth = b * (k + 1), {m: full_depth(times, b, k, m) for m in modes}
            bound = verify_bytes(costs, hits, setup, b, k, ns.context) / bandwidth
            row = [b, k, n, ms(depth["eager"]), ms(depth.get("graph")), ms(bound)]
            full.append([*row, ratio(depth[best], bound), ms(verify[k]), ratio(verify[k], plain)])
            write = {m: write_time(times, b, k, m) for m in modes}
            alone = times["write alone", b, k]["eager"]
            bound = write_bytes(served, n, item) / bandwidth
            row = [b, k, n, ms(write["eager"]), ms(write.get("graph")), ms(alone), ms(bound)]
            writes.append([*row, ratio(write[best], bound)])
        d, t = drafter[b], drafter[b]["pass_s"]
        bound = pass_bytes(served, d["experts_hit"], b, item) / bandwidth
        row = [b, b * BLOCK, ms(t), ms(d["forward_s"]), ms(t - d["forward_s"])]
        row += [statistics.mean(d["experts_hit"]), ms(bound), ratio(t, bound)]
        passes.append([*row, ratio(t, verify[BLOCK])])
        lines.append([b, ms(c.line[0]), c.line[1] * 1e6, ms(c.drafter), c.cost_tokens])
    head = "batch|L|tokens|eager ms|graph ms|bound ms"
    return {
        f"Full-depth verify step ({best} = best; extrapolated; served = + the main-key write):": (
            headers(f"{head}|best / bound|served ms|served / plain L=0"),
            full,
        ),
        "Main-key write the served forward pays (served − unserved forward; measured):": (
            headers("batch|L|tokens|eager ms|graph ms|alone eager ms|bound ms|best / bound"),
            writes,
        ),
        "DSpark drafting pass a step (DSparkDrafts.run, eager as the engine runs it; measured):": (
            headers(
                "batch|rows|pass ms|dspark_forward ms|rest ms|experts hit / layer|bound ms|"
                "pass / bound|pass / served L=5"
            ),
            passes,
        ),
        f"Served verify ms ≈ intercept + slope × tokens ({best}, least squares over L); "
        "cost_tokens = (intercept + pass) / slope:": (
            headers("batch|intercept ms|slope µs / token|pass ms|cost_tokens"),
            lines,
        ),
    }, fits


def projection_table(ns: argparse.Namespace, fits: dict[int, Costs]) -> Table:
    workloads = {"const": (ns.tau, [rate_of(ns.tau)])}
    workloads["mix"] = (statistics.mean(ns.mix), [rate_of(t) for t in ns.mix])
    schedules = [*CONFIDENCE, *GRAPHED] if ns.graph else CONFIDENCE
    rows = []
    for b, (name, (tau, rates)) in itertools.product(ns.batches, workloads.items()):
        got = {m: project(fits[b], rates, m) for m in ["no drafts", "fixed 5", *schedules]}
        for m, (k, gained, step, tok_s) in got.items():
            versus = [ratio(tok_s, got[other][3]) for other in ("fixed 5", "no drafts")]
            rows.append([b, name, tau, m, k, gained, ms(step), tok_s, *versus])
    spec = "batch|requests|mean τ|mode|drafts verified / request|tokens / request / step|"
    return headers(f"{spec}step ms|tok/s per user|× fixed 5|× no drafts"), rows


def report(
    ns: argparse.Namespace,
    setup: Setup,
    kernels: Kernels,
    bandwidth: float,
    measured: tuple[Times, dict, dict, dict],
    served: DeepseekV41,
) -> dict[str, list[list]]:
    """Prints the tables, the cost_tokens lines and the RESULTS block; returns the rows."""
    modes = ["eager", "graph"] if ns.graph else ["eager"]
    tables = verify_tables(ns, measured[0], modes)
    steps, fits = step_tables(ns, setup, bandwidth, measured, served, modes)
    tables |= steps
    title = "Tokens/s per user, PROJECTED from the step costs above (not a served run):"
    tables[title] = projection_table(ns, fits)
    for title, (columns, body) in tables.items():
        print(f"\n{title}\n{table(columns, body)}")
    print()
    for b, c in fits.items():
        print(f"batch {b}: speculative.verify_cost_tokens = {c.cost_tokens:.1f} ({modes[-1]})")
        points = ", ".join(f'"{t}:{v:.1f}"' for t, v in c.curve)
        print(f"batch {b}: speculative.verify_cost_curve = [{points}]")
    ds = served.args.dspark
    assert ds is not None
    notes = [
        "Shapes: the reported V4.1-Flash hyper-parameters (unverified), random weights, routed "
        f"experts packed FP4, no engram; DSpark: {len(served.mtp)} layers, block "
        f"{ds.block_size}, {ds.num_experts} experts top-{ds.num_experts_per_tok}, Markov rank "
        f"{ds.markov_rank}; ctx {ns.context}. Kernels {describe_kernels(kernels)}.",
        "Verify step with L drafts: L + 1 tokens a request; per kind = model with it − model "
        f"without it, median of {ns.repeats} after {ns.warmup} warm-up ({', '.join(modes)}). "
        "Full depth is extrapolated, not measured. Bound = bytes / copy bandwidth measured in "
        f"the run ({bandwidth / 1e12:.3f} TB/s), a lower bound for L > 0.",
        "Drafting pass = DSparkDrafts.run (eager, as the engine runs it); main-key write = "
        "served − unserved forward of 3 target layers on the same weights.",
        f"Projection, not a served run: const = every request at τ {ns.tau}; mix = requests "
        f"cycling τ {ns.mix}; confidence = ConfidenceSchedule with a calibrated confidence "
        "head and the fitted line (cost_tokens) or the measured curve of step costs"
        + (
            "; graph rows = the engine's graphs (1, 2, 4 or 6 rows a request)." if ns.graph else "."
        ),
    ]
    blocks = [f"{title}\n\n{markdown(columns, body)}" for title, (columns, body) in tables.items()]
    heading = "DSpark drafting and verification steps, V4.1-Flash shapes"
    print(f"\n{results_block(heading, SCRIPT, setup, notes, blocks)}")
    return {title: body for title, (_, body) in tables.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--batch", help="batch sizes (default 1,32; --tiny: 1,4)")
    ap.add_argument("--context", type=int, help="tokens a request holds (default 4096; --tiny 64)")
    ap.add_argument("--tau", type=float, default=3.5, help="acceptance length with 5 drafts")
    ap.add_argument("--mix", default="1.5,2.5,4.5,5.5", help="acceptance lengths of the mix")
    ap.add_argument("--backend", default="auto", help="auto | torch_ref | attention=X,moe=Y")
    ap.add_argument("--graph", action="store_true", help="also time CUDA-graph replays")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes; CPU/fp32 without CUDA")
    if ap.parse_known_args()[0].tiny:  # a smoke test: fewer timed calls unless asked
        ap.set_defaults(warmup=1, repeats=3)
    ns = ap.parse_args()
    setup = make_setup(ns.tiny)
    if ns.graph and not setup.is_cuda:
        print("--graph: no CUDA device, eager only")
        ns.graph = False
    ns.timing = (max(1, ns.warmup), ns.repeats)  # eager: a first call builds the plans
    ns.batches = parse_ints(ns.batch or ("1,4" if ns.tiny else "1,32"))
    ns.context = ns.context or (64 if ns.tiny else 4096)
    ns.mix = [float(v) for v in ns.mix.split(",") if v.strip()]
    for tau in [ns.tau, *ns.mix]:
        rate_of(tau)  # in range, before anything is measured
    kernels = select_kernels(kernel_config(ns.backend), setup.device)
    bandwidth = copy_bandwidth(setup)
    print(f"{device_name(setup)}: copy {bandwidth / 1e12:.3f} TB/s; {describe_kernels(kernels)}")
    times: Times = {}
    hits: dict = {}
    costs: dict = {}
    drafter: dict = {}
    payload = {**header(setup), "script": SCRIPT, "bandwidth_Bps": bandwidth}

    def dump() -> None:
        payload["times"] = [
            {"part": p, "batch": b, "drafts": k, **{f"{m}_s": v for m, v in t.items()}}
            for (p, b, k), t in times.items()
        ]
        payload["drafter"] = {str(b): d for b, d in drafter.items()}
        write_json(ns.json, payload)

    measure_kinds(ns, setup, kernels, times, hits, costs)
    dump()
    served = measure_drafter(ns, setup, kernels, times, drafter)
    dump()
    payload["tables"] = report(ns, setup, kernels, bandwidth, (times, hits, costs, drafter), served)
    write_json(ns.json, payload)


if __name__ == "__main__":
    main()
