"""The engine against the oracle (transformers' deepseek_v4 on the same tiny weights), and against
itself: batched, chunked and preempted runs must reproduce the run alone.

Tolerances: 1e-4 on prompt logprobs against transformers (fp32, different op order); 1e-5
between our own runs (same kernels, different batch/chunk shapes). Greedy tokens: identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_spies import graph_shaped, record_preemptions
from oracle import (
    hf_greedy,
    hf_prompt_logprobs,
    oracle_prompts,
    prompt_token_logprobs,
    sampled_logprobs,
)

from deepinfer import LLM, SamplingParams
from deepinfer.outputs import RequestOutput

ORACLE_ATOL = 1e-4
SELF_ATOL = 1e-5
NUM_NEW = 32


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def llm_hf(oracle_hf_dir: Path) -> LLM:
    return LLM(model=oracle_hf_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def llm_upstream(oracle_upstream_dir: Path) -> LLM:
    return LLM(model=oracle_upstream_dir, device="cpu", dtype="float32")


def _greedy(logprobs: int | None = 0, prompt_logprobs: int | None = 0) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW, logprobs=logprobs, prompt_logprobs=prompt_logprobs
    )


def test_prompts_cross_windows() -> None:
    lengths = [len(p) for p in oracle_prompts()]
    assert len(lengths) >= 3 and len(set(lengths)) == len(lengths) and max(lengths) >= 300


@pytest.mark.parametrize("naming", ["hf", "upstream"])
def test_matches_transformers(naming: str, request: pytest.FixtureRequest) -> None:
    llm: LLM = request.getfixturevalue(f"llm_{naming}")
    folder = request.getfixturevalue(f"oracle_{naming}_dir")
    for prompt in oracle_prompts():
        out = llm.generate([prompt], _greedy(), use_tqdm=False)[0]
        ours = prompt_token_logprobs(out)
        theirs = hf_prompt_logprobs(folder, prompt)
        diff = (ours - theirs).abs().max().item()
        assert diff < ORACLE_ATOL, f"prompt of {len(prompt)} tokens: max |diff| {diff:.2e}"
        assert out.outputs[0].token_ids == hf_greedy(folder, prompt, NUM_NEW)
        assert out.outputs[0].finish_reason == "length"


def _run_alone(llm: LLM, params: SamplingParams) -> list[RequestOutput]:
    return [llm.generate([p], params, use_tqdm=False)[0] for p in oracle_prompts()]


def _assert_same(alone: list[RequestOutput], together: list[RequestOutput]) -> None:
    for a, b in zip(alone, together, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for name, fn in (("prompt", prompt_token_logprobs), ("sampled", sampled_logprobs)):
            diff = (fn(a) - fn(b)).abs().max().item()
            assert diff < SELF_ATOL, f"{name} logprobs differ by {diff:.2e}"


def test_batched_chunked_preempted_match_alone(llm_hf: LLM, oracle_hf_dir: Path) -> None:
    alone = _run_alone(llm_hf, _greedy())
    # Blocks of 16 tokens and 30 of them: the three prompts (+32 tokens each) need 36, so the
    # youngest request is preempted mid-generation and recomputed. Chunks of 37 tokens split
    # prefills at odd offsets inside compression windows and mix them with decode tokens.
    tight = LLM(
        model=oracle_hf_dir,
        device="cpu",
        dtype="float32",
        block_size=16,
        num_blocks=30,
        max_num_batched_tokens=37,
    )
    preempted = record_preemptions(tight)
    together = tight.generate(oracle_prompts(), _greedy(), use_tqdm=False)
    assert preempted, "the memory limit was meant to force a preemption"
    _assert_same(alone, together)
    assert tight.engine.scheduler.block_manager.num_used_blocks == 0
    tight.engine.scheduler.check_integrity()


def test_window_lists_derived_on_the_device_change_nothing(
    llm_hf: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step's window lists derived on the device (step_plan.WindowPlan, for steps of
    WINDOW_ON_DEVICE_MIN_TOKENS tokens and more; here all, decode steps' ring reads included):
    the tokens and logprobs of the host's lists."""
    from deepinfer.model.deepseek_v4 import step_plan

    alone = _run_alone(llm_hf, _greedy())
    monkeypatch.setattr(step_plan, "WINDOW_ON_DEVICE_MIN_TOKENS", 0)
    _assert_same(alone, _run_alone(llm_hf, _greedy()))


def test_seeded_sampling_is_batch_invariant(llm_hf: LLM) -> None:
    prompts = oracle_prompts()
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=NUM_NEW)
    other = SamplingParams(temperature=1.0, max_tokens=NUM_NEW)
    alone = llm_hf.generate([prompts[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm_hf.generate(
        [prompts[0], prompts[1], prompts[2]], [other, seeded, other], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    # A different seed gives a different continuation (the seed really is used).
    reseeded = SamplingParams(temperature=0.8, top_p=0.95, seed=4321, max_tokens=NUM_NEW)
    assert llm_hf.generate([prompts[1]], reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_graph_shaped_decode_steps_match_the_eager_path(llm_hf: LLM, oracle_hf_dir: Path) -> None:
    """Decode steps as CUDA graphs run them (requests padded onto the scratch slot, entry lists
    padded to the context bucket, a candidate window pooled for every request), run eagerly on
    the CPU: the same tokens and logprobs as the plain path, alone."""
    alone = _run_alone(llm_hf, _greedy())
    padded = LLM(model=oracle_hf_dir, device="cpu", dtype="float32", block_size=16)
    steps = graph_shaped(padded.engine.executor)
    together = padded.generate(oracle_prompts(), _greedy(), use_tqdm=False)
    assert (3, 1) in steps, f"no decode step of all three requests ran padded: {steps}"
    _assert_same(alone, together)
