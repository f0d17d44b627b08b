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
    # The Triton kernels on the CPU tests' model (FlashMLA takes none of its calls, but its
    # backend would give the decode steps' window as one source, in another order).
    common = {"device": "cuda", "dtype": "bfloat16", "block_size": 16, "max_model_len": 1024}
    common["attention"] = "triton"
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
        from deepinfer.ops.norm.triton import TritonNormBackend

        _round_tripped_dense_cache(patch, TritonAttentionBackend, TritonNormBackend)
        patch.setattr(AttentionConfig, "per_source", property(lambda self: True))
        oracle = LLM(**common).generate(prompts, params, use_tqdm=False)

    def tokens(outputs):
        return [o.outputs[0].token_ids for o in outputs]

    assert tokens(first) == tokens(oracle)
    assert tokens(again) == tokens(first)


def test_prefill_chunks_unpack_packed_rows_to_the_same_attention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From UNPACK_MIN_TOKENS query tokens the Triton op unpacks the rows its lists name and
    runs the dense kernel: on V4-Flash shapes (64 heads of 512, bf16), a 300-token chunk's
    output matches the kernel's own read of the packed rows and the dense kernel over the
    rows unpacked by torch, holes included."""
    from deepinfer.ops.attention import triton as ours
    from deepinfer.ops.attention.kv_fp8 import Fp8Layout, Fp8Rows

    layout, num_q, heads, gen = Fp8Layout(512, 64), 300, 64, torch.Generator("cuda").manual_seed(0)
    ring = Fp8Rows.of(
        torch.zeros(4, 144, layout.row_bytes, dtype=torch.uint8, device="cuda"), layout
    )
    ring.store(
        torch.arange(576, device="cuda"), torch.randn(576, 512, device="cuda", generator=gen)
    )
    pool = Fp8Rows.of(
        torch.zeros(64, 32, layout.row_bytes, dtype=torch.uint8, device="cuda"), layout
    )
    pool.store(
        torch.arange(2048, device="cuda"), torch.randn(2048, 512, device="cuda", generator=gen)
    )
    ring_idx = torch.randint(-1, 576, (num_q, 128), device="cuda", generator=gen)
    pool_idx = torch.randint(-1, 2048, (num_q, 512), device="cuda", generator=gen)
    q = torch.randn(num_q, heads, 512, device="cuda", generator=gen).bfloat16()
    sinks = torch.randn(heads, device="cuda", generator=gen)
    packed = [(ring, ring_idx), (pool, pool_idx)]
    dense = [(ring.gather(torch.arange(576, device="cuda")), ring_idx)]
    dense.append((pool.gather(torch.arange(2048, device="cuda")), pool_idx))

    unpacked = ours.sparse_attention(q, packed, sinks, 512**-0.5).float()
    over_dense = ours.sparse_attention(q, dense, sinks, 512**-0.5).float()
    monkeypatch.setattr(ours, "UNPACK_MIN_TOKENS", 10**9)
    in_kernel = ours.sparse_attention(q, packed, sinks, 512**-0.5).float()

    assert torch.equal(unpacked, over_dense)  # the same rows, the same kernel and tiles
    assert ((in_kernel - unpacked).norm() / unpacked.norm()).item() < 1e-2
