"""Speculative decoding on CUDA, fp32, TF32 off: with n-gram drafts, the MTP layer's and (on the
tiny V4.1, lengths scheduled by its confidence head) DSpark's, the tiny model's tokens and
logprobs are those of the plain run (Triton kernels, decode graphs on: the verify steps replay
graphs of 1 + k rows per request, every step with MTP and DSpark, the few with n-gram drafts the
random weights allow), batched, chunked, preempted, with prefix hits and asynchronous scheduling
on; every graph was captured at start-up; and the verify steps are timed (their times include
first-use kernel compilation here: the figures are benchmarks/spec_verify.py's)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.cuda_graphs import row_buckets
from deepinfer.model.tiny import make_tiny_model

pytestmark = pytest.mark.gpu

PROMPTS = [
    [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9],
    [(13 * i) % 50 + 3 for i in range(30)] * 2,
    [(17 * i + 1) % 983 + 3 for i in range(40)],
    [101, 102, 103],
    [5, 6] * 9,  # n-gram drafts whatever the model says: verify steps replay graphs
]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=5)


@pytest.fixture(scope="module")
def tiny_v41(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny41") / "model"
    return make_tiny_model(folder, model_type="deepseek_v41", seed=5)


def _run(folder: Path, **kw: object) -> tuple[list, LLM]:
    llm = LLM(
        model=folder,
        device="cuda",
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=24,
        max_model_len=1024,
        gpu_memory_utilization=0.1,
        async_scheduling=True,
        **kw,
    )
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    outputs += llm.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False)  # prefix hits
    assert outputs[-1].num_cached_tokens > 0  # the 60-token prompt
    llm.engine.scheduler.check_integrity()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], llm


@pytest.mark.parametrize("method", ["ngram", "mtp", "dspark"])
def test_tokens_with_drafts_are_those_without_on_cuda(
    tiny_dir: Path,
    tiny_v41: Path,
    ieee_fp32: None,
    method: str,
    record_figure: Callable[[str], None],
) -> None:
    """dspark: the tiny V4.1 (its drafter's block of 4), verification lengths scheduled by the
    confidence head, knowing the graph rows."""
    folder = tiny_v41 if method == "dspark" else tiny_dir
    plain, _ = _run(folder)
    spec: dict = {"method": method, "num_speculative_tokens": 3}
    if method == "dspark":
        spec = {"method": method, "num_speculative_tokens": 4, "verify_schedule": "confidence"}
    drafted, llm = _run(folder, speculative_config=spec, num_blocks=8)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(drafted, plain, strict=True):
        assert tokens == want_tokens
        for a, b in zip(logprobs or [], want_logprobs or [], strict=True):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    stats = llm.engine.spec_stats()
    assert stats["num_drafts"] > 0 and llm.engine.num_preemptions > 0
    steps = sum(stats["verify_time_counts"])
    assert steps > 0
    graphs = llm.engine.executor.graphs
    assert graphs is not None and graphs.row_buckets == row_buckets(
        1 + spec["num_speculative_tokens"]
    )
    assert graphs.num_captures_while_serving == 0
    if method == "dspark":  # the schedule prices steps by the rows of the graphs they replay
        schedule = llm.engine.scheduler.verify_schedule
        assert schedule is not None and schedule.row_buckets == tuple(graphs.row_buckets)
    if method != "ngram":  # every decode step verifies drafts (on random weights n-grams rarely)
        assert graphs.num_verify_replays > 0
    record_figure(
        f"speculative {method} (tiny, fp32): tokens = plain run's; {stats['num_drafts']} runs, "
        f"{stats['num_accepted_tokens']}/{stats['num_draft_tokens']} drafts accepted, "
        f"{llm.engine.num_preemptions} preemptions, {steps} verify steps timed, "
        f"{graphs.num_verify_replays} of them graph replays"
    )
    torch.cuda.synchronize()
