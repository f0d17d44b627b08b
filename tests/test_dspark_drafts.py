"""DSpark drafts (speculative.method = "dspark", deepseek_v41/dspark.py) on the built-in tiny
DeepSeek-V4.1: the engine's tokens with DSpark drafts equal to those without (batched, chunked,
preempted, prefix hits, async scheduling on and off, steps shaped as CUDA graphs run them), and
every block of drafts the engine proposed equal to the drafter run after a from-scratch forward
of the request's tokens on an empty cache (what the main keys written step by step, through
chunks, rejected drafts, preemption and snapshots, must reproduce), with partly accepted drafts
on the way. No oracle exists for the drafter itself: these are the identities its design
guarantees."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from draft_runs import (
    PROMPTS,
    Outputs,
    assert_same_outputs,
    cpu_llm,
    run_with_prefix_hits,
    sampling,
)
from engine_spies import TruthDrafts, graph_shaped

from deepinfer import LLM, SamplingParams
from deepinfer.config import SpeculativeConfig
from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import SeqSpan, flatten
from deepinfer.model.deepseek_v41.dspark import Block, DSparkDrafts
from deepinfer.model.deepseek_v41.family import FAMILY
from deepinfer.model.tiny import make_tiny_model
from deepinfer.scheduler.drafts import ConfidenceSchedule

DSPARK = {"method": "dspark", "num_speculative_tokens": 4}  # the tiny drafter's block size
PARAMS = sampling(14)


def _outputs(llm: LLM) -> Outputs:
    return run_with_prefix_hits(llm, PROMPTS, PARAMS, again=3)


@pytest.fixture(scope="module")
def plain(tiny_v41_dir: Path) -> Outputs:
    return _outputs(cpu_llm(tiny_v41_dir, async_scheduling=False))


def test_dspark_configuration_errors(tiny_v41_dir: Path, tmp_path: Path) -> None:
    v4 = make_tiny_model(tmp_path / "v4", seed=5)
    with pytest.raises(ValueError, match="deepseek_v41 only"):
        LLM(model=v4, device="cpu", speculative_config=DSPARK)
    with pytest.raises(ValueError, match="dspark_block_size=4 tokens a step, so the draft count"):
        LLM(
            model=tiny_v41_dir,
            device="cpu",
            speculative_config={**DSPARK, "num_speculative_tokens": 3},
        )
    for curve, problem in [(["1:20"], "at least two points"), (["1:20", "2ms"], "tokens:ms")]:
        with pytest.raises(ValueError, match=problem):
            SpeculativeConfig(**DSPARK, verify_schedule="confidence", verify_cost_curve=curve)
    for curve in (["6:20", "1:30"], ["1:20", "6:10"]):  # tokens increasing, ms non-decreasing
        with pytest.raises(ValueError, match="increasing"):
            SpeculativeConfig(**DSPARK, verify_schedule="confidence", verify_cost_curve=curve)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tokens_with_dspark_drafts_are_those_without(
    tiny_v41_dir: Path, plain: list, async_scheduling: bool
) -> None:
    # num_blocks=8: too few blocks for all four at once, so some are preempted and recomputed.
    llm = cpu_llm(
        tiny_v41_dir, async_scheduling=async_scheduling, speculative_config=DSPARK, num_blocks=8
    )
    assert_same_outputs(_outputs(llm), plain)
    assert llm.engine is not None
    stats = llm.engine.spec_stats()
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] > stats["num_drafts"]
    assert llm.engine.num_preemptions > 0
    # The confidence head's estimates of the last blocks: probabilities, one per draft.
    confidence = llm.engine.executor.step_drafts.confidence
    assert all(len(c) == 4 and all(0 < p < 1 for p in c) for c in confidence.values())


@torch.inference_mode()
def _reference_drafts(model: torch.nn.Module, tokens: list[int]) -> list[tuple[float, int]]:
    """For each draft of the block after ``tokens`` (its last at position e = len - 1): (the
    top-2 margin of the corrected logits, their argmax), the drafter run after a forward of
    positions 0 .. e - 1 on an empty cache (the main keys written once, in one chunk)."""
    spec = FAMILY.cache_spec(model.args, block_size=16, ring_margin=16, max_draft=4)
    kv = KVCache(spec, num_blocks=16, num_slots=1, dtype=torch.float32, device=torch.device("cpu"))
    e = len(tokens) - 1
    seqs = [SeqSpan(0, e, 0, 0, list(range(16)))]
    geometry = FAMILY.geometry(model.args, kv)
    host = FAMILY.step_arrays(seqs, tokens[:e], [e - 1], geometry)
    model(FAMILY.batch_views(torch.from_numpy(flatten(host)), host, seqs, geometry), kv)
    drafter = DSparkDrafts(model, kv, geometry, 4, lambda a: torch.from_numpy(np.asarray(a)))
    batch = drafter._batch([Block("r", 0, 0, tokens[e], e)])
    logits, _ = model.dspark_forward(batch, kv)
    head, previous, out = model.mtp[-1], torch.tensor([tokens[e]]), []
    for i in range(4):
        corrected = logits[i] + head.markov_head.head(head.markov_head.embed(previous))[0]
        top = corrected.topk(2).values
        previous = corrected.argmax().view(1)
        out.append((float(top[0] - top[1]), int(previous)))
    return out


@pytest.mark.parametrize("graphed", [False, True])
def test_every_dspark_block_is_the_drafter_after_a_forward_from_scratch(
    tiny_v41_dir: Path, plain: list, graphed: bool
) -> None:
    """``graphed``: the verify steps shaped as CUDA graphs run them (``graph_shaped``: the
    main keys of pads go to the scratch slot)."""
    llm = cpu_llm(tiny_v41_dir, async_scheduling=True, speculative_config=DSPARK, num_blocks=8)
    assert llm.engine is not None
    runner = llm.engine.executor
    steps = graph_shaped(runner, max_tokens=5) if graphed else []
    recorder = TruthDrafts(runner.step_drafts.run, PROMPTS, [t for t, _ in plain[:4]])
    runner.step_drafts.run = recorder
    assert_same_outputs(_outputs(llm), plain)
    stats = llm.engine.spec_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert llm.engine.num_preemptions > 0
    if graphed:
        assert any(n > 1 and rows == 5 for n, rows in steps), f"no batched verify step: {steps}"
    checked = 0
    for tokens, drafts in recorder.records[::3]:  # every third block: the CI's time
        for (margin, want), got in zip(
            _reference_drafts(runner.model, tokens), drafts, strict=True
        ):
            if margin > 1e-3:  # a near-tie may flip with the order of the sums
                assert got == want, (len(tokens), drafts)
                checked += 1
    assert checked > 0.9 * 4 * len(recorder.records[::3]) > 40


def test_the_confidence_schedule_takes_the_drafts_worth_their_cost() -> None:
    # Cumulative gains: a .9 .81 .729 .6561, b .2 .1 .05 .025. With a step's fixed cost at 8
    # tokens, (2 + gains) / (8 + 2 + k) peaks at k = 4 (0.364; k = 5 gives 0.353): a's four.
    rates = {"a": [0.9, 0.9, 0.9, 0.9], "b": [0.2, 0.5, 0.5, 0.5]}
    assert ConfidenceSchedule(cost_tokens=8.0).counts(rates) == {"a": 4, "b": 0}
    assert ConfidenceSchedule(cost_tokens=8.0, max_tokens=2).counts(rates) == {"a": 2, "b": 0}
    # A step that costs nothing fixed gains nothing from a draft below certainty; one that
    # costs a lot gains from every draft.
    assert ConfidenceSchedule(cost_tokens=0.0).counts(rates) == {"a": 0, "b": 0}
    assert ConfidenceSchedule(cost_tokens=1e3).counts(rates) == {"a": 4, "b": 4}
    assert ConfidenceSchedule(cost_tokens=8.0).counts({}) == {}
    # A measured curve, flat to 4 tokens, then 1 ms a token: drafts that the straight line
    # of no fixed cost refuses are free up to 4 tokens. (2 + gains) / cost(2 + k): k = 2 ->
    # 3.71 / 10; 3 -> 4.439 / 11; 4 -> 5.095 / 12 = 0.425 (the peak); 5 -> 5.295 / 13.
    curve = ((1, 10.0), (4, 10.0), (8, 14.0))
    steep = ConfidenceSchedule(cost_tokens=0.0, curve=curve)
    assert steep.cost(2) == 10.0 and steep.cost(12) == 18.0  # its last segment extended
    assert steep.counts(rates) == {"a": 4, "b": 0}


def test_graphed_steps_verify_what_their_graph_rows_hold() -> None:
    # 2 requests pad to a batch bucket of 2; rows 1, 2, 4 or 6 a request. Cumulative gains:
    # a .9 .81 .729 .656 .59, b .2 .1 .05 .025 .0125. At 4 tokens' fixed cost, rows 1 -> 2 / 6
    # = 0.333; 2 -> 3.1 / 8 = 0.388; 4 -> 4.789 / 12 = 0.399; 6 -> 6.073 / 16 = 0.380: both
    # requests fill rows 4's 3 drafts. The free schedule gives b none (its 0.2 is worth less
    # than a token) and would pay b's pads in the graph a's 5 drafts need.
    rates = {"a": [0.9] * 5, "b": [0.2, 0.5, 0.5, 0.5, 0.5]}
    graphed = ConfidenceSchedule(cost_tokens=4.0, batch_buckets=(1, 2, 4), row_buckets=(1, 2, 4, 6))
    assert graphed.counts(rates) == {"a": 3, "b": 3}
    assert ConfidenceSchedule(cost_tokens=4.0).counts(rates) == {"a": 5, "b": 0}
    # A budget of 4 drafts rules rows 4 and 6 out; past the largest batch bucket, no graph.
    limited = dataclasses.replace(graphed, max_tokens=4)
    assert limited.counts(rates) == {"a": 1, "b": 1}
    alone = dataclasses.replace(graphed, batch_buckets=(1,))
    assert alone.counts(rates) == {"a": 5, "b": 0}


def test_the_confidence_schedule_changes_what_is_verified_not_the_tokens(
    tiny_v41_dir: Path, plain: list
) -> None:
    stats = {}
    for schedule in ("fixed", "confidence"):
        spec = {**DSPARK, "verify_schedule": schedule}
        llm = cpu_llm(tiny_v41_dir, speculative_config=spec, num_blocks=8)
        assert_same_outputs(_outputs(llm), plain)
        assert llm.engine is not None
        stats[schedule] = llm.engine.spec_stats()
    fixed, scheduled = stats["fixed"], stats["confidence"]
    # The random drafter's confidence is about 0.5 a draft: verifying the fourth (gain ~0.06)
    # does not pay for its cost, so fewer drafts are verified per run.
    per_run = {k: s["num_draft_tokens"] / s["num_drafts"] for k, s in stats.items()}
    assert 0 < per_run["confidence"] < per_run["fixed"], per_run
    assert scheduled["num_drafts"] > 0 and fixed["num_drafts"] > 0
    with pytest.raises(ValueError, match="needs a drafter with a confidence head"):
        LLM(speculative_config={"method": "ngram", "verify_schedule": "confidence"})


@pytest.mark.parametrize("agrees", [True, False])
def test_verification_of_any_length_keeps_the_targets_distribution(agrees: bool) -> None:
    """Steps verifying 1 to 4 drafts (lengths as the confidence schedule varies them): with the
    sampler's draws keyed by (seed, position), every seeded run's tokens are exactly the plain
    run's, so each output position follows the target's p (checked within 3 sigma over 2 x 10^4
    seeds of a synthetic p), for a drafter that agrees with the target (its argmax) and one
    that does not."""
    from deepinfer.ops.sampling.torch_ref import SamplingMetadata, sample
    from deepinfer.scheduler.drafts import accepted

    num, first, span, out_len = 20_000, 7, 13, 4
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(num) for _ in range(span)]
    positions = [first + j for _ in range(num) for j in range(span)]
    metadata = SamplingMetadata.build(
        params, [[1]] * len(params), [[]] * len(params), positions, eos_token_id=None, device="cpu"
    )
    logits = p.log().expand(len(params), -1).contiguous()
    draws = sample(logits, metadata).token_ids.view(num, span).tolist()  # [seed][position]
    draft = 0 if agrees else 4
    lengths = [1, 4, 2, 3]
    outputs = []
    for row in draws:
        tokens, step = [], 0
        while len(tokens) < out_len:
            n = lengths[step % len(lengths)]
            at = len(tokens)  # the next position to sample, from ``first``
            tokens += accepted([draft] * n, row[at : at + n + 1])
            step += 1
        assert tokens[:out_len] == row[:out_len]  # the plain run's: one draw a position
        outputs.append(tokens[:out_len])
    counts = torch.nn.functional.one_hot(torch.tensor(outputs), 5).float().mean(dim=0)  # [4, 5]
    sigma = (p * (1 - p) / num).sqrt()
    assert ((counts - p).abs() <= 3 * sigma).all(), counts
