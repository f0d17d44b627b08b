"""The FlashMLA attention backend's mapping (ops/attention/flashmla_backend.py), on the CPU.

FlashMLA itself runs only on SM90 (tests/gpu/test_gpu_flashmla.py holds it to torch_ref, and
tests/gpu/test_gpu_flashmla_backend.py the engine on it). Here: an engine cache part seen as
FlashMLA's paged cache has the bytes ``flashmla.pack_kv_cache`` lays out (the layout the GPU
test checked against the kernel), the parts FlashMLA cannot read are refused, and a call's
sources, lists, sinks and RoPE reach ``flashmla.sparse_decode`` so that a model of what that
function computes (its docstring: main and extra caches, index lists of block * r + slot)
gives torch_ref's answer.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops.attention import flashmla
from deepinfer.ops.attention import torch_ref as ref
from deepinfer.ops.attention.kv_fp8 import Fp8Layout, Fp8Rows
from deepinfer.ops.norm import torch_ref as norm_ref

LAYOUT = flashmla.LAYOUT


@pytest.fixture
def backend_module():
    from deepinfer.ops.attention import flashmla_backend  # imports the Triton modules

    return flashmla_backend


def _packed_part(groups: int, rows: int, gen: torch.Generator) -> tuple[Fp8Rows, torch.Tensor]:
    """A cache part of ``groups`` x ``rows`` V4 rows as the engine allocates one, filled with
    random rows, and those rows."""
    part = torch.zeros(groups, rows, LAYOUT.row_bytes, dtype=torch.uint8)
    packed = Fp8Rows.of(part, LAYOUT)
    values = torch.randn(groups * rows, LAYOUT.head_dim, generator=gen)
    packed.store(torch.arange(groups * rows), values)
    return packed, values


@pytest.mark.parametrize("rows", [2, 32, 144])
def test_paged_view_is_the_part_in_flashmlas_layout(backend_module, rows: int) -> None:
    packed, values = _packed_part(3, rows, torch.Generator().manual_seed(rows))
    view = backend_module.paged_view(packed)
    assert view is not None and view.dtype == torch.float8_e4m3fn
    assert view.shape == (3, rows, 1, flashmla.BYTES_PER_TOKEN)
    assert view.stride()[1:] == (flashmla.BYTES_PER_TOKEN,) * 2 + (1,)
    assert view.data_ptr() == packed.data.data_ptr()  # the part's own bytes, no copy
    expected = flashmla.pack_kv_cache(values, block_size=rows)
    assert torch.equal(view.view(torch.uint8), expected.view(torch.uint8))


def test_paged_view_refuses_what_flashmla_cannot_read(backend_module) -> None:
    gen = torch.Generator().manual_seed(0)
    odd, _ = _packed_part(4, 1, gen)  # HCA entries at block_size 128: groups 584 bytes apart
    assert backend_module.paged_view(odd) is None
    tiny = Fp8Layout(64, 16)
    part = torch.zeros(2, 4, tiny.row_bytes, dtype=torch.uint8)
    assert backend_module.paged_view(Fp8Rows.of(part, tiny)) is None
    assert backend_module.paged_view(torch.zeros(8, flashmla.HEAD_DIM)) is None
    even, _ = _packed_part(2, 2, gen)
    q = torch.zeros(1, 64, flashmla.HEAD_DIM, dtype=torch.bfloat16)  # a CPU tensor
    assert not backend_module.fits(q, [backend_module.paged_view(even)])


def dense_of(rows: Fp8Rows) -> torch.Tensor:
    """Every row of a packed part, as the kernels read them (fp32)."""
    return rows.gather(torch.arange(rows.num_rows)).float()


def _flashmla_model(q, k_cache, indices, sinks, scale, *, extra_cache=None, extra_indices=None):
    """What ``flashmla.sparse_decode`` computes (its docstring), from FlashMLA's own inputs:
    every query token of batch row b attends to the rows its lists name in each cache."""
    batch, s_q, heads, dim = q.shape
    sources = [(flashmla.unpack_kv_cache(k_cache).float(), indices.flatten(0, 1))]
    if extra_cache is not None:
        sources.append((flashmla.unpack_kv_cache(extra_cache).float(), extra_indices.flatten(0, 1)))
    out = ref.sparse_attention(q.flatten(0, 1), sources, sinks, scale)
    return out.view(batch, s_q, heads, dim)


@pytest.mark.parametrize("num_sources", [1, 2])
def test_a_call_reaches_flashmla_as_its_two_caches(
    backend_module, monkeypatch: pytest.MonkeyPatch, num_sources: int
) -> None:
    gen = torch.Generator().manual_seed(num_sources)
    tokens, heads = 3, 64
    ring, _ = _packed_part(tokens, 144, gen)  # a ring slot a request
    pool, _ = _packed_part(5, 32, gen)  # CSA entries, block_size 128
    window = torch.randint(-1, ring.num_rows, (tokens, 64), generator=gen)
    entries = torch.randint(-1, pool.num_rows, (tokens, 512), generator=gen)
    sources = [(ring, window), (pool, entries)][:num_sources]
    q = torch.randn(tokens, heads, flashmla.HEAD_DIM, generator=gen)
    sinks = torch.randn(heads, generator=gen)
    angles = torch.rand(tokens, 32, generator=gen) * 6
    back = (torch.cos(angles), -torch.sin(angles))

    calls = []

    def sparse_decode(*args, **kwargs):
        calls.append(kwargs.keys())
        return _flashmla_model(*args, **kwargs)

    monkeypatch.setattr(backend_module, "fits", lambda q, caches: True)
    monkeypatch.setattr(backend_module, "MIN_TOKENS", 1)
    monkeypatch.setattr(backend_module.flashmla, "sparse_decode", sparse_decode)
    monkeypatch.setattr(
        backend_module, "apply_rope", lambda x, c, s, num_sms: norm_ref.apply_rope(x, c, s)
    )
    backend = backend_module.FlashMLAAttentionBackend(torch.device("cpu"))
    assert backend.window_from_ring(1) and not backend.window_from_ring(0)
    out = backend.sparse_attention(q, sources, sinks, 0.04, back)
    assert len(calls) == 1 and ("extra_cache" in calls[0]) == (num_sources == 2)
    # An entry list of no columns (no entry closed yet) is left out of the call.
    empty = [sources[0], (pool, entries[:, :0])]
    torch.testing.assert_close(
        backend.sparse_attention(q, empty, sinks, 0.04, back),
        ref.sparse_attention(q, [(dense_of(ring), window)], sinks, 0.04, back),
        rtol=1e-5,
        atol=1e-5,
    )
    assert len(calls) == 2 and "extra_cache" not in calls[1]
    dense = [(dense_of(kv), idx) for kv, idx in sources]
    expected = ref.sparse_attention(q, dense, sinks, 0.04, back)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_prefill_chunk_reaches_flashmla_as_one_source(
    backend_module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk's three sources (its own keys dense, the ring and the entries packed) go to
    FlashMLA's sparse prefill as one: the rows the lists name, renumbered."""
    gen = torch.Generator().manual_seed(7)
    tokens, heads = 6, 64
    step = torch.randn(tokens, flashmla.HEAD_DIM, generator=gen)
    ring, _ = _packed_part(2, 144, gen)
    pool, _ = _packed_part(5, 32, gen)
    sources = [
        (step, torch.randint(-1, tokens, (tokens, 8), generator=gen)),
        (ring, torch.randint(-1, ring.num_rows, (tokens, 128), generator=gen)),
        (pool, torch.randint(-1, pool.num_rows, (tokens, 512), generator=gen)),
    ]
    q = torch.randn(tokens, heads, flashmla.HEAD_DIM, generator=gen)
    sinks = torch.randn(heads, generator=gen)
    angles = torch.rand(tokens, 32, generator=gen) * 6
    back = (torch.cos(angles), -torch.sin(angles))

    calls = []

    def sparse_prefill(q, kv, indices, sinks, scale):
        calls.append(kv.shape[0])
        return ref.sparse_attention(q, [(kv, indices)], sinks, scale)

    monkeypatch.setattr(backend_module, "takes_queries", lambda q: True)
    monkeypatch.setattr(backend_module, "unpacks", lambda q, sources: True)
    monkeypatch.setattr(backend_module.flashmla, "sparse_prefill", sparse_prefill)
    rope = lambda x, c, s, num_sms: norm_ref.apply_rope(x, c, s)  # noqa: E731
    monkeypatch.setattr(backend_module, "apply_rope", rope)
    backend = backend_module.FlashMLAAttentionBackend(torch.device("cpu"))
    out = backend.sparse_attention(q, sources, sinks, 0.04, back)
    named = sum(idx.unique().numel() for _, idx in sources[1:])  # -1 too: a row of its own
    assert calls == [tokens + named]  # the chunk's rows, and each named packed row once
    dense = [(step, sources[0][1])]
    dense += [(kv.gather(torch.arange(kv.num_rows)).float(), idx) for kv, idx in sources[1:]]
    expected = ref.sparse_attention(q, dense, sinks, 0.04, back)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # A bf16 cache's parts are not copied whole: such a chunk stays on Triton.
    big = torch.randn(4 * tokens, flashmla.HEAD_DIM, generator=gen)
    assert backend_module.prefill_sources(q, [sources[0], (big, sources[1][1])]) is None
