"""Sparse attention with sinks and the Lightning indexer's scores, Triton kernels for CUDA.

Same contract as torch_ref (the oracle). Both ops are shared-KV multi-query: one kv row is key
and value for every head, so for one query token the heads form the M dimension of the matmuls
(FlashMLA's sparse formulation) and a gathered kv tile is read once per block of heads:

    q tile [BLOCK_H, D] x gathered kv tile [BLOCK_N, D]^T -> logits [BLOCK_H, BLOCK_N]
    probs  [BLOCK_H, BLOCK_N] x the same kv tile [BLOCK_N, D] -> acc [BLOCK_H, D]

``sparse_attention`` walks one query token's key list, the concatenation of its sources' index
lists, in tiles of BLOCK_N positions with an online (flash) softmax in fp32; a tile may straddle
two sources, as every key carries its own row pointer (wide tiles instead walk each source in
its own tiles; the kernel says why). Decode has too few (token, head block)
programs to fill the GPU, so the list is cut into splits (flash-decoding), each program writing
a partial (max, sum, acc) in fp32 that a combine kernel merges with the sink::

    key list of token t:  | source 0 (L0) | source 1 (L1)        | source 2 (L2)           |
    splits:               | split 0            | split 1            | split 2       |
                          (keys_per_split each, a whole number of BLOCK_N tiles)

    partials, fp32:  m, l [T, H, S]   acc [T, H, S, D]   (S = splits; m in log2 units)

With one split the attention kernel applies the sink and writes the output itself.

``indexer_scores`` runs one program per (token, block of entries); blocks past the token's
visible entries only write -inf. ``indexer_topk`` runs one program per token that holds its
scores in registers and finds the k-th largest by a 32-step bit search (no sort), then writes
the chosen rows in column order: one launch where torch took a sort, a gather and two
elementwise kernels. ``indexer_select`` runs that top-k in the scores' launch at decode (a
token's last scores program, by ticket: ``triton_tickets``).

An FP8 KV cache (cache.kv_dtype = "fp8", ``kv_fp8.py``) gives packed sources. The attention
kernel reads their rows itself (``_load_bytes``: a row as [tiles, 64] channels under one scale
load a tile), except in a chunk of UNPACK_MIN_TOKENS or more, whose named rows are unpacked
once into dense rows first. The backend's ``store_rows`` / ``as_stored`` pack a step's rows in
one launch (``_fp8_rows_kernel``), rounding on integers so that Triton's interpreter matches
the GPU and torch bit for bit.

Inputs are bf16 in production (tensor-core dots, fp32 accumulation) or fp32 in the parity mode,
where every dot runs in IEEE fp32 (``input_precision="ieee"``) to match the CPU to ~1e-5.

One file of ~850 lines: a backend is one module per op family (``ops/registry.py``), and these
kernels share their launchers' tile tables (``benchmarks/attention_tiles.py`` sweeps them).
``TritonAttentionBackend`` at the end is the backend object: it keeps the device's SM count and
any tile override, and calls the launchers with them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.ops.attention import kv_fp8
from deepinfer.ops.attention import torch_ref as ref
from deepinfer.ops.attention.kv_fp8 import Fp8Layout, Fp8Rows, KVSource
from deepinfer.ops.registry import Backend, ParallelContext
from deepinfer.ops.triton_pdl import enter, pdl
from deepinfer.ops.triton_rope import rotate, rotate_pair
from deepinfer.ops.triton_tickets import arrive, depart, ticket_counters
from deepinfer.ops.triton_utils import dot_precision, num_sms

_LOG2E = tl.constexpr(math.log2(math.e))
# The running max starts finite, so a tile with no valid key gives exp2(-inf - m) = 0 and a
# rescale of exp2(0) = 1, never exp2(-inf + inf) = NaN.
_M_INIT = tl.constexpr(-1e30)


@dataclass(frozen=True)
class AttentionConfig:
    """Tiles of the sparse attention kernel (benchmarks/attention_tiles.py sweeps them)."""

    block_h: int  # heads per program (the M of the dots)
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int = 2

    @property
    def per_source(self) -> bool:
        """Walk each key source in its own tiles (the kernel's PER_SOURCE says why)."""
        return self.block_h >= 64 or self.block_n >= 64


# SMs assumed where torch cannot ask the device (Triton's CPU interpreter): an H200's.
_num_sms = functools.partial(num_sms, cpu_stand_in=132)
# "tf32" is the default and is ignored for 16-bit inputs; fp32 inputs must stay IEEE.
_dot_precision = functools.partial(dot_precision, for_16bit="tf32")


def attention_config(
    dtype: torch.dtype, num_heads: int, num_q: int, *, packed: bool = False
) -> AttentionConfig:
    """Tiles for num_q query tokens of num_heads heads: the fastest of
    benchmarks/attention_tiles.py on the H200 at V4's 64 heads of 512 (RESULTS.md, 2026-11-30).

    64 heads a program make the dots' M a full wgmma (HGMMA in the SASS): q [64, D] and the
    stages of kv tiles live in shared memory (about 192 KB at 64 keys a tile), acc [64, D] fp32
    in the registers of two warpgroups (128 each), and each tile's keys are read once for all
    64 heads. That wins from 64 query tokens up (1.1x the best 32-head tiles at 64, 1.7x from
    128). Below, there are too few programs to fill the SMs with 64-head blocks, and 32-head
    blocks (mma.sync, HMMA, ~160 registers) win: 32 keys a tile at one to four tokens (more
    splits), 64 above. fp32 runs IEEE dots on CUDA cores: 16 x 16 over 8 warps (~175).

    Packed FP8 sources (``packed``) are dequantized in registers, which the 64-head tiles pay
    for in spills (~760 bytes): 32-head tiles win at every count there (H100, 2026-12-06:
    1.23x the 64-head tiles at 128 tokens, 1.33x in a 1,024-token prefill chunk).
    """
    if dtype == torch.float32:
        return AttentionConfig(block_h=16, block_n=16, num_warps=8)
    if num_heads <= 16:
        return AttentionConfig(block_h=16, block_n=16, num_warps=4)
    if num_heads < 64 or num_q <= 4:
        return AttentionConfig(block_h=32, block_n=32, num_warps=8)
    if num_q <= 32 or packed:
        return AttentionConfig(block_h=32, block_n=64, num_warps=8)
    # A third stage pays at decode batches (128-256 tokens: 4-5% faster), not in prefill chunks.
    stages = 3 if 64 < num_q <= 512 else 2
    return AttentionConfig(block_h=64, block_n=64, num_warps=8, num_stages=stages)


def _split_keys(
    num_q: int, num_head_blocks: int, num_keys: int, block_n: int, num_sms: int
) -> tuple[int, int]:
    """(number of splits, keys per split) of every token's key list.

    As many splits as keep (tokens x head blocks x splits) programs within one wave of the SMs
    (a partial second wave would double the step for a few programs), each split at least one
    tile; splits get whole tiles and none is empty.
    """
    num_tiles = max(triton.cdiv(num_keys, block_n), 1)
    wanted = min(max(num_sms // (num_q * num_head_blocks), 1), num_tiles)
    tiles_per_split = triton.cdiv(num_tiles, wanted)
    return triton.cdiv(num_tiles, tiles_per_split), tiles_per_split * block_n


@triton.jit
def _fold_tile(q, kv, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """Fold one gathered kv tile [BLOCK_N, D] (rows where ``valid``) into the online softmax."""
    s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _gather_source(rows, kv_rows, pos, kv_ptr, idx_ptr, stride_kv, first, length):
    """Rows of one source for the key positions pos [BLOCK_N] of the token's concatenated list.

    The source holds positions [first, first + length); idx_ptr points at the token's index row
    of it. Positions elsewhere keep the rows (int64, -1 = no key) and row pointers kv_rows they
    came with; only this source's positions load an index.
    """
    local = pos - first
    here = (local >= 0) & (local < length)
    source_rows = tl.load(idx_ptr + local, mask=here, other=-1).to(tl.int64)
    rows = tl.where(here, source_rows, rows)
    kv_rows = tl.where(here, kv_ptr + source_rows * stride_kv, kv_rows)
    return rows, kv_rows


@triton.jit
def _attend_straddling(
    q, m_i, l_i, acc, kv0_ptr, idx0_row, stride_kv0, len0, kv1_ptr, idx1_row, stride_kv1, len1,
    kv2_ptr, idx2_row, stride_kv2, len2, lo, hi, qk_scale, D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SOURCES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Positions [lo, hi) of the concatenated list in full tiles that may straddle sources: each
    key carries its own row pointer, picked among the sources'."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + offs_n
        pos = tl.where(pos < hi, pos, -1)  # past the split: in no source
        rows = tl.full([BLOCK_N], -1, dtype=tl.int64)
        # Row pointers start at kv0's row 0, not at rows * stride: a provably aligned base
        # keeps the gather below vectorised (16-byte loads), where row -1 would not.
        kv_rows = kv0_ptr + tl.zeros([BLOCK_N], dtype=tl.int64)
        rows, kv_rows = _gather_source(rows, kv_rows, pos, kv0_ptr, idx0_row, stride_kv0, 0, len0)
        if NUM_SOURCES > 1:
            rows, kv_rows = _gather_source(
                rows, kv_rows, pos, kv1_ptr, idx1_row, stride_kv1, len0, len1
            )
        if NUM_SOURCES > 2:
            rows, kv_rows = _gather_source(
                rows, kv_rows, pos, kv2_ptr, idx2_row, stride_kv2, len0 + len1, len2
            )
        valid = rows >= 0
        kv = tl.load(kv_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _fold_tile(q, kv, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _pick(source, first, second, third):
    """The value of source 0, 1 or 2 (``source`` known only at run time)."""
    return tl.where(source == 0, first, tl.where(source == 1, second, third))


@triton.jit
def _attend_source(
    q,
    m_i,
    l_i,
    acc,
    kv_ptr,
    idx_row,
    stride_kv,
    first,
    length,
    lo,
    hi,
    qk_scale,
    rows_per_group,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PACKED: tl.constexpr,
    NOPE: tl.constexpr,
    TILE: tl.constexpr,
    GROUPS: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
):
    """Fold one source's keys at positions [lo, hi) of the token's list into (m_i, l_i, acc).

    The source holds positions [first, first + length); idx_row points at the token's index row
    of it. Holes (-1) load nothing and score -inf. PACKED: kv_ptr is a byte pointer and
    stride_kv in bytes; the source is packed FP8 rows when rows_per_group > 0 (``_load_bytes``).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    begin = tl.maximum(lo, first) - first
    end = tl.minimum(hi, first + length) - first
    for tile in range(begin, end, BLOCK_N):
        local = tile + offs_n
        rows = tl.load(idx_row + local, mask=local < end, other=-1).to(tl.int64)
        valid = rows >= 0
        if PACKED:
            kv = _load_bytes(
                kv_ptr, rows, valid, stride_kv, rows_per_group, offs_d, q.dtype, D, NOPE, TILE,
                GROUPS, DATA_BYTES, SCALE_BYTES,
            )  # fmt: skip
        else:
            kv_rows = tl.multiple_of(kv_ptr + tl.where(valid, rows, 0) * stride_kv, 16)
            kv = tl.load(kv_rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _fold_tile(q, kv, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _load_bytes(
    kv_ptr, rows, valid, stride_kv, rows_per_group, offs_d, DTYPE: tl.constexpr,
    D: tl.constexpr, NOPE: tl.constexpr, TILE: tl.constexpr, GROUPS: tl.constexpr,
    DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
):  # fmt: skip
    """Rows [BLOCK_N, D] in DTYPE from a byte pointer: packed FP8 rows (kv_fp8.py's layout:
    group g = row // rows_per_group at kv_ptr + g * stride_kv holds its rows' data, then their
    scales; NoPE e4m3 x 2^(scale byte - 127), RoPE bf16, the values unpack gives) when
    rows_per_group > 0, else dense rows of DTYPE, stride_kv bytes apart.

    A packed row is read as [GROUPS, D // GROUPS] channels, group j scaled by scale byte j
    (GROUPS = D // TILE, or 1 when the NoPE part is one tile): one scale load per tile, not
    per channel. Rows start 8-byte aligned (data and row sizes are multiples of 8), so codes
    and RoPE load 8 bytes at a time.
    """
    safe = tl.where(valid, rows, 0)
    if rows_per_group > 0:
        flat = safe.to(tl.int32)  # the host checks rows < 2^31: a 32-bit division
        group = flat // rows_per_group
        slot = flat - group * rows_per_group
        base = kv_ptr + group.to(tl.int64) * stride_kv
        data = tl.multiple_of(base + slot * DATA_BYTES, 8)
        scales = base + rows_per_group * DATA_BYTES + slot * SCALE_BYTES
        WIDTH: tl.constexpr = D // GROUPS
        offs_g = tl.arange(0, GROUPS)
        chan = offs_g[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]  # [GROUPS, WIDTH]
        is_nope = (chan < NOPE)[None, :, :]
        row_mask = valid[:, None, None]
        tile_mask = valid[:, None] & (offs_g * TILE < NOPE)[None, :]
        exponents = tl.load(scales[:, None] + offs_g[None, :], mask=tile_mask, other=127)
        factor = _power_of_two(exponents.to(tl.int32) - 127).to(DTYPE)  # [BLOCK_N, GROUPS]
        codes_ptrs = data.to(tl.pointer_type(tl.float8e4nv))[:, None, None] + chan[None, :, :]
        codes = tl.load(codes_ptrs, mask=row_mask & is_nope, other=0.0).to(DTYPE)
        # A power of two times an e4m3 value: exact in DTYPE (bf16 has fp32's exponent range).
        nope = codes * factor[:, :, None]
        rope_rows = tl.multiple_of(data + NOPE, 8).to(tl.pointer_type(tl.bfloat16))
        rope_ptrs = rope_rows[:, None, None] + (chan - NOPE)[None, :, :]
        rope = tl.load(rope_ptrs, mask=row_mask & ~is_nope, other=0.0).to(DTYPE)
        kv = tl.reshape(tl.where(is_nope, nope, rope), (rows.shape[0], D))
    else:
        row_ptrs = tl.multiple_of(kv_ptr + safe * stride_kv, 16).to(tl.pointer_type(DTYPE))
        kv = tl.load(row_ptrs[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    return kv


@triton.jit
def _power_of_two(exponent):
    """2^exponent in fp32, exactly, built from its bits (exponent in [-126, 127])."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), as fp32: integer arithmetic on its
    bits, so that Triton's interpreter (which truncates) rounds as the GPU and torch do."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(y):
    """fp32 y (|y| <= 448 up to rounding) -> its e4m3fn code 0..255, rounded to nearest even
    as torch's cast does, on integers (the interpreter's float8 cast does not round)."""
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(y)
    small = tl.minimum(a, 0.015625)  # below 2^-6: subnormal, m x 2^-9 with m in 0..8
    subnormal = ((small * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)  # exponent bias 7
    return tl.minimum(tl.where(a < 0.015625, subnormal, normal), 0x7E) | sign


@triton.jit
def _e4m3_value(code):
    """An e4m3fn code 0..255 -> its value in fp32 (exactly)."""
    exponent = (code >> 3) & 15
    mantissa = code & 7
    magnitude = tl.where(exponent == 0, mantissa, mantissa + 8).to(tl.float32)
    value = magnitude * _power_of_two(tl.maximum(exponent, 1) - 10)
    return tl.where((code & 0x80) != 0, -value, value)


@triton.jit
def _fp8_rows_kernel(
    values_ptr, rows_ptr, index_ptr, part_ptr, out_ptr, stride_values, stride_group, stride_out,
    rows_per_group, D: tl.constexpr, NOPE: tl.constexpr, TILE: tl.constexpr,
    GROUPS: tl.constexpr, DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr,
    STORE: tl.constexpr, GATHER: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program m: row m of values [M, D] (GATHER: row rows[m]) packed as ``Fp8Layout.pack``
    does (rounded to bf16; each NoPE tile's scale 2^ceil(log2(max(amax / 448, 1e-4))), its
    channels e4m3 under it). STORE: into packed row index[m] of the part at part_ptr
    (``_load_bytes``'s addressing); else the row as unpacked (``Fp8Layout.roundtrip``) into out
    row m."""
    enter(PDL)
    m = tl.program_id(0).to(tl.int64)
    src = tl.load(rows_ptr + m).to(tl.int64) if GATHER else m
    WIDTH: tl.constexpr = D // GROUPS
    offs_g = tl.arange(0, GROUPS)
    chan = offs_g[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]  # [GROUPS, WIDTH]: tile g
    is_nope = chan < NOPE
    v = _round_to_bf16(tl.load(values_ptr + src * stride_values + chan).to(tl.float32))
    amax = tl.max(tl.where(is_nope, tl.abs(v), 0.0), axis=1)  # [GROUPS]
    scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-4)
    # ceil(log2(scale)) of a normal fp32: its exponent, plus one unless a power of two.
    bits = scale.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    codes = _e4m3_bits(v * _power_of_two(-exponent)[:, None])  # exact: a power of two
    if STORE:
        flat = tl.load(index_ptr + m).to(tl.int32)
        group = flat // rows_per_group
        slot = flat - group * rows_per_group
        base = part_ptr + group.to(tl.int64) * stride_group
        data = base + slot * DATA_BYTES
        tl.store(data + chan, codes.to(tl.uint8), mask=is_nope)
        rope = (data + NOPE).to(tl.pointer_type(tl.bfloat16)) + (chan - NOPE)
        tl.store(rope, v.to(tl.bfloat16), mask=~is_nope)  # exact: v is a bf16 value
        scales = base + rows_per_group * DATA_BYTES + slot * SCALE_BYTES
        NUM_TILES: tl.constexpr = NOPE // TILE
        offs_s = tl.arange(0, SCALE_BYTES)
        tl.store(scales + offs_s, tl.zeros([SCALE_BYTES], tl.uint8), mask=offs_s >= NUM_TILES)
        tl.store(scales + offs_g, (exponent + 127).to(tl.uint8), mask=offs_g < NUM_TILES)
    else:
        nope = _e4m3_value(codes) * _power_of_two(exponent)[:, None]  # exact in bf16
        row = tl.where(is_nope, nope, v).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + m * stride_out + chan, row)


def _fp8_rows(
    values: torch.Tensor,
    layout: Fp8Layout,
    target: Fp8Rows | None,
    index: torch.Tensor | None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Launch ``_fp8_rows_kernel``: store values (or values[rows]) into target's rows at index,
    or (target None) return their round trip."""
    dim = values.shape[1]
    num = values.shape[0] if rows is None else rows.shape[0]
    assert dim == layout.head_dim and dim & (dim - 1) == 0, f"rows {tuple(values.shape)}"
    values = values if values.stride(1) == 1 else values.contiguous()
    out = None if target is not None else torch.empty_like(values)
    if num == 0:
        return out
    if target is None:
        part, stride_group, rows_per_group, index = values, 0, 1, values
    else:
        assert target.num_rows < 2**31, f"{target.num_rows} packed rows: indexed 32-bit"
        part = target.data
        stride_group, rows_per_group = part.stride(0), part.shape[1]
    _fp8_rows_kernel[(num,)](
        values, index if rows is None else rows, index, part,
        out if out is not None else values, values.stride(0), stride_group,
        out.stride(0) if out is not None else 0, rows_per_group, D=dim, NOPE=layout.nope_dim,
        TILE=layout.tile, GROUPS=_scale_groups(layout, dim), DATA_BYTES=layout.data_bytes,
        SCALE_BYTES=layout.scale_bytes, STORE=target is not None, GATHER=rows is not None,
        num_warps=4 if dim >= 256 else 1, **pdl(values.device),
    )  # fmt: skip
    return out


@triton.jit
def _store_rows_kernel(
    values_ptr, rows_ptr, index_ptr, target_ptr, stride_values, stride_target, D,
    BLOCK: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (m, block): target[index[m]] = values[rows[m]] (GATHER; else values[m]) for one
    block of columns, cast to target's dtype (fp32 into bf16: ``_round_to_bf16`` first, to
    nearest even as torch's cast, also under the interpreter)."""
    enter(PDL)
    m = tl.program_id(0).to(tl.int64)
    src = tl.load(rows_ptr + m).to(tl.int64) if GATHER else m
    dst = tl.load(index_ptr + m).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(values_ptr + src * stride_values + cols, mask=cols < D)
    if row.dtype == tl.float32 and target_ptr.dtype.element_ty == tl.bfloat16:
        row = _round_to_bf16(row)
    tl.store(target_ptr + dst * stride_target + cols, row.to(target_ptr.dtype.element_ty),
             mask=cols < D)  # fmt: skip


def store_rows(
    target: KVSource, index: torch.Tensor, values: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """``kv_fp8.store_rows`` in one launch, the gather of ``rows`` included: a packed part's
    rows packed by ``_fp8_rows_kernel``, a dense tensor's copied by ``_store_rows_kernel``."""
    if isinstance(target, Fp8Rows):
        _fp8_rows(values, target.layout, target, index, rows)
        return
    num, dim = index.shape[0], values.shape[1]
    assert target.shape[1] == dim and target.stride(1) == 1 and values.stride(1) == 1, (
        f"rows {tuple(values.shape)} strides {values.stride()} into {tuple(target.shape)} "
        f"strides {target.stride()}"
    )
    assert rows is None or rows.shape[0] == num, f"{rows.shape[0]} rows for {num} indices"
    if num == 0:
        return
    block = min(triton.next_power_of_2(dim), 1024)
    _store_rows_kernel[(num, triton.cdiv(dim, block))](
        values, index if rows is None else rows, index, target, values.stride(0),
        target.stride(0), dim, BLOCK=block, GATHER=rows is not None, **pdl(values.device),
    )  # fmt: skip


def as_stored(target: KVSource, values: torch.Tensor) -> torch.Tensor:
    """``kv_fp8.as_stored``, a packed part's round trip in one launch."""
    if not isinstance(target, Fp8Rows):
        return kv_fp8.as_stored(target, values)
    out = _fp8_rows(values, target.layout, None, None)
    assert out is not None
    return out


@triton.jit
def _sparse_attention_kernel(
    q_ptr,
    sinks_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    kv0_ptr,
    idx0_ptr,
    kv1_ptr,
    idx1_ptr,
    kv2_ptr,
    idx2_ptr,
    stride_kv0,
    stride_idx0,
    len0,
    stride_kv1,
    stride_idx1,
    len1,
    stride_kv2,
    stride_idx2,
    len2,
    rows_per_group0,
    rows_per_group1,
    rows_per_group2,
    num_heads,
    keys_per_split,
    qk_scale,
    cos_ptr,
    sin_ptr,
    stride_cos,
    stride_sin,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OUT_NOPE: tl.constexpr,
    OUT_HALF: tl.constexpr,
    NUM_SOURCES: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    PER_SOURCE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PACKED: tl.constexpr,
    NOPE: tl.constexpr,
    TILE: tl.constexpr,
    GROUPS: tl.constexpr,
    DATA_BYTES: tl.constexpr,
    SCALE_BYTES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T, cdiv(H, BLOCK_H), S): token, head block, split of the token's key list.

    q, out: [T, H, D] contiguous. Source s: kv [N_s, D] (row stride stride_kv{s}), idx [T, L_s]
    (row stride stride_idx{s}, unit column stride). IS_SPLIT: write the partials m, l [T, H, S]
    and acc [T, H, S, D] (fp32) for the combine kernel; else apply the sink and write out, and
    with OUT_HALF > 0 rotate its channels from OUT_NOPE on by cos, sin [T, OUT_HALF]
    (``_rotate_stored``).

    The split's positions of the concatenated key list are walked in full tiles that may
    straddle sources, or, with PER_SOURCE, source by source: one loop whose tiles end at source
    boundaries (a partial tile more per boundary) and gather from one source each. At 64 heads
    or 64 keys a tile the straddling loop, which picks every key's row pointer among three,
    spills registers (650-750 bytes at 64 x 64, ptxas, sm_90a), the per-source one only ~60 in
    the epilogue; for narrower tiles straddling wastes no tile on short sources (decode's step
    has one key of its own).
    """
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_mask = heads < num_heads
    offs_d = tl.arange(0, D)

    q_ptrs = q_ptr + (t * num_heads + heads)[:, None] * D + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None], other=0.0)  # [BLOCK_H, D]
    m_i = tl.full([BLOCK_H], _M_INIT, dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)

    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, len0 + len1 + len2)
    if PER_SOURCE:
        # One loop over the sources, not one inlined copy per source: three copies keep their
        # loop invariants live together and spill.
        for source in range(NUM_SOURCES):
            kv_ptr = _pick(source, kv0_ptr, kv1_ptr, kv2_ptr)
            idx_ptr = _pick(source, idx0_ptr, idx1_ptr, idx2_ptr)
            stride_kv = _pick(source, stride_kv0, stride_kv1, stride_kv2)
            stride_idx = _pick(source, stride_idx0, stride_idx1, stride_idx2)
            first = _pick(source, 0, len0, len0 + len1)
            length = _pick(source, len0, len1, len2)
            rows_per_group = _pick(source, rows_per_group0, rows_per_group1, rows_per_group2)
            m_i, l_i, acc = _attend_source(
                q, m_i, l_i, acc, kv_ptr, idx_ptr + t * stride_idx, stride_kv, first, length,
                lo, hi, qk_scale, rows_per_group, D, BLOCK_N, DOT_PRECISION, PACKED, NOPE, TILE,
                GROUPS, DATA_BYTES, SCALE_BYTES,
            )  # fmt: skip
    else:
        m_i, l_i, acc = _attend_straddling(
            q, m_i, l_i, acc, kv0_ptr, idx0_ptr + t * stride_idx0, stride_kv0, len0, kv1_ptr,
            idx1_ptr + t * stride_idx1, stride_kv1, len1, kv2_ptr, idx2_ptr + t * stride_idx2,
            stride_kv2, len2, lo, hi, qk_scale, D, BLOCK_N, NUM_SOURCES, DOT_PRECISION,
        )  # fmt: skip

    if IS_SPLIT:
        num_splits = tl.num_programs(2)
        part = (t * num_heads + heads) * num_splits + split  # [BLOCK_H] row of m, l, acc
        tl.store(part_m_ptr + part, m_i, mask=head_mask)
        tl.store(part_l_ptr + part, l_i, mask=head_mask)
        acc_ptrs = part_acc_ptr + part[:, None] * D + offs_d[None, :]
        tl.store(acc_ptrs, acc, mask=head_mask[:, None])
    else:
        # exp(sink) joins the denominator: with m = max(m_i, sink), the weights are rescaled
        # by exp2(m_i - m); a query without keys (l_i = 0) gets acc = 0, output 0.
        sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0) * _LOG2E
        m = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m)
        inv_denom = alpha / (l_i * alpha + tl.exp2(sink - m))
        out = acc * inv_denom[:, None]
        out_rows = out_ptr + (t * num_heads + heads) * D
        tl.store(out_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=head_mask[:, None])  # fmt: skip
        if OUT_HALF > 0:
            _rotate_stored(
                out_rows, head_mask, cos_ptr + t * stride_cos, sin_ptr + t * stride_sin,
                OUT_NOPE, 0, OUT_HALF, OUT_HALF,
            )  # fmt: skip


@triton.jit
def _rotate_stored(rows, row_mask, cos_row, sin_row, NOPE, first, end, HALF: tl.constexpr):
    """RoPE pairs first..end-1 of the rows just stored by this program (channels NOPE + 2i,
    NOPE + 2i + 1 by angle i; cos_row, sin_row: the token's [HALF] fp32), as the norm family's
    apply_rope does on them: read back as stored, rotated in fp32, rounded once. Barriers
    around the read: every thread's stores land before any thread reads (bar.sync orders a
    CTA's global accesses), and every read before any write (a value held by two threads)."""
    pairs = first + tl.arange(0, HALF)
    pair_mask = pairs < end
    cos = tl.load(cos_row + pairs, mask=pair_mask, other=1.0)[None, :]
    sin = tl.load(sin_row + pairs, mask=pair_mask, other=0.0)[None, :]
    even_ptrs = rows[:, None] + NOPE + 2 * pairs[None, :]
    mask = row_mask[:, None] & pair_mask[None, :]
    tl.debug_barrier()
    even = tl.load(even_ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    odd = tl.load(even_ptrs + 1, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.debug_barrier()
    dtype = rows.dtype.element_ty
    even, odd = rotate_pair(even, odd, cos, sin)
    tl.store(even_ptrs, even.to(dtype), mask=mask)
    tl.store(even_ptrs + 1, odd.to(dtype), mask=mask)


@triton.jit
def _combine_splits_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    sinks_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    stride_cos,
    stride_sin,
    num_heads,
    num_splits,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OUT_NOPE: tl.constexpr,
    OUT_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T, H, D // BLOCK_D): merge the S partials of one (token, head) with the sink.

    out[t, h] = sum_s w_s acc_s / (sum_s w_s l_s + exp2(sink - m)), w_s = exp2(m_s - m), where
    m = max(max_s m_s, sink), all in log2 units. OUT_HALF > 0: the RoPE pairs of this block's
    channels from OUT_NOPE on rotated as the attention kernel's epilogue does.
    """
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    split_mask = offs_s < num_splits
    part = (t * num_heads + h) * num_splits + offs_s  # [BLOCK_S]
    m_s = tl.load(part_m_ptr + part, mask=split_mask, other=_M_INIT)
    l_s = tl.load(part_l_ptr + part, mask=split_mask, other=0.0)
    acc_ptrs = part_acc_ptr + part[:, None] * D + offs_d[None, :]
    acc_s = tl.load(acc_ptrs, mask=split_mask[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
    sink = tl.load(sinks_ptr + h) * _LOG2E
    m = tl.maximum(tl.max(m_s, axis=0), sink)
    weight = tl.exp2(m_s - m)
    denom = tl.sum(l_s * weight, axis=0) + tl.exp2(sink - m)
    out = tl.sum(acc_s * weight[:, None], axis=0) / denom
    out_row = out_ptr + (t * num_heads + h) * D
    tl.store(out_row + offs_d, out.to(out_ptr.dtype.element_ty))
    if OUT_HALF > 0:
        d0 = tl.program_id(2) * BLOCK_D
        if d0 + BLOCK_D > OUT_NOPE:  # the block holds RoPE channels
            first = tl.maximum(d0 - OUT_NOPE, 0) // 2
            end = tl.minimum((d0 + BLOCK_D - OUT_NOPE) // 2, OUT_HALF)
            _rotate_stored(
                out_row + tl.zeros([1], tl.int64), tl.full([1], 1, tl.int1),
                cos_ptr + t * stride_cos, sin_ptr + t * stride_sin, OUT_NOPE, first, end,
                OUT_HALF,
            )  # fmt: skip


def _scale_groups(layout: Fp8Layout | None, dim: int) -> int:
    """How many channel groups the kernel reads a packed row in (``_load_bytes``): one per
    scale tile when the tiles divide the row, one when the NoPE part is a single tile."""
    if layout is None:
        return 1
    groups = dim // layout.tile
    if dim % layout.tile == 0 and groups & (groups - 1) == 0:
        return groups
    assert layout.num_tiles == 1, f"{layout.name}: scale tiles must divide the row in 2^k"
    return 1


# From this many query tokens (a prefill chunk), packed sources are unpacked first: the rows the
# index lists name, once each, into a dense scratch that the dense kernel reads with its widest
# tiles. Reading packed rows in the kernel dequantizes each row once per 32-head block and tile,
# 3.8x the dense kernel's time in a 1,024-token chunk; unpacking costs a sort of the index
# lists and a host sync (the scratch's size), which CUDA graphs cannot hold, so captured steps
# (decode) never take this path.
UNPACK_MIN_TOKENS = 256


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def unpacks(q: torch.Tensor, sources: Sequence[tuple[KVSource, torch.Tensor]]) -> bool:
    """Whether a call of q over these sources reads its packed rows unpacked first (``unpacked``):
    a packed source, UNPACK_MIN_TOKENS query tokens or more, no CUDA graph being captured."""
    has_packed = any(isinstance(kv, Fp8Rows) for kv, _ in sources)
    return has_packed and q.shape[0] >= UNPACK_MIN_TOKENS and not _capturing(q.device)


def unpacked(kv: KVSource, idx: torch.Tensor, dtype: torch.dtype) -> tuple[KVSource, torch.Tensor]:
    """A packed source as dense rows in ``dtype``: the distinct rows of ``idx``, exactly
    unpacked, and ``idx`` renumbered onto them (holes stay -1). A dense source as it is."""
    if not isinstance(kv, Fp8Rows):
        return kv, idx
    rows, local = torch.unique(idx.clamp(min=-1), return_inverse=True)  # syncs: the row count
    dense = kv.gather(rows.clamp(min=0)).to(dtype)
    return dense, torch.where(idx < 0, -1, local).to(idx.dtype)


def sparse_attention(
    q: torch.Tensor,
    sources: Sequence[tuple[KVSource, torch.Tensor]],
    sinks: torch.Tensor,
    scale: float,
    *,
    config: AttentionConfig | None = None,
    num_sms: int | None = None,
    out_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Shared-KV multi-query attention over listed keys, with a per-head sink logit.

    q: [T, H, D] bf16/fp16/fp32, D a power of two >= 16. sources: 1 to 3 (kv [N, D] in q's
    dtype with unit column stride, or packed FP8 rows (``kv_fp8.Fp8Rows``, read as their exact
    values, walked source by source), idx [T, L] int32/int64 rows of kv, -1 = no key). sinks: [H].
    Returns [T, H, D] in q's dtype; a query with no keys outputs zeros. config: tiles other
    than attention_config's (for tuning). num_sms: the SMs the splits fill (default: q's
    device's; the backend object passes its own). out_rope: (cos, sin) [T, rope_dim / 2]
    fp32 (a power of two): the output's trailing rope_dim channels rotated by them in the
    output's own store (the norm family's apply_rope values: (cos, -sin) rotates V's RoPE back).
    """
    num_q, num_heads, dim = q.shape
    assert 1 <= len(sources) <= 3, f"1 to 3 key sources, got {len(sources)}"
    assert dim >= 16 and dim & (dim - 1) == 0, f"head dim must be a power of two >= 16, got {dim}"
    out = torch.empty((num_q, num_heads, dim), dtype=q.dtype, device=q.device)
    if num_q == 0:
        return out
    q = q.contiguous()
    sinks = sinks.float().contiguous()
    cos, sin = out_rope if out_rope is not None else (sinks, sinks)  # not read without it
    half = cos.shape[-1] if out_rope is not None else 0
    if out_rope is not None:
        assert cos.shape == sin.shape == (num_q, half) and 0 < 2 * half <= dim, (
            f"out_rope: cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, q {tuple(q.shape)}"
        )
        assert half & (half - 1) == 0, f"out_rope: rope_dim {2 * half} is not a power of two"
        cos, sin = (c if c.stride(-1) == 1 else c.contiguous() for c in (cos, sin))
    rope_args = (cos, sin, cos.stride(0), sin.stride(0))
    rope_constexprs = {"OUT_NOPE": dim - 2 * half, "OUT_HALF": half}
    # The kernel picks a source's index pointer at run time, so all share one index dtype (the
    # engine's are all int64 already).
    if len({idx.dtype for _, idx in sources}) > 1:
        sources = [(kv, idx.long()) for kv, idx in sources]
    # Packed FP8 sources (cache.kv_dtype = "fp8"): every source goes in as bytes, and the kernel
    # reads a packed one's rows as their exact values (_load_bytes).
    layouts = {kv.layout for kv, _ in sources if isinstance(kv, Fp8Rows)}
    assert len(layouts) <= 1, f"packed sources of several layouts: {layouts}"
    layout = next(iter(layouts), None)
    if unpacks(q, sources):
        sources = [unpacked(kv, idx, q.dtype) for kv, idx in sources]
        layout = None
    # Absent sources repeat the first with length 0: never read, as NUM_SOURCES bounds the loop.
    padded = [*sources] + [sources[0]] * (3 - len(sources))
    source_ptrs: list[torch.Tensor] = []
    source_sizes: list[int] = []
    rows_per_group: list[int] = []
    for s, (kv, idx) in enumerate(padded):
        assert idx.shape[0] == num_q, f"idx {tuple(idx.shape)} for {num_q} query tokens"
        idx = idx if idx.stride(1) == 1 else idx.contiguous()
        if isinstance(kv, Fp8Rows):
            assert kv.layout.head_dim == dim, f"packed rows of {kv.layout.head_dim}, q of {dim}"
            assert kv.num_rows < 2**31, f"{kv.num_rows} packed rows: the kernel indexes 32-bit"
            ptr, stride_kv, groups = kv.data, kv.data.stride(0), kv.data.shape[1]
        else:
            assert kv.dtype == q.dtype and kv.shape[1] == dim and kv.stride(1) == 1, (
                f"kv {tuple(kv.shape)} {kv.dtype} strides {kv.stride()} vs q "
                f"{tuple(q.shape)} {q.dtype}"
            )
            # The kernel promises 16-byte aligned rows (tl.multiple_of) for vectorised gathers.
            assert kv.data_ptr() % 16 == 0 and kv.stride(0) * kv.element_size() % 16 == 0, (
                f"kv rows must be 16-byte aligned: data_ptr {kv.data_ptr()}, strides {kv.stride()}"
            )
            ptr, stride_kv, groups = kv, kv.stride(0), 0
            if layout is not None:
                ptr, stride_kv = kv.view(torch.uint8), kv.stride(0) * kv.element_size()
        source_ptrs += [ptr, idx]
        source_sizes += [stride_kv, idx.stride(0), idx.shape[1] if s < len(sources) else 0]
        rows_per_group.append(groups)
    num_keys = sum(idx.shape[1] for _, idx in sources)

    num_sms = _num_sms(q.device) if num_sms is None else num_sms
    config = config or attention_config(q.dtype, num_heads, num_q, packed=layout is not None)
    num_head_blocks = triton.cdiv(num_heads, config.block_h)
    num_splits, keys_per_split = _split_keys(
        num_q, num_head_blocks, num_keys, config.block_n, num_sms
    )
    is_split = num_splits > 1
    if is_split:
        part_m = torch.empty((num_q, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            (num_q, num_heads, num_splits, dim), dtype=torch.float32, device=q.device
        )
    else:
        part_m = part_l = part_acc = out  # unused: IS_SPLIT is constexpr
    _sparse_attention_kernel[(num_q, num_head_blocks, num_splits)](
        q,
        sinks,
        out,
        part_m,
        part_l,
        part_acc,
        *source_ptrs,
        *source_sizes,
        *rows_per_group,
        num_heads,
        keys_per_split,
        scale * _LOG2E.value,
        *rope_args,
        D=dim,
        BLOCK_H=config.block_h,
        BLOCK_N=config.block_n,
        **rope_constexprs,
        NUM_SOURCES=len(sources),
        IS_SPLIT=is_split,
        PER_SOURCE=config.per_source or layout is not None,
        DOT_PRECISION=_dot_precision(q.dtype),
        PACKED=layout is not None,
        NOPE=layout.nope_dim if layout else 0,
        TILE=layout.tile if layout else 1,
        GROUPS=_scale_groups(layout, dim),
        DATA_BYTES=layout.data_bytes if layout else 0,
        SCALE_BYTES=layout.scale_bytes if layout else 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl(q.device),
    )
    if is_split:
        block_d = min(dim, 128)
        _combine_splits_kernel[(num_q, num_heads, dim // block_d)](
            part_m,
            part_l,
            part_acc,
            sinks,
            out,
            *rope_args,
            num_heads,
            num_splits,
            D=dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            **rope_constexprs,
            num_warps=4,
            **pdl(part_m.device),
        )
    return out


@triton.jit
def _indexer_scores_kernel(
    q_ptr,
    weights_ptr,
    keys_ptr,
    entry_rows_ptr,
    token_req_ptr,
    num_visible_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_wh,
    stride_keys,
    stride_entry_b,
    stride_entry_n,
    stride_cos,
    stride_sin,
    num_heads,
    num_entries,
    weight_scale,
    score_scale,
    counters_ptr,
    top_ptr,
    top_k,
    stride_top,
    D: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T, cdiv(N, BLOCK_N)): the scores of one token over one block of its entries.
    TOPK (``indexer_select``): then a ticket a token (``triton_tickets``); the token's last
    program reads its row of scores back and stores its top_k best entries to top
    (``_topk_row``, a row of up to TOPK_BLOCK entries).

    out [T, N] fp32 contiguous. Entries at or past num_visible[t] are neither looked up in
    entry_rows nor loaded from keys (their rows may be garbage): they score -inf. ROPE: q's
    channels from NOPE on rotated first by cos, sin [T, (D - NOPE) / 2] (fp32 math, rounded to
    q's dtype: apply_rope's values), each channel's pair partner (channel ^ 1) loaded beside it.
    """
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK_N
    n = first + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + t * num_entries + n
    num_visible = tl.load(num_visible_ptr + t)
    if first < num_visible:
        visible = (n < num_visible) & (n < num_entries)
        req = tl.load(token_req_ptr + t).to(tl.int64)
        rows = tl.load(
            entry_rows_ptr + req * stride_entry_b + n * stride_entry_n, mask=visible, other=0
        )
        offs_d = tl.arange(0, D)
        k_ptrs = keys_ptr + rows.to(tl.int64)[:, None] * stride_keys + offs_d[None, :]
        k = tl.load(k_ptrs, mask=visible[:, None], other=0.0)  # [BLOCK_N, D]
        heads = tl.arange(0, BLOCK_H)
        head_mask = heads < num_heads
        q_ptrs = q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=head_mask[:, None], other=0.0)  # [BLOCK_H, D]
        if ROPE:
            is_rope = offs_d >= NOPE
            partner = tl.where(is_rope, NOPE + ((offs_d - NOPE) ^ 1), offs_d)
            rope_mask = head_mask[:, None] & is_rope[None, :]
            q_partner = tl.load(
                q_ptr + t * stride_qt + heads[:, None] * stride_qh + partner[None, :],
                mask=rope_mask,
                other=0.0,
            ).to(tl.float32)
            pair = tl.where(is_rope, (offs_d - NOPE) // 2, 0)
            cos = tl.load(cos_ptr + t * stride_cos + pair, mask=is_rope, other=1.0)
            sin = tl.load(sin_ptr + t * stride_sin + pair, mask=is_rope, other=0.0)
            qf = q.to(tl.float32)
            even = ((offs_d - NOPE) % 2 == 0)[None, :]
            signed_sin = tl.where(even, -sin[None, :], sin[None, :])
            rotated = rotate(qf, q_partner, cos[None, :], signed_sin)
            q = tl.where(rope_mask, rotated, qf).to(q_ptr.dtype.element_ty)
        w = tl.load(weights_ptr + t * stride_wt + heads * stride_wh, mask=head_mask, other=0.0)
        w = w.to(tl.float32) * weight_scale  # torch_ref's weights.float() * weight_scale
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N] fp32
        scores = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0) * score_scale
        tl.store(out_ptrs, tl.where(visible, scores, float("-inf")), mask=n < num_entries)
    else:
        tl.store(out_ptrs, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=n < num_entries)
    if TOPK:  # noqa: SIM102 - a constexpr branch: without it, no ticket is taken
        if arrive(counters_ptr + t, tl.num_programs(1)):
            row = tl.arange(0, TOPK_BLOCK)
            every = tl.load(
                out_ptr + t * num_entries + row,
                mask=row < num_entries,
                other=float("-inf"),
                cache_modifier=".cg",
            )
            _topk_row(
                every, t, num_entries, top_k, entry_rows_ptr, token_req_ptr, top_ptr,
                stride_entry_b, stride_entry_n, stride_top, TOPK_BLOCK,
            )  # fmt: skip
            depart(counters_ptr + t)


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_req: torch.Tensor,
    num_visible: torch.Tensor,
    weight_scale: float = 1.0,
    q_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Lightning indexer scores of every query token over its request's compressed entries.

    q: [T, Hi, Di] (Di a power of two >= 16); weights: [T, Hi], any float dtype, taken
    as weights.float() * weight_scale in the kernel (no launch of its own); keys: [P, Di] in
    q's dtype, unit column stride; entry_rows: [B, N] integer rows of keys (any value at or past
    a request's entry count); token_req: [T]; num_visible: [T]. q_rope: (cos, sin) [T,
    rope_dim / 2] fp32: q's trailing rope_dim channels rotated in the kernel (apply_rope's
    values; no launch of its own).
    Returns [T, N] fp32: sum_h weights[t, h] * relu(q[t, h] . keys[entry]) * Di^-0.5, -inf where
    n >= num_visible[t].
    """
    num_q, num_entries = q.shape[0], entry_rows.shape[1]
    out = torch.empty((num_q, num_entries), dtype=torch.float32, device=q.device)
    if num_q == 0 or num_entries == 0:
        return out
    _scores(q, weights, keys, entry_rows, token_req, num_visible, weight_scale, q_rope, out)
    return out


def _scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_req: torch.Tensor,
    num_visible: torch.Tensor,
    weight_scale: float,
    q_rope: tuple[torch.Tensor, torch.Tensor] | None,
    out: torch.Tensor,
    top: torch.Tensor | None = None,
) -> None:
    """indexer_scores' launch into out [T, N] (T, N > 0); ``top`` (rows [T, k], k <= N): with
    each token's top-k in it (``indexer_select``)."""
    num_q, num_heads, dim = q.shape
    num_entries = entry_rows.shape[1]
    assert dim >= 16 and dim & (dim - 1) == 0, (
        f"indexer dim must be a power of two >= 16, got {dim}"
    )
    assert keys.dtype == q.dtype and keys.shape[1] == dim and keys.stride(1) == 1, (
        f"keys {tuple(keys.shape)} {keys.dtype} strides {keys.stride()} vs q {tuple(q.shape)}"
    )
    q = q if q.stride(2) == 1 else q.contiguous()
    token_req, num_visible = token_req.contiguous(), num_visible.contiguous()  # read at [t]
    cos, sin = q_rope if q_rope is not None else (out, out)  # not read without ROPE
    rope_dim = 2 * cos.shape[-1] if q_rope is not None else 0
    if q_rope is not None:
        assert cos.shape == sin.shape == (num_q, rope_dim // 2) and 0 < rope_dim <= dim, (
            f"indexer_scores: cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, q {tuple(q.shape)}"
        )
        cos, sin = (c if c.stride(-1) == 1 else c.contiguous() for c in (cos, sin))
    # 64 entries a program: decode (T = 1, N = 8192) still gets 128 programs. bf16 runs one
    # wgmma (~75 registers); fp32's IEEE dot on CUDA cores holds its operands in registers and
    # spills below 16 warps (ptxas -v, sm_90).
    block_n = 64
    num_warps = 16 if q.dtype == torch.float32 else 4
    top_rows = top if top is not None else out  # out: a pointer not read
    _indexer_scores_kernel[(num_q, triton.cdiv(num_entries, block_n))](
        q,
        weights,
        keys,
        entry_rows,
        token_req,
        num_visible,
        out,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        weights.stride(1),
        keys.stride(0),
        entry_rows.stride(0),
        entry_rows.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_heads,
        num_entries,
        float(weight_scale),
        dim**-0.5,
        ticket_counters(q.device),
        top_rows,
        top_rows.shape[1] if top is not None else 0,
        top_rows.stride(0),
        D=dim,
        NOPE=dim - rope_dim,
        ROPE=q_rope is not None,
        BLOCK_H=max(triton.next_power_of_2(num_heads), 16),
        BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype),
        TOPK=top is not None,
        TOPK_BLOCK=_topk_block(num_entries) if top is not None else 16,
        num_warps=num_warps,
        **pdl(q.device),
    )


# indexer_topk holds a token's scores in one program's registers up to this many entries (a
# context of 64K tokens at CSA's ratio 4: 32 keys a thread at 16 warps); past it, torch_ref's.
TOPK_MAX_ENTRIES = 16384


@triton.jit
def _topk_row(
    scores, t, num_entries, k, entry_rows_ptr, token_req_ptr, out_ptr, stride_entry_b,
    stride_entry_n, stride_ot, BLOCK: tl.constexpr,
):  # fmt: skip
    """Token t's k best of its scores [BLOCK] (-inf past num_entries), ties to the lower column,
    stored in column order as rows of entry_rows to out's row t.

    Scores become keys that order as unsigned integers (a negative score's bits all flip, a
    positive one's sign bit sets; -inf is 0x007FFFFF, columns past N are 0, below every score).
    The k-th largest key is found bit by bit from the top (32 counts of keys >= a candidate);
    the entries above it are taken, then the first tied ones up to k, and each is stored at its
    rank among the taken columns (a prefix sum).
    """
    n = tl.arange(0, BLOCK)
    in_row = n < num_entries
    bits = scores.to(tl.uint32, bitcast=True)
    keys = tl.where((bits >> 31) == 1, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    keys = tl.where(in_row, keys, 0)
    kth = tl.full([], 0, tl.uint32)
    for bit in tl.static_range(32):
        candidate = kth | tl.full([], 1 << (31 - bit), tl.uint32)
        count = tl.sum((keys >= candidate).to(tl.int32), axis=0)
        kth = tl.where(count >= k, candidate, kth)
    above = keys > kth
    tied = keys == kth
    need = k - tl.sum(above.to(tl.int32), axis=0)
    take = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    req = tl.load(token_req_ptr + t).to(tl.int64)
    rows = tl.load(entry_rows_ptr + req * stride_entry_b + n * stride_entry_n, mask=take, other=0)
    rows = tl.where(scores == float("-inf"), -1, rows)
    tl.store(out_ptr + t * stride_ot + slot, rows.to(out_ptr.dtype.element_ty), mask=take)


@triton.jit
def _indexer_topk_kernel(
    scores_ptr,
    entry_rows_ptr,
    token_req_ptr,
    out_ptr,
    num_entries,
    k,
    stride_st,
    stride_entry_b,
    stride_entry_n,
    stride_ot,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T,): one token's k best entries (``_topk_row``)."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK)
    scores = tl.load(scores_ptr + t * stride_st + n, mask=n < num_entries, other=float("-inf"))
    _topk_row(
        scores, t, num_entries, k, entry_rows_ptr, token_req_ptr, out_ptr, stride_entry_b,
        stride_entry_n, stride_ot, BLOCK,
    )  # fmt: skip


def indexer_topk(
    scores: torch.Tensor, entry_rows: torch.Tensor, token_req: torch.Tensor, k: int
) -> torch.Tensor:
    """Each query token's k best-scored entries as rows of the indexer-key pool: torch_ref's
    contract, one launch for up to TOPK_MAX_ENTRIES entries (a row's entries in column order),
    torch_ref's sort past it. scores: [T, N] fp32; entry_rows: [B, N]; token_req: [T]."""
    num_q, num_entries = scores.shape
    width = min(k, num_entries)
    if num_entries > TOPK_MAX_ENTRIES:
        return ref.indexer_topk(scores, entry_rows, token_req, k)
    out = torch.empty((num_q, width), dtype=entry_rows.dtype, device=scores.device)
    if num_q == 0 or width == 0:
        return out
    assert scores.dtype == torch.float32 and scores.stride(1) == 1, (
        f"indexer_topk: scores {scores.dtype} strides {scores.stride()}"
    )
    block = _topk_block(num_entries)
    _indexer_topk_kernel[(num_q,)](
        scores,
        entry_rows,
        token_req.contiguous(),
        out,
        num_entries,
        width,
        scores.stride(0),
        entry_rows.stride(0),
        entry_rows.stride(1),
        out.stride(0),
        BLOCK=block,
        num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16,
        **pdl(scores.device),
    )
    return out


def _topk_block(num_entries: int) -> int:
    """The block of a row's keys that the top-k holds (indexer_topk's and indexer_select's)."""
    return max(16, triton.next_power_of_2(num_entries))


# indexer_select runs the top-k in the scores' launch (a token's last program) up to this many
# entries (a context of 8K tokens at CSA's ratio 4: 16 keys a thread at the scores' 4 warps)
# and tokens (decode and verify steps: the top-k's registers, 168 a thread at sm_90 against the
# scores' ~75 alone, would cut the programs an SM of a prefill's many).
SELECT_MAX_ENTRIES = 2048
SELECT_MAX_TOKENS = 64


def indexer_select(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_req: torch.Tensor,
    num_visible: torch.Tensor,
    k: int,
    weight_scale: float = 1.0,
    q_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``indexer_topk(indexer_scores(...), entry_rows, token_req, k)`` (torch_ref's
    indexer_select): up to SELECT_MAX_ENTRIES entries in one launch, the top-k in each token's
    last scores program (a ticket a token), up to SELECT_MAX_TOKENS tokens; past either, the
    two launches."""
    num_q, num_entries = q.shape[0], entry_rows.shape[1]
    if num_entries > SELECT_MAX_ENTRIES or num_q > SELECT_MAX_TOKENS:
        scores = indexer_scores(
            q, weights, keys, entry_rows, token_req, num_visible, weight_scale, q_rope
        )
        return indexer_topk(scores, entry_rows, token_req, k)
    top = torch.empty((num_q, min(k, num_entries)), dtype=entry_rows.dtype, device=q.device)
    if num_q == 0 or top.shape[1] == 0:
        return top
    scores = torch.empty((num_q, num_entries), dtype=torch.float32, device=q.device)
    _scores(
        q, weights, keys, entry_rows, token_req, num_visible, weight_scale, q_rope, scores, top
    )  # fmt: skip
    return top


class TritonAttentionBackend(Backend):
    """This module's kernels on one CUDA device (or the interpreter's CPU). ``num_sms``: the SMs
    that sparse_attention's splits fill; ``config``: tiles for every call instead of
    attention_config's (for tuning; None in the engine)."""

    @staticmethod
    def window_from_ring(num_tokens: int) -> bool:
        return False

    indexer_scores = staticmethod(indexer_scores)
    indexer_topk = staticmethod(indexer_topk)
    indexer_select = staticmethod(indexer_select)
    store_rows = staticmethod(store_rows)
    as_stored = staticmethod(as_stored)

    def __init__(
        self,
        device: torch.device,
        parallel: ParallelContext | None = None,
        *,
        config: AttentionConfig | None = None,
    ) -> None:
        super().__init__(device, parallel)
        self.num_sms = _num_sms(device)
        self.config = config

    def sparse_attention(
        self,
        q: torch.Tensor,
        sources: Sequence[tuple[KVSource, torch.Tensor]],
        sinks: torch.Tensor,
        scale: float,
        out_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return sparse_attention(
            q, sources, sinks, scale, config=self.config, num_sms=self.num_sms, out_rope=out_rope
        )
