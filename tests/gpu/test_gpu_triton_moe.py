"""The Triton fused MoE on CUDA against the torch reference at DeepSeek-V4-Flash shapes.

D = 4096, I = 2048, k = 6, T from decode (1) to prefill (4096). fp32 (the engine's parity mode:
the kernels' IEEE dot) against torch_ref in fp32 on CUDA with TF32 off, with E = 32 experts
(3.2 GB of fp32 weights rather than 25 GB). bf16 with all E = 256 experts (12.9 GB) against an
fp32 reference computed from the same bf16 values, 32 experts' weights upcast at a time. Error:
||out - ref|| / ||ref||.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from triton_modules import compiled

from deepinfer.ops.moe import torch_ref

pytestmark = pytest.mark.gpu

DIM, INTER, TOP_K, LIMIT = 4096, 2048, 6, 10.0
NUM_TOKENS = [1, 32, 512, 4096]
Experts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@pytest.fixture(scope="module")
def moe_triton() -> ModuleType:
    """The backend with compiled kernels."""
    return compiled("deepinfer.ops.moe.triton")


def _experts(num_experts: int, dtype: torch.dtype, seed: int) -> Experts:
    """w1, w2, w3 on CUDA, scaled so that gate, up and each expert's output are ~N(0, 1)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def draw(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device="cuda", dtype=dtype).mul_(std)

    w1 = draw(num_experts, INTER, DIM, std=DIM**-0.5)
    w2 = draw(num_experts, DIM, INTER, std=INTER**-0.5)
    w3 = draw(num_experts, INTER, DIM, std=DIM**-0.5)
    return w1, w2, w3


@pytest.fixture(scope="module")
def fp32_experts() -> Experts:
    return _experts(32, torch.float32, seed=0)


@pytest.fixture(scope="module")
def bf16_experts() -> Experts:
    return _experts(256, torch.bfloat16, seed=1)


def _batch(
    num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, D] in dtype, topk_ids [T, k] (distinct per token), topk_weights [T, k] fp32; CUDA."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, DIM, generator=gen).to("cuda", dtype)
    topk_ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(-1)[:, :TOP_K]
    topk_weights = torch.rand(num_tokens, TOP_K, generator=gen)
    return x, topk_ids.cuda(), topk_weights.cuda()


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm()).item()


# fp32 against fp32: the IEEE FMA dot and cuBLAS differ only in summation order over K = 4096
# and 2048 (~sqrt(K) * 2^-24 each, a few 1e-6); a lost pair or a wrong clamp is > 1e-2.
FP32_TOL = 1e-5


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_fp32_matches_reference(
    moe_triton: ModuleType,
    fp32_experts: Experts,
    ieee_fp32: None,
    record_figure: Callable[[str], None],
    num_tokens: int,
) -> None:
    w1, w2, w3 = fp32_experts
    x, topk_ids, topk_weights = _batch(num_tokens, w1.shape[0], torch.float32, seed=num_tokens)
    ref = torch_ref.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT)
    out = moe_triton.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT)
    assert out.dtype == torch.float32
    err = _rel_err(out, ref)
    record_figure(f"triton fused_moe fp32 E=32 T={num_tokens}: rel err {err:.2e} (< {FP32_TOL})")
    assert err < FP32_TOL


def _reference_fp32(
    x: torch.Tensor,
    experts: Experts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    chunk: int = 32,
) -> torch.Tensor:
    """torch_ref in fp32 from bf16 values, summed over chunks of ``chunk`` experts.

    In each chunk a pair routed elsewhere goes to the chunk's first expert with weight 0: its
    term is exactly 0 (the clamped SwiGLU keeps it finite), so the chunks add up to the whole.
    """
    w1, w2, w3 = experts
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for start in range(0, w1.shape[0], chunk):
        in_chunk = (topk_ids >= start) & (topk_ids < start + chunk)
        ids = torch.where(in_chunk, topk_ids - start, 0)
        weights = torch.where(in_chunk, topk_weights, 0.0)
        w1_c, w2_c, w3_c = (w[start : start + chunk].float() for w in (w1, w2, w3))
        out += torch_ref.fused_moe(x.float(), w1_c, w2_c, w3_c, ids, weights, LIMIT)
    return out


# bf16 operands with fp32 accumulation; h, each weighted pair output and the sum are rounded to
# bf16 once each (~1.1e-3 RMS apiece, ~2e-3 together), with headroom for the clamp boundary.
BF16_TOL = 1.5e-2


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_bf16_matches_fp32_reference(
    moe_triton: ModuleType,
    bf16_experts: Experts,
    ieee_fp32: None,
    record_figure: Callable[[str], None],
    num_tokens: int,
) -> None:
    x, topk_ids, topk_weights = _batch(num_tokens, 256, torch.bfloat16, seed=num_tokens)
    ref = _reference_fp32(x, bf16_experts, topk_ids, topk_weights)
    out = moe_triton.fused_moe(x, *bf16_experts, topk_ids, topk_weights, LIMIT)
    assert out.dtype == torch.bfloat16
    err = _rel_err(out, ref)
    record_figure(f"triton fused_moe bf16 E=256 T={num_tokens}: rel err {err:.2e} (< {BF16_TOL})")
    assert err < BF16_TOL


def test_bf16_token_output_does_not_depend_on_the_batch(
    moe_triton: ModuleType, bf16_experts: Experts
) -> None:
    """A decode token alone and among 31 others: bitwise the same (one row of the tile table)."""
    w1, w2, w3 = bf16_experts
    x, topk_ids, topk_weights = _batch(32, 256, torch.bfloat16, seed=5)
    # Every token shares token 11's first expert: its group is 32 pairs, two full M blocks of 16
    # (a token that already had that expert now holds it twice: both terms count).
    topk_ids[:, 0] = topk_ids[11, 0]
    assert moe_triton.pick_tile_config(TOP_K, x.dtype) == moe_triton.pick_tile_config(
        32 * TOP_K, x.dtype
    )
    batched = moe_triton.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT)
    alone = moe_triton.fused_moe(x[11:12], w1, w2, w3, topk_ids[11:12], topk_weights[11:12], LIMIT)
    assert torch.equal(alone[0], batched[11])


def test_bf16_captures_in_a_cuda_graph(moe_triton: ModuleType, bf16_experts: Experts) -> None:
    """No host synchronisation: capture succeeds, and a replay on new routing is exact."""
    w1, w2, w3 = bf16_experts
    x, topk_ids, topk_weights = _batch(32, 256, torch.bfloat16, seed=6)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm the allocator outside the capture
        moe_triton.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_triton.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT)
    new_x, new_ids, new_weights = _batch(32, 256, torch.bfloat16, seed=7)
    x.copy_(new_x)
    topk_ids.copy_(new_ids)
    topk_weights.copy_(new_weights)
    graph.replay()
    expected = moe_triton.fused_moe(new_x, w1, w2, w3, new_ids, new_weights, LIMIT)
    assert torch.equal(out, expected)


@pytest.fixture(scope="module")
def mxfp4_experts(bf16_experts: Experts) -> tuple[list[torch_ref.Mxfp4Weight], Experts]:
    """The bf16 experts packed MXFP4, and the packed values dequantized to bf16 (exact)."""
    packed = [torch_ref.quantize_mxfp4(w) for w in bf16_experts]
    dense = tuple(w.dequantize().bfloat16() for w in packed)
    return packed, dense  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("num_tokens", "bits"),
    [*((t, False) for t in [1, 16, *NUM_TOKENS[1:]]), (32, True), (128, True), (4096, True)],
)
def test_mxfp4_matches_the_fp32_reference_on_its_values(
    moe_triton: ModuleType,
    mxfp4_experts: tuple[list[torch_ref.Mxfp4Weight], Experts],
    ieee_fp32: None,
    record_figure: Callable[[str], None],
    num_tokens: int,
    bits: bool,
) -> None:
    """E = 256 at V4-Flash shapes, decode to prefill tiles (T = 1 and 16: a program a pair):
    the packed path (values exact in registers, other summation order) within BF16_TOL of the
    fp32 reference on the dequantized weights, as the bf16 kernel on those weights is. bits:
    the grouped kernels' decode or prefill tiles with TileConfig.bits_upcast (codes to bf16 by
    inline PTX, the product transposed); a wrong value (a flushed subnormal for code 1, a
    misplaced nibble) would be far outside the tolerance."""
    packed, dense = mxfp4_experts
    x, topk_ids, topk_weights = _batch(num_tokens, 256, torch.bfloat16, seed=10 + num_tokens)
    tiles = moe_triton.pick_tile_config(num_tokens * TOP_K, torch.bfloat16, True)
    if bits:  # the grouped kernels, also where the engine takes a program a pair
        tiles = moe_triton.pick_tile_config(max(4096, num_tokens * TOP_K), torch.bfloat16, True)
    config = None  # the engine's program a pair
    if isinstance(tiles, moe_triton.TileConfig):  # the scaled dot, or the bits upcast
        config = dataclasses.replace(tiles, bits_upcast=bits)
    out = moe_triton.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT, config=config)
    ref = _reference_fp32(x, dense, topk_ids, topk_weights)
    err = _rel_err(out, ref)
    dense_err = _rel_err(moe_triton.fused_moe(x, *dense, topk_ids, topk_weights, LIMIT), ref)
    bytes_ = sum(w.packed.numel() + w.scale.numel() for w in packed)
    record_figure(
        f"triton fused_moe MXFP4{' bits upcast' * bits} E=256 T={num_tokens}: rel err "
        f"{err:.2e} (bf16 on the same values {dense_err:.2e}; < {BF16_TOL}); "
        f"{bytes_ / 2**30:.2f} GiB packed vs {sum(w.numel() * 2 for w in dense) / 2**30:.2f} GiB"
    )
    assert err < BF16_TOL


@pytest.mark.parametrize(
    ("num_tokens", "ring"), [(40, 0), (128, 0), (600, 0), (40, 3), (128, 4), (600, 3)]
)
def test_mxfp4_gluon_matches_the_reference_and_the_triton_bits_path(
    moe_triton: ModuleType,
    mxfp4_experts: tuple[list[torch_ref.Mxfp4Weight], Experts],
    ieee_fp32: None,
    record_figure: Callable[[str], None],
    num_tokens: int,
    ring: int,
) -> None:
    """The decode row's tiles (240 to 3,600 pairs) with TileConfig.gluon, the GEMMs gluon.py's:
    within BF16_TOL of the fp32 reference on the dequantized weights, and close to the Triton
    bits path on the same tiles (the same bf16 products, summed in another order); with a
    residual, and replayed from a CUDA graph on new inputs bit for bit. A value in the wrong K
    position, a lost pair or a wrong h column would be far outside. ring: the K steps through a
    shared-memory ring, the same products in the same order as the register prefetch's, so
    its output bit for bit."""
    packed, dense = mxfp4_experts
    x, topk_ids, topk_weights = _batch(num_tokens, 256, torch.bfloat16, seed=40 + num_tokens)
    tiles = moe_triton.pick_tile_config(num_tokens * TOP_K, torch.bfloat16, True)
    assert tiles.bits_upcast and (tiles.block_m, tiles.block_n, tiles.block_k) == (16, 64, 128)
    tiles = dataclasses.replace(tiles, gluon=True, ring=ring)
    out = moe_triton.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT, config=tiles)
    if ring:
        registers = dataclasses.replace(tiles, ring=0)
        assert torch.equal(
            out, moe_triton.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT, config=registers)
        )
    ref = _reference_fp32(x, dense, topk_ids, topk_weights)
    triton_bits = dataclasses.replace(tiles, gluon=False)
    bits_out = moe_triton.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT, config=triton_bits)
    err, bits_err = _rel_err(out, ref), _rel_err(bits_out, ref)
    between = _rel_err(out, bits_out.float())
    residual = torch.randn_like(x)
    with_residual = moe_triton.fused_moe(
        x, *packed, topk_ids, topk_weights, LIMIT, config=tiles, residual=residual
    )
    expected = (out.float() + residual.float()).bfloat16()
    record_figure(
        f"triton fused_moe MXFP4 Gluon ring {ring} E=256 T={num_tokens}: rel err {err:.2e} "
        f"(Triton bits path {bits_err:.2e}; < {BF16_TOL}); Gluon vs Triton bits {between:.2e}"
    )
    assert err < BF16_TOL and between < BF16_TOL
    assert (with_residual.float() - expected.float()).abs().max() <= 2**-6 * expected.abs().max()
    run = functools.partial(moe_triton.fused_moe, limit=LIMIT, config=tiles)
    _replays_on_new_inputs(run, packed, num_tokens, seeds=(40 + num_tokens, 50))


def _replays_on_new_inputs(
    run: Callable, packed: list, num_tokens: int, seeds: tuple[int, int]
) -> None:
    """``run`` (fused_moe with its limit, and tiles) on ``packed`` captured in a CUDA graph,
    replayed on a second batch: the eager result on that batch, bit for bit."""
    x, topk_ids, topk_weights = _batch(num_tokens, 256, torch.bfloat16, seed=seeds[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm the allocator outside the capture
        run(x, *packed, topk_ids, topk_weights)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, *packed, topk_ids, topk_weights)
    new_x, new_ids, new_weights = _batch(num_tokens, 256, torch.bfloat16, seed=seeds[1])
    x.copy_(new_x)
    topk_ids.copy_(new_ids)
    topk_weights.copy_(new_weights)
    graph.replay()
    assert torch.equal(out, run(new_x, *packed, new_ids, new_weights))


def test_mxfp4_bits_tiles_over_short_rows_take_the_scaled_dot(moe_triton: ModuleType) -> None:
    """A tiny model's experts (D = 64, I = 32: rows shorter than the bits loop's 128-input K
    tile) under a bits_upcast config: the kernels take the scaled dot instead, bitwise the
    output of the same tiles without bits (the engine's tiles are bits by default)."""
    gen = torch.Generator(device="cuda").manual_seed(31)
    shapes = ((8, 32, 64), (8, 64, 32), (8, 32, 64))
    draws = [torch.randn(*shape, generator=gen, device="cuda") for shape in shapes]
    packed = [torch_ref.quantize_mxfp4(w) for w in draws]
    x = torch.randn(16, 64, generator=gen, device="cuda").bfloat16()
    topk_ids = torch.rand(16, 8, generator=gen, device="cuda").argsort(-1)[:, :2]
    topk_weights = torch.rand(16, 2, generator=gen, device="cuda")
    tiles = moe_triton.pick_tile_config(4096, torch.bfloat16, True)
    assert tiles.bits_upcast and tiles.block_k > 64
    configs = [dataclasses.replace(tiles, bits_upcast=bits) for bits in (True, False)]
    outs = [
        moe_triton.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT, config=config)
        for config in configs
    ]
    assert torch.isfinite(outs[0]).all() and outs[0].abs().max() > 0
    assert torch.equal(outs[0], outs[1])


def test_mxfp4_captures_in_a_cuda_graph(
    moe_triton: ModuleType, mxfp4_experts: tuple[list[torch_ref.Mxfp4Weight], Experts]
) -> None:
    run = functools.partial(moe_triton.fused_moe, limit=LIMIT)
    _replays_on_new_inputs(run, mxfp4_experts[0], 8, seeds=(20, 21))


def test_mxfp4_decode_gemv_in_fp32_is_the_reference(
    moe_triton: ModuleType, fp32_experts: Experts, ieee_fp32: None
) -> None:
    """fp32 (parity) decode through a program a pair: torch_ref on the same packed bytes, to
    FP32_TOL (the fp32 FMAs differ from cuBLAS only in summation order)."""
    packed = [torch_ref.quantize_mxfp4(w) for w in fp32_experts]
    x, topk_ids, topk_weights = _batch(3, 32, torch.float32, seed=30)
    assert isinstance(moe_triton.pick_tile_config(3 * TOP_K, torch.float32, packed=True),
                      moe_triton.GemvConfig)  # fmt: skip
    out = moe_triton.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT)
    ref = torch_ref.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT)
    assert _rel_err(out, ref.float()) < FP32_TOL


def test_mxfp4_decode_gemv_token_output_does_not_depend_on_the_batch(
    moe_triton: ModuleType, mxfp4_experts: tuple[list[torch_ref.Mxfp4Weight], Experts]
) -> None:
    """bf16, a program a pair: a token alone and among 15 others, bitwise the same."""
    packed, _ = mxfp4_experts
    x, topk_ids, topk_weights = _batch(16, 256, torch.bfloat16, seed=31)
    batched = moe_triton.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT)
    one = slice(9, 10)
    alone = moe_triton.fused_moe(x[one], *packed, topk_ids[one], topk_weights[one], LIMIT)
    assert torch.equal(alone[0], batched[9])


@pytest.mark.parametrize("num_tokens", [1, 4])
def test_mxfp4_decode_down_split_over_slots_is_the_loop_bitwise(
    moe_triton: ModuleType,
    mxfp4_experts: tuple[list[torch_ref.Mxfp4Weight], Experts],
    num_tokens: int,
) -> None:
    """bf16, V4-Flash shapes: the down kernel a program per (token, slot), its tiles' last
    program adding the products through the ticket, against one program looping over the slots:
    bitwise alike, over 50 graph replays (the tickets' ordering on real SMs); x in nibble-major
    order through gate_up gives the same h."""
    from deepinfer.ops.moe import triton_gemv

    packed, _ = mxfp4_experts
    x, topk_ids, topk_weights = _batch(num_tokens, 256, torch.bfloat16, seed=40 + num_tokens)
    engine = moe_triton.pick_tile_config(num_tokens * TOP_K, torch.bfloat16, packed=True)
    loop = dataclasses.replace(engine, down_split_tokens=0)
    split = dataclasses.replace(engine, down_split_tokens=num_tokens)
    expected = moe_triton.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT, config=loop)
    graph = torch.cuda.CUDAGraph()
    moe_triton.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT, config=split)  # compile
    with torch.cuda.graph(graph):
        out = moe_triton.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT, config=split)
    for _ in range(50):
        graph.replay()
        assert torch.equal(out, expected)
    operands = ((packed[0].packed, packed[0].scale), (packed[2].packed, packed[2].scale))
    h = triton_gemv.gate_up(x, *operands, topk_ids, LIMIT, engine)
    reordered = triton_gemv.nibble_major(x)
    h_reordered = triton_gemv.gate_up(
        reordered, *operands, topk_ids, LIMIT, engine, x_nibble_major=True
    )
    assert torch.equal(h_reordered, h)


@pytest.mark.parametrize(("num_tokens", "split"), [(1, False), (4, True), (512, False)])
def test_mxfp4_residual_joins_the_last_store_as_an_add_would(
    moe_triton: ModuleType,
    mxfp4_experts: tuple[list[torch_ref.Mxfp4Weight], Experts],
    num_tokens: int,
    split: bool,
) -> None:
    """bf16, V4-Flash shapes: fused_moe(..., residual=r) (r added in the down kernel's store,
    in the last program of a ticket when the down kernel is split over slots, or in the grouped
    combine's) is bitwise fused_moe(...) + r, also replayed from a CUDA graph."""
    packed, _ = mxfp4_experts
    x, topk_ids, topk_weights = _batch(num_tokens, 256, torch.bfloat16, seed=50 + num_tokens)
    residual = torch.randn(x.shape, device="cuda").bfloat16()
    config = moe_triton.pick_tile_config(num_tokens * TOP_K, torch.bfloat16, packed=True)
    if isinstance(config, moe_triton.GemvConfig):
        config = dataclasses.replace(config, down_split_tokens=num_tokens if split else 0)
    run = functools.partial(
        moe_triton.fused_moe, x, *packed, topk_ids, topk_weights, LIMIT, config=config
    )
    expected = run() + residual
    assert torch.equal(run(residual=residual), expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(residual=residual)
    for _ in range(5):
        graph.replay()
        assert torch.equal(out, expected)


@pytest.mark.parametrize("num_tokens", [1, 128, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_the_reference(
    moe_triton: ModuleType, num_tokens: int, dtype: torch.dtype
) -> None:
    """The shared expert's activation at V4-Flash's I on the column blocks of one GEMM output.
    fp32: within 1e-6 of torch_ref. bf16: within 2^-7 relative, since torch_ref rounds SiLU's
    output to bf16 before the product (<= 2^-9 each for that rounding, the product's and the
    kernel's one)."""
    gen = torch.Generator().manual_seed(num_tokens)
    projected = (8 * torch.randn(num_tokens, 2 * INTER, generator=gen)).to("cuda", dtype)
    gate, up = projected.split(INTER, dim=1)
    out = moe_triton.swiglu(gate, up, LIMIT)
    ref = torch_ref.swiglu(gate, up, LIMIT)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 128, 4096])
def test_router_on_cuda_picks_the_reference_experts(num_tokens: int) -> None:
    """The one-launch router at V4-Flash's 256 experts, top 6, bf16 logits: the experts of
    torch_ref.route on CUDA (as sets; a token may differ only where the reference's 6th and
    7th scores tie within 1e-5, the kernel's exp and log being a few ulps off CUDA's) and its
    weights within 1e-5 where they agree; a hash layer's ids kept."""
    router = compiled("deepinfer.ops.moe.triton_router")
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    logits = (torch.randn(num_tokens, 256, generator=gen, device="cuda") * 3).bfloat16()
    bias = torch.randn(256, generator=gen, device="cuda") * 0.1
    hash_ids = torch.rand(num_tokens, 256, generator=gen, device="cuda").argsort(-1)[:, :TOP_K]
    for args in ((bias, None), (None, hash_ids)):
        weights, ids = router.route(logits, *args, TOP_K, 2.5)
        ref_weights, ref_ids = torch_ref.route(logits, *args, TOP_K, 2.5)
        order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
        same = (ids.gather(1, order) == ref_ids.gather(1, ref_order)).all(-1)
        if not same.all():
            biased = torch.nn.functional.softplus(logits.float()).sqrt() + args[0]
            top = biased[~same].topk(TOP_K + 1, dim=-1).values
            assert (top[:, -2] - top[:, -1] < 1e-5).all(), "experts differ without a tie"
        torch.testing.assert_close(
            weights.gather(1, order)[same],
            ref_weights.gather(1, ref_order)[same],
            rtol=1e-5,
            atol=1e-6,
        )
