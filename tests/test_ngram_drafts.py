"""Prompt-lookup (n-gram) drafts: the lookup against a brute-force search, the acceptance
accounting exactly on a scripted model whose continuation repeats its prompt, the engine's
tokens with drafts equal to those without on the tiny model (batched, chunked, preempted,
prefix hits, async scheduling on and off), the configuration and the node's metrics."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_spies import graph_shaped
from scripted_executor import ScriptedExecutor

from deepinfer import LLM, SamplingParams
from deepinfer.config import Config
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.model.tiny import make_tiny_model
from deepinfer.scheduler.drafts import lookup

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}


def _brute(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix (max_n down to min_n) seen before; of its earlier occurrences the most
    recent with k tokens after it, else the most recent."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        starts = [e for e in range(n, len(tokens)) if tokens[e - n : e] == tokens[-n:]]
        if starts:
            full = [e for e in starts if e + k <= len(tokens)]
            start = (full or starts)[-1]
            return tokens[start : start + k]
    return []


def test_lookup_is_the_longest_earlier_suffix_match() -> None:
    rng = random.Random(0)
    for _ in range(600):
        tokens = [rng.randrange(rng.randint(1, 4)) for _ in range(rng.randint(1, 40))]
        min_n = rng.randint(1, 3)
        max_n, k = min_n + rng.randint(0, 3), rng.randint(1, 5)
        assert lookup(np.array(tokens), min_n, max_n, k) == _brute(tokens, min_n, max_n, k)
    # A worked case: "11 12" ... the longest suffix "10 11 12" occurred at 0..2.
    assert lookup(np.array([10, 11, 12, 13, 10, 11, 12]), 2, 4, 3) == [13, 10, 11]


PROMPT = [10, 11, 12, 13, 10, 11]
# The prompt's cycle, broken once by 99 (output position 4).
SCRIPT = [12, 13, 10, 11, 99, 13, 10, 11, 12, 13, 10, 11, 12]


def _scripted_engine(**speculative: object) -> LLMEngine:
    config = Config.load(
        overrides={
            "speculative": {**NGRAM, **speculative},
            "scheduler": {"async_scheduling": False},
        }
    )
    executor = ScriptedExecutor(lambda prompt: SCRIPT, eos_token_id=None)
    return LLMEngine(config, executor=executor)


def _run(engine: LLMEngine, params: SamplingParams) -> list[int]:
    engine.add_request("r", PROMPT, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
    return tokens


def test_acceptance_accounting_is_exact_on_a_scripted_model() -> None:
    """By hand (k = 3, n-grams of 2..4): after the prefill's 12, drafts [13, 10, 11] all hold
    (+ 99 sampled); after 99 and then 13 no 2-gram repeats (two plain steps); then [11, 99, 13]
    keeps 11 (12 sampled); then [13, 10, 11] all hold (+ 12): the 13 tokens in 6 steps."""
    engine = _scripted_engine()
    assert _run(engine, SamplingParams(max_tokens=13, ignore_eos=True)) == SCRIPT
    stats = engine.spec_stats()
    assert {k: stats[k] for k in list(stats)[:5]} == {
        "num_drafts": 3,
        "num_draft_tokens": 9,
        "num_accepted_tokens": 7,
        "accepted_per_position": [3, 2, 2],
        "acceptance_lengths": {4: 2, 2: 1},
    }
    assert sum(stats["verify_time_counts"]) == 0  # the scripted executor times nothing
    assert engine.executor.num_steps == 6
    engine.scheduler.check_integrity()


def test_max_tokens_and_the_draft_count_bound_the_drafts() -> None:
    engine = _scripted_engine(num_speculative_tokens=1)
    assert _run(engine, SamplingParams(max_tokens=3, ignore_eos=True)) == SCRIPT[:3]
    # One draft a step: 13 after the prefill's 12 (+ 10 sampled), then max_tokens leaves none.
    stats = engine.spec_stats()
    assert (stats["num_drafts"], stats["num_draft_tokens"], stats["num_accepted_tokens"]) == (
        1,
        1,
        1,
    )


def test_config_forms_and_errors() -> None:
    config = Config.load(overrides={"speculative": NGRAM})
    assert config.cache.max_draft_tokens == 3  # sized from the drafts
    with pytest.raises(ValueError, match=r"speculative\.method"):
        Config.load(overrides={"speculative": {"method": "eagle"}})
    with pytest.raises(ValueError, match=r"cache\.ring_margin"):
        Config.load(overrides={"speculative": {**NGRAM, "num_speculative_tokens": 17}})
    with pytest.raises(ValueError, match="fewer than"):
        Config.load(overrides={"speculative": NGRAM, "cache": {"max_draft_tokens": 2}})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['k'\]"):
        LLM(speculative_config={"method": "ngram", "k": 3})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=5)


# Prompts that repeat themselves, so that the drafter has something to propose even on random
# weights (most drafts are then rejected: equality is the check, not the acceptance rate).
PROMPTS = [
    [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9],
    [(13 * i) % 50 + 3 for i in range(30)] * 2,
    [5, 6] * 9,
    [101, 102, 103],  # nothing to look up
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
]


def _outputs(
    folder: Path, graphed: bool = False, **kw: object
) -> tuple[list[tuple[list[int], object]], dict]:
    """``graphed``: decode and verify steps shaped as CUDA graphs run them (4 rows per request)."""
    torch.set_num_threads(2)
    llm = LLM(model=folder, device="cpu", block_size=16, max_num_batched_tokens=24, **kw)
    steps = graph_shaped(llm.engine.executor, max_tokens=4) if graphed else []
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    again = llm.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False)  # prefix hits
    assert [o.num_cached_tokens for o in again] != [0, 0]
    result = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs + again]
    assert llm.engine is not None
    llm.engine.scheduler.check_integrity()
    if graphed:  # verify steps of several requests, some with fewer drafts than others
        assert any(n > 1 and rows == 4 for n, rows in steps), f"no batched verify step: {steps}"
    return result, {**llm.engine.spec_stats(), "num_preemptions": llm.engine.num_preemptions}


@pytest.mark.parametrize(
    ("async_scheduling", "graphed"), [(False, False), (True, False), (True, True)]
)
def test_tokens_with_ngram_drafts_are_those_without(
    tiny_dir: Path, async_scheduling: bool, graphed: bool
) -> None:
    plain, none = _outputs(tiny_dir, async_scheduling=async_scheduling)
    assert none["num_drafts"] == 0
    # num_blocks=8: too few blocks for all four at once, so some are preempted and recomputed.
    drafted, stats = _outputs(
        tiny_dir,
        graphed,
        async_scheduling=async_scheduling,
        speculative_config=NGRAM,
        num_blocks=8,
    )
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(drafted, plain, strict=True):
        assert tokens == want_tokens
        for a, b in zip(logprobs or [], want_logprobs or [], strict=True):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_drafts"]
    assert stats["num_preemptions"] > 0


def test_node_metrics_export_the_verification_counters() -> None:
    """The scripted run's counters through the node's /metrics text, under our and vLLM's
    names."""
    from deepinfer.server.node_metrics import NodeMetrics
    from deepinfer.server.protocol import NodeLoad

    engine = _scripted_engine()
    metrics = NodeMetrics("n0", "tiny", 4096, NodeLoad)
    metrics.watch_drafts(engine.spec_stats)
    assert "spec_decode" not in metrics.render().decode()  # nothing verified yet
    _run(engine, SamplingParams(max_tokens=13, ignore_eos=True))
    text = metrics.render().decode()
    labels = 'component="node",model_name="tiny",node="n0"'
    for line in (
        f"deepinfer_spec_decode_num_drafts_total{{{labels}}} 3.0",
        f"deepinfer_spec_decode_num_draft_tokens_total{{{labels}}} 9.0",
        f"deepinfer_spec_decode_num_accepted_tokens_total{{{labels}}} 7.0",
        f'deepinfer_spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="1"}} 2.0',
        'deepinfer_spec_decode_acceptance_length_bucket{component="node",le="2",'
        'model_name="tiny",node="n0"} 1.0',
        'deepinfer_spec_decode_acceptance_length_bucket{component="node",le="4",'
        'model_name="tiny",node="n0"} 3.0',
        f"deepinfer_spec_decode_acceptance_length_sum{{{labels}}} 10.0",
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 7.0",
        f"deepinfer_spec_decode_verify_step_seconds_count{{{labels}}} 0.0",
    ):
        assert line in text, line


@pytest.mark.parametrize("agrees", [True, False])
def test_equality_acceptance_is_the_rejection_rule_for_one_token_drafts(agrees: bool) -> None:
    """A one-token draft d (q = one-hot) is kept when the sample at its position equals it: the
    rejection rule accepts with probability min(1, p(d) / q(d)) = p(d) and otherwise samples the
    residual p without d. 10^5 seeded rows of a synthetic p through our sampler (keyed draws):
    the acceptance rate is p(d) and the rejected rows' tokens follow p without d, each within
    3 sigma; for a drafter that agrees with the target (its argmax) and one that does not."""
    from deepinfer.ops.sampling.torch_ref import SamplingMetadata, sample
    from deepinfer.scheduler.drafts import accepted

    num = 100_000
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    draft = 0 if agrees else 4
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(num)]
    metadata = SamplingMetadata.build(
        params, [[1]] * num, [[]] * num, [7] * num, eos_token_id=None, device="cpu"
    )
    samples = sample(p.log().expand(num, -1).contiguous(), metadata).token_ids.tolist()
    # What the verification keeps at the drafted position: samples[0] is the token before it.
    kept = [accepted([draft], [s, -1]) for s in samples]
    is_accepted = torch.tensor([len(k) == 2 for k in kept])
    rate, want = is_accepted.float().mean().item(), p[draft].item()
    assert abs(rate - want) < 3 * (want * (1 - want) / num) ** 0.5
    residual = p.clone()
    residual[draft] = 0
    residual /= residual.sum()
    rejected = torch.tensor(samples)[~is_accepted]
    counts = torch.bincount(rejected, minlength=5).float() / len(rejected)
    sigma = (residual * (1 - residual) / len(rejected)).sqrt()
    assert ((counts - residual).abs() <= 3 * sigma + 1e-12).all(), (counts, residual)
