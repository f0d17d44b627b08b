"""DSpark drafting and verification steps on DeepSeek-V4.1-Flash shapes, and a projection of
fixed against confidence-scheduled verification.

    bash scripts/gpu_bench.sh benchmarks/dspark_verify.py [--batch 1,32] [--context 4096]
        [--tau 3.5] [--mix 1.5,2.5,4.5,5.5] [--graph] [--json PATH]
    python3 -P benchmarks/dspark_verify.py --tiny   # CPU smoke test: shapes shrunk, 3 repeats

Shapes: v41_flash.py's (the reported V4.1-Flash hyper-parameters, unverified; random weights,
routed experts packed FP4, no engram) and the drafter of the notes (§2.1, §4): 3 DSpark layers
(sliding window, 128 experts of their own, top-3), block 5, Markov rank 256, noise token 128799
(--tiny: 4 experts top-2, rank 8, token 4).

Method. A verification step with L drafts (L = 0 .. 5; 0 is the plain decode step): each of B
requests feeds L + 1 tokens at positions ctx .. ctx + L, logits at all (``verify_inputs``), on
a cache of random values (no prefill). Per layer kind as v41_flash.py measures it (the model
with it − the model without it; "outer": no layers), each step eager and, with --graph, as
CUDA-graph replays (what the engine runs for decode and verify steps); CUDA events (host clock
on the CPU), median of --repeats after --warmup, plans kept on the batch; "plans" = the outer
model's step with its plans rebuilt − kept (host work, added to both). Full depth = 2 swa + 3 c2
+ 15 c2_shared + 1 c1 + 4 c1_index + 15 c1_shared + outer + plans, extrapolated, not measured.

Drafter: 3 sliding-window layers (the targets, dspark_target_layer_ids [0, 1, 2], one side of
the YoCo boundary as the release's [37, 38, 39]) and the 3 DSpark layers, served (the cache has
their rings), and its twin on the same weights, not served. Main-key write = served − unserved
forward of the same step (stream means, main_proj + main_norm, each layer's wkv + kv_norm +
RoPE, ring writes); ``_write_main_keys`` alone as a check. "Served" full depth adds it. Drafting
pass = ``DSparkDrafts.run`` after a decode step, eager as the engine runs it (block plans in one
upload, ``dspark_forward`` over B x 5 rows, the Markov / confidence loop, the read-back); also
``dspark_forward`` alone. Bounds = bytes / copy bandwidth measured in the run: weights but
routed experts, the experts the routers hit (FP4), KV read once a request (a lower bound for
L > 0), the LM head; for the pass, its 3 layers' and 128 main keys a request, LM + Markov heads.

Projection (from these step costs, not a served run): step = served verify(T) + pass, T the
step's tokens, verify interpolated linearly between the measured T = B(L + 1) (graph replays
with --graph, else eager). A request accepts each draft with a conditional rate a: "const", all
with 1 + a + .. + a^5 = --tau; "mix", requests cycling through the --mix acceptance lengths.
Confidence head calibrated (confidence = a): verifying k drafts gains 1 + a + .. + a^k tokens.
Modes: no drafts (plain step, unserved); fixed 5; confidence (``ConfidenceSchedule``, its
cost_tokens = (intercept + pass) / slope of the least-squares line of served verify time
against T at that batch). With --graph, "padded": every request runs 1 + 5 rows once one
verifies a draft (DecodeGraphs' row buckets are 1 and 1 + num_speculative_tokens); "unpadded"
is graphs per token count, a what-if. Tok/s per user = tokens a request gains per step / step
time, mean over requests. Not timed: sampling, acceptance, scheduling.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import sys
from collections.abc import Callable
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
DSPARK = {
    "num_nextn_predict_layers": 3,
    "dspark_block_size": BLOCK,
    "dspark_target_layer_ids": [0, 1, 2],
    "dspark_markov_rank": 256,
    "dspark_noise_token_id": 128799,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
}
TINY = {"dspark_markov_rank": 8, "dspark_noise_token_id": 4}
TINY |= {"dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2}
Times = dict[tuple[str, int, int], dict[str, float]]  # (part, batch, L) -> seconds by mode


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
    out = {"eager": median_time(fn, setup, max(1, ns.warmup), ns.repeats)}
    if ns.graph:
        graph, why = graph_time(fn, setup, ns.warmup, ns.repeats)
        if graph is None:
            raise SystemExit(f"no CUDA graph: {why}")
        out["graph"] = graph
    return out


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

            def step(batch: ForwardBatch = batch, cache: KVCache = cache) -> object:
                return model(batch, cache)  # plans built on the first call, kept on the batch

            def fresh(batch: ForwardBatch = batch, cache: KVCache = cache) -> object:
                batch.metadata = None
                return model(batch, cache)

            times[name, b, k] = timed(step, setup, ns)
            if name == OUTER:
                plans = median_time(fresh, setup, ns.warmup, ns.repeats) - times[name, b, k]["eager"]
                times[PLANS, b, k] = dict.fromkeys(times[name, b, k], plans)
            else:
                counts = experts_hit(model, step)
                hits[kind, b, k] = counts[-1] if counts else args.num_experts
            del batch, cache, step, fresh
            release()
        print(f"  measured {name}")
        del model
        release()


def build_twins(kernels: Kernels, setup: Setup, seed: int) -> tuple[DeepseekV41, DeepseekV41]:
    """The drafter's model served and not served, on one set of random weights (as
    v41_flash.build builds a model)."""
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
            times[name, b, k] = timed(lambda m=model, x=batch, c=cache: m(x, c), setup, ns)
        features = torch.randn(b * (k + 1), a.hidden_size, device=setup.device, dtype=setup.dtype)
        cross = CrossLayer(features=dict.fromkeys(range(3), features), feature_batch=batch)

        def write(cross: CrossLayer = cross, cache: KVCache = cache) -> None:
            with torch.inference_mode():  # the batch's plans and RoPE: from the forwards above
                served._write_main_keys(cross, cache)

        times["write alone", b, k] = {"eager": median_time(write, setup, ns.warmup, ns.repeats)}
        if k == 0:
            drafter[b] = drafting_pass(ns, setup, served, cache, b)
        del batch, cache, write
        release()
    print("  measured the drafter")
    return served


def drafting_pass(
    ns: argparse.Namespace, setup: Setup, model: DeepseekV41, cache: KVCache, batch: int
) -> dict:
    """``DSparkDrafts.run`` after a decode step of ``batch`` requests at ctx (each kept one token,
    at ctx + 1), and its ``dspark_forward`` alone; the experts each DSpark layer's router hit."""
    staging = PinnedStaging(setup.device, copy_stream=True) if setup.is_cuda else None

    def upload(values: np.ndarray) -> torch.Tensor:  # the runner's: pinned staging on CUDA
        return staging.upload(values) if staging else torch.from_numpy(values).to(setup.device)

    drafts = DSparkDrafts(model, cache, FAMILY.geometry(model.args, cache), BLOCK, upload)
    scheduled = [Scheduled(f"r{i}", ns.context, i) for i in range(batch)]
    kept = {s.request_id: [3 + 7 * s.state_slot] for s in scheduled}
    blocks = [Block(r, i, 0, *kept[r], ns.context + 1) for i, r in enumerate(kept)]
    block_batch = drafts._batch(blocks)

    def run() -> object:
        return drafts.run(scheduled, None, kept)  # type: ignore[arg-type]

    def forward() -> object:
        return model.dspark_forward(block_batch, cache)

    return {
        "pass_s": median_time(run, setup, max(1, ns.warmup), ns.repeats),
        "forward_s": median_time(forward, setup, max(1, ns.warmup), ns.repeats),
        "experts_hit": experts_hit(model, run),
    }
