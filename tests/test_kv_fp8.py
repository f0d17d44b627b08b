"""The FP8 KV cache (cache.kv_dtype = "fp8"), on the CPU: the row format (ops/attention/kv_fp8.py),
packed cache parts as attention key sources, and the engine.

The oracle of the engine test is a bf16-layout run whose stored keys (and a step's own keys,
read as stored) go through the same FP8 round trip: the two runs then compute on the same values,
so their tokens and logprobs must be equal, which checks the packed path (stores, gathers, the
block layout, snapshots, the prefix cache), not the rounding.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model.deepseek_v4 import step_plan
from deepinfer.ops.attention import torch_ref
from deepinfer.ops.attention.kv_fp8 import Fp8Layout, Fp8Rows
from deepinfer.ops.norm import CompressRows
from deepinfer.ops.norm import torch_ref as norm_torch_ref

V4_FLASH = Fp8Layout(512, 64)
TINY = Fp8Layout(64, 16)  # the built-in model: head_dim 64, a quarter of it RoPE


def _rows(gen: torch.Generator, num: int, layout: Fp8Layout) -> torch.Tensor:
    """Rows whose tiles differ in magnitude by up to 2^12, some entries zero."""
    values = torch.randn(num, layout.head_dim, generator=gen)
    values *= torch.exp2(torch.randint(-6, 7, (num, 1), generator=gen).float())
    values[0, :8] = 0.0
    return values


def test_layout_sizes_match_flashmla() -> None:
    assert (V4_FLASH.data_bytes, V4_FLASH.scale_bytes, V4_FLASH.row_bytes) == (576, 8, 584)
    assert (TINY.tile, TINY.num_tiles, TINY.row_bytes) == (48, 1, 48 + 32 + 8)


@pytest.mark.parametrize("layout", [V4_FLASH, TINY], ids=["v4_flash", "tiny"])
def test_round_trip_error_is_e4m3_rounding_and_rope_stays_bf16(layout: Fp8Layout) -> None:
    values = _rows(torch.Generator().manual_seed(0), 33, layout)
    back = layout.roundtrip(values)
    assert back.dtype == values.dtype and back.shape == values.shape
    rope = slice(layout.nope_dim, None)
    assert torch.equal(back[:, rope], values[:, rope].bfloat16().float())
    nope = values[:, : layout.nope_dim].bfloat16().float().view(33, layout.num_tiles, -1)
    got = back[:, : layout.nope_dim].view(33, layout.num_tiles, -1)
    # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative); below 2^-6 of the tile's scale the
    # subnormal step 2^-9 x scale (half: 2^-10); scale = 2^ceil(log2(amax / 448)).
    scale = torch.exp2(torch.ceil(torch.log2((nope.abs().amax(-1) / 448).clamp(min=1e-4))))
    bound = torch.maximum(nope.abs() * 2**-4, scale[..., None] * 2**-10)
    assert ((got - nope).abs() <= bound).all()
    assert (got[0, 0, :8] == 0).all()
    # A second round trip changes nothing: stored values are fixed points.
    assert torch.equal(layout.roundtrip(back), back)


def test_packed_part_stores_and_gathers_rows_in_flashmla_block_order() -> None:
    layout, groups, per = TINY, 3, 4
    part = torch.zeros(groups, per, layout.row_bytes, dtype=torch.uint8)
    rows = Fp8Rows.of(part, layout)
    assert rows.num_rows == groups * per
    values = _rows(torch.Generator().manual_seed(1), 5, layout)
    index = torch.tensor([0, 5, 6, 11, 3])
    rows.store(index, values)
    assert torch.equal(rows.gather(index).float(), layout.roundtrip(values))
    assert torch.equal(rows.gather(index[[1, 1]]), rows.gather(torch.tensor([5, 5])))
    # Row 5 = group 1, row 1: its data after row 0's in the group's first per * data_bytes
    # bytes, its scales after the group's data.
    data, scales = layout.pack(values[1:2])
    group = part[1].flatten()
    d, sb = layout.data_bytes, layout.scale_bytes
    assert torch.equal(group[d : 2 * d], data[0])
    assert torch.equal(group[per * d + sb : per * d + 2 * sb], scales[0])
    assert (part[2, :, :].flatten()[: 2 * d] == 0).all()  # group 2's rows 0, 1 untouched


def test_attention_over_packed_rows_is_attention_over_their_values() -> None:
    gen = torch.Generator().manual_seed(2)
    layout, heads, num_q = V4_FLASH, 4, 6
    part = torch.zeros(2, 8, layout.row_bytes, dtype=torch.uint8)
    packed = Fp8Rows.of(part, layout)
    packed.store(torch.arange(16), _rows(gen, 16, layout))
    dense = packed.gather(torch.arange(16)).float()
    step_kv = torch.randn(num_q, layout.head_dim, generator=gen)
    q = torch.randn(num_q, heads, layout.head_dim, generator=gen)
    idx = torch.randint(-1, 16, (num_q, 7), generator=gen)
    step_idx = torch.arange(num_q).view(-1, 1)
    sinks = torch.randn(heads, generator=gen)
    scale = layout.head_dim**-0.5
    out = torch_ref.sparse_attention(q, [(step_kv, step_idx), (packed, idx)], sinks, scale)
    expected = torch_ref.sparse_attention(q, [(step_kv, step_idx), (dense, idx)], sinks, scale)
    assert torch.allclose(out, expected, rtol=0, atol=1e-5)


def _round_tripped_dense_cache(
    monkeypatch: pytest.MonkeyPatch,
    backend: type,
    norm_backend: type = norm_torch_ref.TorchRefNormBackend,
) -> None:
    """The model's KV writes and a step's own keys FP8-rounded in a dense cache: the oracle,
    through the cache writes of the attention backend class ``backend`` (and those that
    ``norm_backend`` makes itself into a dense cache, the compressors' entries and a few
    tokens' ring rows, through them too). Only KV rows (head_dim wide) round-trip; the
    indexer's keys stay as they are."""
    pool, norm_rope = norm_backend.compress_windows, norm_backend.rms_norm_rope

    def as_stored(target: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return TINY.roundtrip(values)

    def store_rows(
        target: torch.Tensor,
        index: torch.Tensor,
        values: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> None:
        values = values if rows is None else values[rows]
        if values.shape[-1] == TINY.head_dim:
            values = TINY.roundtrip(values)
        target[index] = values.to(target.dtype)

    def compress_windows(
        kv: torch.Tensor, gate: torch.Tensor, rows: CompressRows, *args: object
    ) -> torch.Tensor:
        unstored = dataclasses.replace(rows, entries=None, entry_dst=None)
        pooled = pool(kv, gate, unstored, *args)
        if rows.entries is not None and rows.entry_dst is not None and pooled.shape[0]:
            store_rows(rows.entries, rows.entry_dst, pooled)
        return pooled

    monkeypatch.setattr(backend, "as_stored", staticmethod(as_stored))
    monkeypatch.setattr(backend, "store_rows", staticmethod(store_rows))

    def rms_norm_rope(
        *args: object, store: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        y = norm_rope(*args)
        if store is not None:
            store_rows(*store, y)
        return y

    def rms_norm_rope_pair(
        x: torch.Tensor,
        k: torch.Tensor,
        weights: tuple[torch.Tensor | None, torch.Tensor | None],
        *args: object,
        store: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm_rope(x, weights[0], *args), rms_norm_rope(k, weights[1], *args, store=store)

    monkeypatch.setattr(norm_backend, "compress_windows", staticmethod(compress_windows))
    monkeypatch.setattr(norm_backend, "rms_norm_rope", staticmethod(rms_norm_rope))
    monkeypatch.setattr(norm_backend, "rms_norm_rope_pair", staticmethod(rms_norm_rope_pair))


def test_engine_on_fp8_kv_gives_the_tokens_of_round_tripped_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(2)
    # Prompts past the window (8) and several compression windows (4, 16), and a repeat that
    # the prefix cache serves.
    prompts = ["The quick brown fox jumps over the lazy dog " * 6, "1 2 3 4 5 6 7 8 9 10 11 12"]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    common = {"device": "cpu", "block_size": 16}

    fp8 = LLM(**common, kv_dtype="fp8")
    part = fp8.engine.executor.kv_cache[1, "entries"]
    assert part.dtype == torch.uint8 and part.shape[-1] == TINY.row_bytes
    first = fp8.generate(prompts, params, use_tqdm=False)
    again = fp8.generate(prompts, params, use_tqdm=False)  # prefix cache hits
    assert again[0].num_cached_tokens >= 32  # whole blocks of the long prompt came from it
    del fp8

    with monkeypatch.context() as patch:
        _round_tripped_dense_cache(patch, torch_ref.TorchRefAttentionBackend)
        oracle = LLM(**common).generate(prompts, params, use_tqdm=False)
    plain = LLM(**common).generate(prompts, params, use_tqdm=False)

    def tokens(outputs):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    assert tokens(first) == tokens(oracle)
    assert tokens(again) == tokens(first)
    # The rounding is real: the unrounded cache's logprobs differ somewhere.
    assert tokens(plain) != tokens(first)


def test_window_from_ring_gives_the_tokens_of_two_window_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A backend that reads a packed window from the ring alone (FlashMLA's) gets the step's
    keys stored into the ring before attention and one list of ring rows (StepMetadata.ring_window)
    at every decode step, the prefill keeping the two sources. The keys and their order are the
    same, so the oracle's tokens and logprobs are equal (unpadded: -1 columns would lengthen its
    sums, which changes fp32's rounding)."""
    torch.set_num_threads(2)
    prompts = ["The quick brown fox jumps over the lazy dog " * 3, "1 2 3 4 5 6 7 8 9 10 11 12"]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    common = {"device": "cpu", "block_size": 16, "kv_dtype": "fp8"}
    two_sources = LLM(**common).generate(prompts, params, use_tqdm=False)

    merged = []
    ring_window = step_plan.StepMetadata.ring_window

    def kept(meta: step_plan.StepMetadata) -> torch.Tensor:
        merged.append(ring_window(meta))
        return merged[-1]

    always = staticmethod(lambda num_tokens: True)
    monkeypatch.setattr(torch_ref.TorchRefAttentionBackend, "window_from_ring", always)
    monkeypatch.setattr(step_plan.StepMetadata, "ring_window", kept)
    monkeypatch.setattr(step_plan, "RING_WINDOW_COLUMNS", 1)
    from_ring = LLM(**common).generate(prompts, params, use_tqdm=False)
    # Decode steps (a token a request) read it: one list a step, shared by the layers.
    assert len({id(m) for m in merged}) >= params.max_tokens - 1
    assert all(m.dtype == torch.int32 and m.shape[0] == len(prompts) for m in merged)

    def tokens(outputs):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    assert tokens(from_ring) == tokens(two_sources)


def test_a_v41_model_refuses_fp8_kv_by_name(tiny_v41_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"cache\.kv_dtype = 'fp8' is built for DeepSeek-V4"):
        LLM(model=tiny_v41_dir, device="cpu", block_size=16, kv_dtype="fp8")
