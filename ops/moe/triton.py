"""Routed experts with clamped SwiGLU as two grouped GEMMs in Triton (vLLM-style fused MoE).

Data flow, all on x's CUDA device and free of host synchronisation (shapes depend only on T, k
and E, never on the routing), so that a CUDA graph can capture it:

    topk_ids [T, k]            --align_by_expert-->  sorted_pair_ids [num_blocks * BLOCK_M],
                                                     block_expert [num_blocks]  (int32)
    x [T, D], w1, w3 [E, I, D] --_gate_up_kernel-->  h [num_blocks * BLOCK_M, I]  (SwiGLU applied)
    h, w2 [E, D, I]            --_down_kernel----->  pair_out [T * k, D]  (routing weight applied)
    pair_out as [T, k, D]      --_combine_kernel-->  out [T, D]  (fp32 sum over slots 0..k-1)

A pair is one (token, slot) of the routing, numbered p = t * k + j. The alignment sorts the pairs
by expert (stable, so by p within an expert) and pads each expert's group to a multiple of
BLOCK_M, so that every M block of the grouped GEMMs belongs to one expert:

    E = 4, BLOCK_M = 4, topk_ids = [[2, 0], [2, 3], [2, 0]]   (pairs 0..5, sentinel - = 6)

    sorted_pair_ids  | 1  5  -  - | 0  2  4  - | 3  -  -  - | -  -  -  - |
    block_expert     |     0      |     2      |     3      |     -1     |

Blocks past the real count (here the fourth) carry -1 and their programs return at once.

D, I and k are compile-time constants of the kernels (fixed per model, and Triton's interpreter
cannot take a runtime loop bound under numpy >= 2.4); the pair and block counts are runtime
arguments it does not specialise on, so every T within one row of the tile table shares a binary.

Every pair's expert output is written to its own row of pair_out (no atomics), and the combine
adds a token's k rows in slot order in fp32. A token's output therefore depends only on its own
routing and on the tile configuration, not on which other tokens share its experts' blocks: it is
bitwise the same alone or in any batch that picks the same TileConfig (pick_tile_config keys on
T * k, so batches in one bucket of the table agree; across buckets the GEMM tile shapes, and with
them the summation order, differ).

MXFP4 experts (``Mxfp4Weight``: e2m1 codes two per byte, one ue8m0 scale per 32 inputs) run the
same kernels with W_FP4 set: each K tile of a weight is read as its [BLOCK_K/2, BLOCK_N] bytes and
[BLOCK_N, BLOCK_K/32] scale bytes (a quarter of bf16's bytes, plus a byte per 32). Compiled
bf16 / fp16 runs hand them to ``tl.dot_scaled`` (e2m1 x ue8m0, upcast in registers on Hopper);
fp32 (parity) runs and Triton's interpreter, which has no scaled dot, take one scale group at a
time (``_mxfp4_group_dot``: the low and high nibbles become two exact value planes that multiply
the even and the odd activations, and the group's scale, a power of two, multiplies the fp32
partial sum). Either way the values are those of ``dequantize_mxfp4``; only the summation order
differs from the dense kernel's. benchmarks/moe_fp4.py measures them against bf16.

``swiglu`` is the shared expert's activation (between its GEMMs, outside the routed path) as
one elementwise launch.

One file of ~720 lines: a backend is one module per op family (``ops/registry.py``); the
alignment, both GEMMs and the combine share one tile table (``benchmarks/moe_tiles.py``).
``TritonMoEBackend`` at the end is the backend object: it keeps any tile override.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from deepinfer.ops.moe import gluon as moe_gluon
from deepinfer.ops.moe.mxfp4_bits import MXFP4_BITS_ASM
from deepinfer.ops.moe.torch_ref import (
    MXFP4_BLOCK,
    ExpertWeight,
    Fp8ExpertWeight,
    Mxfp4Weight,
)
from deepinfer.ops.moe.triton_gemv import (
    GemvConfig,
    decode_moe,
    reorder_mma_order,
    reorder_pair_order,
    residual_rows,
    store_output,
)
from deepinfer.ops.moe.triton_router import route
from deepinfer.ops.registry import Backend, ParallelContext
from deepinfer.ops.streams import Pending
from deepinfer.ops.triton_pdl import enter, pdl
from deepinfer.ops.triton_swiglu import swiglu as swiglu_tile
from deepinfer.ops.triton_utils import dot_precision

__all__ = [
    "GemvConfig",
    "TileConfig",
    "TritonMoEBackend",
    "align_by_expert",
    "fused_moe",
    "pick_tile_config",
    "swiglu",
]


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch settings shared by both grouped GEMMs.

    block_m: pairs per M block (the alignment pads each expert's group to it); block_n, block_k:
    the N (output features) and K (reduction) tiles; group_m: M blocks that sweep the N tiles
    together, so that weight tiles are reused from L2 across an expert's blocks. fast_math
    (MXFP4 weights on the compiled scaled dot): the upcast skips its NaN handling of scale byte
    255, which no MXFP4 weight carries (quantize_mxfp4 never writes it; a checkpoint's would be
    NaN in the OCP format). It is most of the upcast's cost: 1.34x at 768 pairs on the H100
    (benchmarks/RESULTS.md, 2026-12-06); False is the slow path, kept for measuring it.
    bits_upcast (MXFP4 weights, compiled bf16): instead of the scaled dot, each 32-bit word's
    eight codes become bf16 values in registers by shifts and masks (``_mxfp4_bits``), and the
    product runs transposed, the weights as the MMA's register operand. gluon (with
    bits_upcast, on Hopper, at one of gluon.TILES): the two GEMMs are gluon.py's, whose upcast
    lands in wgmma's register operand without the pass through shared memory. ring (gluon):
    the K steps through a ring of that many shared-memory stages (at least 3) filled by
    cp.async ring - 2 steps ahead, each MMA beside the next step's upcast; 0: the next step's
    words prefetched in registers.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    fast_math: bool = True
    bits_upcast: bool = False
    gluon: bool = False
    ring: int = 0


# bf16/fp16, keyed by the number of pairs T * k (first row whose bound is >= T * k). Decode is
# memory bound on streaming the experts' weights: small M blocks, wide K tiles, deep pipelines.
# Prefill fills M blocks (E = 256 experts: ~T * k / 256 pairs each) and wants larger tiles.
# Shared memory per stage of the gate/up kernel is (BM * BK + 2 * BK * BN) * 2 bytes. On the
# H200 at V4-Flash's shapes (benchmarks/moe_tiles.py, RESULTS.md 2026-11-30) each row is within
# 3% of the fastest candidate for its token counts; 128 x 256 tiles need 240 KB of shared
# memory, over the 227 KB an SM has.
_TILE_TABLE: tuple[tuple[int, TileConfig], ...] = (
    # max T * k          block_m, block_n, block_k, group_m, num_warps, num_stages
    (1024, TileConfig(16, 64, 128, 1, 4, 3)),
    (8192, TileConfig(32, 64, 128, 8, 4, 3)),
    (32768, TileConfig(64, 64, 64, 8, 4, 4)),
    (1 << 62, TileConfig(128, 128, 64, 8, 8, 3)),
)


# MXFP4 experts (benchmarks/moe_fp4.py on the H200, RESULTS.md 2026-12-01): the decode row up to
# 4,096 pairs (at 3,072 it beats the second row by 7%), the bf16 rows up to 16,384 (at 12,288 the
# third row was the fastest candidate), then taller, narrower tiles than bf16's last row: 1.44x
# faster at 24,576 pairs (T = 4096), 1.24x at 49,152.
_MXFP4_DECODE_PAIRS = 4096
_MXFP4_PREFILL_PAIRS = 16384
_MXFP4_PREFILL_TILES = TileConfig(128, 64, 64, 8, 4, 4)
# The grouped kernels upcast MXFP4 by bits (TileConfig.bits_upcast) where the weights' scale
# bytes allow it (Mxfp4Weight.max_scale <= BITS_MAX_SCALE; else the scaled dot). H100, 2026-12-07
# (benchmarks/RESULTS.md, moe_fp4.py): the decode tile at T = 128 (768 pairs) 2,010 µs against
# 2,092, the prefill tile at T = 4096 4,593 against 4,937.
_MXFP4_BITS_UPCAST = True
BITS_MAX_SCALE = 128
# Where the bits tiles are one of gluon.py's (the decode row), its kernels take them on Hopper.
# H100, 2026-12-07 (benchmarks/RESULTS.md, moe_fp4.py): T = 48 / 128 / 512 (288 to 3,072 pairs)
# 1,290 / 1,747 / 1,892 µs against the Triton bits kernels' 1,468 / 1,978 / 2,287, at the same
# tile; 128 weight rows a program within 1%, 256 slower.
_MXFP4_GLUON = True
# Its K steps through a ring of this many shared-memory stages (TileConfig.ring; 0: the next
# step prefetched in registers). H100, 2026-12-07 (RESULTS.md, seventh session): T = 48 / 128 /
# 512 1,248 / 1,710 / 1,810 µs against the register prefetch's 1,292 / 1,780 / 1,892; rings of
# 4 and 5 within 2% of 3.
_MXFP4_GLUON_RING = 3
# Past the decode row on Hopper, Gluon's prefill tiles (first row whose bound is >= T * k), with
# the ring. H100, same run: T = 2,048 (12,288 pairs) 64 x 64 on 4 warps 2,555 µs against the
# Triton bits row's 3,001; T = 8,192 (49,152) 128 x 128 on 8 warps 7,420 against 8,547 (64 x 64:
# 8,768; 128 x 64 on 4 warps: 7,896); with the down kernel's MMA beside its next upcast, 7,180
# (64 x 64: 7,962).
_MXFP4_GLUON_PREFILL: tuple[tuple[int, TileConfig], ...] = (
    (_MXFP4_PREFILL_PAIRS, TileConfig(64, 64, 128, 1, 4, 3)),
    (1 << 62, TileConfig(128, 128, 128, 1, 8, 3)),
)
# MXFP4 experts at decode: a program a pair (triton_gemv.py) up to this many pairs. H200,
# 2026-12-06 (benchmarks/RESULTS.md, moe_gemv.py): gate/up 32 x 256 is the best tile or within 5%
# of it at T = 1, 4, 16 (38.6 / 114.7 / 381.8 µs), down 8 x 1024 the best at each (35.9 / 78.4 /
# 248.7 µs). H100, moe_fp4.py, since the grouped kernel's upcast skips the NaN check (fast_math):
# at T = 16 (96 pairs) these tiles take 624 µs; at T = 32 (192 pairs) 1,205 against the grouped
# kernel's 1,255; at T = 40 (240 pairs) 1,488 against 1,393 and at T = 48 1,712 against 1,549:
# the grouped kernel from 193 pairs. H100, moe_gemv.py (RESULTS.md 2026-12-06, the slot split):
# down 16 x 2048 on 8 warps, a program per (token, slot): 28.4 / 73.6 / 475 µs at T = 1 / 4 / 32
# against 40.4 / 82.4 / 473 for 8 x 1024 a token; gate/up on x in nibble-major order 107 / 650
# µs at T = 4 / 32 against 119 / 739 (T = 1: 39.2 against 40.8, less than the reorder's launch).
_MXFP4_GEMV_PAIRS = 192
_MXFP4_GEMV = GemvConfig(
    block_n=32,
    block_k=256,
    num_warps=4,
    down_block_n=16,
    down_block_k=2048,
    down_num_warps=8,
    down_split_tokens=32,
    reorder_x_tokens=2,
)
# swiglu: columns a program (the shared expert's I = 2,048 in two programs a token).
SWIGLU_BLOCK = 1024


def _on_hopper() -> bool:
    """Whether the current CUDA device runs gluon.py's kernels (its prefill tiles are chosen
    only there: elsewhere the Triton kernels keep their own rows)."""
    return torch.cuda.is_available() and moe_gluon.runs_on(
        torch.device("cuda", torch.cuda.current_device())
    )


def pick_tile_config(
    num_pairs: int, dtype: torch.dtype, packed: bool = False
) -> TileConfig | GemvConfig:
    """The tile configuration for T * k = ``num_pairs`` pairs of ``dtype`` activations
    (``packed``: MXFP4 experts): a GemvConfig runs triton_gemv.py's kernels instead of the
    grouped GEMMs.

    fp32 (the engine's parity mode) runs the IEEE FMA dot, not tensor cores: 4-byte operands
    held in registers, so smaller M and K tiles and two stages keep it within registers and
    shared memory. It is for exactness, not speed.
    """
    if packed and num_pairs <= _MXFP4_GEMV_PAIRS:
        return _MXFP4_GEMV
    if packed and num_pairs <= _MXFP4_DECODE_PAIRS:
        num_pairs = 1
    config = next(config for bound, config in _TILE_TABLE if num_pairs <= bound)
    if packed and num_pairs > _MXFP4_PREFILL_PAIRS:
        config = _MXFP4_PREFILL_TILES
    if packed and dtype == torch.bfloat16 and _MXFP4_BITS_UPCAST:
        if _MXFP4_GLUON and num_pairs > _MXFP4_DECODE_PAIRS and _on_hopper():
            config = next(config for bound, config in _MXFP4_GLUON_PREFILL if num_pairs <= bound)
        gluon = _MXFP4_GLUON and _tile(config) in moe_gluon.TILES
        ring = _MXFP4_GLUON_RING if gluon else 0
        config = replace(config, bits_upcast=True, gluon=gluon, ring=ring)
    if dtype == torch.float32:
        return TileConfig(
            block_m=min(config.block_m, 64),
            block_n=64,
            block_k=32,
            group_m=config.group_m,
            num_warps=4,
            num_stages=2,
        )
    return config


def _tile(config: TileConfig) -> tuple[int, int, int, int]:
    return config.block_m, config.block_n, config.block_k, config.num_warps


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the T * k pairs by expert and pad each expert's group to a multiple of ``block_m``.

    topk_ids: [T, k] integer expert ids in [0, num_experts). Returns sorted_pair_ids
    [num_blocks * block_m] int32 (pair ids p = t * k + j grouped by expert, ascending within a
    group, the sentinel T * k in padding) and block_expert [num_blocks] int32 (the expert of each
    M block, -1 for blocks past the last group); see the picture at the top of the module.

    num_blocks is a bound computed from shapes only: each of the at most min(E, T * k) experts
    that receive a pair adds at most block_m - 1 padding slots, so the real block count is at
    most (T * k + min(E, T * k) * (block_m - 1)) // block_m. At decode (T = 1, k = 6) that is
    exactly 6 blocks; it never launches E mostly empty blocks. Only torch ops without host
    synchronisation are used (sort, searchsorted, cumsum, gather, scatter).
    """
    flat_ids = topk_ids.reshape(-1)  # [P], P = T * k
    num_pairs = flat_ids.numel()
    num_blocks = (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m
    device = flat_ids.device

    sorted_experts, order = torch.sort(flat_ids, stable=True)  # [P], [P]
    experts = torch.arange(num_experts, device=device, dtype=sorted_experts.dtype)
    group_ends = torch.searchsorted(sorted_experts, experts, right=True)  # [E]
    counts = torch.diff(group_ends, prepend=group_ends.new_zeros(1))  # [E]
    padded_counts = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_ends = torch.cumsum(padded_counts, dim=0)  # [E]
    rank = torch.arange(num_pairs, device=device) - (group_ends - counts)[sorted_experts]  # [P]
    slots = (padded_ends - padded_counts)[sorted_experts] + rank  # [P]

    sorted_pair_ids = torch.full(
        (num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device
    )
    sorted_pair_ids.scatter_(0, slots, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m  # [num_blocks]
    # The first expert whose padded group ends after the block's start owns the block.
    block_expert = torch.searchsorted(padded_ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pair_ids, block_expert


@triton.jit
def _tile_ids(pid, num_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(M block, N tile) of a program: GROUP_M consecutive M blocks sweep the N tiles together."""
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    num_pids_in_group = GROUP_M * num_tiles_n
    first_m = (pid // num_pids_in_group) * GROUP_M
    group_size = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % num_pids_in_group) % group_size
    pid_n = (pid % num_pids_in_group) // group_size
    return pid_m, pid_n


@triton.jit
def _e2m1_values(codes, DTYPE: tl.constexpr):
    """e2m1 codes (0..15: sign bit 3, exponent bits 2-1, mantissa bit 0) -> values in DTYPE,
    exactly: fp32 bits sign << 31 and, for exponent bits e > 0, the biased exponent e + 126
    with the mantissa bit at 22 (2 ** (e - 1) * (1 + m / 2)); e = 0 is 0 or 0.5."""
    c = codes.to(tl.uint32)
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22)) | ((c >> 3) << 31)
    return bits.to(tl.float32, bitcast=True).to(DTYPE)


@triton.jit
def _mxfp4_bits(words, scales):
    """words [BN, W] uint32 (W = BLOCK_K / 8), scales [BN, W / 4] uint8 -> [BN, 8 W] bf16, the
    weights in pair order (``_in_pair_order``; ``MXFP4_BITS_ASM``; compiled only: the
    interpreter has no PTX)."""
    rows: tl.constexpr = words.shape[0]
    num_words: tl.constexpr = words.shape[1]
    factors = (scales.to(tl.uint32) + 126) * 0x00800080  # 2 ** (s - 1) in both bf16 halves
    word_factors = tl.broadcast_to(factors[:, :, None], (rows, num_words // 4, 4))
    v = tl.inline_asm_elementwise(
        MXFP4_BITS_ASM,
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        [words, word_factors.reshape(rows, num_words)],
        dtype=(tl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )
    return _in_pair_order(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7])


@triton.jit
def _in_pair_order(v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight [rows, W] tensors, v_j holding code j of each word -> [rows, 8 W]: code j of word w
    at 8w + 2 (j % 4) + j // 4 (``triton_gemv.pair_order``), so that codes j and j + 4, one register
    of ``MXFP4_BITS_ASM``, sit side by side as the MMA's operand pairs them. The activations
    the weights meet (x, h) are read in the same order."""
    f0 = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [rows, W, 2, 2]: (p, q) holds v[2p + q]
    f1 = tl.join(tl.join(v4, v6), tl.join(v5, v7))
    return tl.join(f0, f1).reshape(v0.shape[0], v0.shape[1] * 8)  # (p, q, b): v[2p + q + 4b]


@triton.jit
def _mxfp4_group_dot(
    acc,
    a_ptrs,
    a_mask,
    stride_ak,
    b_ptrs,
    s_ptrs,
    valid,
    DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """acc + a[:, 32 inputs] @ w[32 inputs, BLOCK_N] for one MXFP4 scale group.

    b_ptrs [16, BLOCK_N]: the group's bytes (byte j: inputs 2j low nibble, 2j + 1 high);
    a_ptrs [BLOCK_M, 16]: the activations of the even inputs (the odd ones are one stride_ak
    on); s_ptrs [1, BLOCK_N]: the group's scale bytes; valid: the group is inside K. The two
    nibble planes multiply the even and the odd activations (no interleave), and the scale,
    a power of two, multiplies the fp32 partial sum exactly.
    """
    packed = tl.load(b_ptrs, mask=valid, other=0)
    a_even = tl.load(a_ptrs, mask=a_mask & valid, other=0.0)
    a_odd = tl.load(a_ptrs + stride_ak, mask=a_mask & valid, other=0.0)
    part = tl.dot(a_even, _e2m1_values(packed & 0xF, DTYPE), input_precision=DOT_PRECISION)
    part = tl.dot(a_odd, _e2m1_values(packed >> 4, DTYPE), part, input_precision=DOT_PRECISION)
    exps = tl.load(s_ptrs, mask=valid, other=127)
    return acc + part * (exps.to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _gate_up_kernel(
    x_ptr,
    w1_ptr,
    w3_ptr,
    s1_ptr,
    s3_ptr,
    h_ptr,
    sorted_pair_ids_ptr,
    block_expert_ptr,
    num_pairs,
    num_blocks,
    limit,
    stride_xt,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_hm,
    stride_hn,
    N: tl.constexpr,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    W_FP4: tl.constexpr,
    SCALED_DOT: tl.constexpr,
    A_FORMAT: tl.constexpr,
    FAST_MATH: tl.constexpr,
    BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """h[rows of an M block, N tile] = swiglu(x[tokens] @ w1[e]^T, x[tokens] @ w3[e]^T).

    N = I, K = D. Padding rows gather nothing (A rows of zeros) and store swiglu(0, 0) = 0, so
    every row of a used block is written and the down kernel reads h without a row mask.
    W_FP4: w1, w3 are packed bytes with scales s1, s3 (strides stride_s*); else s1, s3 unused.
    BITS: w1, w3 are the packed bytes' int32 words (strides in words; TileConfig.bits_upcast),
    x is in their pair order (``pair_order``), and h is stored in it for the down kernel.
    """
    enter(PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_blocks, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ids = tl.load(sorted_pair_ids_ptr + offs_m)
    is_pair = pair_ids < num_pairs
    token_ids = (pair_ids // TOP_K).to(tl.int64)
    # Wrapped columns keep the weight loads in bounds; their results are not stored.
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)

    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if W_FP4 and BITS:
        # Transposed: the weights [BN, BK], upcast in registers, are the MMA's A operand (its M
        # is BLOCK_N), x^T [BK, BM] its B. K % BLOCK_K == 0 (the host checks).
        offs_w = tl.arange(0, BLOCK_K // 8)
        offs_g = tl.arange(0, BLOCK_K // 32)
        xt_ptrs = x_ptr + token_ids[None, :] * stride_xt + offs_k[:, None] * stride_xk
        w_offs = expert * stride_we + offs_n[:, None] * stride_wn + offs_w[None, :] * stride_wk
        s_offs = expert * stride_se + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sk
        gate_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        up_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            xt = tl.load(xt_ptrs, mask=is_pair[None, :], other=0.0)
            w1 = tl.load(w1_ptr + w_offs).to(tl.uint32, bitcast=True)
            w3 = tl.load(w3_ptr + w_offs).to(tl.uint32, bitcast=True)
            gate_t = tl.dot(_mxfp4_bits(w1, tl.load(s1_ptr + s_offs)), xt, gate_t)
            up_t = tl.dot(_mxfp4_bits(w3, tl.load(s3_ptr + s_offs)), xt, up_t)
            xt_ptrs += BLOCK_K * stride_xk
            w_offs += BLOCK_K // 8 * stride_wk
            s_offs += BLOCK_K // 32 * stride_sk
        gate = tl.trans(gate_t)
        up = tl.trans(up_t)
    elif W_FP4 and SCALED_DOT:
        # Triton's microscaled dot: e2m1 bytes [BK/2, BN] and ue8m0 scales [BN, BK/32] as
        # stored, upcast to x's dtype in registers (Hopper has no FP4 tensor cores).
        offs_jk = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 32)
        a_ptrs = x_ptr + token_ids[:, None] * stride_xt + offs_k[None, :] * stride_xk
        b_offs = expert * stride_we + offs_n[None, :] * stride_wn + offs_jk[:, None] * stride_wk
        s_offs = expert * stride_se + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sk
        for k_start in range(0, K, BLOCK_K):
            in_k = offs_k < K - k_start
            a = tl.load(a_ptrs, mask=is_pair[:, None] & in_k[None, :], other=0.0)
            in_j = offs_jk[:, None] < (K - k_start) // 2
            in_g = offs_g[None, :] < (K - k_start) // 32
            b1 = tl.load(w1_ptr + b_offs, mask=in_j, other=0)
            b3 = tl.load(w3_ptr + b_offs, mask=in_j, other=0)
            e1 = tl.load(s1_ptr + s_offs, mask=in_g, other=127)
            e3 = tl.load(s3_ptr + s_offs, mask=in_g, other=127)
            gate = tl.dot_scaled(a, None, A_FORMAT, b1, e1, "e2m1", acc=gate, fast_math=FAST_MATH)
            up = tl.dot_scaled(a, None, A_FORMAT, b3, e3, "e2m1", acc=up, fast_math=FAST_MATH)
            a_ptrs += BLOCK_K * stride_xk
            b_offs += BLOCK_K // 2 * stride_wk
            s_offs += BLOCK_K // 32 * stride_sk
    elif W_FP4:
        # One scale group (32 inputs, 16 bytes of a row) at a time, BLOCK_K // 32 per iteration.
        offs_j = tl.arange(0, 16)
        w_rows = expert * stride_we + offs_n[None, :] * stride_wn  # [1, BN]
        s_rows = expert * stride_se + offs_n[None, :] * stride_sn
        a_rows = x_ptr + token_ids[:, None] * stride_xt + 2 * offs_j[None, :] * stride_xk
        dtype = x_ptr.dtype.element_ty
        for k_start in range(0, K, BLOCK_K):
            for g in tl.static_range(BLOCK_K // 32):
                k0 = k_start + g * 32
                valid = k0 < K
                a_ptrs = a_rows + k0 * stride_xk
                b_offs = (k0 // 2 + offs_j)[:, None] * stride_wk
                s_off = (k0 // 32) * stride_sk
                gate = _mxfp4_group_dot(
                    gate, a_ptrs, is_pair[:, None], stride_xk, w1_ptr + w_rows + b_offs,
                    s1_ptr + s_rows + s_off, valid, dtype, DOT_PRECISION,
                )  # fmt: skip
                up = _mxfp4_group_dot(
                    up, a_ptrs, is_pair[:, None], stride_xk, w3_ptr + w_rows + b_offs,
                    s3_ptr + s_rows + s_off, valid, dtype, DOT_PRECISION,
                )  # fmt: skip
    else:
        a_ptrs = x_ptr + token_ids[:, None] * stride_xt + offs_k[None, :] * stride_xk  # [BM, BK]
        w_offs = expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        w1_ptrs = w1_ptr + w_offs  # [BK, BN]: w1[e, n, k] read as its transpose
        w3_ptrs = w3_ptr + w_offs
        for k_start in range(0, K, BLOCK_K):
            if K % BLOCK_K == 0:
                a = tl.load(a_ptrs, mask=is_pair[:, None], other=0.0)
                b1 = tl.load(w1_ptrs)
                b3 = tl.load(w3_ptrs)
            else:
                in_k = offs_k < K - k_start
                a = tl.load(a_ptrs, mask=is_pair[:, None] & in_k[None, :], other=0.0)
                b1 = tl.load(w1_ptrs, mask=in_k[:, None], other=0.0)
                b3 = tl.load(w3_ptrs, mask=in_k[:, None], other=0.0)
            gate = tl.dot(a, b1, gate, input_precision=DOT_PRECISION)
            up = tl.dot(a, b3, up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_xk
            w1_ptrs += BLOCK_K * stride_wk
            w3_ptrs += BLOCK_K * stride_wk

    h = swiglu_tile(gate, up, limit)

    if W_FP4 and BITS:  # h in the pair order the down kernel reads, permuted before the store
        h = tl.reshape(h, (BLOCK_M, BLOCK_N // 8, 2, 4))  # (w, b, i): input 8w + 4b + i
        h = tl.reshape(tl.permute(h, (0, 1, 3, 2)), (BLOCK_M, BLOCK_N))  # at 8w + 2i + b
    offs_hn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + offs_hn[None, :] * stride_hn
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=offs_hn[None, :] < N)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _down_kernel(
    h_ptr,
    w2_ptr,
    s2_ptr,
    pair_out_ptr,
    topk_weights_ptr,
    sorted_pair_ids_ptr,
    block_expert_ptr,
    num_pairs,
    num_blocks,
    stride_hm,
    stride_hk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_om,
    stride_on,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    W_FP4: tl.constexpr,
    SCALED_DOT: tl.constexpr,
    A_FORMAT: tl.constexpr,
    FAST_MATH: tl.constexpr,
    BITS: tl.constexpr,
    PDL: tl.constexpr,
):
    """pair_out[pair, N tile] = topk_weight[pair] * h[row] @ w2[e]^T for the rows of an M block.

    N = D, K = I. Each pair is stored to its own row, exactly once.
    """
    enter(PDL)
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_blocks, N, BLOCK_N, GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ids = tl.load(sorted_pair_ids_ptr + offs_m)
    is_pair = pair_ids < num_pairs
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    h_rows = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm
    if W_FP4 and BITS:  # as the gate/up kernel's: transposed, w2's words upcast in registers
        offs_w = tl.arange(0, BLOCK_K // 8)
        offs_g = tl.arange(0, BLOCK_K // 32)
        ht_ptrs = h_ptr + offs_m[None, :].to(tl.int64) * stride_hm + offs_k[:, None] * stride_hk
        w_ptrs = (
            w2_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_w[None, :] * stride_wk
        )
        s_ptrs = (
            s2_ptr + expert * stride_se + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sk
        )
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            words = tl.load(w_ptrs).to(tl.uint32, bitcast=True)
            acc_t = tl.dot(_mxfp4_bits(words, tl.load(s_ptrs)), tl.load(ht_ptrs), acc_t)
            ht_ptrs += BLOCK_K * stride_hk
            w_ptrs += BLOCK_K // 8 * stride_wk
            s_ptrs += BLOCK_K // 32 * stride_sk
        acc = tl.trans(acc_t)
    elif W_FP4 and SCALED_DOT:
        offs_jk = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 32)
        a_ptrs = h_rows + offs_k[None, :] * stride_hk
        b_ptrs = (
            w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_jk[:, None] * stride_wk
        )
        s_ptrs = (
            s2_ptr + expert * stride_se + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sk
        )
        for k_start in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k_start, other=0.0)
            b = tl.load(b_ptrs, mask=offs_jk[:, None] < (K - k_start) // 2, other=0)
            e = tl.load(s_ptrs, mask=offs_g[None, :] < (K - k_start) // 32, other=127)
            acc = tl.dot_scaled(a, None, A_FORMAT, b, e, "e2m1", acc=acc, fast_math=FAST_MATH)
            a_ptrs += BLOCK_K * stride_hk
            b_ptrs += BLOCK_K // 2 * stride_wk
            s_ptrs += BLOCK_K // 32 * stride_sk
    elif W_FP4:
        offs_j = tl.arange(0, 16)
        w_rows = w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn  # [1, BN]
        s_rows = s2_ptr + expert * stride_se + offs_n[None, :] * stride_sn
        a_rows = h_rows + 2 * offs_j[None, :] * stride_hk
        dtype = h_ptr.dtype.element_ty
        for k_start in range(0, K, BLOCK_K):
            for g in tl.static_range(BLOCK_K // 32):
                k0 = k_start + g * 32
                acc = _mxfp4_group_dot(
                    acc, a_rows + k0 * stride_hk, True, stride_hk,
                    w_rows + (k0 // 2 + offs_j)[:, None] * stride_wk,
                    s_rows + (k0 // 32) * stride_sk, k0 < K, dtype, DOT_PRECISION,
                )  # fmt: skip
    else:
        a_ptrs = h_rows + offs_k[None, :] * stride_hk
        w_ptrs = (
            w2_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        )
        for k_start in range(0, K, BLOCK_K):
            if K % BLOCK_K == 0:
                a = tl.load(a_ptrs)
                b = tl.load(w_ptrs)
            else:
                in_k = offs_k < K - k_start
                a = tl.load(a_ptrs, mask=in_k[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=in_k[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_hk
            w_ptrs += BLOCK_K * stride_wk

    routing_weight = tl.load(topk_weights_ptr + pair_ids, mask=is_pair, other=0.0)
    acc = acc * routing_weight.to(tl.float32)[:, None]

    offs_on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = (
        pair_out_ptr + pair_ids[:, None].to(tl.int64) * stride_om + offs_on[None, :] * stride_on
    )
    tl.store(
        out_ptrs,
        acc.to(pair_out_ptr.dtype.element_ty),
        mask=is_pair[:, None] & (offs_on[None, :] < N),
    )


@triton.jit
def _combine_kernel(
    pair_out_ptr,
    out_ptr,
    residual_ptr,
    stride_pt,
    stride_pj,
    stride_pd,
    stride_ot,
    stride_od,
    stride_rt,
    D: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t, D tile] = sum over slots j = 0..k-1, in that order, of pair_out[t, j] in fp32
    (RESIDUAL: plus residual[t], ``store_output``)."""
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = offs_d < D
    row_ptrs = pair_out_ptr + token * stride_pt + offs_d * stride_pd
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(TOP_K):
        acc += tl.load(row_ptrs + j * stride_pj, mask=in_d, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + token * stride_ot + offs_d * stride_od
    store_output(out_ptrs, residual_ptr + token * stride_rt + offs_d, acc, in_d, RESIDUAL)


def fused_moe(
    x: torch.Tensor,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float,
    *,
    config: TileConfig | GemvConfig | None = None,
    residual: torch.Tensor | Pending | None = None,
) -> torch.Tensor:
    """Sum over each token's selected experts of weight * expert(x), as torch_ref.fused_moe.

    x: [T, D]; w1, w3: [E, I, D]; w2: [E, D, I], all dense in x's dtype (bf16, fp16 or fp32)
    or all ``Mxfp4Weight`` (D and I multiples of 32); topk_ids: [T, k] int64; topk_weights:
    [T, k] fp32. Returns [T, D] in x's dtype. GEMMs accumulate in fp32; h and the weighted
    per-pair outputs are rounded to x's dtype before the fp32 combine. fp32 inputs use the IEEE
    dot, so they match the CPU reference to ~1e-6. config: tiles other than
    pick_tile_config's (for tuning); a GemvConfig takes triton_gemv.py's kernels (D and I
    multiples of 32). residual: [T, D] in x's dtype, added to the output in the last launch
    (the shared expert's; as ``routed + residual`` computes), or None; a ``Pending`` one (made
    on the side stream) is joined right before that launch.
    """
    num_tokens, dim = x.shape
    num_experts, inter, _ = w1.shape
    top_k = topk_ids.shape[1]
    assert w1.shape == w3.shape == (num_experts, inter, dim), f"w1 {w1.shape}, w3 {w3.shape}"
    assert w2.shape == (num_experts, dim, inter), f"w2 {w2.shape}, expected {w1.shape[::2]}"
    assert topk_weights.shape == topk_ids.shape == (num_tokens, top_k), (
        f"topk_ids {topk_ids.shape}, topk_weights {topk_weights.shape}, T = {num_tokens}"
    )
    bits_exact = all(_bits_exact(w) for w in (w1, w2, w3))
    (w1, s1), (w2, s2), (w3, s3) = (_operand(w, x.dtype) for w in (w1, w2, w3))
    packed = s1 is not None
    assert packed == (s2 is not None) == (s3 is not None), "w1, w2, w3: all MXFP4 or none"
    assert w1.stride() == w3.stride(), f"w1 strides {w1.stride()} != w3 strides {w3.stride()}"
    assert not packed or s1.stride() == s3.stride(), f"scale strides {s1.stride()}, {s3.stride()}"
    out = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        residual_rows(residual, out)  # joined all the same
        return out

    num_pairs = num_tokens * top_k
    config = config or pick_tile_config(num_pairs, x.dtype, packed)
    if isinstance(config, GemvConfig):
        weights = ((w1, s1), (w2, s2), (w3, s3))
        return decode_moe(x, weights, topk_ids, topk_weights, limit, config, residual)
    assert not packed or config.block_k % MXFP4_BLOCK == 0, f"BLOCK_K {config.block_k}"
    # The bits upcast: compiled (inline PTX) bf16 runs on whole K tiles (else, as for D or I
    # under BLOCK_K in small models, the scaled dot), the packed bytes read as int32 words.
    whole_tiles = dim % config.block_k == inter % config.block_k == 0
    compiled_bf16 = x.dtype == torch.bfloat16 and x.is_cuda
    bits = config.bits_upcast and bits_exact and whole_tiles and compiled_bf16
    if bits:  # the words, and x in the order their upcast yields the weights
        w1, w2, w3 = (w.view(torch.int32) for w in (w1, w2, w3))
    sorted_pair_ids, block_expert = align_by_expert(topk_ids, num_experts, config.block_m)
    flat_weights = topk_weights.reshape(-1)  # [T * k]
    gluon = config.gluon and _tile(config) in moe_gluon.TILES and moe_gluon.runs_on(x.device)
    if bits and gluon and dim % config.block_n == inter % config.block_n == 0:
        h = moe_gluon.gate_up(
            reorder_mma_order(x), w1, w3, s1, s3, sorted_pair_ids, block_expert, num_pairs,
            top_k, limit, config.block_m, config.block_n, config.ring,
        )  # fmt: skip
        pair_out = moe_gluon.down(
            h, w2, s2, flat_weights, sorted_pair_ids, block_expert, num_pairs, config.block_m,
            config.block_n, config.ring,
        )  # fmt: skip
        return _combine(pair_out, out, residual, top_k)
    if bits:
        x = reorder_pair_order(x)
    num_blocks = block_expert.numel()
    launch = {
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "GROUP_M": config.group_m,
        # tl.dot's input_precision only matters for fp32 operands; bf16/fp16 ignore it.
        "DOT_PRECISION": dot_precision(x.dtype, for_16bit="tf32"),
        "W_FP4": packed,
        # Compiled bf16 / fp16 runs take tl.dot_scaled; fp32 (parity) and the interpreter,
        # which has no scaled dot, dequantize one scale group at a time.
        "SCALED_DOT": packed and x.dtype != torch.float32 and x.is_cuda,
        "A_FORMAT": "fp16" if x.dtype == torch.float16 else "bf16",
        "FAST_MATH": bool(config.fast_math),
        "BITS": bits,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }

    h = torch.empty((num_blocks * config.block_m, inter), dtype=x.dtype, device=x.device)
    grid = (num_blocks * triton.cdiv(inter, config.block_n),)
    _gate_up_kernel[grid](
        x,
        w1,
        w3,
        w1 if s1 is None else s1,
        w3 if s3 is None else s3,
        h,
        sorted_pair_ids,
        block_expert,
        num_pairs,
        num_blocks,
        float(limit),
        *x.stride(),
        *w1.stride(),
        *(w1 if s1 is None else s1).stride(),
        *h.stride(),
        N=inter,
        K=dim,
        TOP_K=top_k,
        **launch,
        **pdl(x.device),
    )

    pair_out = torch.empty((num_pairs, dim), dtype=x.dtype, device=x.device)  # [T * k, D]
    grid = (num_blocks * triton.cdiv(dim, config.block_n),)
    _down_kernel[grid](
        h,
        w2,
        w2 if s2 is None else s2,
        pair_out,
        flat_weights,
        sorted_pair_ids,
        block_expert,
        num_pairs,
        num_blocks,
        *h.stride(),
        *w2.stride(),
        *(w2 if s2 is None else s2).stride(),
        *pair_out.stride(),
        N=dim,
        K=inter,
        **launch,
        **pdl(h.device),
    )

    return _combine(pair_out, out, residual, top_k)


def _combine(
    pair_out: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | Pending | None, top_k: int
) -> torch.Tensor:
    """out [T, D] = the sum of each token's k rows of pair_out [T * k, D] in slot order (fp32),
    plus residual."""
    num_tokens, dim = out.shape
    residual = residual_rows(residual, out)
    pair_out = pair_out.view(num_tokens, top_k, dim)  # [T, k, D]
    block_d = min(triton.next_power_of_2(dim), 1024)
    _combine_kernel[(num_tokens, triton.cdiv(dim, block_d))](
        pair_out,
        out,
        out if residual is None else residual,
        *pair_out.stride(),
        *out.stride(),
        0 if residual is None else residual.stride(0),
        D=dim,
        TOP_K=top_k,
        BLOCK_D=block_d,
        RESIDUAL=residual is not None,
        **pdl(out.device),
    )
    return out


def _bits_exact(w: ExpertWeight) -> bool:
    """Whether the bits upcast gives w's exact values: MXFP4 whose largest scale byte was
    measured at or under BITS_MAX_SCALE (``MXFP4_BITS_ASM``)."""
    return isinstance(w, Mxfp4Weight) and w.max_scale is not None and w.max_scale <= BITS_MAX_SCALE


def _operand(w: ExpertWeight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the weight's tensor, its scale bytes or None): a dense weight must be in ``dtype``."""
    if isinstance(w, Fp8ExpertWeight):
        raise TypeError("FP8 routed experts run on kernel.moe = 'deepgemm' or 'torch_ref'")
    if isinstance(w, Mxfp4Weight):
        _, _, cols = w.shape
        assert cols % MXFP4_BLOCK == 0, f"MXFP4 rows of {cols} inputs: not whole scale groups"
        return w.packed, w.scale
    assert w.dtype == dtype, f"weight dtype {w.dtype}, activations {dtype}"
    return w, None


@triton.jit
def _swiglu_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    num_cols,
    stride_g,
    stride_u,
    stride_o,
    limit,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[row, block] = silu(min(gate, limit)) * clamp(up, -limit, limit), in fp32."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    h = swiglu_tile(gate, up, limit)
    tl.store(out_ptr + row * stride_o + cols, h.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """torch_ref.swiglu (the shared expert's clamped SwiGLU) in one launch instead of four.

    gate, up: [T, I] with unit column stride (the two column blocks of one GEMM's output do);
    returns [T, I] in their dtype. The math is the grouped kernels' (fp32, one rounding at the
    end; torch_ref rounds SiLU's output to the dtype first)."""
    assert gate.shape == up.shape and gate.dim() == 2, f"swiglu: {gate.shape} vs {up.shape}"
    assert gate.stride(1) == 1 and up.stride(1) == 1, "swiglu: columns must be contiguous"
    rows, cols = gate.shape
    out = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
    if rows == 0:
        return out
    block = min(SWIGLU_BLOCK, triton.next_power_of_2(cols))
    _swiglu_kernel[(rows, triton.cdiv(cols, block))](
        gate,
        up,
        out,
        cols,
        gate.stride(0),
        up.stride(0),
        out.stride(0),
        float(limit),
        BLOCK=block,
        **pdl(out.device),
    )
    return out


class TritonMoEBackend(Backend):
    """This module's grouped GEMMs on one CUDA device (or the interpreter's CPU). ``config``:
    tiles for every call instead of pick_tile_config's (for tuning; None in the engine)."""

    swiglu = staticmethod(swiglu)
    route = staticmethod(route)

    def __init__(
        self,
        device: torch.device,
        parallel: ParallelContext | None = None,
        *,
        config: TileConfig | GemvConfig | None = None,
    ) -> None:
        super().__init__(device, parallel)
        self.config = config

    def fused_moe(
        self,
        x: torch.Tensor,
        w1: ExpertWeight,
        w2: ExpertWeight,
        w3: ExpertWeight,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        limit: float,
        residual: torch.Tensor | Pending | None = None,
    ) -> torch.Tensor:
        return fused_moe(
            x, w1, w2, w3, topk_ids, topk_weights, limit, config=self.config, residual=residual
        )
