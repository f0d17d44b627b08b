"""FlashMLA's V4 FP8 KV layout as ops/attention/flashmla.py packs it, on the CPU.

Exact bytes at the documented offsets, the quantization error bound, unpack as a fixed point (the
values it returns are the ones the kernel computes with, so packing them again changes nothing),
and, where scripts/fetch_flashmla.sh has put FlashMLA's source in .flashmla/, byte equality
with FlashMLA's own reference quantizer (tests/quant.py, MODEL1_FP8Sparse).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from deepinfer.ops.attention import flashmla

FLASHMLA_QUANT = Path(__file__).parents[1] / ".flashmla" / "FlashMLA" / "tests" / "quant.py"
BLOCK_SIZE = 64
NUM_ROWS = 150  # 3 blocks, the last one partly filled


def _kv(num_rows: int, seed: int = 0) -> torch.Tensor:
    """bf16 rows [N, 512] with per-row magnitudes over 1e-3..3, a zero tile and a tiny tile."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(torch.empty(num_rows, 1).uniform_(-7, 1, generator=gen))
    kv = (torch.randn(num_rows, flashmla.HEAD_DIM, generator=gen) * magnitude).bfloat16()
    kv[3, :64] = 0  # amax 0: the scale floor, 2^-13
    kv[4, 64:128] = 1e-7  # below the floor: e4m3 subnormals
    return kv


@pytest.fixture(scope="module")
def packed() -> tuple[torch.Tensor, torch.Tensor]:
    """(kv [150, 512] bf16, its packed cache in blocks of 64)."""
    kv = _kv(NUM_ROWS)
    return kv, flashmla.pack_kv_cache(kv, BLOCK_SIZE)


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """Every byte of every block, [num_blocks, block stride], from the packed view's storage."""
    stride = flashmla.block_stride_bytes(cache.shape[1])
    return torch.as_strided(cache.view(torch.uint8), (cache.shape[0], stride), (stride, 1))


def test_shape_strides_and_block_stride(packed: tuple[torch.Tensor, torch.Tensor]) -> None:
    _, cache = packed
    assert cache.dtype == torch.float8_e4m3fn
    assert cache.shape == (3, BLOCK_SIZE, 1, 584)
    # 64 x 584 = 37376 bytes, rounded up to 65 x 576.
    assert flashmla.block_stride_bytes(BLOCK_SIZE) == 37440
    assert cache.stride() == (37440, 584, 584, 1)
    assert flashmla.block_stride_bytes(2) == 1728  # 1168 -> 3 x 576
    assert flashmla.block_stride_bytes(256) == 149760  # 149504 -> 260 x 576


@pytest.mark.parametrize("row", [0, 3, 4, 70, 127, 149])
def test_byte_offsets(packed: tuple[torch.Tensor, torch.Tensor], row: int) -> None:
    kv, cache = packed
    raw = _raw(cache)
    block, slot = divmod(row, BLOCK_SIZE)
    token = raw[block, slot * 576 : (slot + 1) * 576]
    scales = raw[block, BLOCK_SIZE * 576 + slot * 8 : BLOCK_SIZE * 576 + (slot + 1) * 8]

    assert torch.equal(token[448:].view(torch.bfloat16), kv[row, 448:])
    exponents = scales[:7].int() - 127
    assert scales[7] == 0
    tiles = kv[row, :448].float().view(7, 64)
    amax = tiles.abs().amax(dim=1)
    scale = torch.exp2(exponents.float())
    # The smallest power of two at least max(amax / 448, 1e-4).
    floor = (amax / 448).clamp(min=1e-4)
    assert torch.all(scale >= floor) and torch.all(scale < 2 * floor)
    expected = (tiles / scale.unsqueeze(1)).to(torch.float8_e4m3fn).view(torch.uint8).flatten()
    assert torch.equal(token[:448], expected)
    if row == 3:
        assert exponents[0] == -13 and not token[:64].any()


def test_padding_is_zero(packed: tuple[torch.Tensor, torch.Tensor]) -> None:
    raw = _raw(packed[1])
    assert not raw[:, BLOCK_SIZE * 584 :].any()  # past the scales, up to the block stride
    last_rows = NUM_ROWS % BLOCK_SIZE
    assert not raw[2, last_rows * 576 : BLOCK_SIZE * 576].any()  # slots past row N - 1
    scales = raw[:, BLOCK_SIZE * 576 : BLOCK_SIZE * 584].reshape(3, BLOCK_SIZE, 8)
    assert not scales[..., 7].any()


def test_round_trip_error_bound(packed: tuple[torch.Tensor, torch.Tensor]) -> None:
    """e4m3 keeps 3 mantissa bits: |error| <= 2^-4 |x| for normals, and at most half the
    subnormal spacing (2^-10 x the tile's scale) below 2^-6 x the scale. RoPE is exact."""
    kv, cache = packed
    rows = flashmla.unpack_kv_cache(cache, NUM_ROWS)
    assert rows.shape == (NUM_ROWS, 512) and rows.dtype == torch.bfloat16
    assert torch.equal(rows[:, 448:], kv[:, 448:])
    scales = _raw(cache)[:, BLOCK_SIZE * 576 : BLOCK_SIZE * 584].reshape(-1, 8)[:NUM_ROWS, :7]
    scale = torch.exp2(scales.float() - 127).repeat_interleave(64, dim=1)  # [N, 448]
    x, err = kv[:, :448].float(), (rows[:, :448].float() - kv[:, :448].float()).abs()
    assert torch.all(err <= 2**-4 * x.abs() + 2**-10 * scale)
    rel = (err.norm() / x.norm()).item()
    assert rel < 0.03, rel  # ~2^-4 / sqrt(12) x sqrt(3) RMS for uniform mantissas


def test_unpack_is_a_fixed_point() -> None:
    rows = flashmla.unpack_kv_cache(flashmla.pack_kv_cache(_kv(NUM_ROWS, seed=1), 16))
    again = flashmla.unpack_kv_cache(flashmla.pack_kv_cache(rows, 16))
    assert torch.equal(again, rows)


@pytest.mark.skipif(
    not FLASHMLA_QUANT.is_file(), reason="no .flashmla/ (scripts/fetch_flashmla.sh)"
)
def test_matches_flashmla_reference_quantizer() -> None:
    spec = importlib.util.spec_from_file_location("flashmla_quant", FLASHMLA_QUANT)
    assert spec is not None and spec.loader is not None
    quant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quant)
    layout = quant.FP8KVCacheLayout.MODEL1_FP8Sparse

    kv = _kv(3 * BLOCK_SIZE, seed=2)
    ours = flashmla.pack_kv_cache(kv, BLOCK_SIZE)
    theirs = quant.quantize_k_cache(kv.view(3, BLOCK_SIZE, 1, 512), layout)
    assert theirs.shape == ours.shape and theirs.stride() == ours.stride()
    a, b = ours.view(torch.uint8).flatten(1), theirs.view(torch.uint8).flatten(1)
    data = BLOCK_SIZE * 576
    assert torch.equal(a[:, :data], b[:, :data])
    # Their 8th scale byte is left uninitialised.
    a_scales, b_scales = (t[:, data:].reshape(3, BLOCK_SIZE, 8)[..., :7] for t in (a, b))
    assert torch.equal(a_scales, b_scales)
    their_rows = quant.dequantize_k_cache(theirs, layout).view(-1, 512)
    assert torch.equal(flashmla.unpack_kv_cache(ours), their_rows)


def test_pad_topk() -> None:
    idx = torch.arange(6, dtype=torch.int64).view(1, 2, 3)
    padded = flashmla._pad_topk(idx, 64)
    assert padded.dtype == torch.int32 and padded.shape == (1, 2, 64)
    assert torch.equal(padded[..., :3], idx.int()) and torch.all(padded[..., 3:] == -1)
    aligned = torch.zeros(2, 128, dtype=torch.int32)
    assert flashmla._pad_topk(aligned, 64) is aligned


def test_not_available_on_cpu() -> None:
    ok, why = flashmla.is_available(torch.device("cpu"))
    assert not ok and "not cpu" in why
