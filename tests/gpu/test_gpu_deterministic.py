"""Deterministic mode on CUDA: a request alone and inside a busy, chunked, preempting batch gives
bit-identical tokens and logprobs (bf16 and fp32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.model.tiny import make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("quantized") / "model", seed=1, quantized=True)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [0] + [rng.randrange(3, 128000) for _ in range(n - 1)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_alone_equals_batched_on_cuda(tiny_dir: Path, dtype: str, record_figure) -> None:
    _alone_equals_batched(dict(model=tiny_dir, device="cuda", dtype=dtype), record_figure)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_alone_equals_batched_on_fp8_weights(
    quantized_dir: Path, dtype: str, record_figure
) -> None:
    """The quantized tiny checkpoint with every linear FP8 (W8A8) and its FP4 experts packed."""
    common = dict(model=quantized_dir, device="cuda", dtype=dtype)
    _alone_equals_batched(common | dict(fp8_weights=True, fp8_min_weights=0), record_figure)


def _alone_equals_batched(model: dict, record_figure) -> None:
    rng = random.Random(3)
    target = _prompt(rng, 45)
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=12, logprobs=0)
    common = dict(model, block_size=16, deterministic=True)
    dtype = model["dtype"] + (", FP8 weights" if model.get("fp8_weights") else "")
    alone = LLM(**common).generate([target], params, use_tqdm=False)[0].outputs[0]
    busy = LLM(**common, num_blocks=12, max_num_batched_tokens=23)
    others = [_prompt(rng, rng.randrange(10, 57)) for _ in range(4)]
    other = SamplingParams(temperature=1.0, max_tokens=8)
    outs = busy.generate(
        [*others[:2], target, *others[2:]], [other, other, params, other, other], use_tqdm=False
    )
    batched = outs[2].outputs[0]
    assert batched.token_ids == alone.token_ids
    assert batched.logprobs == alone.logprobs
    record_figure(f"deterministic mode, {dtype} CUDA: alone vs batched bit-identical (12 tokens)")
