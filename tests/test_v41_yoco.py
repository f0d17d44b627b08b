"""YoCo prefill truncation on the tiny DeepSeek-V4.1 (``model.yoco_truncation``, keep 12 tokens:
the tiny window 8 + room): compact equals mask exactly, for prompts shorter than, equal to and
longer than the kept tail, chunked and batched; under compact the engine's invariants hold
(batched = alone, preempted = plain, a prefix hit = cold); what cannot hold is refused.

compact against off is an approximation by design: its agreement is printed, not asserted.
Tolerance: 1e-5 on logprobs between our own runs; greedy tokens identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_spies import record_preemptions
from oracle import oracle_prompts, sampled_logprobs

from deepinfer import LLM, SamplingParams
from deepinfer.outputs import RequestOutput

SELF_ATOL = 1e-5
KEEP = 12
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0)


@pytest.fixture(scope="module", autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)


def _llm(folder: Path, mode: str, **kw: Any) -> LLM:
    return LLM(
        model=folder,
        device="cpu",
        dtype="float32",
        yoco_truncation=mode,
        yoco_keep_tokens=KEEP,
        **kw,
    )


def _prompts() -> list[list[int]]:
    """Shorter than the kept tail, exactly it, and longer (18, 80 and 88 tokens)."""
    short, mid, long = oracle_prompts()
    return [mid[:7], mid[:KEEP], short, long[:80], mid]


def _assert_same(a: list[RequestOutput], b: list[RequestOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
        diff = (sampled_logprobs(x) - sampled_logprobs(y)).abs().max().item()
        assert diff < SELF_ATOL, f"logprobs differ by {diff:.2e}"


@pytest.fixture(scope="module")
def mask_alone(tiny_v41_dir: Path) -> list[RequestOutput]:
    llm = _llm(tiny_v41_dir, "mask")
    return [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in _prompts()]


def test_compact_equals_mask_chunked_batched_and_preempted(
    tiny_v41_dir: Path, mask_alone: list[RequestOutput]
) -> None:
    """compact alone, and compact batched with chunks of 37 tokens (the longer prompts' chunks
    before their kept tails keep one placeholder row each) under a pool that preempts: the mask
    run's tokens and logprobs."""
    compact = _llm(tiny_v41_dir, "compact")
    _assert_same(mask_alone, [compact.generate([p], PARAMS, use_tqdm=False)[0] for p in _prompts()])
    tight = _llm(tiny_v41_dir, "compact", block_size=16, num_blocks=14, max_num_batched_tokens=37)
    preempted = record_preemptions(tight)
    _assert_same(mask_alone, tight.generate(_prompts(), PARAMS, use_tqdm=False))
    # Chunks of 17: one starts exactly at the 80-token prompt's kept tail (68 = 4 * 17), whose
    # windows still reach before it (the consumer half must narrow them).
    seventeen = _llm(tiny_v41_dir, "compact", max_num_batched_tokens=17)
    _assert_same(mask_alone[3:4], seventeen.generate(_prompts()[3:4], PARAMS, use_tqdm=False))
    assert preempted, "the memory limit was meant to force a preemption"
    assert tight.engine.scheduler.block_manager.num_used_blocks == 0
    tight.engine.scheduler.check_integrity()


def test_window_lists_derived_on_the_device_change_nothing(
    tiny_v41_dir: Path, mask_alone: list[RequestOutput], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step's window lists derived on the device (v4 step_plan.WindowPlan), the consumer
    half's narrowed ones (mask) and its kept spans' (compact) included: the host lists'
    tokens and logprobs."""
    from deepinfer.model.deepseek_v4 import step_plan

    monkeypatch.setattr(step_plan, "WINDOW_ON_DEVICE_MIN_TOKENS", 0)
    for mode in ("mask", "compact"):
        llm = _llm(tiny_v41_dir, mode, max_num_batched_tokens=37)
        _assert_same(mask_alone, llm.generate(_prompts(), PARAMS, use_tqdm=False))


def test_compact_against_off(tiny_v41_dir: Path, mask_alone: list[RequestOutput]) -> None:
    """An approximation by design: prompts no longer than the kept tail are exact, the others
    agree as far as they do (printed)."""
    off = _llm(tiny_v41_dir, "off")
    plain = [off.generate([p], PARAMS, use_tqdm=False)[0] for p in _prompts()]
    _assert_same(plain[:2], mask_alone[:2])  # no longer than the kept tail: nothing truncated
    same = sum(
        a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        for a, b in zip(plain[2:], mask_alone[2:], strict=True)
    )
    diff = max(
        (sampled_logprobs(a)[:1] - sampled_logprobs(b)[:1]).abs().item()
        for a, b in zip(plain[2:], mask_alone[2:], strict=True)
    )
    print(
        f"compact vs off, prompts past the kept tail: top-1 {same}/3, max |logprob diff| {diff:.3f}"
    )


def test_prefix_hits_recompute_the_kept_tail(tiny_v41_dir: Path) -> None:
    """A hit never covers the kept tail (its consumer-half rows depend on the prompt's own
    length): the hit stops KEEP tokens before the prompt's end, and matches a cold run. The
    last prompt (124 tokens) keeps 112..123; its chunks are cut at the hit (96) and at the
    snapshot boundary 112, so a chunk starts right at its kept tail."""
    cold = _llm(tiny_v41_dir, "compact", block_size=16, enable_prefix_caching=False)
    warm = _llm(tiny_v41_dir, "compact", block_size=16, host_tier_gib=0.01)
    first = oracle_prompts()[2][:120]
    warm.generate([first], PARAMS, use_tqdm=False)
    tail = oracle_prompts()[1][1:25]
    cases = (([*first[:100], 7, 8, 9], 80), (first[:100] + tail, 96))
    for prompt, cached in cases:
        out = warm.generate([prompt], PARAMS, use_tqdm=False)[0]
        assert out.num_cached_tokens == cached, (len(prompt), out.num_cached_tokens)
        assert cached <= len(prompt) - KEEP
        _assert_same([cold.generate([prompt], PARAMS, use_tqdm=False)[0]], [out])


def test_what_truncation_cannot_serve_is_refused(tiny_v41_dir: Path, oracle_hf_dir: Path) -> None:
    llm = _llm(tiny_v41_dir, "compact")
    with pytest.raises(ValueError, match="prompt_logprobs are not available"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)
    with pytest.raises(ValueError, match=r"yoco_keep_tokens=6 must be >= the sliding window \(8\)"):
        LLM(model=tiny_v41_dir, device="cpu", dtype="float32", yoco_truncation="compact",
            yoco_keep_tokens=6)  # fmt: skip
    with pytest.raises(ValueError, match="deepseek_v4 checkpoints have no YoCo layers"):
        LLM(model=oracle_hf_dir, device="cpu", dtype="float32", yoco_truncation="mask")
