"""Verification steps (scheduler/drafts.py): a test drafter proposes the plain run's own next
tokens, with every third one wrong, and the engine verifies up to three per request per step.
The tokens and logprobs must be the plain run's, for greedy and seeded sampling and a grammar,
beside a request that does not draft, through chunked prefill, preemption and prefix hits, with
asynchronous scheduling on and off; and drafts must really have been both accepted and
rejected."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model.tiny import make_tiny_model
from deepinfer.outputs import RequestOutput
from deepinfer.scheduler.output import ModelRunnerOutput, SchedulerOutput
from deepinfer.scheduler.request import Request

NUM_NEW = 20
PROMPTS = [
    [(11 * i + 5) % 997 + 3 for i in range(21)],
    [(13 * i + 7) % 991 + 3 for i in range(9)],
    [(17 * i + 1) % 983 + 3 for i in range(40)],
    [(19 * i + 2) % 977 + 3 for i in range(12)],
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=NUM_NEW, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=7, max_tokens=NUM_NEW, logprobs=1, ignore_eos=True),
    # Does not draft (see _Drafter): batched beside the others.
    SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True),
    # A grammar: each drafted position is masked by the state after the drafts before it.
    SamplingParams(
        seed=4, max_tokens=12, logprobs=1, constraint=("regex", "[a-z]{2,6}( [a-z]{2,6})*")
    ),
]
DRAFTED = (0, 1, 3)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def _llm(folder: Path, async_scheduling: bool, **kw: object) -> LLM:
    torch.set_num_threads(2)
    return LLM(
        model=folder,
        device="cpu",
        block_size=16,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=24,  # chunked prefill of the longer prompts
        **kw,
    )


def _generate(llm: LLM) -> list[RequestOutput]:
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def plain(tiny_dir: Path) -> list[RequestOutput]:
    return _generate(_llm(tiny_dir, async_scheduling=False))


class _Drafter:
    """The plain run's continuation, every third guess wrong; nothing for PROMPTS[2]."""

    def __init__(self, plain: list[RequestOutput]) -> None:
        self.truth = {tuple(PROMPTS[i]): plain[i].outputs[0].token_ids for i in DRAFTED}
        self.num_proposed = 0

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        truth = self.truth.get(tuple(request.prompt_token_ids))
        if truth is None:
            return []
        done = request.num_output_tokens
        guesses = list(truth[done : done + max_tokens])
        for i in range(len(guesses)):
            if (done + i) % 3 == 2:
                guesses[i] = guesses[i] % 900 + 5
        self.num_proposed += len(guesses)
        return guesses


def _count_verdicts(llm: LLM) -> Counter[str]:
    counts: Counter[str] = Counter()
    scheduler = llm.engine.scheduler
    update = scheduler.update

    def spy(out: SchedulerOutput, result: ModelRunnerOutput) -> list:
        for s in out.scheduled:
            tokens = result.sampled_token_ids.get(s.request_id)
            if s.num_draft_tokens and tokens:
                counts["accepted"] += len(tokens) - 1
                counts["rejected"] += s.num_draft_tokens - (len(tokens) - 1)
        return update(out, result)

    schedule = scheduler.schedule

    def spy_schedule() -> SchedulerOutput:
        out = schedule()
        counts["preempted"] += len(out.preempted_request_ids)
        return out

    scheduler.update = spy  # type: ignore[method-assign]
    scheduler.schedule = spy_schedule  # type: ignore[method-assign]
    return counts


def _assert_same(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or [], strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 1e-4 for t in a), (a, b)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_verified_drafts_give_the_plain_tokens(
    tiny_dir: Path, plain: list[RequestOutput], async_scheduling: bool
) -> None:
    # 9 blocks of 16 for requests of 41, 29, 60 and 24 tokens: the newest are preempted.
    llm = _llm(tiny_dir, async_scheduling, max_draft_tokens=3, num_blocks=9)
    drafter = _Drafter(plain)
    llm.engine.set_drafter(drafter)
    counts = _count_verdicts(llm)
    _assert_same(_generate(llm), plain)
    again = _generate(llm)  # the prompts' full blocks are prefix-cache hits now
    _assert_same(again, plain)
    assert sum(o.num_cached_tokens for o in again) >= 16, [o.num_cached_tokens for o in again]
    assert drafter.num_proposed and counts["accepted"] and counts["rejected"], counts
    assert counts["preempted"], counts


def test_a_drafter_needs_a_rollback_margin(tiny_dir: Path, plain: list[RequestOutput]) -> None:
    llm = _llm(tiny_dir, async_scheduling=False)
    with pytest.raises(ValueError, match="max_draft_tokens > 0"):
        llm.engine.set_drafter(_Drafter(plain))
