"""The FP8 KV cache (cache.kv_dtype = "fp8") on CUDA with the Triton kernels and CUDA graphs:
the tokens and logprobs of a bf16-layout run whose stored keys go through the same FP8 round
trip (tests/test_kv_fp8.py's oracle, here in bf16 on the GPU), also through the prefix cache.

The kernel walks packed sources source by source (``PER_SOURCE``); the oracle walks its dense
ones the same way, so both sum the same tiles in the same order and greedy tokens may be
compared exactly (the tiny model's 16-head tiles would otherwise straddle sources).
"""

from __future__ import annotations

import pytest
import torch
from test_kv_fp8 import TINY, _round_tripped_dense_cache

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def test_fp8_kv_on_cuda_gives_the_tokens_of_round_tripped_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    common = {"device": "cuda", "dtype": "bfloat16", "block_size": 16, "max_model_len": 1024}
    common["gpu_memory_utilization"] = 0.1
    prompts = ["The quick brown fox jumps over the lazy dog " * 8, "1 2 3 4 5 6 7 8 9 10 11 12"]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)

    fp8 = LLM(**common, kv_dtype="fp8")
    executor = fp8.engine.executor
    assert type(executor.kernels.attention).__module__ == "deepinfer.ops.attention.triton"
    assert executor.kv_cache[1, "ring"].shape[-1] == TINY.row_bytes
    first = fp8.generate(prompts, params, use_tqdm=False)
    again = fp8.generate(prompts, params, use_tqdm=False)
    assert again[0].num_cached_tokens >= 32
    del fp8, executor
    torch.cuda.empty_cache()
    with monkeypatch.context() as patch:
        # Imported here, not at collection (where the CPU tests want the interpreted module).
        from deepinfer.ops.attention.triton import AttentionConfig, TritonAttentionBackend

        _round_tripped_dense_cache(patch, TritonAttentionBackend)
        patch.setattr(AttentionConfig, "per_source", property(lambda self: True))
        oracle = LLM(**common).generate(prompts, params, use_tqdm=False)

    def tokens(outputs):
        return [o.outputs[0].token_ids for o in outputs]

    assert tokens(first) == tokens(oracle)
    assert tokens(again) == tokens(first)
