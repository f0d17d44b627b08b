"""Deterministic mode: a request's tokens and logprobs are bit-identical alone and inside batches
of random other requests, with odd chunk sizes and preemption, greedy and seeded sampling."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from engine_spies import record_preemptions

from deepinfer import LLM, SamplingParams
from deepinfer.model.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


def _llm(folder: Path, **kw) -> LLM:
    torch.set_num_threads(2)
    return LLM(model=folder, device="cpu", block_size=16, deterministic=True, **kw)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [0] + [rng.randrange(3, 128000) for _ in range(n - 1)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_alone_equals_batched_chunked_preempted(tiny_dir: Path, temperature: float) -> None:
    rng = random.Random(int(temperature * 10))
    target = _prompt(rng, 45)
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=12, logprobs=0)
    alone = _llm(tiny_dir).generate([target], params, use_tqdm=False)[0].outputs[0]

    # 12 blocks of 16 tokens for five requests of up to 57 + 12 tokens: preemptions; chunks of
    # 23 tokens split prefills at odd offsets and mix them with decodes.
    busy = _llm(tiny_dir, num_blocks=12, max_num_batched_tokens=23)
    preempted = record_preemptions(busy)
    others = [_prompt(rng, rng.randrange(10, 57)) for _ in range(4)]
    other_params = SamplingParams(temperature=1.0, max_tokens=rng.randrange(4, 12))
    prompts = [*others[:2], target, *others[2:]]
    outs = busy.generate(
        prompts, [other_params, other_params, params, other_params, other_params], use_tqdm=False
    )
    assert preempted, "the small pool was meant to force preemption"
    batched = outs[2].outputs[0]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == alone.logprobs  # bit-identical floats, not just close


def test_one_deterministic_request_among_batched_ones(tiny_dir: Path) -> None:
    """Per request: only the request that asks runs one token per forward; it gives what it
    gives alone while the others batch, chunk and get preempted around it."""
    rng = random.Random(5)
    target = _prompt(rng, 41)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, logprobs=0, deterministic=True)
    plain = dict(model=tiny_dir, device="cpu", block_size=16)
    alone = LLM(**plain).generate([target], params, use_tqdm=False)[0].outputs[0]
    busy = LLM(**plain, num_blocks=12, max_num_batched_tokens=23)
    forwards: list[int] = []
    model_forward = busy.engine.executor.model.forward

    def spy(batch, cache):
        forwards.append(batch.num_tokens)
        return model_forward(batch, cache)

    busy.engine.executor.model.forward = spy
    others = [_prompt(rng, rng.randrange(10, 57)) for _ in range(4)]
    other_params = SamplingParams(temperature=1.0, max_tokens=8)
    outs = busy.generate(
        [others[0], target, *others[1:]],
        [other_params, params, *[other_params] * 3],
        use_tqdm=False,
    )
    assert outs[1].outputs[0].token_ids == alone.token_ids
    assert outs[1].outputs[0].logprobs == alone.logprobs  # bit-identical
    assert max(forwards) > 1, "the other requests were meant to run batched"
