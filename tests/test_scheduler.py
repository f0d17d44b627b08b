"""Scheduler: exact chunks per step, admission, preemption, prompt logprobs, finish reasons.

A fake executor stands in for the device: it samples a chosen token id (default 1) for every
request with do_sample and returns one ``{position: 0.0}`` dict per prompt-logprob position, so
tests can see exactly which positions were delivered.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from deepinfer.config import SchedulerConfig
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.output import ModelRunnerOutput, RequestOutputDelta, SchedulerOutput
from deepinfer.scheduler.request import Request, RequestStatus
from deepinfer.scheduler.scheduler import Scheduler

EOS = 2


def make_scheduler(
    *,
    budget: int = 64,
    max_num_seqs: int = 8,
    threshold: int = 0,
    block_size: int = 4,
    num_blocks: int = 64,
    num_state_slots: int = 8,
    max_model_len: int = 256,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
    )
    return Scheduler(
        config,
        block_size=block_size,
        num_blocks=num_blocks,
        num_state_slots=num_state_slots,
        max_model_len=max_model_len,
    )


def make_request(request_id: str, num_prompt_tokens: int, **params: object) -> Request:
    params.setdefault("max_tokens", 100)
    prompt = list(range(100, 100 + num_prompt_tokens))
    return Request(request_id, prompt, SamplingParams(**params), eos_token_id=EOS)  # type: ignore[arg-type]


def fake_runner_output(output: SchedulerOutput, tokens: dict[str, int]) -> ModelRunnerOutput:
    result = ModelRunnerOutput()
    for scheduled in output.scheduled:
        request_id = scheduled.request_id
        if scheduled.do_sample:
            token_id = tokens.get(request_id, 1)
            result.sampled_token_ids[request_id] = [token_id]
            if scheduled.request.sampling_params.logprobs is not None:
                result.logprobs[request_id] = [{token_id: -0.5}]
        start, num_positions = scheduled.start_pos, scheduled.num_prompt_logprob_positions
        if num_positions:
            positions = range(start, start + num_positions)
            result.prompt_logprobs[request_id] = [{p: 0.0} for p in positions]
    return result


def step(
    scheduler: Scheduler, tokens: dict[str, int] | None = None
) -> tuple[SchedulerOutput, list[RequestOutputDelta]]:
    output = scheduler.schedule()
    scheduler.check_integrity()
    deltas = scheduler.update(output, fake_runner_output(output, tokens or {}))
    scheduler.check_integrity()
    return output, deltas


def chunks(output: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request id, start_pos, num_tokens, do_sample) per scheduled request."""
    return [(s.request_id, s.start_pos, s.num_tokens, s.do_sample) for s in output.scheduled]


def tables(output: SchedulerOutput) -> dict[str, list[int]]:
    return {s.request_id: s.block_table for s in output.scheduled}


def logprob_positions(output: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: s.num_prompt_logprob_positions for s in output.scheduled}


def delta_positions(delta: RequestOutputDelta) -> list[int]:
    return [next(iter(d)) for d in delta.new_prompt_logprobs or []]


# -- token budget, chunked prefill ----------------------------------------------------------------


def test_decode_and_chunked_prefill_share_the_token_budget() -> None:
    scheduler = make_scheduler(budget=10)
    scheduler.add_request(make_request("A", 6))
    scheduler.add_request(make_request("B", 12))

    out, deltas = step(scheduler)
    assert chunks(out) == [("A", 0, 6, True), ("B", 0, 4, False)]
    assert tables(out) == {"A": [0, 1], "B": [2]}
    assert [s.state_slot for s in out.scheduled] == [0, 1]
    assert out.scheduled[0].token_ids == list(range(100, 106))
    assert [(d.request_id, d.new_token_ids) for d in deltas] == [("A", [1])]

    out, _ = step(scheduler)
    assert chunks(out) == [("A", 6, 1, True), ("B", 4, 8, True)]
    assert tables(out) == {"A": [0, 1], "B": [2, 3, 4]}
    assert out.scheduled[0].token_ids == [1]

    scheduler.add_request(make_request("C", 20))
    out, _ = step(scheduler)
    assert chunks(out) == [("A", 7, 1, True), ("B", 12, 1, True), ("C", 0, 8, False)]
    assert tables(out) == {"A": [0, 1], "B": [2, 3, 4, 5], "C": [6, 7]}
    assert out.num_scheduled_tokens == 10

    out, _ = step(scheduler)
    assert chunks(out) == [("A", 8, 1, True), ("B", 13, 1, True), ("C", 8, 8, False)]
    assert tables(out)["A"] == [0, 1, 8]


def test_long_prefill_threshold_caps_each_chunk() -> None:
    scheduler = make_scheduler(budget=10, threshold=3)
    scheduler.add_request(make_request("A", 7))
    scheduler.add_request(make_request("B", 2))
    assert chunks(step(scheduler)[0]) == [("A", 0, 3, False), ("B", 0, 2, True)]
    assert chunks(step(scheduler)[0]) == [("A", 3, 3, False), ("B", 2, 1, True)]
    assert chunks(step(scheduler)[0]) == [("A", 6, 1, True), ("B", 3, 1, True)]
    assert chunks(step(scheduler)[0]) == [("A", 7, 1, True), ("B", 4, 1, True)]


def test_budget_runs_out_before_later_running_requests() -> None:
    scheduler = make_scheduler(budget=2)
    for request_id in "ABC":
        scheduler.add_request(make_request(request_id, 1))
    assert chunks(step(scheduler)[0]) == [("A", 0, 1, True), ("B", 0, 1, True)]
    assert chunks(step(scheduler)[0]) == [("A", 1, 1, True), ("B", 1, 1, True)]
    assert scheduler.num_waiting == 1


# -- admission ------------------------------------------------------------------------------------


def test_admission_waits_for_a_free_state_slot() -> None:
    scheduler = make_scheduler(num_state_slots=2)
    scheduler.add_request(make_request("A", 3, max_tokens=1))
    scheduler.add_request(make_request("B", 3))
    scheduler.add_request(make_request("C", 3))
    out, deltas = step(scheduler)
    assert chunks(out) == [("A", 0, 3, True), ("B", 0, 3, True)]
    assert deltas[0].finish_reason == "length"
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    out, _ = step(scheduler)
    assert chunks(out) == [("B", 3, 1, True), ("C", 0, 3, True)]
    assert out.freed_request_ids == {"A"}
    assert out.scheduled[1].state_slot == 0  # A's slot, the lowest free id
    assert tables(out)["C"] == [2]  # A's block [0] went to the back of the free list


def test_admission_is_capped_by_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for request_id in "ABC":
        scheduler.add_request(make_request(request_id, 2))
    assert chunks(step(scheduler)[0]) == [("A", 0, 2, True), ("B", 0, 2, True)]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)


def test_admission_waits_for_blocks_and_never_skips_the_head() -> None:
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("A", 10, max_tokens=1))  # 3 blocks
    scheduler.add_request(make_request("B", 8))  # 2 blocks: does not fit
    scheduler.add_request(make_request("C", 2))  # 1 block would fit, but C is behind B
    out, _ = step(scheduler)
    assert chunks(out) == [("A", 0, 10, True)]
    assert scheduler.num_waiting == 2
    out, _ = step(scheduler)
    assert chunks(out) == [("B", 0, 8, True), ("C", 0, 2, True)]
    assert tables(out) == {"B": [3, 2], "C": [1]}  # [3] then A's table [0, 1, 2] tail first


# -- preemption -----------------------------------------------------------------------------------


def test_preemption_takes_the_newest_running_request_even_itself() -> None:
    scheduler = make_scheduler(num_blocks=6, threshold=4)
    scheduler.add_request(make_request("A", 4, max_tokens=4))
    scheduler.add_request(make_request("B", 3))
    scheduler.add_request(make_request("C", 8))
    out, _ = step(scheduler)
    assert chunks(out) == [("A", 0, 4, True), ("B", 0, 3, True), ("C", 0, 4, False)]
    assert tables(out) == {"A": [0], "B": [1], "C": [2]}
    out, _ = step(scheduler)
    assert chunks(out) == [("A", 4, 1, True), ("B", 3, 1, True), ("C", 4, 4, True)]
    assert tables(out) == {"A": [0, 3], "B": [1], "C": [2, 4]}

    # B needs a block; only [5] is free. C needs a third block, none is left: C is the newest,
    # so it preempts itself and frees [2, 4] (tail first: 4, 2).
    out, _ = step(scheduler)
    assert chunks(out) == [("A", 5, 1, True), ("B", 4, 1, True)]
    assert tables(out) == {"A": [0, 3], "B": [1, 5]}
    assert out.preempted_request_ids == {"C"}
    assert out.freed_request_ids == {"C"}
    c = scheduler.get_request("C")
    assert c is not None
    assert (c.status, c.num_computed_tokens, c.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert (c.block_table, c.state_slot, c.output_token_ids) == ([], None, [1])
    # C's first chunk would fit in the freed blocks, but a step that preempted admits nobody.
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)

    out, deltas = step(scheduler)
    assert chunks(out) == [("A", 6, 1, True), ("B", 5, 1, True), ("C", 0, 4, False)]
    assert tables(out)["C"] == [4]
    assert out.scheduled[2].token_ids == list(range(100, 104))
    assert out.scheduled[2].state_slot == 2
    assert out.preempted_request_ids == set()
    assert deltas[0].finish_reason == "length"  # A frees [0, 3]: free list [3, 0]
    out, _ = step(scheduler)
    assert chunks(out) == [("B", 6, 1, True), ("C", 4, 4, False)]
    assert out.scheduled[1].token_ids == [104, 105, 106, 107]
    assert tables(out)["C"] == [4, 2]
    out, _ = step(scheduler)
    assert chunks(out) == [("B", 7, 1, True), ("C", 8, 1, True)]
    assert out.scheduled[1].token_ids == [1]  # C's output token from before the preemption
    assert tables(out)["C"] == [4, 2, 3]


def test_preempted_victims_return_to_the_queue_front_in_admission_order() -> None:
    scheduler = make_scheduler(num_blocks=3)
    scheduler.add_request(make_request("A", 4, max_tokens=2))
    scheduler.add_request(make_request("B", 4))
    scheduler.add_request(make_request("C", 4))
    scheduler.add_request(make_request("D", 1))
    out, _ = step(scheduler)
    assert chunks(out) == [("A", 0, 4, True), ("B", 0, 4, True), ("C", 0, 4, True)]
    # A needs a second block: C goes first, then B (the newest left) preempts itself.
    out, deltas = step(scheduler)
    assert chunks(out) == [("A", 4, 1, True)]
    assert tables(out) == {"A": [0, 2]}
    assert out.preempted_request_ids == {"B", "C"}
    assert deltas[0].finish_reason == "length"
    # Waiting: [B, C, D]. A's blocks [0, 2] and the free [1] give B two blocks, then C none.
    out, _ = step(scheduler)
    assert chunks(out) == [("B", 0, 5, True)]
    assert tables(out) == {"B": [1, 2]}
    assert out.freed_request_ids == {"A"}
    assert scheduler.num_waiting == 2


# -- prompt logprobs ------------------------------------------------------------------------------


def test_prompt_logprobs_follow_the_chunks() -> None:
    scheduler = make_scheduler(threshold=4)
    scheduler.add_request(make_request("A", 10, prompt_logprobs=1))
    out, deltas = step(scheduler)
    assert logprob_positions(out) == {"A": 4}
    assert [(d.new_token_ids, delta_positions(d)) for d in deltas] == [([], [0, 1, 2, 3])]
    out, deltas = step(scheduler)
    assert delta_positions(deltas[0]) == [4, 5, 6, 7]
    out, deltas = step(scheduler)  # chunk [8, 10): only position 8 scores a prompt token
    assert chunks(out) == [("A", 8, 2, True)]
    assert logprob_positions(out) == {"A": 1}
    assert [(d.new_token_ids, delta_positions(d)) for d in deltas] == [([1], [8])]
    out, deltas = step(scheduler)
    assert logprob_positions(out) == {"A": 0}
    assert deltas[0].new_prompt_logprobs is None


def test_prompt_logprobs_are_not_delivered_twice_after_preemption() -> None:
    scheduler = make_scheduler(budget=4, num_blocks=4)
    scheduler.add_request(make_request("A", 4, max_tokens=4))
    scheduler.add_request(make_request("L", 14, max_tokens=1, prompt_logprobs=0))
    assert chunks(step(scheduler)[0]) == [("A", 0, 4, True)]
    out, deltas = step(scheduler)
    assert chunks(out) == [("A", 4, 1, True), ("L", 0, 3, False)]
    assert delta_positions(deltas[1]) == [0, 1, 2]
    out, deltas = step(scheduler)
    assert delta_positions(deltas[1]) == [3, 4, 5]
    out, deltas = step(scheduler)  # L needs a third block: preempted with 6 positions delivered
    assert chunks(out) == [("A", 6, 1, True)]
    assert out.preempted_request_ids == {"L"}
    assert deltas[0].finish_reason == "length"
    # The recompute stops its chunk at position 6, so the wanted ones are a prefix of the next.
    expected = [
        ([("L", 0, 4, False)], {"L": 0}, []),
        ([("L", 4, 2, False)], {"L": 0}, []),
        ([("L", 6, 4, False)], {"L": 4}, [6, 7, 8, 9]),
        ([("L", 10, 4, True)], {"L": 3}, [10, 11, 12]),
    ]
    for want_chunks, want_positions, want_delivered in expected:
        out, deltas = step(scheduler)
        assert chunks(out) == want_chunks
        assert logprob_positions(out) == want_positions
        assert [p for d in deltas for p in delta_positions(d)] == want_delivered
    assert not scheduler.has_unfinished_requests()


# -- finish reasons -------------------------------------------------------------------------------


def run_until_finished(scheduler: Scheduler, tokens: list[int]) -> list[RequestOutputDelta]:
    """Run one request, sampling ``tokens`` in turn; return its deltas."""
    deltas: list[RequestOutputDelta] = []
    for token_id in tokens:
        deltas += step(scheduler, {"A": token_id})[1]
        if not scheduler.has_unfinished_requests():
            break
    return deltas


@pytest.mark.parametrize(
    ("params", "tokens", "num_output_tokens", "finish_reason", "stop_reason"),
    [
        ({}, [5, EOS, 5], 2, "stop", None),
        ({"stop_token_ids": [7]}, [5, 7, 5], 2, "stop", 7),
        ({"stop_token_ids": [EOS]}, [EOS], 1, "stop", None),  # EOS is checked first
        ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS, EOS], 3, "length", None),
        ({"min_tokens": 2}, [EOS, EOS, 5], 2, "stop", None),
        ({"min_tokens": 3, "stop_token_ids": [7]}, [7, 7, 7, 7], 3, "stop", 7),
        ({"max_tokens": 3}, [5, 5, 5, 5], 3, "length", None),
        ({"max_tokens": None}, [5] * 10, 4, "length", None),  # max_model_len 8, prompt 4
    ],
)
def test_token_level_finish_reasons(
    params: dict[str, object],
    tokens: list[int],
    num_output_tokens: int,
    finish_reason: str,
    stop_reason: int | None,
) -> None:
    scheduler = make_scheduler(max_model_len=8)
    request = make_request("A", 4, **params)
    scheduler.add_request(request)
    deltas = run_until_finished(scheduler, tokens)
    assert [d.new_token_ids for d in deltas] == [[t] for t in tokens[:num_output_tokens]]
    assert [d.finish_reason for d in deltas] == [None] * (num_output_tokens - 1) + [finish_reason]
    assert (deltas[-1].stop_reason, request.stop_reason) == (stop_reason, stop_reason)
    assert request.finish_reason == finish_reason
    assert scheduler.get_request("A") is None
    assert (request.block_table, request.state_slot) == ([], None)
    assert scheduler.block_manager.num_free_blocks == 64
    assert scheduler.schedule().freed_request_ids == {"A"}


def test_length_is_capped_by_the_kv_pool() -> None:
    scheduler = make_scheduler(num_blocks=2, max_model_len=100)
    request = make_request("A", 5, max_tokens=None)
    scheduler.add_request(request)
    deltas = run_until_finished(scheduler, [5] * 10)
    assert (request.num_tokens, request.finish_reason) == (8, "length")
    assert len(deltas) == 3


def test_sampled_logprobs_are_appended_and_delivered() -> None:
    scheduler = make_scheduler()
    request = make_request("A", 3, logprobs=1, max_tokens=2)
    scheduler.add_request(request)
    deltas = run_until_finished(scheduler, [5, 6])
    assert [d.new_logprobs for d in deltas] == [[{5: -0.5}], [{6: -0.5}]]
    assert request.output_logprobs == [{5: -0.5}, {6: -0.5}]


# -- abort and finish from outside ----------------------------------------------------------------


def test_abort_in_every_state_frees_everything() -> None:
    scheduler = make_scheduler(num_blocks=3, num_state_slots=2)
    scheduler.add_request(make_request("A", 4))
    scheduler.add_request(make_request("B", 4))
    scheduler.add_request(make_request("W", 4))  # waiting: no slot
    step(scheduler)
    step(scheduler)  # A needs a second block: B preempts itself
    b, w = scheduler.get_request("B"), scheduler.get_request("W")
    assert b is not None and w is not None
    assert (b.status, w.status) == (RequestStatus.PREEMPTED, RequestStatus.WAITING)
    assert scheduler.abort_requests(["W", "B", "nope", "B"]) == ["W", "B"]
    assert (b.finish_reason, w.finish_reason) == ("abort", "abort")
    assert scheduler.abort_requests(["A"]) == ["A"]
    scheduler.check_integrity()
    assert not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == 3
    assert scheduler.state_slots.num_free_slots == 2
    assert scheduler.schedule().freed_request_ids == {"A", "B", "W"}


def test_abort_between_schedule_and_update_is_skipped() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("A", 4))
    scheduler.add_request(make_request("B", 4))
    out = scheduler.schedule()
    assert scheduler.abort_requests(["A"]) == ["A"]
    deltas = scheduler.update(out, fake_runner_output(out, {}))
    assert [d.request_id for d in deltas] == ["B"]
    scheduler.check_integrity()
    assert scheduler.block_manager.num_used_blocks == 1
    out = scheduler.schedule()
    assert (chunks(out), out.freed_request_ids) == ([("B", 4, 1, True)], {"A"})


def test_finish_requests_for_a_stop_string() -> None:
    scheduler = make_scheduler()
    request = make_request("A", 4)
    scheduler.add_request(request)
    step(scheduler)
    assert scheduler.finish_requests(["A"], RequestStatus.FINISHED_STOPPED, "###") == ["A"]
    assert (request.finish_reason, request.stop_reason) == ("stop", "###")
    assert scheduler.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="needs a finished status, got RUNNING"):
        scheduler.finish_requests(["A"], RequestStatus.RUNNING)


# -- validation -----------------------------------------------------------------------------------


def test_add_request_validation_names_the_numbers() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=12)
    with pytest.raises(ValueError, match="prompt has 12 tokens but max_model_len is 12"):
        scheduler.add_request(make_request("A", 12))
    scheduler = make_scheduler(num_blocks=4, max_model_len=100)
    with pytest.raises(ValueError, match=r"needs 17 KV positions .* 4 blocks x 4 tokens = 16"):
        scheduler.add_request(make_request("A", 16))
    scheduler.add_request(make_request("A", 15))
    with pytest.raises(ValueError, match="'A' is already in use"):
        scheduler.add_request(make_request("A", 3))


# -- randomized -----------------------------------------------------------------------------------


def run_random_trial(rng: random.Random) -> None:
    block_size = rng.choice([4, 8])
    num_blocks = rng.randint(2, 10)
    max_model_len = rng.randint(4, 64)
    capacity = min(max_model_len, num_blocks * block_size)
    config = {
        "budget": rng.randint(1, 24),
        "max_num_seqs": rng.randint(1, 5),
        "threshold": rng.choice([0, rng.randint(1, 12)]),
    }
    scheduler = make_scheduler(
        **config,
        block_size=block_size,
        num_blocks=num_blocks,
        num_state_slots=rng.randint(1, 4),
        max_model_len=max_model_len,
    )
    arrivals: dict[int, list[Request]] = {}
    for i in range(rng.randint(1, 10)):
        max_tokens = rng.choice([None, rng.randint(1, 20)])
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, max_tokens or 3),
            stop_token_ids=rng.sample(range(10), rng.randint(0, 2)),
            ignore_eos=rng.random() < 0.3,
            prompt_logprobs=rng.choice([None, 0, 2]),
            logprobs=rng.choice([None, 1]),
        )
        prompt = [rng.randrange(10) for _ in range(rng.randint(1, capacity - 1))]
        request = Request(f"r{i}", prompt, params, eos_token_id=rng.choice([None, 0]))
        arrivals.setdefault(rng.randint(0, 15), []).append(request)
    requests = [r for batch in arrivals.values() for r in batch]
    computed: dict[str, int] = {}  # request id -> end of its last chunk
    preemptions: dict[str, int] = {}
    delivered: dict[str, list[int]] = {r.request_id: [] for r in requests}

    for step_index in range(3000):
        for request in arrivals.get(step_index, []):
            scheduler.add_request(request)
        if step_index > 15 and not scheduler.has_unfinished_requests():
            break
        if rng.random() < 0.03:
            scheduler.abort_requests([rng.choice(requests).request_id])
        out = scheduler.schedule()
        scheduler.check_integrity()
        assert out.num_scheduled_tokens <= config["budget"]
        assert len(out.scheduled) <= config["max_num_seqs"]
        for s in out.scheduled:
            request = s.request
            if config["threshold"]:
                assert s.num_tokens <= config["threshold"]
            if request.num_preemptions != preemptions.get(request.request_id, 0):
                preemptions[request.request_id] = request.num_preemptions
                computed[request.request_id] = 0
            assert s.start_pos == computed.get(request.request_id, 0)
            end = s.start_pos + s.num_tokens
            computed[request.request_id] = end
            assert s.token_ids == request.all_token_ids[s.start_pos : end]
            assert len(s.block_table) == -(-end // block_size)
            assert s.do_sample == (end == request.num_tokens)
        if out.scheduled and rng.random() < 0.05:
            scheduler.finish_requests(
                [rng.choice(out.scheduled).request_id], RequestStatus.FINISHED_STOPPED, "stop"
            )
        tokens = {s.request_id: rng.randrange(10) for s in out.scheduled}
        for delta in scheduler.update(out, fake_runner_output(out, tokens)):
            positions = delta_positions(delta)
            seen = delivered[delta.request_id]
            assert positions == list(range(len(seen), len(seen) + len(positions)))
            seen += positions
        scheduler.check_integrity()
    else:
        raise AssertionError(f"requests still unfinished after 3000 steps: {config}")

    assert scheduler.block_manager.num_free_blocks == num_blocks
    assert scheduler.state_slots.num_free_slots == scheduler.state_slots.num_slots
    for request in requests:
        assert request.is_finished and request.block_table == []
        if request.finish_reason == "length":
            max_tokens = request.sampling_params.max_tokens
            assert request.num_output_tokens == max_tokens or request.num_tokens == capacity
        wants_logprobs = request.sampling_params.prompt_logprobs is not None
        if wants_logprobs and request.output_token_ids:
            assert delivered[request.request_id] == list(range(request.num_prompt_tokens - 1))


def test_random_workloads_finish_without_leaks() -> None:
    seeds = random.Random(20240611)
    for _ in range(200):
        run_random_trial(random.Random(seeds.getrandbits(32)))


def test_scheduler_import_does_not_import_torch() -> None:
    code = "import deepinfer.scheduler.scheduler, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
