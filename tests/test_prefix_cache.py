"""Prefix caching on the oracle checkpoint: a request served from cached blocks (with a snapshot
restore or a bounded replay) gives the same tokens and logprobs as the same request computed
cold; the replay cost is what the design says; a replay shorter than the bound is wrong.

Tolerance: 1e-5 on sampled-token logprobs between our own runs (same kernels, other shapes).
Requests with prompt logprobs skip the lookup, so sampled-token logprobs are compared.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle import oracle_prompts, sampled_logprobs

from deepinfer import LLM, SamplingParams
from deepinfer.outputs import RequestOutput

ATOL = 1e-5
BLOCK = 16  # a multiple of the oracle's ratios (CSA 4, HCA 16)
REPLAY_BOUND = 5 * (8 - 1)  # num_layers * (window - 1) of the oracle model
BASE = 160  # divergence points are BASE + in-block offset
OFFSETS = {"0": 0, "1": 1, "csa_ratio-1": 3, "window-1": 7, "window": 8, "block-1": 15}


def _llm(folder: Path, **kw) -> LLM:
    torch.set_num_threads(2)
    return LLM(model=folder, device="cpu", dtype="float32", block_size=BLOCK, **kw)


@pytest.fixture(scope="module")
def cold(oracle_hf_dir: Path) -> LLM:
    return _llm(oracle_hf_dir, enable_prefix_caching=False)


PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)


def _first() -> list[int]:
    return oracle_prompts()[2]  # 301 tokens


def _diverging(offset: int) -> list[int]:
    """The first prompt up to BASE + offset, then other text."""
    tail = oracle_prompts()[1][1:41]
    return _first()[: BASE + offset] + tail


def _assert_same(warm: RequestOutput, cold: RequestOutput) -> None:
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    diff = (sampled_logprobs(warm) - sampled_logprobs(cold)).abs().max().item()
    assert diff < ATOL, f"logprobs differ by {diff:.2e}"


def _run(llm: LLM, prompt: list[int]) -> tuple[RequestOutput, int, int]:
    """Output, tokens replayed and snapshots restored for this request."""
    prefix = llm.engine.scheduler.prefix
    replayed, restored = prefix.stats.num_replayed_tokens, prefix.snapshots.stats.num_restored
    out = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    return (
        out,
        prefix.stats.num_replayed_tokens - replayed,
        prefix.snapshots.stats.num_restored - restored,
    )


@pytest.mark.parametrize(("interval", "first_replay"), [(0, REPLAY_BOUND), (2, 0), (3, BLOCK)])
def test_hit_matches_cold(oracle_hf_dir: Path, cold: LLM, interval: int, first_replay: int) -> None:
    """Snapshots of the first prompt every ``interval`` blocks (0: only at its last full block).
    The first hit at BASE finds none on its path (replays the bound, from an empty slot), one at
    the boundary (replays nothing) or one a block back (replays that block); it then leaves a
    snapshot at the boundary, so the later hits there replay nothing."""
    warm = _llm(oracle_hf_dir, snapshot_interval_blocks=interval)
    _run(warm, _first())
    for i, (name, offset) in enumerate(OFFSETS.items()):
        prompt = _diverging(offset)
        out, replayed, restored = _run(warm, prompt)
        assert out.num_cached_tokens == BASE, name
        expected = (int(i > 0 or interval > 0), first_replay if i == 0 else 0)
        assert (restored, replayed) == expected, name
        _assert_same(out, cold.generate([prompt], PARAMS, use_tqdm=False)[0])
    warm.engine.scheduler.check_integrity()


def test_fully_cached_prompt_computes_its_last_token(oracle_hf_dir: Path, cold: LLM) -> None:
    warm = _llm(oracle_hf_dir)
    prompt = _first()[: 12 * BLOCK]  # a multiple of the block size
    _run(warm, _first())
    out, replayed, restored = _run(warm, prompt)
    assert out.num_cached_tokens == 11 * BLOCK  # the last block holds the token to compute
    assert restored == 0 and replayed == REPLAY_BOUND
    _assert_same(out, cold.generate([prompt], PARAMS, use_tqdm=False)[0])
    again, replayed, restored = _run(warm, prompt)  # its own prompt snapshot is now cached
    assert restored == 1 and replayed == 0
    _assert_same(again, out)


def test_replay_shorter_than_the_bound_is_wrong(oracle_hf_dir: Path, cold: LLM) -> None:
    short = _llm(
        oracle_hf_dir, snapshot_interval_blocks=0, replay_tokens_override=REPLAY_BOUND // 3
    )
    _run(short, _first())
    prompt = _diverging(OFFSETS["window"])
    out, replayed, _ = _run(short, prompt)
    assert replayed == REPLAY_BOUND // 3
    reference = cold.generate([prompt], PARAMS, use_tqdm=False)[0]
    diff = (sampled_logprobs(out) - sampled_logprobs(reference)).abs().max().item()
    assert diff > ATOL, f"a too-short replay should be visibly wrong, max diff {diff:.2e}"


def test_multi_turn_hits_its_own_history(oracle_hf_dir: Path, cold: LLM) -> None:
    """Blocks filled while decoding enter the cache: the next turn, which repeats the reply,
    hits past the first prompt, restoring the finished request's last-block snapshot."""
    warm = _llm(oracle_hf_dir)
    first = _first()[:100]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    reply = warm.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids
    second = first + reply + oracle_prompts()[0][1:]
    out, replayed, restored = _run(warm, second)
    assert out.num_cached_tokens == (100 + 40 - 1) // BLOCK * BLOCK == 128
    assert restored == 1 and replayed == 0
    _assert_same(out, cold.generate([second], PARAMS, use_tqdm=False)[0])
