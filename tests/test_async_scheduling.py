"""Asynchronous scheduling (llm_engine.py): step N+1 is scheduled and launched before step N's
tokens reach the host. The tokens must be those of synchronous scheduling, through preemption,
prefix-cache hits, grammars, penalties, min_tokens and aborts, and nothing may leak."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model.tiny import make_tiny_model
from deepinfer.scheduler.output import PLACEHOLDER_TOKEN_ID, SchedulerOutput


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def _llm(folder: Path, async_scheduling: bool, **kw) -> LLM:
    torch.set_num_threads(2)
    return LLM(model=folder, device="cpu", block_size=16, async_scheduling=async_scheduling, **kw)


class _Spy:
    """Counts what the scheduler hands out (placeholders fed, samples scheduled per request),
    how often the engine waited for the step in flight before scheduling (``syncs``), and how
    often it applied that step between a forward and its sampler (``mask_waits``: grammars)."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.engine
        scheduler = engine.scheduler
        self.placeholders = 0
        self.samples: Counter[str] = Counter()
        self.syncs = 0
        self.mask_waits = 0
        self.preemptions = 0
        schedule, needs = scheduler.schedule, scheduler.needs_sampled_tokens
        launch = engine._launch
        assert launch is not None, "the engine schedules synchronously"

        def spy_launch(out: SchedulerOutput, before_sampling=None):
            self.mask_waits += before_sampling is not None
            return launch(out, before_sampling)

        engine._launch = spy_launch

        def spy_schedule() -> SchedulerOutput:
            out = schedule()
            for s in out.scheduled:
                self.placeholders += s.token_ids.count(PLACEHOLDER_TOKEN_ID)
                self.samples[s.request_id] += s.do_sample
            self.preemptions += len(out.preempted_request_ids)
            return out

        def spy_needs() -> bool:
            answer = needs()
            self.syncs += answer
            return answer

        scheduler.schedule = spy_schedule
        scheduler.needs_sampled_tokens = spy_needs


def _assert_nothing_held(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_integrity()
    assert engine.scheduler.block_manager.num_used_blocks == 0
    assert not engine.scheduler.state_slots.used_slots


def _workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Shared prefixes (prefix-cache hits), a grammar (its masks need the previous step's
    token: applied between each forward and its sampler), and penalties and min_tokens, which
    count a pending token on the device; all decode on placeholders."""
    rng = random.Random(seed)
    shared = [0] + [rng.randrange(3, 128000) for _ in range(40)]
    prompts = [
        shared + [rng.randrange(3, 128000) for _ in range(rng.randrange(1, 30))] for _ in range(7)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.8, top_k=50, seed=11, max_tokens=12),
        SamplingParams(temperature=1.0, seed=5, max_tokens=20, logprobs=0),
        SamplingParams(temperature=0.8, seed=2, repetition_penalty=1.3, max_tokens=4),
        SamplingParams(temperature=1.0, seed=9, min_tokens=3, max_tokens=5),
        SamplingParams(seed=4, max_tokens=5, constraint=("regex", "[a-z]{2,6}( [a-z]{2,6})*")),
        SamplingParams(temperature=0.0, max_tokens=24),
    ]
    return prompts, params


@pytest.mark.parametrize("num_blocks", [None, 14])
def test_async_gives_the_tokens_of_sync(tiny_dir: Path, num_blocks: int | None) -> None:
    """Same tokens (and logprobs to float noise) with and without asynchronous scheduling; with
    14 blocks the pool forces preemption of requests whose next token is still in flight."""
    prompts, params = _workload(0)
    sync_llm = _llm(tiny_dir, False, num_blocks=num_blocks, max_num_batched_tokens=48)
    expected = sync_llm.generate(prompts, params, use_tqdm=False)
    async_llm = _llm(tiny_dir, True, num_blocks=num_blocks, max_num_batched_tokens=48)
    spy = _Spy(async_llm)
    got = async_llm.generate(prompts, params, use_tqdm=False)
    for want, have in zip(expected, got, strict=True):
        a, b = want.outputs[0], have.outputs[0]
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        if a.logprobs is not None:
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.keys() == y.keys()
                assert all(abs(x[t] - y[t]) < 1e-4 for t in x)
    assert spy.placeholders > 20, "decode steps were meant to run on placeholders"
    assert spy.mask_waits > 0, "the grammar request's masks need the previous step's tokens"
    if num_blocks is not None:
        assert spy.preemptions > 0, "the small pool was meant to force preemption"
    _assert_nothing_held(async_llm)


def test_length_limits_waste_no_step_and_a_stop_token_wastes_one(tiny_dir: Path) -> None:
    """A request whose pending token reaches max_tokens is not scheduled again; one stopped by
    a token it sampled had one more step in flight, whose token is dropped."""
    prompts, _ = _workload(1)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    reference = _llm(tiny_dir, False).generate(prompts[:2], greedy, use_tqdm=False)
    stop_at = reference[1].outputs[0].token_ids[3]
    stopping = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_at])
    llm = _llm(tiny_dir, True, enable_prefix_caching=False)
    spy = _Spy(llm)
    outs = llm.generate(prompts[:2], [greedy, stopping], use_tqdm=False)
    by_length, by_stop = outs[0].outputs[0], outs[1].outputs[0]
    assert by_length.token_ids == reference[0].outputs[0].token_ids
    assert by_length.finish_reason == "length"
    assert spy.samples[outs[0].request_id] == 10
    stopped_ids = reference[1].outputs[0].token_ids
    assert by_stop.token_ids == stopped_ids[: stopped_ids.index(stop_at) + 1]
    assert by_stop.finish_reason == "stop"
    assert spy.samples[outs[1].request_id] == len(by_stop.token_ids) + 1
    _assert_nothing_held(llm)


def test_abort_while_a_step_is_in_flight(tiny_dir: Path) -> None:
    """Aborting a request whose next step is already launched frees it at once; that step's
    token never reaches it, the others finish as they would have, and nothing leaks."""
    prompts, _ = _workload(2)
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=12)
    expected = _llm(tiny_dir, False).generate(prompts[:3], params, use_tqdm=False)
    engine = _llm(tiny_dir, True).engine
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {"0": [], "1": [], "2": []}
    aborted_at = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
        if aborted_at is None and len(tokens["1"]) == 4:
            assert engine._in_flight is not None, "a step should be in flight here"
            engine.abort_requests(["1"])
            aborted_at = len(tokens["1"])
    assert tokens["1"] == expected[1].outputs[0].token_ids[:aborted_at]
    assert tokens["0"] == expected[0].outputs[0].token_ids
    assert tokens["2"] == expected[2].outputs[0].token_ids
    engine.scheduler.check_integrity()
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_penalties_and_min_tokens_need_no_sync(tiny_dir: Path) -> None:
    """Repetition, frequency and presence penalties and min_tokens count the token still on
    the device: every decode step runs on placeholders, with the tokens of synchronous
    scheduling (prefix caching off: its block boundaries are the other sync point)."""
    prompts, _ = _workload(3)
    # Penalties that favour repeats: the newest token (the pending one) is what they pull
    # towards, so leaving it out changes the tokens.
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=0.5, max_tokens=16),
        SamplingParams(temperature=0.9, seed=3, frequency_penalty=-2.0, max_tokens=16),
        SamplingParams(temperature=0.0, presence_penalty=-2.0, max_tokens=16, logprobs=1),
        SamplingParams(temperature=1.0, seed=8, min_tokens=12, max_tokens=16),
    ]
    kw = {"enable_prefix_caching": False}
    expected = _llm(tiny_dir, False, **kw).generate(prompts[:4], params, use_tqdm=False)
    llm = _llm(tiny_dir, True, **kw)
    spy = _Spy(llm)
    got = llm.generate(prompts[:4], params, use_tqdm=False)
    for want, have in zip(expected, got, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
    assert spy.syncs == spy.mask_waits == 0
    assert spy.placeholders == sum(len(o.outputs[0].token_ids) - 1 for o in got)
    _assert_nothing_held(llm)
