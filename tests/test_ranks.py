"""Lock-step ranks on the CPU (gloo, one thread per rank): data-parallel attention and
expert-parallel MoE give one process's tokens and logprobs; placeholders, aborts, a killed rank.

Each LLM here starts real rank processes (spawned); one per test module where it can be shared.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from oracle import oracle_prompts, prompt_token_logprobs, sampled_logprobs
from rank_workers import abort_mid_steps

from deepinfer import LLM, SamplingParams
from deepinfer.config import Config
from deepinfer.model.tiny import ensure_tiny_model
from deepinfer.parallel.group import RankGroupError, free_port

TOL = 1e-5
# Chunked prefill (32 tokens a step), 16-token blocks (few enough that a rank preempts).
ENGINE = {"device": "cpu", "num_threads": 1, "max_num_batched_tokens": 32, "block_size": 16}


def _prompts(vocab: int = 129280) -> list[list[int]]:
    """Mixed lengths: 3 to 150 tokens."""
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (3, 150, 41, 9, 77)]


def _params(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, prompt_logprobs=1)


def _assert_same(one: list, ranked: list) -> None:
    for a, b in zip(one, ranked, strict=True):
        assert b.prompt_token_ids == a.prompt_token_ids
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        torch.testing.assert_close(sampled_logprobs(b), sampled_logprobs(a), atol=TOL, rtol=0)
        torch.testing.assert_close(
            prompt_token_logprobs(b), prompt_token_logprobs(a), atol=TOL, rtol=0
        )


@pytest.fixture(scope="module")
def one_process() -> LLM:
    return LLM(**ENGINE, num_blocks=14)


@pytest.fixture(scope="module")
def two_ranks() -> LLM:
    llm = LLM(**ENGINE, num_blocks=14, data_parallel_size=2, enable_expert_parallel=True)
    yield llm
    llm.close()


def test_two_ranks_match_one_process_with_chunks_and_a_preemption(one_process, two_ranks):
    prompts, params = _prompts(), _params(max_tokens=40)
    _assert_same(one_process.generate(prompts, params, use_tqdm=False),
                 two_ranks.generate(prompts, params, use_tqdm=False))  # fmt: skip
    stats = two_ranks.ranks.stats
    assert [s["forward_steps"] > 0 for s in stats] == [True, True]  # both ranks had requests
    assert max(s["num_preemptions"] for s in stats) >= 1, stats
    # Every rank ran the same steps; the MoE exchanges happened on each.
    assert len({s["steps"] for s in stats}) == 1
    # Prefill chunks run first; the last steps decode on both ranks (the agreement says so).
    assert len({s["decode_only_steps"] for s in stats}) == 1
    assert 0 < stats[0]["decode_only_steps"] < stats[0]["steps"]
    assert all(s["exchange_seconds"] > 0 for s in stats)


def test_a_rank_without_requests_runs_placeholder_steps(one_process, two_ranks):
    prompt, params = _prompts()[1:2], _params()
    _assert_same(one_process.generate(prompt, params, use_tqdm=False),
                 two_ranks.generate(prompt, params, use_tqdm=False))  # fmt: skip
    busy, idle = sorted(two_ranks.ranks.stats, key=lambda s: -s["forward_steps"])
    assert idle["forward_steps"] == 0
    assert idle["placeholder_steps"] == busy["forward_steps"] > 0
    assert idle["steps"] == busy["steps"]


def test_each_rank_holds_half_of_the_routed_experts(one_process, two_ranks):
    full = one_process.engine.executor.weight_bytes
    info = two_ranks.ranks.info
    assert [i["experts"] for i in info] == ["0..3", "4..7"]
    assert all(2 * i["expert_bytes"] == full.routed_experts > 0 for i in info)
    assert all(i["weight_bytes"] == full.total - full.routed_experts / 2 for i in info)


@pytest.fixture(scope="module")
def oracle_one_process(oracle_hf_dir) -> list:
    """One process on the oracle (both namings load the same tensors: test_loader.py)."""
    return LLM(oracle_hf_dir, **ENGINE).generate(oracle_prompts(), _params(), use_tqdm=False)


@pytest.mark.parametrize(("folder", "ranks"), [("oracle_hf_dir", 2), ("oracle_upstream_dir", 4)])
def test_oracle_checkpoints_over_ranks_match_one_process(
    folder, ranks, oracle_one_process, request
):
    """Hash-routed layers (0, 1) and score-routed ones, each rank holding 8 / ranks experts."""
    model = request.getfixturevalue(folder)
    llm = LLM(model, **ENGINE, data_parallel_size=ranks, enable_expert_parallel=True)
    try:
        _assert_same(oracle_one_process, llm.generate(oracle_prompts(), _params(), use_tqdm=False))
        assert [i["experts"] for i in llm.ranks.info][-1] == f"{8 - 8 // ranks}..7"
    finally:
        llm.close()


def test_data_parallel_without_expert_parallel_replicates_the_experts(one_process):
    prompts, params = _prompts()[:3], _params()
    llm = LLM(**ENGINE, num_blocks=14, data_parallel_size=2)
    try:
        _assert_same(one_process.generate(prompts, params, use_tqdm=False),
                     llm.generate(prompts, params, use_tqdm=False))  # fmt: skip
        full = one_process.engine.executor.weight_bytes
        assert all(i["experts"] == "all" for i in llm.ranks.info)
        assert all(i["expert_bytes"] == full.routed_experts for i in llm.ranks.info)
        assert all(s["exchange_seconds"] == 0 for s in llm.ranks.stats)
    finally:
        llm.close()


def test_a_rank_that_fails_to_start_ends_the_start_at_once(tmp_path: Path):
    """A rank's start fails (its model folder lacks weights): the others, waiting for it at the
    rendezvous, are stopped too, long before the collective timeout."""
    folder = tmp_path / "no_weights"
    folder.mkdir()
    tiny = ensure_tiny_model(0)
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_bytes((tiny / name).read_bytes())
    start = time.monotonic()
    with pytest.raises(RankGroupError, match=r"did not start.*no model.safetensors"):
        LLM(folder, **ENGINE, data_parallel_size=2, collective_timeout_s=60.0)
    assert time.monotonic() - start < 30


def test_experts_must_split_evenly():
    with pytest.raises(ValueError, match=r"8 routed experts do not split evenly.*3 ranks"):
        LLM(device="cpu", data_parallel_size=3, enable_expert_parallel=True)


def test_killing_a_rank_ends_the_group_with_an_error_for_every_open_request():
    timeout_s = 10.0
    llm = LLM(
        **ENGINE,
        data_parallel_size=2,
        enable_expert_parallel=True,
        collective_timeout_s=timeout_s,
    )
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    raised: list[BaseException] = []
    work = threading.Thread(
        target=lambda: _capture(raised, llm.generate, _prompts()[:4], params, use_tqdm=False)
    )
    work.start()
    time.sleep(3.0)  # well into decoding: 4000 tokens take far longer
    killed = time.monotonic()
    os.kill(llm.ranks.pids[1], signal.SIGKILL)
    work.join(timeout=timeout_s + 10)
    ended = time.monotonic() - killed
    assert not work.is_alive(), "generate still waits on the group"
    assert ended < timeout_s, ended
    assert len(raised) == 1 and isinstance(raised[0], RankGroupError), raised
    error = raised[0]
    assert "rank 1's process died (exit code -9)" in str(error)
    assert sorted(error.failed) == ["0", "1", "2", "3"] and error.finished == []
    with pytest.raises(RankGroupError, match="ended earlier"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert all(not p.is_alive() for p in llm.ranks.processes)


def _capture(raised: list, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except BaseException as error:
        raised.append(error)


def test_an_abort_on_one_rank_keeps_the_ranks_in_step():
    prompts = _prompts()
    plan = {
        "prompts": [{"a": prompts[1], "b": prompts[2]}, {"c": prompts[3]}],
        "abort": "a",
        "abort_after": 4,
        "max_tokens": 10,
    }
    base = Config.load(overrides={"model": {"device": "cpu"}, "kernel": {"num_threads": 1}})
    config = dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, path=str(ensure_tiny_model(0))),
        parallel=dataclasses.replace(
            base.parallel,
            data_parallel_size=2,
            enable_expert_parallel=True,
            data_parallel_master_port=free_port(),
            collective_timeout_s=30.0,
        ),
    )
    context = multiprocessing.get_context("spawn")
    pipes = [context.Pipe() for _ in range(2)]
    ranks = [
        context.Process(target=abort_mid_steps, args=(config, rank, plan, pipes[rank][1]))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    results = [pipes[rank][0].recv() for rank in range(2)]
    for process in ranks:
        process.join(timeout=30)
    (tokens0, stats0, invariant0), (tokens1, stats1, invariant1) = results
    assert stats0["steps"] == stats1["steps"]
    assert 0 < len(tokens0["a"]) < 10 and len(tokens0["b"]) == len(tokens1["c"]) == 10
    one = LLM(**{k: v for k, v in ENGINE.items() if k not in ("block_size",)})
    alone = one.generate([prompts[2], prompts[3]], SamplingParams(temperature=0.0, max_tokens=10,
                         ignore_eos=True), use_tqdm=False)  # fmt: skip
    assert [tokens0["b"], tokens1["c"]] == [o.outputs[0].token_ids for o in alone]
    assert invariant0 and invariant1


def test_a_served_rank_needs_the_rendezvous_port():
    import asyncio

    from server.node import load_engine

    config = Config.load(overrides={"parallel": {"data_parallel_size": 2}})
    with pytest.raises(ValueError, match=r"needs parallel\.data_parallel_master_port"):
        asyncio.run(load_engine(config))
