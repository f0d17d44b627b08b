"""FP8 block-scaled linear layers: the torch reference, the Triton kernels on the CPU through
Triton's interpreter, and the loader/model path that keeps FP8 weights.

The interpreter runs float8 loads, stores and tl.dot (it widens e4m3 to fp16, exactly); its own
fp32 -> e4m3 cast loses a rounding carry (125.0 -> 64), which the quantizer never relies on: it
rounds explicitly first (ops/linear/triton.py), and the tests below check it bitwise against
torch's cast. Shapes are small, with K and N not multiples of 128 (ragged last blocks).
tests/gpu/test_gpu_linear_fp8.py covers the compiled kernels at DeepSeek-V4-Flash shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os

_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on numpy, on the CPU

import inspect  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

pytest.importorskip("triton")

from triton_modules import Launches, contract_mismatches, interpreted, no_sm_lookup  # noqa: E402

from deepinfer.model.deepseek_v4.args import ModelArgs  # noqa: E402
from deepinfer.model.deepseek_v4.checkpoint import load_checkpoint  # noqa: E402
from deepinfer.model.deepseek_v4.model import DeepseekV4  # noqa: E402
from deepinfer.model.deepseek_v4.tiny import TINY_CONFIG, random_weights  # noqa: E402
from deepinfer.model.deepseek_v4.weights import fp8_scale_name, is_fp8_linear  # noqa: E402
from deepinfer.model.layers import Fp8Linear, grouped_linear, use_fp8_linears  # noqa: E402
from deepinfer.ops import reference_kernels  # noqa: E402
from deepinfer.ops.linear import BACKENDS, LinearBackend, torch_ref  # noqa: E402
from deepinfer.ops.moe import torch_ref as moe_torch_ref  # noqa: E402

# Triton against the same W8A8 arithmetic done in torch (x quantized by torch_ref, then an fp32
# matmul of the dequantized values): both sum exact fp32 products, in another order
# (|y| ~ 1, K <= 512: a few 1e-7).
EMULATED_TOL = 1e-5
# Triton (x quantized to e4m3) against torch_ref (x exact): e4m3 keeps 3 mantissa bits, a
# rounding error of at most 2^-4 relative and ~2.6e-2 RMS (uniform within a step of 2^-3 x the
# value's binade); the errors of the K products are independent, so the output's relative
# error (norm of the difference over norm of the reference) is about that RMS: 2.5e-2 .. 2.6e-2
# at the shapes below.
W8A8_TOL = 4e-2


@pytest.fixture(scope="module")
def linear_triton() -> Iterator[ModuleType]:
    """The backend with interpreted kernels (the GPU tests may have imported it compiled)."""
    yield from interpreted("deepinfer.ops.linear.triton", _INTERPRET_BEFORE)


@pytest.fixture(scope="module")
def moe_triton() -> Iterator[ModuleType]:
    """The MoE backend's kernels, interpreted: its SwiGLU launch."""
    yield from interpreted("deepinfer.ops.moe.triton", _INTERPRET_BEFORE)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random FP8 weight [n, k] and its block scales, blocks of differing magnitude."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * k**-0.5
    w *= torch.exp2(torch.randint(-3, 3, (n, 1), generator=gen).float())  # rows of 1/8 .. 4
    return torch_ref.quantize_fp8(w)


def _emulated(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 in torch: x quantized per token per 128 inputs, fp32 matmul of exact values."""
    q, x_scale = torch_ref.quantize_activations(x)
    x_hat = q.float() * x_scale.repeat_interleave(128, 1)[:, : x.shape[1]]
    return x_hat @ torch_ref.dequantize_fp8(weight, scale).T


def test_registered_before_torch_ref(linear_triton: ModuleType) -> None:
    assert BACKENDS.names == ["deepgemm", "triton", "torch_ref"]
    assert type(BACKENDS.select("auto", torch.device("cpu"))) is torch_ref.TorchRefLinearBackend
    ours = inspect.signature(linear_triton.fp8_linear).parameters
    ref = inspect.signature(torch_ref.fp8_linear).parameters
    assert list(ours)[: len(ref)] == list(ref)
    assert all(ours[name].default == ref[name].default for name in ref)
    assert ours["config"].kind is inspect.Parameter.KEYWORD_ONLY


def test_torch_ref_is_blockwise_dequantize_then_fp32_matmul() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, scale = _weight(300, 200, seed=0)  # blocks: rows 128+128+44, columns 128+72
    assert scale.shape == (3, 2)
    w = torch.empty(300, 200)
    for r in range(3):
        for c in range(2):
            rows, cols = slice(128 * r, 128 * (r + 1)), slice(128 * c, 128 * (c + 1))
            w[rows, cols] = weight[rows, cols].float() * scale[r, c]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 200, generator=gen).to(dtype)
        out = torch_ref.fp8_linear(x, weight, scale)
        assert out.dtype == dtype
        assert torch.equal(out, (x.float() @ w.T).to(dtype))


def test_quantize_fp8_round_trip() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(200, 300, generator=gen) * torch.rand(200, 1, generator=gen)
    q, scale = torch_ref.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    # The largest value of each block maps to 448 (e4m3's largest finite value).
    assert q.float().abs().amax() == 448
    err = (torch_ref.dequantize_fp8(q, scale) - w).abs()
    # 3 mantissa bits: <= 2^-4 relative; below e4m3's normal range, half a step of 2^-9.
    bound = w.abs() / 16 + scale.max() * 2**-10
    assert (err <= bound).all()


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value, each midpoint between neighbours (ties: round to even) and
    points just either side of each midpoint, all times one positive and one negative sign."""
    codes = torch.arange(0, 127, dtype=torch.uint8)  # +0 .. 448 (127 = NaN)
    values = codes.view(torch.float8_e4m3fn).float()
    mids = (values[1:] + values[:-1]) / 2
    ulp = mids.abs() * 2**-20
    magnitudes = torch.cat([values, mids, mids + ulp, mids - ulp])
    return torch.cat([magnitudes, -magnitudes])


def test_quantizer_rounds_to_nearest_even(linear_triton: ModuleType) -> None:
    """With a group amax of 448 the scale is 1 and q = the value rounded to e4m3: bitwise the
    torch cast, over the whole e4m3 range (the carry into the next binade, ties, subnormals)."""
    grid = _e4m3_grid()
    rows = -(-grid.numel() // 127)
    values = torch.zeros(rows * 127)
    values[: grid.numel()] = grid
    x = torch.cat([values.view(rows, 127), torch.full((rows, 1), 448.0)], dim=1)  # [rows, 128]
    q, scale = linear_triton.quantize_activations(x)
    assert torch.equal(scale, torch.ones_like(scale))
    assert torch.equal(q.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_matches_reference_bitwise(linear_triton: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(7, 300, generator=gen) * 3).to(dtype)  # groups of 128, 128, 44
    x[1] = 0  # an all-zero row: scale max(0, eps) / 448, q = 0
    x[2, 5] = 1e4  # an outlier: the rest of its group lands in e4m3's subnormals
    q, scale = linear_triton.quantize_activations(x)
    ref_q, ref_scale = torch_ref.quantize_activations(x)
    assert q.shape == x.shape and scale.shape == (7, 3) and scale.stride() == (1, 7)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale, ref_scale)
    assert torch.equal(scale[1], torch.full((3,), 1e-10 / 448))
    x_hat = q.float() * scale.repeat_interleave(128, 1)[:, :300]
    bound = x.float().abs() / 16 + scale.repeat_interleave(128, 1)[:, :300] * 2**-10
    assert ((x_hat - x.float()).abs() <= bound).all()


def _config(linear_triton: ModuleType, path: str) -> object:
    """A tile configuration that takes one path of the kernels at small shapes."""
    tile = linear_triton.TileConfig
    return {
        "table": None,
        "separate_quantizer": tile(16, 64, 2, 4, 2, False, 1),
        "quantize_in_gemm": tile(16, 64, 2, 4, 2, True, 1),
        "split_k": tile(16, 32, 1, 4, 2, True, 8),
        "swap_ab": tile(16, 64, 1, 4, 2, True, 8, 1, True),
        "swap_ab_separate_quantizer": tile(32, 64, 2, 4, 2, False, 1, 1, True),
    }[path]


@pytest.mark.parametrize(
    "path",
    [
        "table",
        "separate_quantizer",
        "quantize_in_gemm",
        "split_k",
        "swap_ab",
        "swap_ab_separate_quantizer",
    ],
)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 512), (5, 200, 300), (37, 130, 256)])
def test_fp8_linear_matches_reference(
    linear_triton: ModuleType, path: str, m: int, n: int, k: int
) -> None:
    weight, scale = _weight(n, k, seed=n + k)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    out = linear_triton.fp8_linear(x, weight, scale, config=_config(linear_triton, path))
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert _rel_err(out, _emulated(x, weight, scale)) < EMULATED_TOL
    assert _rel_err(out, torch_ref.fp8_linear(x, weight, scale)) < W8A8_TOL


@pytest.mark.parametrize("quantize_in_gemm", [True, False])
def test_tile_across_weight_scale_blocks(linear_triton: ModuleType, quantize_in_gemm: bool) -> None:
    """Weight blocks of 32 x 128 under 64-wide tiles: each column takes its own block's scale
    (the tiles inside one block load theirs as one number)."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(96, 256, generator=gen) * torch.exp2(torch.arange(96).float() // 32)[:, None]
    weight, scale = torch_ref.quantize_fp8(w, (32, 128))
    x = torch.randn(2, 256, generator=gen)
    config = linear_triton.TileConfig(16, 64, 1, 4, 2, quantize_in_gemm, 1)
    out = linear_triton.fp8_linear(x, weight, scale, (32, 128), config=config)
    q, x_scale = torch_ref.quantize_activations(x)
    x_hat = q.float() * x_scale.repeat_interleave(128, 1)
    assert _rel_err(out, x_hat @ torch_ref.dequantize_fp8(weight, scale, (32, 128)).T) < 1e-5


def test_split_k_and_quantizer_placement(linear_triton: ModuleType) -> None:
    """K = 512 (4 blocks) over 2 N tiles on the interpreter's 4 "SMs": split in 2. Quantizing in
    the GEMM or in a separate pass gives bitwise the same result."""
    weight, scale = _weight(64, 512, seed=3)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    split = _config(linear_triton, "split_k")
    assert linear_triton._split_k(2, 4, split.max_split_k, 4) == 2
    unsplit = linear_triton.TileConfig(16, 32, 1, 4, 2, True, 1)
    a = linear_triton.fp8_linear(x, weight, scale, config=split)
    b = linear_triton.fp8_linear(x, weight, scale, config=unsplit)
    assert _rel_err(a, b) < EMULATED_TOL
    separate = linear_triton.TileConfig(16, 32, 1, 4, 2, False, 1)
    assert torch.equal(linear_triton.fp8_linear(x, weight, scale, config=separate), b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_is_f_linear_in_one_launch(
    linear_triton: ModuleType, dtype: torch.dtype
) -> None:
    """dense_linear (a weight in x's dtype, the FP8 GEMM's tiles without scales): F.linear's
    values within the sum order's rounding (fp32: 1e-6; bf16: the output's rounding, 2^-8),
    K split over 4 programs an SM stand-in (3 splits of 64-channel steps, and a partial last
    step), strided x; a row's output the same alone as among 5 (the ONE_ROW path); counters
    reset; the backend object's up to DENSE_MAX_ROWS rows and F.linear's past it."""
    gen = torch.Generator().manual_seed(31)
    weight = torch.randn(96, 184, generator=gen).to(dtype)
    x = torch.randn(5, 2 * 184, generator=gen).to(dtype)[:, ::2]  # strided rows
    out = linear_triton.dense_linear(x, weight)
    ref = torch.nn.functional.linear(x.float(), weight.float())
    assert out.dtype == dtype and out.shape == (5, 96)
    assert _rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 2**-8)
    assert torch.equal(linear_triton.dense_linear(x[2:3], weight), out[2:3])
    assert not linear_triton.ticket_counters(x.device).any()
    backend = linear_triton.TritonLinearBackend(torch.device("cpu"))
    few = x[: linear_triton.DENSE_MAX_ROWS]
    assert torch.equal(backend.dense_linear(few, weight), linear_triton.dense_linear(few, weight))
    many = torch.randn(linear_triton.DENSE_MAX_ROWS + 1, 184, generator=gen).to(dtype)
    assert torch.equal(backend.dense_linear(many, weight), torch.nn.functional.linear(many, weight))
    assert linear_triton.dense_linear(x[:0], weight).shape == (0, 96)
    with pytest.raises(AssertionError, match="no swapped tiles"):
        linear_triton.dense_linear(x, weight, config=_config(linear_triton, "swap_ab"))


@pytest.mark.parametrize("path", ["separate_quantizer", "quantize_in_gemm", "split_k", "swap_ab"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
def test_swiglu_input_is_the_swiglu_launch_then_the_gemm(
    linear_triton: ModuleType, moe_triton: ModuleType, path: str, dtype: torch.dtype, m: int
) -> None:
    """The shared expert's w2 with its activation computed where x is quantized: gate and up
    the column blocks of one [M, 2K] tensor (the fused w1 + w3 GEMM's), limit 1.5 so that both
    clamps engage, K = 300 (a ragged last block): bitwise the MoE backend's SwiGLU launch, then
    fp8_linear, on every path (one row: the quantized row repeated down the tile); the
    quantizer alone (cuBLAS's path) bitwise the quantizer of that launch's output; torch_ref
    bitwise its own SwiGLU, then its GEMM."""
    k, limit = 300, 1.5
    weight, scale = _weight(64, k, seed=k + m)
    gate_up = (2 * torch.randn(m, 2 * k, generator=torch.Generator().manual_seed(m))).to(dtype)
    gate, up = gate_up[:, :k], gate_up[:, k:]
    assert (gate > limit).any() and (up.abs() > limit).any()
    h = moe_triton.swiglu(gate, up, limit)
    config = _config(linear_triton, path)
    fused = linear_triton.fp8_linear(gate, weight, scale, swiglu=(up, limit), config=config)
    assert fused.dtype == dtype
    assert torch.equal(fused, linear_triton.fp8_linear(h, weight, scale, config=config))
    q, x_scale = linear_triton.quantize_activations(gate, swiglu=(up, limit))
    expected = linear_triton.quantize_activations(h)
    assert torch.equal(q.view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(x_scale, expected[1])
    ref = torch_ref.fp8_linear(gate, weight, scale, swiglu=(up, limit))
    activation = moe_torch_ref.swiglu(gate, up, limit)
    assert torch.equal(ref, torch_ref.fp8_linear(activation, weight, scale))


def test_split_k_sums_in_the_tiles_last_program(linear_triton: ModuleType) -> None:
    """Split K in one launch: the tile's last split adds the partial sums in split order, then
    resets its counter, so a second call (a graph replay) sums again and bitwise alike. A
    counter left over breaks that tile's next sum: the ticket decides which program adds."""
    weight, scale = _weight(64, 512, seed=9)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(9))
    config = _config(linear_triton, "split_k")
    first = linear_triton.fp8_linear(x, weight, scale, config=config)
    counters = linear_triton.ticket_counters(x.device)
    assert not counters.any(), "a tile's counter was not reset"
    assert torch.equal(linear_triton.fp8_linear(x, weight, scale, config=config), first)
    assert _rel_err(first, _emulated(x, weight, scale)) < EMULATED_TOL
    counters[0] = 1  # tile 0's first split takes the last ticket, before the other's sums
    stale = linear_triton.fp8_linear(x, weight, scale, config=config)
    counters.zero_()
    assert not torch.equal(stale[:, :32], first[:, :32])
    assert torch.equal(stale[:, 32:], first[:, 32:])


@pytest.mark.parametrize("path", ["separate_quantizer", "quantize_in_gemm", "split_k", "swap_ab"])
def test_grouped_linear_is_each_group_alone(linear_triton: ModuleType, path: str) -> None:
    """wo_a's form: 3 groups of 128 weight rows (whole block rows) on a strided x [M, G, K],
    one launch: bitwise fp8_linear on each group's rows and slice with the same tiles and split
    (a grid wide enough that both split K alike), and within W8A8_TOL of torch_ref's einsum."""
    groups, n, k = 3, 128, 256
    weight, scale = _weight(groups * n, k, seed=11)
    wide = torch.randn(2, groups, k + 32, generator=torch.Generator().manual_seed(2))
    x = wide[..., :k]  # a row stride of groups * (k + 32)
    config = _config(linear_triton, path)
    out = linear_triton.fp8_grouped_linear(x, weight, scale, config=config, num_sms=1000)
    assert out.shape == (2, groups, n) and out.is_contiguous()
    for g in range(groups):
        rows = slice(g * n, (g + 1) * n)
        alone = linear_triton.fp8_linear(
            x[:, g], weight[rows], scale[g : g + 1], config=config, num_sms=1000
        )
        assert torch.equal(out[:, g], alone), g
    assert _rel_err(out, torch_ref.fp8_grouped_linear(x, weight, scale)) < W8A8_TOL


@pytest.mark.parametrize("quantize_in_gemm", [True, False])
def test_grouped_linear_groups_off_the_scale_blocks(
    linear_triton: ModuleType, quantize_in_gemm: bool
) -> None:
    """Groups off the block rows (the tiny models' wo_a has 16-row groups): 4 groups of 48 rows
    over two 128-row scale blocks of differing magnitude, the third group straddling them; a
    column takes the scale of the whole weight's row g * 48 + n."""
    groups, n, k = 4, 48, 200
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(groups * n, k, generator=gen)
    w *= torch.exp2(torch.arange(groups * n).float() // 128 * 3)[:, None]
    w *= torch.exp2(torch.arange(k).float() // 128)
    weight, scale = torch_ref.quantize_fp8(w)
    assert scale.shape == (2, 2)
    x = torch.randn(5, groups, k, generator=gen)
    config = linear_triton.TileConfig(16, 64, 1, 4, 2, quantize_in_gemm, 2)
    out = linear_triton.fp8_grouped_linear(x, weight, scale, config=config)
    q, x_scale = torch_ref.quantize_activations(x.reshape(-1, k))
    x_hat = (q.float() * x_scale.repeat_interleave(128, 1)[:, :k]).view(5, groups, k)
    assert _rel_err(out, torch_ref.fp8_grouped_linear(x_hat, weight, scale)) < EMULATED_TOL


def test_grouped_linear_per_group_from_the_split_rows(linear_triton: ModuleType) -> None:
    """From GROUPED_SPLIT_ROWS rows a grouped linear runs a GEMM a group (cuBLAS's or
    DeepGEMM's) where groups are whole block rows; ``fp8_linear_per_group`` is that loop."""
    split_rows = linear_triton.GROUPED_SPLIT_ROWS
    assert linear_triton.split_groups(split_rows, 1024, (128, 128))
    assert not linear_triton.split_groups(split_rows - 1, 1024, (128, 128))
    assert not linear_triton.split_groups(split_rows, 16, (128, 128))  # tiny wo_a: never
    weight, scale = _weight(2 * 128, 128, seed=4)
    x = torch.randn(3, 2, 128, generator=torch.Generator().manual_seed(4))
    per_group = linear_triton.fp8_linear_per_group(
        torch_ref.fp8_linear, x, weight, scale, (128, 128)
    )
    assert _rel_err(per_group, torch_ref.fp8_grouped_linear(x, weight, scale)) < 1e-6


def test_backend_object_launches_with_its_sm_count_and_tiles(
    linear_triton: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TritonLinearBackend keeps the SM count of the device it was made for (the interpreter's
    stand-in, 4) and its tile override, and launches by them, never asking the module again.
    K = 512 (4 blocks) over 2 tiles: 4 SMs split K in 2, 8 SMs in 4, one SM not at all; with four
    programs an SM wanted (``programs_per_sm``), one SM splits it in 2."""
    split = _config(linear_triton, "split_k")
    backend = linear_triton.TritonLinearBackend(torch.device("cpu"), config=split)
    assert backend.num_sms == 4 and backend.config is split
    assert contract_mismatches(backend, LinearBackend) == []
    monkeypatch.setattr(linear_triton, "_num_sms", no_sm_lookup)
    monkeypatch.setattr(
        linear_triton, "pick_tile_config", lambda m: pytest.fail("the tile override was ignored")
    )
    launches = Launches(linear_triton._gemm_kernel)
    monkeypatch.setattr(linear_triton, "_gemm_kernel", launches)
    weight, scale = _weight(64, 512, seed=3)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    for num_sms in (4, 8, 1):
        backend.num_sms = num_sms
        out = backend.fp8_linear(x, weight, scale, (128, 128))
        assert _rel_err(out, _emulated(x, weight, scale)) < EMULATED_TOL
    backend.config = dataclasses.replace(split, programs_per_sm=4)
    out = backend.fp8_linear(x, weight, scale, (128, 128))
    assert _rel_err(out, _emulated(x, weight, scale)) < EMULATED_TOL
    assert launches.grids == [(2, 2, 1), (2, 4, 1), (2, 1, 1), (2, 2, 1)]


def test_backend_takes_cublas_where_it_is_faster_and_drops_it_when_refused(
    linear_triton: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ``use_cublas`` says so, for bf16 x (CUDA only; switched on by hand here), the
    backend calls cublas_fp8_linear; where torch refuses the recipe (RuntimeError) it answers
    with our kernel, and keeps to ours from then on."""
    use = linear_triton.use_cublas
    assert not any(use(m, 4096, 1024) for m in (1, 32, 64))  # ours to 64 rows (swapped tiles)
    assert use(65, 4096, 1024) and use(1024, 128, 128)
    assert not use(1024, 200, 256) and not use(1024, 256, 64)  # partial blocks: ours
    partial, partial_scale = _weight(200, 256, seed=4)
    with pytest.raises(AssertionError, match="partial blocks"):  # use_cublas keeps them ours
        linear_triton.cublas_fp8_linear(torch.zeros(80, 256), partial, partial_scale)
    backend = linear_triton.TritonLinearBackend(torch.device("cpu"))
    assert not backend.cublas  # not on the CPU
    calls: list[int] = []

    def refused(
        x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, swiglu: object = None
    ) -> torch.Tensor:
        calls.append(x.shape[0])
        raise RuntimeError("blockwise scaling needs CUDA 12.9")

    monkeypatch.setattr(linear_triton, "cublas_fp8_linear", refused)
    backend.cublas = True
    weight, scale = _weight(128, 256, seed=4)
    x = torch.randn(80, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    backend.fp8_linear(x[:3], weight, scale)  # 3 rows: ours
    backend.fp8_linear(x.float(), weight, scale)  # fp32 (parity runs): ours
    assert calls == [] and backend.cublas
    out = backend.fp8_linear(x, weight, scale)
    assert calls == [80] and not backend.cublas
    assert torch.equal(out, linear_triton.fp8_linear(x, weight, scale))
    backend.fp8_linear(x, weight, scale)
    assert calls == [80]


def test_quantizer_pads_rows_for_a_gemm_that_wants_them(linear_triton: ModuleType) -> None:
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5))
    q, scale = linear_triton.quantize_activations(x, 128, rows=16)
    assert q.shape == (16, 256) and scale.shape == (16, 2) and scale.stride() == (1, 16)
    expected = torch_ref.quantize_activations(x)
    assert torch.equal(q[:5].view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(scale[:5], expected[1])


def test_bf16_input_strided_and_empty(linear_triton: ModuleType) -> None:
    weight, scale = _weight(96, 200, seed=4)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 300, generator=gen).to(torch.bfloat16)[:, 50:250]  # row stride 300
    out = linear_triton.fp8_linear(x, weight, scale)
    assert out.dtype == torch.bfloat16
    # One bf16 rounding of the output (2^-9 relative) on top of the fp32 result.
    assert _rel_err(out, _emulated(x, weight, scale)) < 4e-3
    empty = linear_triton.fp8_linear(x[:0], weight, scale)
    assert empty.shape == (0, 96) and empty.dtype == torch.bfloat16


# ---- the model on FP8 weights ------------------------------------------------------------------

# The tiny architecture with a small vocabulary (the loader and model never look at it).
SMALL = {**TINY_CONFIG, "vocab_size": 512}


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A checkpoint in our names whose linears are FP8 with ``.scale`` tensors, one of them
    ue8m0 as upstream ships them; returns the folder and the tensors written."""
    folder = tmp_path_factory.mktemp("fp8")
    args = ModelArgs.from_dict(SMALL)
    tensors = random_weights(args, seed=0, device=torch.device("cpu"), dtype=torch.float32)
    for name in list(tensors):
        if is_fp8_linear(name):
            tensors[name], tensors[fp8_scale_name(name)] = torch_ref.quantize_fp8(tensors[name])
    e8m0 = fp8_scale_name("layers.1.attn.wq_b.weight")
    tensors[e8m0] = tensors[e8m0].to(torch.float8_e8m0fnu)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(SMALL))
    return folder, tensors


def test_loader_keeps_fp8_linears(fp8_checkpoint: tuple[Path, dict]) -> None:
    folder, written = fp8_checkpoint
    args = ModelArgs.from_dict(SMALL)
    plain = load_checkpoint(folder, args, show_progress=False)
    kept = load_checkpoint(folder, args, show_progress=False, keep_fp8=True)
    fp8_names = [n for n in plain if is_fp8_linear(n)]
    # 8 per layer (wq_a, wq_b, wkv, wo_a, wo_b, shared w1..w3), 6 more per CSA layer (two
    # compressors' wkv and wgate, the indexer's wq_b and weights_proj), 2 more per HCA layer.
    assert len(fp8_names) == 6 * 8 + 2 * 6 + 2 * 2
    expected_order = []
    for name in plain:
        expected_order += [name, fp8_scale_name(name)] if is_fp8_linear(name) else [name]
    assert list(kept) == expected_order
    for name in plain:
        if not is_fp8_linear(name):
            assert kept[name].dtype == plain[name].dtype and torch.equal(kept[name], plain[name])
            continue
        scale = kept[fp8_scale_name(name)]
        assert kept[name].dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert torch.equal(kept[name].view(torch.uint8), written[name].view(torch.uint8))
        assert torch.equal(scale, written[fp8_scale_name(name)].float())
        assert torch.equal(torch_ref.dequantize_fp8(kept[name], scale), plain[name])


def test_model_runs_fp8_linears(fp8_checkpoint: tuple[Path, dict]) -> None:
    """Built on the meta device, the model takes the FP8 state dict once its linears are
    swapped, and an Fp8Linear computes what nn.Linear computes on the dequantized weight."""
    folder, _ = fp8_checkpoint
    args = ModelArgs.from_dict(SMALL)
    kept = load_checkpoint(folder, args, show_progress=False, keep_fp8=True)
    plain = load_checkpoint(folder, args, show_progress=False)
    kernels = reference_kernels()
    with torch.device("meta"):
        model = DeepseekV4(args, kernels)
        num_fp8 = use_fp8_linears(model, kept, (128, 128), kernels.linear)
    assert num_fp8 == sum(is_fp8_linear(n) for n in plain)
    model.load_state_dict(kept, strict=True, assign=True)
    attn = model.layers[1].attn
    assert isinstance(attn.wq_b, Fp8Linear) and isinstance(attn.indexer.compressor.wgate, Fp8Linear)
    assert isinstance(attn.wo_a, Fp8Linear) and type(model.head) is nn.Linear
    x = torch.randn(2, 3, args.q_lora_rank, generator=torch.Generator().manual_seed(5))
    out = attn.wq_b(x)
    assert out.shape == (2, 3, args.num_heads * args.head_dim)
    ref = F.linear(x, plain["layers.1.attn.wq_b.weight"])
    assert _rel_err(out, ref) < 1e-6
    # wo_a, block-diagonal: group g's rows on x's g-th slice, as the bf16 model's einsum.
    groups = torch.randn(3, args.o_groups, args.num_heads * args.head_dim // args.o_groups)
    out = grouped_linear(attn.wo_a, groups)
    assert out.shape == (3, args.o_groups, args.o_lora_rank)
    dense = nn.Linear(groups.shape[2], args.o_groups * args.o_lora_rank, bias=False)
    dense.weight.data = plain["layers.1.attn.wo_a.weight"]
    assert _rel_err(out, grouped_linear(dense, groups)) < 1e-6
    # The shared expert on an FP8 w2: its activation passed to the linear with the gate.
    mlp = model.layers[1].ffn.shared_experts
    assert isinstance(mlp.w2, Fp8Linear)
    h = torch.randn(4, args.hidden_size, generator=torch.Generator().manual_seed(6))
    gate, up = (F.linear(h, plain[f"layers.1.ffn.shared_experts.{w}.weight"]) for w in ("w1", "w3"))
    activation = moe_torch_ref.swiglu(gate, up, args.swiglu_limit)
    ref = F.linear(activation, plain["layers.1.ffn.shared_experts.w2.weight"])
    assert _rel_err(mlp(h), ref) < 1e-6
