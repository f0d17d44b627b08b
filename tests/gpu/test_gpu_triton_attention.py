"""The Triton attention kernels on CUDA against torch_ref, at DeepSeek-V4 production shapes.

sparse_attention: D = 512, H = 64, three key sources as the model passes them (this step's new
keys, the 128-slot sliding-window ring, 512 compressed entries of a paged pool), -1 holes in the
middle of every list; decode T in {1, 32, 128} (split-KV at 1 and 32) and a prefill T = 1024.
indexer_scores: Hi = 64, Di = 128, N = 8192 entries, decode-like and prefill-like visibility.

Inputs are drawn in fp32 on the CPU and rounded to bf16 once; the reference runs torch_ref in
fp32 on CUDA with TF32 off from those same values, so in the bf16 cases the error measured is the
kernels' own arithmetic and output rounding. Error: ||out - ref|| / ||ref||. One bf16 rounding is
at most 2^-8 = 3.9e-3 relative (~1.7e-3 RMS over many elements).

Triton is imported inside the fixture, not at collection: importing it compiled here would stop
tests/test_triton_attention.py from switching it to the interpreter in a CPU-only session.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest
import torch

from deepinfer.ops.attention import torch_ref

pytestmark = pytest.mark.gpu

SEEDS = [0, 1]
DIM, NUM_HEADS, WINDOW, NUM_COMPRESSED = 512, 64, 128, 512
INDEXER_HEADS, INDEXER_DIM, NUM_ENTRIES = 64, 128, 8192

# fp32: IEEE products and fp32 accumulation (tl.dot input_precision "ieee"); only the summation
# order and exp2 against exp differ from the reference.
FP32_TOL = 1e-5
# bf16: logits and softmax in fp32 from the bf16 inputs, the probabilities rounded to bf16 for
# the value product, and the output rounding (torch_ref in bf16 also rounds the logits).
ATTENTION_BF16_TOL = 1.5e-2
# bf16 inputs, fp32 products and accumulation on tensor cores: summation order only.
INDEXER_BF16_TOL = 1e-4


@pytest.fixture(scope="module")
def attention_triton() -> Iterator[ModuleType]:
    """The backend module; TF32 off meanwhile, so that the CUDA fp32 reference is IEEE fp32."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process (the CPU tests); run tests/gpu alone")
    pytest.importorskip("triton")
    from deepinfer.ops.attention import triton as module

    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield module
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32


def _bf16(*shape: int, gen: torch.Generator, std: float = 1.0) -> torch.Tensor:
    """fp32 CPU values that bf16 represents exactly."""
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16).float()


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm()).item()


def _with_holes(idx: torch.Tensor, gen: torch.Generator, frac: float) -> torch.Tensor:
    return idx.masked_fill(torch.rand(idx.shape, generator=gen) < frac, -1)


def _attention_inputs(
    num_q: int, gen: torch.Generator
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """q [T, H, D], three (kv, idx) sources and sinks [H], on the CPU, bf16-exact.

    Decode (T <= 128): one token per request, its one new key, its own window ring slots and 512
    entries of a shared 8192-row pool. Prefill (T = 1024): one request; token t sees the new keys
    t - 127 .. t (the ring is still empty: all -1). The last token of a batch sees no key.
    """
    is_prefill = num_q > 128
    q = _bf16(num_q, NUM_HEADS, DIM, gen=gen, std=2.0)  # peaked softmax rows
    t = torch.arange(num_q)
    new_kv = _bf16(num_q, DIM, gen=gen)
    if is_prefill:
        new_idx = t.unsqueeze(1) - WINDOW + 1 + torch.arange(WINDOW)  # [T, 128]
        new_idx = new_idx.masked_fill(new_idx < 0, -1)
        window_kv = _bf16(WINDOW, DIM, gen=gen)
        window_idx = torch.full((num_q, WINDOW), -1)
    else:
        new_idx = t.unsqueeze(1)  # [T, 1]
        window_kv = _bf16(num_q * WINDOW, DIM, gen=gen)
        window_idx = t.unsqueeze(1) * WINDOW + torch.arange(WINDOW)  # [T, 128]
        window_idx = _with_holes(window_idx, gen, 0.1)
    pool_rows = 16 * NUM_COMPRESSED
    pool_kv = _bf16(pool_rows, DIM, gen=gen)
    pool_idx = torch.stack([torch.randperm(pool_rows, generator=gen)[:NUM_COMPRESSED] for _ in t])
    pool_idx = _with_holes(pool_idx, gen, 0.1)
    pool_idx[:, NUM_COMPRESSED - 100 :] = -1  # entries the token cannot see yet
    if num_q > 1:
        new_idx[-1], window_idx[-1], pool_idx[-1] = -1, -1, -1
    sources = [
        (new_kv, new_idx.int()),
        (window_kv, window_idx.int()),
        (pool_kv, pool_idx.int()),
    ]
    sinks = torch.randn(NUM_HEADS, generator=gen)
    return q, sources, sinks


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("num_q", [1, 32, 128, 1024])
def test_sparse_attention(
    attention_triton: ModuleType,
    record_figure: Callable[[str], None],
    num_q: int,
    seed: int,
) -> None:
    from triton.testing import do_bench

    gen = torch.Generator().manual_seed(seed)
    q, sources, sinks = _attention_inputs(num_q, gen)
    scale = DIM**-0.5
    cuda_sources = [(kv.cuda(), idx.cuda()) for kv, idx in sources]
    ref = torch_ref.sparse_attention(q.cuda(), cuda_sources, sinks.cuda(), scale).cpu()
    for dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, ATTENTION_BF16_TOL)):
        args = (
            q.to("cuda", dtype),
            [(kv.to(dtype), idx) for kv, idx in cuda_sources],
            sinks.cuda(),
            scale,
        )
        out = attention_triton.sparse_attention(*args)
        assert out.dtype == dtype
        out = out.float().cpu()
        if num_q > 1:
            assert not out[-1].any()
        err = _rel_err(out, ref)
        if seed == 0:
            ms = do_bench(lambda args=args: attention_triton.sparse_attention(*args))
            ref_ms = do_bench(lambda args=args: torch_ref.sparse_attention(*args))
            record_figure(
                f"triton sparse_attention {str(dtype).removeprefix('torch.')} T={num_q} H="
                f"{NUM_HEADS} D={DIM} keys={sum(i.shape[1] for _, i in sources)}: rel err "
                f"{err:.2e}, {ms * 1e3:.1f} us (torch_ref {ref_ms * 1e3:.1f} us)"
            )
        assert err < tol, f"{dtype}: {err:.2e}"


@pytest.mark.parametrize("num_q", [1, 32, 1024])
def test_sparse_attention_ropes_its_output_in_its_store(
    attention_triton: ModuleType, num_q: int
) -> None:
    """bf16, V4 shapes: out_rope=(cos, -sin) (V's RoPE rotated back in the split combine's
    store at T = 1 and 32, in the attention kernel's at T = 1024) is bitwise the norm
    backend's apply_rope launch on the output."""
    from deepinfer.ops.norm import rope_cos_sin
    from deepinfer.ops.norm import triton as norm_triton

    gen = torch.Generator().manual_seed(num_q)
    q, sources, sinks = _attention_inputs(num_q, gen)
    args = (
        q.to("cuda", torch.bfloat16),
        [(kv.to("cuda", torch.bfloat16), idx.cuda()) for kv, idx in sources],
        sinks.cuda(),
        DIM**-0.5,
    )
    positions = torch.randint(0, 1 << 20, (num_q,), generator=gen).cuda()
    cos, sin = rope_cos_sin(positions, 1.0 / 10000.0 ** (torch.arange(0, 64, 2).cuda() / 64))
    fused = attention_triton.sparse_attention(*args, out_rope=(cos, -sin))
    unfused = norm_triton.apply_rope(attention_triton.sparse_attention(*args), cos, -sin)
    assert torch.equal(fused, unfused)


def _indexer_inputs(num_q: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """q, weights, keys, entry_rows, token_req, num_visible on the CPU, bf16-exact.

    Decode (T = 64): 8 requests, num_visible anywhere in 0..N. Prefill (T = 1024): one request
    whose tokens see 0 up to all 8192 entries. Rows past a request's visible entries are garbage
    (out of the pool, or negative): the kernel must not read them.
    """
    q = _bf16(num_q, INDEXER_HEADS, INDEXER_DIM, gen=gen)
    weights = _bf16(num_q, INDEXER_HEADS, gen=gen) * INDEXER_HEADS**-0.5
    num_requests = 1 if num_q > 128 else 8
    pool_rows = num_requests * NUM_ENTRIES + 1000
    keys = _bf16(pool_rows, INDEXER_DIM, gen=gen)
    entry_rows = torch.randperm(pool_rows, generator=gen)[: num_requests * NUM_ENTRIES]
    entry_rows = entry_rows.view(num_requests, NUM_ENTRIES)
    if num_requests == 1:
        token_req = torch.zeros(num_q, dtype=torch.int64)
        num_visible = torch.linspace(0, NUM_ENTRIES, num_q).long()
    else:
        token_req = torch.arange(num_q) % num_requests
        num_visible = torch.randint(0, NUM_ENTRIES + 1, (num_q,), generator=gen)
        num_visible[:2] = torch.tensor([0, NUM_ENTRIES])
    for b in range(num_requests):
        seen = int(num_visible[token_req == b].max())
        entry_rows[b, seen:] = torch.where(torch.arange(NUM_ENTRIES - seen) % 2 == 0, -7, 1 << 30)
    return q, weights, keys, entry_rows, token_req, num_visible.int()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("num_q", [64, 1024])
def test_indexer_scores(
    attention_triton: ModuleType,
    record_figure: Callable[[str], None],
    num_q: int,
    seed: int,
) -> None:
    from triton.testing import do_bench

    gen = torch.Generator().manual_seed(seed)
    q, weights, keys, entry_rows, token_req, num_visible = _indexer_inputs(num_q, gen)
    index = [t.cuda() for t in (entry_rows, token_req, num_visible)]
    ref = torch_ref.indexer_scores(q.cuda(), weights.cuda(), keys.cuda(), *index).cpu()
    visible = torch.arange(NUM_ENTRIES) < num_visible.unsqueeze(1)
    for dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, INDEXER_BF16_TOL)):
        args = (q.to("cuda", dtype), weights.to("cuda", dtype), keys.to("cuda", dtype), *index)
        out = attention_triton.indexer_scores(*args).cpu()
        assert out.dtype == torch.float32
        assert torch.equal(out == float("-inf"), ~visible)
        err = _rel_err(out[visible], ref[visible])
        if seed == 0:
            ms = do_bench(lambda args=args: attention_triton.indexer_scores(*args))
            ref_ms = do_bench(lambda args=args: torch_ref.indexer_scores(*args))
            record_figure(
                f"triton indexer_scores {str(dtype).removeprefix('torch.')} T={num_q} "
                f"Hi={INDEXER_HEADS} Di={INDEXER_DIM} N={NUM_ENTRIES}: rel err {err:.2e}, "
                f"{ms * 1e3:.1f} us (torch_ref {ref_ms * 1e3:.1f} us)"
            )
        assert err < tol, f"{dtype}: {err:.2e}"


def test_indexer_scores_scale_weights_and_rope_q_in_the_kernel(
    attention_triton: ModuleType,
) -> None:
    """indexer_scores(q, w, ..., weight_scale=s, q_rope=(cos, sin)) with q and w in bf16 is
    bitwise indexer_scores on apply_rope(q, cos, sin) (the norm backend's kernel) and
    w.float() * s: the cast, the scale and the rotation the kernel does, not launches before."""
    from deepinfer.ops.norm import rope_cos_sin
    from deepinfer.ops.norm import triton as norm_triton

    gen = torch.Generator().manual_seed(3)
    q, weights, keys, *index = (t.cuda() for t in _indexer_inputs(64, gen))
    q, keys, weights = q.bfloat16(), keys.bfloat16(), weights.bfloat16()
    scale = INDEXER_HEADS**-0.5
    positions = torch.randint(0, 1 << 20, (q.shape[0],), generator=gen).cuda()
    rope = rope_cos_sin(positions, 1.0 / 10000.0 ** (torch.arange(0, 64, 2).cuda() / 64))
    fused = attention_triton.indexer_scores(
        q, weights, keys, *index, weight_scale=scale, q_rope=rope
    )
    roped = norm_triton.apply_rope(q, *rope)
    unfused = attention_triton.indexer_scores(roped, weights.float() * scale, keys, *index)
    assert torch.equal(fused, unfused)


def test_indexer_select_is_the_scores_then_the_topk(attention_triton: ModuleType) -> None:
    """indexer_select at decode (64 tokens of 8 requests, V4-Flash's 64 heads of 128, bf16, 1,024
    entries, within SELECT_MAX_ENTRIES: one launch, the top-k in each token's last
    program): the rows of indexer_topk(indexer_scores(...)) bit for bit, ten times over (the
    ticket orders every program's scores before the last one reads them); counters reset."""
    gen = torch.Generator().manual_seed(5)
    q, weights, keys, *index = (t.cuda() for t in _indexer_inputs(64, gen))
    q, keys, weights = q.bfloat16(), keys.bfloat16(), weights.bfloat16()
    entries = attention_triton.SELECT_MAX_ENTRIES // 2  # a context of 4K tokens
    entry_rows, token_req, num_visible = index[0][:, :entries], index[1], index[2]
    index = [entry_rows, token_req, num_visible.clamp(max=entries)]
    scores = attention_triton.indexer_scores(q, weights, keys, *index, weight_scale=0.125)
    expected = attention_triton.indexer_topk(scores, entry_rows, token_req, 512)
    for _ in range(10):
        picked = attention_triton.indexer_select(q, weights, keys, *index, 512, 0.125)
        assert torch.equal(picked, expected)
    assert not attention_triton.ticket_counters(q.device).any()


@pytest.mark.parametrize("packed", [False, True], ids=["bf16", "fp8"])
def test_store_rows_gathers_its_rows_in_the_launch(
    attention_triton: ModuleType, packed: bool
) -> None:
    """store_rows(target, index, values, rows) on CUDA, at a V4 row (448 + 64 RoPE dims): bit
    for bit torch_ref's gather then store, dense bf16 and packed FP8; the other rows untouched."""
    from deepinfer.ops.attention.kv_fp8 import Fp8Layout, Fp8Rows, store_rows

    gen = torch.Generator().manual_seed(4)
    layout = Fp8Layout(DIM, 64)
    values = (torch.randn(300, DIM, generator=gen) * 3).cuda()
    rows = torch.randint(0, 300, (200,), generator=gen).cuda()
    index = torch.randperm(4096, generator=gen)[:200].cuda()
    if packed:
        target = torch.randint(0, 256, (64, 64, layout.row_bytes), dtype=torch.uint8).cuda()
        view = lambda t: Fp8Rows.of(t, layout)  # noqa: E731
    else:
        target = torch.randn(4096, DIM, generator=gen).bfloat16().cuda()
        view = lambda t: t  # noqa: E731
    expected = target.clone()
    store_rows(view(expected), index, values[rows])
    attention_triton.store_rows(view(target), index, values, rows)
    assert torch.equal(target, expected)


@pytest.mark.parametrize(("num_q", "num_entries"), [(1, 1024), (128, 8192), (1024, 16384)])
def test_indexer_topk(
    attention_triton: ModuleType,
    record_figure: Callable[[str], None],
    num_q: int,
    num_entries: int,
) -> None:
    """The same rows as torch_ref's sort (ties to the lower column), top 512, with a third of
    the scores exactly 0 and each token seeing a different prefix of its request's entries."""
    from triton.testing import do_bench

    gen = torch.Generator().manual_seed(num_q)
    scores = torch.randn(num_q, num_entries, generator=gen)
    scores[torch.rand(num_q, num_entries, generator=gen) < 0.33] = 0.0
    num_visible = torch.randint(1, num_entries + 1, (num_q,), generator=gen)
    scores[torch.arange(num_entries) >= num_visible.unsqueeze(1)] = float("-inf")
    entry_rows = torch.randperm(2 * num_entries, generator=gen).view(2, num_entries)
    token_req = torch.arange(num_q) % 2
    args = (scores.cuda(), entry_rows.cuda(), token_req.cuda(), 512)
    out = attention_triton.indexer_topk(*args).cpu()
    expected = torch_ref.indexer_topk(*args).cpu()
    assert torch.equal(out.sort(dim=1).values, expected.sort(dim=1).values)
    ms = do_bench(lambda: attention_triton.indexer_topk(*args))
    topk_ms = do_bench(lambda: args[0].topk(512, dim=-1))
    record_figure(
        f"triton indexer_topk T={num_q} N={num_entries} k=512: {ms * 1e3:.1f} us "
        f"(torch.topk alone {topk_ms * 1e3:.1f} us)"
    )
