"""The Triton norm kernels on CUDA against torch_ref on the CPU, at DeepSeek-V4-Flash shapes.

D = 4096, hc = 4 (K = hc * D = 16384, 24 mix columns), T in {1 (decode), 64, 4096 (prefill)}.
RoPE (rope_dim 64) on the attention q [T, 64, 512], kv [T, 512] and the indexer's q [T, 64, 128],
T in {1, 128, 4096}.
Inputs are drawn in fp32 on the CPU and rounded to bf16 once; the reference computes in fp32 from
those same values on the CPU (TF32 cannot enter it), so in the bf16 cases the error measured is
the kernels' own arithmetic and output rounding. Error: ||out - ref|| / ||ref||. One bf16
rounding is at most 2^-8 = 3.9e-3 relative (~1.7e-3 RMS over many elements).

Triton is imported inside the fixture, not at collection: importing it compiled here would stop
tests/test_triton_norm.py from switching it to the interpreter in a CPU-only session.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from deepinfer.ops.norm import rope_cos_sin, torch_ref

pytestmark = pytest.mark.gpu

HC, DIM, NORM_EPS, HC_EPS, SINKHORN_ITERS = 4, 4096, 1e-6, 1e-6, 20
NUM_TOKENS = [1, 64, 4096]

# fp32: exact IEEE products (tl.dot input_precision "ieee") and IEEE division in Sinkhorn; only
# the summation order and the exp/rsqrt approximations (~2 ulp) differ from the CPU.
FP32_TOL = 1e-5
# bf16, output rounding only: statistics in fp32 from the bf16 inputs, one rounding at the end.
RMS_NORM_BF16_TOL = 3e-3
# bf16 x, fp32 fn: x is exact in tf32, the dot runs tf32x3 (fp32-grade products) on tensor cores,
# whose fp32 accumulation over K = 16384 is the one looser step; post and comb are fp32 outputs.
HC_MIX_BF16_TOL = 2e-3
# bf16 stream outputs (collapsed, hc_post): fp32 math, one rounding to bf16.
HC_STREAM_BF16_TOL = 1e-2
# apply_rope, fp32: the same products as the CPU; only a contraction into an FMA may round once
# less (~1 ulp on a few values).
ROPE_FP32_TOL = 1e-6
# apply_rope, bf16: fp32 math from the bf16 inputs, one rounding to nearest: <= 2^-8 per value.
ROPE_BF16_TOL = 2**-8

ROPE_DIM, ROPE_THETA = 64, 10000.0
ROPE_SHAPES = {"q": (64, 512), "kv": (512,), "index_q": (64, 128)}  # x [T, *shape]
ROPE_NUM_TOKENS = [1, 128, 4096]
# gated_pool, bf16: the reference rounds the softmax weights and each product to bf16 before
# summing; the kernel keeps them fp32 and rounds the pooled row once, then the norm's output:
# a few bf16 roundings apart, each <= 2^-8.
POOL_BF16_TOL = 1e-2
# (windows, slots, dim): CSA's overlapped windows (2 x 4 slots of 512), HCA's 128 slots of 512,
# the indexer's CSA windows of 128; windows as a decode step of 128 requests or a prefill.
POOL_SHAPES = [(128, 8, 512), (2048, 8, 512), (64, 128, 512), (2048, 8, 128)]


@pytest.fixture(scope="module")
def norm_triton() -> ModuleType:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process (the CPU tests); run tests/gpu alone")
    pytest.importorskip("triton")
    from deepinfer.ops.norm import triton as module

    return module


def _bf16(*shape: int, gen: torch.Generator, std: float = 1.0) -> torch.Tensor:
    """fp32 CPU values that bf16 represents exactly."""
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16).float()


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float().cpu()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _hc_inputs(
    num_tokens: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (bf16-exact), fn, scale, base on the CPU, none zero: fn ~ N(0, 1/K) makes the mix
    ~N(0, 1), so the gates and the softmax are far from saturated."""
    mix_size, k = (2 + HC) * HC, HC * DIM
    x = _bf16(num_tokens, HC, DIM, gen=gen, std=2.0)
    fn = torch.randn(mix_size, k, generator=gen) * k**-0.5
    scale = 0.5 + torch.rand(3, generator=gen)
    base = 0.5 * torch.randn(mix_size, generator=gen)
    return x, fn, scale, base


def _cuda(dtype: torch.dtype, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to("cuda", dtype) for t in tensors]


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(norm_triton: ModuleType, num_tokens: int, dtype: torch.dtype) -> None:
    """Weighted over D (attn_norm), unweighted over the flat hc * D = 16384 (the widest row)."""
    tol = FP32_TOL if dtype == torch.float32 else RMS_NORM_BF16_TOL
    gen = torch.Generator().manual_seed(num_tokens)
    x, flat = _bf16(num_tokens, DIM, gen=gen, std=3.0), _bf16(num_tokens, HC * DIM, gen=gen)
    weight = 1 + 0.1 * torch.randn(DIM, generator=gen)
    out = norm_triton.rms_norm(x.to("cuda", dtype), weight.cuda(), NORM_EPS)
    assert out.dtype == dtype
    assert _rel_err(out, torch_ref.rms_norm(x, weight, NORM_EPS)) < tol
    out = norm_triton.rms_norm(flat.to("cuda", dtype), None, NORM_EPS)
    assert _rel_err(out, torch_ref.rms_norm(flat, None, NORM_EPS)) < tol


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre(norm_triton: ModuleType, num_tokens: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(100 + num_tokens)
    x, fn, scale, base = _hc_inputs(num_tokens, gen)
    hc = (SINKHORN_ITERS, HC_EPS, NORM_EPS)
    ref = torch_ref.hc_pre(x, fn, scale, base, *hc)
    weights = _cuda(torch.float32, fn, scale, base)
    post, comb, collapsed = norm_triton.hc_pre(x.to("cuda", dtype), *weights, *hc)
    assert (post.dtype, comb.dtype, collapsed.dtype) == (torch.float32, torch.float32, dtype)
    mix_tol = FP32_TOL if dtype == torch.float32 else HC_MIX_BF16_TOL
    stream_tol = FP32_TOL if dtype == torch.float32 else HC_STREAM_BF16_TOL
    assert _rel_err(post, ref[0]) < mix_tol
    assert _rel_err(comb, ref[1]) < mix_tol
    assert _rel_err(collapsed, ref[2]) < stream_tol


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_with_the_block_norm(
    norm_triton: ModuleType, num_tokens: int, dtype: torch.dtype
) -> None:
    """block_norm (attn_norm's weight and eps) in the collapse launch: the torch_ref composition
    within the stream tolerance, and within an RMSNorm's rounding of hc_pre then rms_norm as two
    launches. At T = 1 and 64 a token's D is split over programs (the ticket path): 20 graph
    replays give the eager result bitwise."""
    gen = torch.Generator().manual_seed(170 + num_tokens)
    x, fn, scale, base = _hc_inputs(num_tokens, gen)
    weight = 1 + 0.1 * torch.randn(DIM, generator=gen)
    hc = (SINKHORN_ITERS, HC_EPS, NORM_EPS)
    ref = torch_ref.hc_pre(x, fn, scale, base, *hc, block_norm=(weight, NORM_EPS))
    inputs = (x.to("cuda", dtype), *_cuda(torch.float32, fn, scale, base))
    block_norm = (weight.cuda(), NORM_EPS)
    fused = norm_triton.hc_pre(*inputs, *hc, block_norm=block_norm)
    stream_tol = FP32_TOL if dtype == torch.float32 else HC_STREAM_BF16_TOL
    assert _rel_err(fused[2], ref[2]) < stream_tol
    two_launches = norm_triton.rms_norm(norm_triton.hc_pre(*inputs, *hc)[2], *block_norm).cpu()
    assert _rel_err(fused[2], two_launches) < (FP32_TOL if dtype == torch.float32 else 2**-8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = norm_triton.hc_pre(*inputs, *hc, block_norm=block_norm)
    for _ in range(20):
        graph.replay()
        assert torch.equal(replayed[2], fused[2])


@pytest.mark.parametrize("num_tokens", [1, 2, 32, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_sinkhorn_apart(
    norm_triton: ModuleType, monkeypatch: pytest.MonkeyPatch, num_tokens: int, dtype: torch.dtype
) -> None:
    """The Sinkhorn in a program of its own (HC_SINKHORN_APART_MAX_TOKENS), shifted and with
    the block norm as the engine runs it: every output bit for bit the one-launch layout's, the
    block input within the stream tolerance of torch_ref's; 5 graph replays give the eager
    result bitwise."""
    gen = torch.Generator().manual_seed(180 + num_tokens)
    x, fn, scale, base = _hc_inputs(num_tokens, gen)
    prev = torch.rand(num_tokens, HC, generator=gen)
    weight = 1 + 0.1 * torch.randn(DIM, generator=gen)
    hc = (SINKHORN_ITERS, HC_EPS, NORM_EPS)
    ref = torch_ref.hc_pre_shifted(x, prev, fn, scale, base, *hc, block_norm=(weight, NORM_EPS))
    inputs = (x.to("cuda", dtype), prev.cuda(), *_cuda(torch.float32, fn, scale, base), *hc)
    block_norm = (weight.cuda(), NORM_EPS)
    monkeypatch.setattr(norm_triton, "HC_SINKHORN_APART_MAX_TOKENS", 0)
    together = norm_triton.hc_pre_shifted(*inputs, block_norm=block_norm)
    monkeypatch.setattr(norm_triton, "HC_SINKHORN_APART_MAX_TOKENS", num_tokens)
    out = norm_triton.hc_pre_shifted(*inputs, block_norm=block_norm)
    for name, o, t in zip(("pre", "post", "comb", "block input"), out, together, strict=True):
        assert torch.equal(o, t), name
    assert _rel_err(out[3], ref[3]) < (FP32_TOL if dtype == torch.float32 else HC_STREAM_BF16_TOL)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = norm_triton.hc_pre_shifted(*inputs, block_norm=block_norm)
    for _ in range(5):
        graph.replay()
        for o, r in zip(out, replayed, strict=True):
            assert torch.equal(o, r)


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normed", [False, True])
def test_hc_head(
    norm_triton: ModuleType, num_tokens: int, dtype: torch.dtype, normed: bool
) -> None:
    """The model's head (hc_pre's gate alone, no Sinkhorn) with and without the final norm in
    the collapse's store, against torch_ref within the stream tolerance; graph replays give the
    eager result bitwise."""
    gen = torch.Generator().manual_seed(190 + num_tokens)
    x, fn, scale, base = _hc_inputs(num_tokens, gen)
    fn, scale, base = fn[:HC], scale[:1], base[:HC]
    weight = 1 + 0.1 * torch.randn(DIM, generator=gen)
    ref = torch_ref.hc_head(
        x, fn, scale, base, HC_EPS, NORM_EPS, block_norm=(weight, NORM_EPS) if normed else None
    )
    inputs = (x.to("cuda", dtype), *_cuda(torch.float32, fn, scale, base), HC_EPS, NORM_EPS)
    block_norm = (weight.cuda(), NORM_EPS) if normed else None
    out = norm_triton.hc_head(*inputs, block_norm=block_norm)
    assert out.dtype == dtype
    assert _rel_err(out, ref) < (FP32_TOL if dtype == torch.float32 else HC_STREAM_BF16_TOL)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = norm_triton.hc_head(*inputs, block_norm=block_norm)
    for _ in range(5):
        graph.replay()
        assert torch.equal(replayed, out)


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_shifted(norm_triton: ModuleType, num_tokens: int, dtype: torch.dtype) -> None:
    """DeepSeek-V4.1's variant: the collapse takes the previous sub-layer's pre."""
    gen = torch.Generator().manual_seed(150 + num_tokens)
    x, fn, scale, base = _hc_inputs(num_tokens, gen)
    prev = torch.rand(num_tokens, HC, generator=gen)
    hc = (SINKHORN_ITERS, HC_EPS, NORM_EPS)
    ref = torch_ref.hc_pre_shifted(x, prev, fn, scale, base, *hc)
    weights = _cuda(torch.float32, fn, scale, base)
    out = norm_triton.hc_pre_shifted(x.to("cuda", dtype), prev.cuda(), *weights, *hc)
    mix_tol = FP32_TOL if dtype == torch.float32 else HC_MIX_BF16_TOL
    stream_tol = FP32_TOL if dtype == torch.float32 else HC_STREAM_BF16_TOL
    for name, o, r, tol in zip(
        ("pre", "post", "comb", "collapsed"), out, ref, (mix_tol,) * 3 + (stream_tol,), strict=True
    ):
        assert _rel_err(o, r) < tol, name


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post(norm_triton: ModuleType, num_tokens: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(200 + num_tokens)
    x, out = _bf16(num_tokens, HC, DIM, gen=gen), _bf16(num_tokens, DIM, gen=gen)
    post = 2 * torch.rand(num_tokens, HC, generator=gen)
    comb = torch.randn(num_tokens, HC, HC, generator=gen).softmax(-1)  # j and k not symmetric
    ref = torch_ref.hc_post(out, x, post, comb)
    new = norm_triton.hc_post(*_cuda(dtype, out, x), *_cuda(torch.float32, post, comb))
    assert new.dtype == dtype
    assert _rel_err(new, ref) < (FP32_TOL if dtype == torch.float32 else HC_STREAM_BF16_TOL)


@pytest.mark.parametrize("num_tokens", [1, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_pre(
    norm_triton: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    num_tokens: int,
    dtype: torch.dtype,
) -> None:
    """The exit and the next entry, the mix in the exit's launch (made to run so at every T):
    the new x bitwise hc_post's, post, comb and the block input (block_norm on) against
    torch_ref's hc_post then hc_pre."""
    monkeypatch.setattr(norm_triton, "HC_POST_MIX_MAX_TOKENS", num_tokens)
    gen = torch.Generator().manual_seed(250 + num_tokens)
    x, fn, scale, base = _hc_inputs(num_tokens, gen)
    out = _bf16(num_tokens, DIM, gen=gen)
    post = 2 * torch.rand(num_tokens, HC, generator=gen)
    comb = torch.randn(num_tokens, HC, HC, generator=gen).softmax(-1)
    weight = 1 + 0.1 * torch.randn(DIM, generator=gen)
    hc = (SINKHORN_ITERS, HC_EPS, NORM_EPS)
    # The reference enters from the new x as the kernel rounded it: the mixes' tolerance is
    # then the mix's own, not the stream rounding's.
    cuda_in = (*_cuda(dtype, out, x), *_cuda(torch.float32, post, comb))
    new = norm_triton.hc_post(*cuda_in)
    ref = torch_ref.hc_pre(new.float().cpu(), fn, scale, base, *hc, block_norm=(weight, 1e-5))
    fused = norm_triton.hc_post_pre(
        *cuda_in, *_cuda(torch.float32, fn, scale, base), *hc, block_norm=(weight.cuda(), 1e-5)
    )
    assert torch.equal(fused[0], new)
    mix_tol = FP32_TOL if dtype == torch.float32 else HC_MIX_BF16_TOL
    stream_tol = FP32_TOL if dtype == torch.float32 else HC_STREAM_BF16_TOL
    for name, o, r, tol in zip(
        ("post", "comb", "block input"), fused[1:], ref, (mix_tol, mix_tol, stream_tol), strict=True
    ):
        assert _rel_err(o, r) < tol, name


def test_decode_step_captures_in_cuda_graph(norm_triton: ModuleType) -> None:
    """hc_pre, hc_post_pre and hc_post never wait on the host (a sync would abort the
    capture), and a replay on new inputs reproduces the eager results bit for bit."""
    gen = torch.Generator().manual_seed(300)
    x, fn, scale, base = _hc_inputs(1, gen)
    x, (fn, scale, base) = x.to("cuda", torch.bfloat16), _cuda(torch.float32, fn, scale, base)
    hc = (SINKHORN_ITERS, HC_EPS, NORM_EPS)

    def step() -> tuple[torch.Tensor, ...]:
        post, comb, collapsed = norm_triton.hc_pre(x, fn, scale, base, *hc)
        entered = norm_triton.hc_post_pre(collapsed, x, post, comb, fn, scale, base, *hc)
        return post, comb, collapsed, *entered, norm_triton.hc_post(collapsed, x, post, comb)

    step()  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(_bf16(1, HC, DIM, gen=gen).cuda())
    graph.replay()
    for got, want in zip(captured, step(), strict=True):
        assert torch.equal(got, want)


def _rope_inputs(
    num_tokens: int, shape: tuple[int, ...], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, *shape] (bf16-exact), cos and sin [T, 32] fp32 at positions in 0 .. 1M, on the CPU."""
    x = _bf16(num_tokens, *shape, gen=gen, std=2.0)
    positions = torch.randint(0, 1 << 20, (num_tokens,), generator=gen)
    exponents = torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM
    return x, *rope_cos_sin(positions, 1.0 / ROPE_THETA**exponents)


@pytest.mark.parametrize("num_tokens", ROPE_NUM_TOKENS)
@pytest.mark.parametrize("kind", list(ROPE_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope(
    norm_triton: ModuleType, num_tokens: int, kind: str, dtype: torch.dtype
) -> None:
    """Forward and inverse (-sin, as on the attention output) against the CPU oracle; the nope
    columns come back bit for bit."""
    gen = torch.Generator().manual_seed(500 + num_tokens + len(kind))
    x, cos, sin = _rope_inputs(num_tokens, ROPE_SHAPES[kind], gen)
    tol = ROPE_FP32_TOL if dtype == torch.float32 else ROPE_BF16_TOL
    x_gpu, cos_gpu, sin_gpu = x.to("cuda", dtype), cos.cuda(), sin.cuda()
    for sign in (1, -1):
        out = norm_triton.apply_rope(x_gpu, cos_gpu, sign * sin_gpu)
        assert out.dtype == dtype and out.shape == x.shape
        assert _rel_err(out, torch_ref.apply_rope(x, cos, sign * sin)) < tol, sign
        nope = x.shape[-1] - ROPE_DIM
        assert torch.equal(out[..., :nope], x_gpu[..., :nope])


@pytest.mark.parametrize("num_tokens", ROPE_NUM_TOKENS)
@pytest.mark.parametrize("kind", list(ROPE_SHAPES))
def test_rms_norm_rope_is_the_two_launches_in_one(
    norm_triton: ModuleType, num_tokens: int, kind: str
) -> None:
    """The fused norm and RoPE (V4's q unweighted, kv weighted) on CUDA in bf16: this
    backend's rms_norm then apply_rope, bit for bit, and the CPU oracle's within RoPE's bf16
    tolerance."""
    gen = torch.Generator().manual_seed(700 + num_tokens + len(kind))
    x, cos, sin = _rope_inputs(num_tokens, ROPE_SHAPES[kind], gen)
    x_gpu, cos_gpu, sin_gpu = x.to("cuda", torch.bfloat16), cos.cuda(), sin.cuda()
    for weight in (None, torch.rand(x.shape[-1], generator=gen) + 0.5):
        w_gpu = None if weight is None else weight.cuda()
        fused = norm_triton.rms_norm_rope(x_gpu, w_gpu, 1e-6, cos_gpu, sin_gpu)
        two = norm_triton.apply_rope(norm_triton.rms_norm(x_gpu, w_gpu, 1e-6), cos_gpu, sin_gpu)
        assert torch.equal(fused, two)
        ref = torch_ref.rms_norm_rope(x.bfloat16(), weight, 1e-6, cos, sin)
        assert _rel_err(fused, ref) < ROPE_BF16_TOL


@pytest.mark.parametrize("num_tokens", ROPE_NUM_TOKENS)
def test_rms_norm_rope_pair_is_both_launches_in_one(
    norm_triton: ModuleType, num_tokens: int
) -> None:
    """A layer's q (unweighted, 64 heads) and kv (weighted, stored into a ring) in one launch
    on CUDA in bf16: q's rows bit for bit rms_norm_rope's, kv's and its ring rows within one
    bf16 ulp of its own launch's (kv's rows reduce in q's tiles here)."""
    gen = torch.Generator().manual_seed(800 + num_tokens)
    q, cos, sin = _rope_inputs(num_tokens, ROPE_SHAPES["q"], gen)
    kv, _, _ = _rope_inputs(num_tokens, ROPE_SHAPES["kv"], gen)
    q, kv, cos, sin = (
        q.to("cuda", torch.bfloat16),
        kv.to("cuda", torch.bfloat16),
        cos.cuda(),
        sin.cuda(),
    )
    weight = torch.rand(kv.shape[-1], generator=gen).cuda() + 0.5
    rows = torch.randperm(2 * num_tokens, generator=gen)[:num_tokens].cuda()
    ring, ring_alone = (
        torch.zeros(2 * num_tokens, kv.shape[-1], device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    q_out, kv_out = norm_triton.rms_norm_rope_pair(
        q, kv, (None, weight), 1e-6, cos, sin, store=(ring, rows)
    )
    assert torch.equal(q_out, norm_triton.rms_norm_rope(q, None, 1e-6, cos, sin))
    alone = norm_triton.rms_norm_rope(kv, weight, 1e-6, cos, sin, store=(ring_alone, rows))
    ulp = 2.0**-7 * alone.float().abs().clamp_min(2.0**-126)
    assert ((kv_out.float() - alone.float()).abs() <= ulp).all()
    assert torch.equal(ring[rows], kv_out) and ring_alone.any()


def test_apply_rope_captures_in_cuda_graph(norm_triton: ModuleType) -> None:
    """A decode step's q rotation replays from a CUDA graph on new inputs, bit for bit."""
    gen = torch.Generator().manual_seed(600)
    x, cos, sin = (t.cuda() for t in _rope_inputs(1, ROPE_SHAPES["q"], gen))
    x = x.to(torch.bfloat16)
    norm_triton.apply_rope(x, cos, sin)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = norm_triton.apply_rope(x, cos, sin)
    new_x, new_cos, new_sin = _rope_inputs(1, ROPE_SHAPES["q"], gen)
    x.copy_(new_x.cuda())
    cos.copy_(new_cos.cuda())
    sin.copy_(new_sin.cuda())
    graph.replay()
    assert torch.equal(captured, norm_triton.apply_rope(x, cos, sin))


def _cuda_time_us(fn: Callable[[], object], iters: int = 50) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


@pytest.mark.parametrize("num_tokens", [1, 4096])
def test_hc_pre_time(
    norm_triton: ModuleType, record_figure: Callable[[str], None], num_tokens: int
) -> None:
    """Figures for the results file; at decode the fused kernels beat torch_ref's ~70 launches."""
    gen = torch.Generator().manual_seed(400)
    x, fn, scale, base = _hc_inputs(num_tokens, gen)
    x, (fn, scale, base) = x.to("cuda", torch.bfloat16), _cuda(torch.float32, fn, scale, base)
    hc = (SINKHORN_ITERS, HC_EPS, NORM_EPS)
    fused = _cuda_time_us(lambda: norm_triton.hc_pre(x, fn, scale, base, *hc))
    reference = _cuda_time_us(lambda: torch_ref.hc_pre(x, fn, scale, base, *hc))
    record_figure(
        f"hc_pre T={num_tokens} bf16: triton {fused:.1f} us, torch_ref {reference:.1f} us"
    )
    if num_tokens == 1:
        assert fused < reference


@pytest.mark.parametrize("num_tokens", ROPE_NUM_TOKENS)
@pytest.mark.parametrize("kind", list(ROPE_SHAPES))
def test_apply_rope_time(
    norm_triton: ModuleType, record_figure: Callable[[str], None], num_tokens: int, kind: str
) -> None:
    """Figures for the results file, bf16, with the bandwidth of one read and one write of x.
    At prefill the one pass beats torch_ref's fp32 copies, stack and cat on the widest x."""
    gen = torch.Generator().manual_seed(700 + num_tokens)
    x, cos, sin = _rope_inputs(num_tokens, ROPE_SHAPES[kind], gen)
    x, cos, sin = x.to("cuda", torch.bfloat16), cos.cuda(), sin.cuda()
    fused = _cuda_time_us(lambda: norm_triton.apply_rope(x, cos, sin))
    reference = _cuda_time_us(lambda: torch_ref.apply_rope(x, cos, sin))
    moved = 2 * x.numel() * x.element_size() + 2 * cos.numel() * cos.element_size()
    record_figure(
        f"apply_rope {kind} {list(x.shape)} bf16: triton {fused:.1f} us "
        f"({moved / fused / 1e3:.0f} GB/s), torch_ref {reference:.1f} us"
    )
    if num_tokens == 4096 and kind == "q":
        assert fused < reference


@pytest.mark.parametrize("shape", POOL_SHAPES, ids=["csa", "csa_prefill", "hca", "indexer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_pool(
    norm_triton: ModuleType, shape: tuple[int, int, int], dtype: torch.dtype
) -> None:
    windows, slots, dim = shape
    gen = torch.Generator().manual_seed(slots * dim)
    kv = _bf16(windows, slots, dim, gen=gen)
    gate = 2 * torch.randn(windows, slots, dim, generator=gen)  # fp32: the model adds fp32 ape
    gate[0, : slots // 2] = float("-inf")  # an empty previous window
    weight = 0.5 + torch.rand(dim, generator=gen)
    out = norm_triton.gated_pool(kv.to("cuda", dtype), gate.cuda(), weight.cuda(), NORM_EPS)
    assert out.dtype == dtype
    ref = torch_ref.gated_pool(kv.to(dtype), gate, weight, NORM_EPS).float()
    tol = FP32_TOL if dtype == torch.float32 else POOL_BF16_TOL
    assert _rel_err(out, ref) < tol


def test_gated_pool_with_rope_is_the_two_launches_in_one(norm_triton: ModuleType) -> None:
    """The compressors' fused pooling and RoPE on CUDA in bf16 at V4's KV (512, rope 64) and
    indexer (128, rope 64) widths: gated_pool then apply_rope of this backend, bit for bit."""
    gen = torch.Generator().manual_seed(17)
    for dim in (512, 128):
        kv = _bf16(64, 8, dim, gen=gen).to("cuda", torch.bfloat16)
        gate = (2 * torch.randn(64, 8, dim, generator=gen)).cuda()
        weight = (0.5 + torch.rand(dim, generator=gen)).cuda()
        positions = torch.randint(0, 1 << 20, (64,), generator=gen)
        exponents = torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM
        cos, sin = (t.cuda() for t in rope_cos_sin(positions, 1.0 / ROPE_THETA**exponents))
        fused = norm_triton.gated_pool(kv, gate, weight, NORM_EPS, cos, sin)
        pooled = norm_triton.gated_pool(kv, gate, weight, NORM_EPS)
        assert torch.equal(fused, norm_triton.apply_rope(pooled, cos, sin)), dim


# compress_windows at V4-Flash widths: CSA's entries (512, from 1,024-wide rows), the indexer's
# (128), HCA's 128-slot windows of 512; a graphed verify step of 3 requests and of 129.
COMPRESS_CASES = [
    ("csa_chunks", 512, None, 1),
    ("csa_graphed", 512, None, 43),
    ("csa_graphed", 128, None, 1),
    ("hca_graphed", 512, 128, 16),
    ("hca_chunks", 512, None, 1),
]


# Decode steps (one token a request, no drafts), the keeps in the pooling's launch: CSA's and
# the indexer's widths, graphed and not, and HCA's 128-slot windows split over channel programs.
KEEP_CASES = [
    ("csa_decode_graphed", 512, 43),
    ("csa_decode_graphed", 128, 43),
    ("csa_decode", 512, 32),
    ("hca_graphed", 512, 64),
]


@pytest.mark.parametrize(("case", "dim", "repeat"), KEEP_CASES)
def test_compress_windows_keeps_in_the_pooling_launch(
    norm_triton: ModuleType, case: str, dim: int, repeat: int
) -> None:
    """CompressRows.keep_in_pool on CUDA, where a race would show: the entries, the entry pool
    and both rings bitwise the three launches' (outside the scratch rows), ten times over;
    prints both paths' times."""
    from compress_cases import compress_step

    ratio = 128 if "hca" in case else None
    step = compress_step(case, dim, True, dim + repeat, "cuda", torch.bfloat16, ratio, repeat)
    args = (step.ape, step.weight, NORM_EPS, step.cos, step.sin)
    three = step.fresh_state()
    expected = norm_triton.compress_windows(step.kv, step.gate, step.rows(three), *args)
    for _ in range(10):
        one = step.fresh_state()
        out = norm_triton.compress_windows(step.kv, step.gate, step.rows(one, True), *args)
        assert torch.equal(out, expected)
        for key in step.state:
            assert torch.equal(one[key][:-1], three[key][:-1]), key
    one_rows, three_rows = step.rows(step.fresh_state(), True), step.rows(step.fresh_state())
    fused = _cuda_time_us(lambda: norm_triton.compress_windows(step.kv, step.gate, one_rows, *args))
    apart = _cuda_time_us(
        lambda: norm_triton.compress_windows(step.kv, step.gate, three_rows, *args)
    )
    print(f"compress_windows {case} d={dim} x{repeat}: keeps in the pool {fused:.1f} us, "
          f"apart {apart:.1f} us")  # fmt: skip


@pytest.mark.parametrize(("case", "dim", "ratio", "repeat"), COMPRESS_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_windows(
    norm_triton: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
    dim: int,
    ratio: int | None,
    repeat: int,
    dtype: torch.dtype,
) -> None:
    """The launches on CUDA: entries and rings bit for bit torch_ref's gathers followed by this
    backend's pooling and rotation (bf16 rings included: the same conversions in the same
    order; HCA's 128-slot windows split the same way in both); prints both paths' times."""
    from compress_cases import compress_step

    step = compress_step(case, dim, True, dim + repeat, "cuda", dtype, ratio, repeat)
    args = (step.ape, step.weight, NORM_EPS, step.cos, step.sin)
    fast_state, ours_state = step.fresh_state(), step.fresh_state()
    fast_rows, ours_rows = step.rows(fast_state), step.rows(ours_state)
    fast = norm_triton.compress_windows(step.kv, step.gate, fast_rows, *args)
    monkeypatch.setattr(torch_ref, "gated_pool", norm_triton.gated_pool)
    monkeypatch.setattr(torch_ref, "apply_rope", norm_triton.apply_rope)
    ours = torch_ref.compress_windows(step.kv, step.gate, ours_rows, *args)
    assert fast.dtype == dtype and fast.shape == (step.num_windows, dim)
    assert torch.equal(fast, ours)
    for key in step.state:  # the scratch slot (last) takes discarded rows in no set order
        assert torch.equal(fast_state[key][:-1], ours_state[key][:-1]), key
    fused = _cuda_time_us(
        lambda: norm_triton.compress_windows(step.kv, step.gate, fast_rows, *args)
    )
    gathers = _cuda_time_us(
        lambda: torch_ref.compress_windows(step.kv, step.gate, ours_rows, *args)
    )
    print(
        f"compress_windows {case} d={dim} m={step.ratio} {step.num_windows} windows "
        f"{dtype}: triton {fused:.1f} us, torch gathers + triton pool {gathers:.1f} us"
    )
