"""FP8 block-scaled linear layers (W8A8, DeepSeek-V3/V4 style) as Triton kernels; and at decode
the dense (bf16) ones through the same GEMM (``dense_linear``: no scales, no quantization).

The weight stays e4m3 with one fp32 scale per (bn, bk) = (128, 128) block; the activations are
quantized to e4m3 per token per K block (scale = amax / 448), the GEMM runs on FP8 tensor cores
and each K block's fp32 partial product is scaled by x_scale[m] * w_scale[n] before it joins the
fp32 accumulator (the scales differ per K block, so they cannot be applied once at the end).
BLOCK_K = bk: one K step of a program is one quantization group. Data flow, all on x's device,
shapes only (no host synchronisation, so it captures in a CUDA graph):

    prefill (quantize_in_gemm off):
      x [M, K] --_quantize_kernel--> q [M, K] e4m3, x_scale [M, Kb] fp32 (strides (1, M))
      q, x_scale, w [N, K] e4m3, w_scale [Nb, Kb] --_gemm_kernel--> y [M, N] in x's dtype

    decode (quantize_in_gemm on): one launch; each program quantizes its own [BLOCK_M, bk] tiles
    of x on the fly (a few rows: recomputing them per N tile costs nothing next to the weight)
      x, w [N, K] e4m3, w_scale [Nb, Kb] --_gemm_kernel--> y [M, N] in x's dtype

    split K (split_k > 1, either path): still one launch; each program writes its fp32
    partial sums, takes a ticket from its tile's counter, and the tile's last program adds them
      ... --_gemm_kernel--> partial [split_k, M, N] fp32 --(the tile's last split)--> y

At small M the N tiles alone are too few programs to stream the weight at full bandwidth (wkv:
N = 512 is 8 tiles of 64), so the K blocks are divided among split_k programs per tile, whose
partial sums the tile's last program adds in split order (deterministic: the atomic counter
decides only which program adds, never the order; no second launch for the sum). Grouped
linears (wo_a) add a grid axis: group g's weight rows and x's g-th slice
(``fp8_grouped_linear``). Quantizing in the GEMM or in a separate pass runs the same helper
(``_quantize_tile``): y is bitwise the same either way for one tile shape and split.

The quantizer rounds to e4m3 explicitly (``_round_to_e4m3``) and divides with IEEE division, so
q and x_scale are bitwise torch_ref.quantize_activations on the GPU and under Triton's
interpreter alike (the interpreter's own float8 cast drops the carry of a round-up into the next
binade: 125.0 -> 64).

K (the loop bound) and the block shape are compile-time constants (fixed per weight; Triton's
interpreter cannot loop to a runtime bound under numpy >= 2.4); M is a runtime argument that
Triton does not specialise on, so every M within one row of the tile table shares a binary.

``TritonLinearBackend`` at the end is the backend object: it keeps the device's SM count and
any tile override, and calls ``fp8_linear`` with them, or cuBLAS's blockwise FP8 GEMM where
that is faster (``use_cublas``; ``cublas_fp8_linear``: torch._scaled_mm on this module's
quantized x).

One file of ~600 lines: a backend is one module per op family (``ops/registry.py``); the
quantizer and the GEMM share their tile and split choices.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deepinfer.ops.linear.torch_ref import AMAX_EPS, FP8_BLOCK, FP8_MAX
from deepinfer.ops.registry import Backend, ParallelContext
from deepinfer.ops.triton_pdl import enter, pdl
from deepinfer.ops.triton_swiglu import swiglu
from deepinfer.ops.triton_tickets import MAX_TICKET_TILES, arrive, depart, ticket_counters
from deepinfer.ops.triton_utils import dot_precision, num_sms

logger = logging.getLogger(__name__)

__all__ = [
    "TileConfig",
    "TritonLinearBackend",
    "cublas_fp8_linear",
    "dense_linear",
    "fp8_grouped_linear",
    "fp8_linear",
    "fp8_linear_per_group",
    "pick_tile_config",
    "quantize_activations",
    "scaled_mm_blockwise",
    "split_groups",
    "use_cublas",
    "whole_blocks",
]

_AMAX_EPS = tl.constexpr(AMAX_EPS)
_FP8_MAX = tl.constexpr(FP8_MAX)


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch settings of the GEMM (BLOCK_K is the weight's bk).

    block_m, block_n: the output tile; group_m: M tiles that sweep the N tiles together (L2 reuse
    of weight tiles at large M); quantize_in_gemm: quantize x inside the GEMM (decode) instead of
    a separate pass; max_split_k: at most this many programs share one tile's K blocks;
    programs_per_sm: split K aims at this many programs an SM (max_split_k caps it). At one row a
    program streams its weight tile, and an SM's loads in flight are its programs' pipelines.
    swap_ab: the MMA computes out^T = W x^T, the weight's block_n rows its M side and x's block_m
    rows its N side. Hopper's FP8 MMA (wgmma) takes 64 rows a warp group on its M side and as few
    as 8 on its N side, so a few tokens against a 64- or 128-row weight tile run on it whole.
    """

    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int
    quantize_in_gemm: bool
    max_split_k: int
    programs_per_sm: int = 1
    swap_ab: bool = False


# Keyed by M (first row whose bound is >= M), H200 (SM90, 132 SMs, 4.8 TB/s). Decode is bound by
# streaming the weight: narrow N tiles and split K give every SM a share of it, and a deep
# pipeline keeps its loads in flight. One row: x's row quantized once in the GEMM, four programs
# an SM (H100, fp8_linear.py --programs-per-sm: 1 -> 4 took wo_b from 30.3 to 14.3 µs,
# shared_w2 9.2 -> 7.2, wq_a 6.4 -> 6.2; 8 no better). From 2 to 64 rows the weight's 64-row
# tiles on the MMA's M side (swap_ab), x quantized by its own launch, two programs an SM (H100,
# fp8_linear.py --tiles, µs against the 16 x 128 tiles quantizing in the GEMM at 32 rows: the
# fused x projections 11.9 against 20.5, the fused wq_b 20.8 against 32.1, wo_b 17.4 against
# 30.7, shared_w2 9.2 against 13.2); up to 8 rows 16 of x's rows a tile (H200, 2-8 rows: wo_b
# 11.7-13.2 µs against 14.2-17.0 on the 32-row tiles, the fused x projections 8.3-8.6 against
# 9.5-10.3). From 65 to 128 rows the engine takes cuBLAS (use_cublas) but for the grouped wo_a,
# where 128 x 64 swapped tiles beat the 64 x 128 ones (H200, 96 and 128 rows: 28.4 and 31.8 µs
# against 32.1 and 35.6). Prefill is bound by the FP8 tensor cores: 128 x 128 tiles, 8 warps.
# Shared memory per stage: (block_m + block_n) * 128 bytes of e4m3 (+ x's bf16 tile when
# quantizing in the GEMM).
_TILE_TABLE: tuple[tuple[int, TileConfig], ...] = (
    # max M  block_m, block_n, group_m, warps, stages, quantize_in_gemm, max_split_k, per SM
    (1, TileConfig(16, 64, 1, 4, 4, True, 16, 4)),
    (8, TileConfig(16, 64, 1, 4, 4, False, 16, 2, swap_ab=True)),
    (32, TileConfig(32, 64, 1, 4, 4, False, 16, 2, swap_ab=True)),
    (64, TileConfig(64, 64, 1, 4, 4, False, 16, 2, swap_ab=True)),
    (128, TileConfig(128, 64, 1, 4, 4, False, 16, 2, swap_ab=True)),
    (512, TileConfig(64, 128, 8, 4, 4, False, 4)),
    (1 << 62, TileConfig(128, 128, 8, 8, 3, False, 1)),
)


def pick_tile_config(num_rows: int) -> TileConfig:
    """The tile configuration for an x of ``num_rows`` rows (tokens)."""
    return next(config for bound, config in _TILE_TABLE if num_rows <= bound)


# The interpreter (CPU) gets a small stand-in for the SMs to fill.
_num_sms = functools.partial(num_sms, cpu_stand_in=4)


def _split_k(num_tiles: int, num_k_blocks: int, max_split_k: int, num_programs: int) -> int:
    """Programs per output tile: about ``num_programs`` in all, and a divisor of the K block
    count, so that every split runs the same whole number of K blocks (V4's K / 128 are powers
    of two)."""
    wanted = max(1, min(max_split_k, num_programs // num_tiles))
    return max(d for d in range(1, wanted + 1) if num_k_blocks % d == 0)


@triton.jit
def _round_to_e4m3(v):
    """fp32 v with |v| <= 448 rounded to the nearest e4m3 value (ties to even), still fp32.

    Normal range (|v| >= 2^-6): keep 3 of fp32's 23 mantissa bits, the carry running into the
    exponent. Subnormal range: multiples of 2^-9, rounded by adding and removing 2^14 (whose fp32
    ulp is 2^-9). The cast of the result to e4m3 is then exact on every backend. Signs are
    carried as bits: Triton's negation is 0 - x, which would turn -0.0 into +0.0.
    """
    bits = v.to(tl.uint32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    magnitude = tl.abs(v)
    subnormal = ((magnitude + 16384.0) - 16384.0).to(tl.uint32, bitcast=True)
    subnormal = subnormal | (bits & 0x80000000)  # the sign as a bit: -0.0 stays -0.0
    return tl.where(magnitude < 0.015625, subnormal, normal).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_tile(x):
    """x [R, G] fp32, one quantization group per row -> (q [R, G] e4m3, scale [R] fp32).

    IEEE division (div_rn; ``/`` is div.full.f32, off by up to 2 ulp), as torch divides. div_rn
    does not broadcast: both operands are given the result's shape.
    """
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, _AMAX_EPS), tl.full(amax.shape, _FP8_MAX, tl.float32))
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    q = tl.clamp(q, -_FP8_MAX, _FP8_MAX)
    return _round_to_e4m3(q).to(tl.float8e4nv), scale


@triton.jit
def _swiglu_input(x, up_ptrs, mask, limit, x_ptr, SWIGLU: tl.constexpr):
    """A tile of the GEMM's input in fp32: x's, or with SWIGLU swiglu(x, up) rounded to x's
    dtype (what the SwiGLU launch would have stored) from up's tile at ``up_ptrs``."""
    x = x.to(tl.float32)
    if SWIGLU:
        up = tl.load(up_ptrs, mask=mask, other=0.0).to(tl.float32)
        x = swiglu(x, up, limit).to(x_ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit(do_not_specialize=["M", "limit"])
def _quantize_kernel(
    x_ptr,
    up_ptr,
    q_ptr,
    s_ptr,
    M,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_qk,
    stride_sm,
    stride_sk,
    limit,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    SWIGLU: tl.constexpr,
    PDL: tl.constexpr,
):
    """q[m, groups], s[m, groups] for GROUPS_PER_PROGRAM consecutive groups of row m; SWIGLU:
    of swiglu(x, up) (up: x's strides)."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, GROUP]
    in_k = cols < K
    offs = row * stride_xm + cols * stride_xk
    x = tl.load(x_ptr + offs, mask=in_k, other=0.0)
    q, scale = _quantize_tile(_swiglu_input(x, up_ptr + offs, in_k, limit, x_ptr, SWIGLU))
    tl.store(q_ptr + row * stride_qm + cols * stride_qk, q, mask=in_k)
    tl.store(s_ptr + row * stride_sm + groups * stride_sk, scale, mask=groups * GROUP < K)


@triton.jit(do_not_specialize=["M", "limit"])
def _gemm_kernel(
    a_ptr,
    up_ptr,
    a_s_ptr,
    b_ptr,
    b_s_ptr,
    c_ptr,
    out_ptr,
    counters_ptr,
    M,
    N,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_bn,
    stride_bk,
    stride_bsn,
    stride_bsk,
    stride_cs,
    stride_cm,
    stride_cn,
    stride_ag,
    stride_asg,
    stride_cg,
    limit,
    K: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    QUANTIZE_A: tl.constexpr,
    ONE_ROW: tl.constexpr,
    ONE_SCALE: tl.constexpr,
    SWIGLU: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DENSE: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[M tile, N tile] = sum over the K blocks of
    (a_q @ b^T)[block] * (a_s[:, block] * b_s[n // SCALE_BLOCK_N, block]); split K (SPLIT_K
    > 1): each split's sum goes to c[split] first, and the tile's last split adds them.

    The two scales are multiplied first, so a K block costs one FMA an output (a tile inside
    one scale block, BLOCK_N dividing SCALE_BLOCK_N, loads its weight scale as one number).

    a: x itself (QUANTIZE_A: quantized here, a_s unused) or its e4m3 q with scales a_s [M, Kb];
    b: the weight [N, K] e4m3, read as its transpose [BLOCK_K, BLOCK_N]; b_s: [Nb, Kb] fp32.
    Program (tile, split, group): tiles in grouped order (GROUP_M M tiles sweep the N tiles
    together). Weight groups (``fp8_grouped_linear``): group g reads a's g-th K slice
    (stride_ag, stride_asg), the weight's rows g*N.. (and their scale rows, counted from the
    whole weight's row g*N + n) and writes c's g-th block (stride_cg); one group: all zero.
    ONE_SCALE: every stored column of a tile is in one weight scale block (one scale a K block).
    ONE_ROW (QUANTIZE_A, M = 1): x's one row is loaded and quantized once and repeated down the
    tile; a 16-row tile quantized 16 copies of it, and their divisions, not the weight's bytes,
    were the cost of a batch-1 decode linear. (Quantizing 2-8 rows and repeating them compiles
    to more instructions than the 16 copies, so M > 1 keeps the whole tile.)
    SWIGLU (QUANTIZE_A): the input is swiglu(a, up) (up: a's strides), computed as quantized.
    DENSE (``dense_linear``): a is x and b a weight in x's dtype, no scales: sum over the K
    blocks of (a @ b^T)[block], the same tiles, split and ticket (ONE_ROW: x's row loaded once).
    SWAP_AB (not DENSE): the sums are of (b @ a^T), a [BLOCK_N, BLOCK_M] accumulator with b read
    as it lies ([BLOCK_N, BLOCK_K], K contiguous), transposed once for the store
    (TileConfig.swap_ab).
    """
    enter(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    w_group = tl.program_id(2).to(tl.int64)  # the weight's group (one: 0)
    a_ptr += w_group * stride_ag
    up_ptr += w_group * stride_ag
    a_s_ptr += w_group * stride_asg
    b_ptr += w_group * N * stride_bn
    c_ptr += w_group * stride_cg
    out_ptr += w_group * stride_cg
    num_tiles_m = tl.cdiv(M, BLOCK_M)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    num_pids_in_group = GROUP_M * num_tiles_n
    first_m = (pid // num_pids_in_group) * GROUP_M
    group_size = tl.minimum(num_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_pids_in_group) % group_size
    pid_n = (pid % num_pids_in_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrapped rows and columns keep the loads in bounds; their results are not stored.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    first_block = split * BLOCKS_PER_SPLIT
    k_start = first_block * BLOCK_K

    a_rows = tl.zeros((1,), dtype=tl.int64) if ONE_ROW else rows
    a_offs = a_rows[:, None] * stride_am + (k_start + offs_k)[None, :] * stride_ak
    a_ptrs = a_ptr + a_offs
    up_ptrs = up_ptr + a_offs  # read with SWIGLU only
    # b's tile: [BLOCK_K, BLOCK_N], or with SWAP_AB [BLOCK_N, BLOCK_K] (the weight's own order).
    if SWAP_AB:
        b_cols, b_ks = cols[:, None], offs_k[None, :]
    else:
        b_cols, b_ks = cols[None, :], offs_k[:, None]
    b_ptrs = b_ptr + b_cols * stride_bn + (k_start + b_ks) * stride_bk
    a_s_ptrs = a_s_ptr + rows * stride_asm + first_block * stride_ask
    if ONE_SCALE:
        b_s_ptrs = b_s_ptr + ((w_group * N + pid_n * BLOCK_N) // SCALE_BLOCK_N) * stride_bsn
    else:  # along b's N axis: [1, BLOCK_N], or with SWAP_AB [BLOCK_N, 1]
        b_s_ptrs = b_s_ptr + ((w_group * N + b_cols) // SCALE_BLOCK_N) * stride_bsn
    b_s_ptrs += first_block * stride_bsk

    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(BLOCKS_PER_SPLIT):
        in_k = offs_k < K - k_start - i * BLOCK_K
        if K % BLOCK_K == 0:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=in_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=b_ks < K - k_start - i * BLOCK_K, other=0.0)
        if DENSE:
            if ONE_ROW:
                a = tl.broadcast_to(a, (BLOCK_M, BLOCK_K))
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        else:
            if QUANTIZE_A:
                a = _swiglu_input(a, up_ptrs, in_k[None, :], limit, a_ptr, SWIGLU)
                a, a_s = _quantize_tile(a)
                if ONE_ROW:  # [1, BLOCK_K] -> [BLOCK_M, BLOCK_K]
                    a = tl.broadcast_to(a, (BLOCK_M, BLOCK_K))
                    a_s = tl.broadcast_to(a_s, (BLOCK_M,))
            else:
                a_s = tl.load(a_s_ptrs)
            b_s = tl.load(b_s_ptrs)  # a scalar, or along b's N axis
            if SWAP_AB:
                acc += tl.dot(b, tl.trans(a)) * (b_s * a_s[None, :])
            else:
                acc += tl.dot(a, b) * (a_s[:, None] * b_s)
        a_ptrs += BLOCK_K * stride_ak
        up_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        a_s_ptrs += stride_ask
        b_s_ptrs += stride_bsk

    if SWAP_AB:
        acc = tl.trans(acc)
    offs_c = offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    in_c = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out_ptr + offs_c, acc.to(out_ptr.dtype.element_ty), mask=in_c)
    else:
        # Split K: this split's fp32 partial sums, then a ticket (ops/triton_tickets.py); the
        # tile's last split adds the partials in split order.
        tl.store(c_ptr + split.to(tl.int64) * stride_cs + offs_c, acc, mask=in_c)
        counter = counters_ptr + w_group * tl.num_programs(0) + pid
        if arrive(counter, SPLIT_K):
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):
                part_ptrs = c_ptr + s * stride_cs + offs_c
                total += tl.load(part_ptrs, mask=in_c, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs_c, total.to(out_ptr.dtype.element_ty), mask=in_c)
            depart(counter)


def quantize_activations(
    x: torch.Tensor,
    group: int = FP8_BLOCK[1],
    rows: int | None = None,
    *,
    swiglu: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As torch_ref.quantize_activations, bitwise: x [M, K] -> (q [M, K] float8_e4m3fn,
    x_scale [M, ceil(K/group)] fp32 with strides (1, M)). ``rows`` >= M: q and x_scale have
    that many rows, the ones past M left unwritten (for a GEMM that wants M padded).
    ``swiglu`` (up, limit): of ``moe.triton.swiglu(x, up, limit)``, bitwise, in this launch."""
    m, k = x.shape
    up, limit = _swiglu_operand(x, swiglu)
    rows = m if rows is None else rows
    assert rows >= m, f"{rows} rows for an x of {m}"
    num_groups = triton.cdiv(k, group)
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((num_groups, rows), dtype=torch.float32, device=x.device).t()
    if m == 0:
        return q, scale
    groups_per_program = min(8, triton.next_power_of_2(num_groups))
    grid = (m, triton.cdiv(num_groups, groups_per_program))
    _quantize_kernel[grid](
        x,
        up,
        q,
        scale,
        m,
        *x.stride(),
        *q.stride(),
        *scale.stride(),
        limit,
        K=k,
        GROUP=group,
        GROUPS_PER_PROGRAM=groups_per_program,
        SWIGLU=swiglu is not None,
        **pdl(x.device),
    )
    return q, scale


def _swiglu_operand(
    x: torch.Tensor, swiglu: tuple[torch.Tensor, float] | None
) -> tuple[torch.Tensor, float]:
    """(up, limit) of a SwiGLU input, checked against the gate ``x`` (same shape, strides and
    dtype); (x, 0.0) without one (a pointer the kernels do not read)."""
    if swiglu is None:
        return x, 0.0
    up, limit = swiglu
    assert up.shape == x.shape and up.stride() == x.stride() and up.dtype == x.dtype, (
        f"swiglu: up {tuple(up.shape)} {up.stride()} {up.dtype}, gate {tuple(x.shape)} "
        f"{x.stride()} {x.dtype}"
    )
    return up, float(limit)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    *,
    swiglu: tuple[torch.Tensor, float] | None = None,
    config: TileConfig | None = None,
    num_sms: int | None = None,
) -> torch.Tensor:
    """y = x @ W^T with W = the block-scaled FP8 weight, x quantized to e4m3 per token per K block.

    x: [M, K] bf16 / fp16 / fp32 (any strides); weight: [N, K] float8_e4m3fn; weight_scale:
    [ceil(N/bn), ceil(K/bk)] fp32; block = (bn, bk), bk a power of two >= 16. Returns [M, N] in
    x's dtype. ``swiglu`` (up, limit): the input is ``moe.triton.swiglu(x, up, limit)``, computed
    where x is quantized (bitwise that launch, then this GEMM). ``config``: a TileConfig instead
    of the table's (tests reach every path with it). ``num_sms``: the SMs split K fills
    (default: x's device's; the backend object passes its own).
    """
    m, k = x.shape
    _check_weight(weight, weight_scale, k, block)
    up, limit = _swiglu_operand(x, swiglu)
    out = torch.empty((m, weight.shape[0]), dtype=x.dtype, device=x.device)
    if m:
        _gemm(
            x.unsqueeze(1),
            weight,
            weight_scale,
            block,
            out.unsqueeze(1),
            config,
            num_sms,
            (up.unsqueeze(1), limit) if swiglu is not None else None,
        )
    return out


# dense_linear's tiles: one row of _TILE_TABLE's kind for its few rows. A bf16 weight tile is
# twice an e4m3 one, so K steps of 64 keep four stages of four programs an SM in shared memory
# ((16 + 64) * 64 * 2 bytes a stage).
DENSE_TILES = TileConfig(16, 64, 1, 4, 4, True, 16, 4)
DENSE_BLOCK_K = 64
# The backend's rows for it: one. H100, graph replays (benchmarks/fp8_linear.py): a CSA
# layer's x projections (4,160 x 4,096) 10.2 µs against cuBLAS's 11.7 at one row, 18.0
# against 10.2 at four; wq_a and wkv alone 1.06x and 1.16x at one row.
DENSE_MAX_ROWS = 1


def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    config: TileConfig | None = None,
    num_sms: int | None = None,
) -> torch.Tensor:
    """F.linear(x, weight) for a few rows (decode): x [M, K] (any strides), weight [N, K] in
    x's dtype -> [M, N]; fp32 sums in K steps of DENSE_BLOCK_K, split K over about
    ``programs_per_sm`` programs an SM, the splits added in order by the tile's last (one
    launch; a row's sums do not depend on M). ``config``, ``num_sms``: as fp8_linear's."""
    m, k = x.shape
    assert weight.dim() == 2 and weight.shape[1] == k and weight.dtype == x.dtype, (
        f"dense_linear: weight {tuple(weight.shape)} {weight.dtype}, x {tuple(x.shape)} {x.dtype}"
    )
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    out = torch.empty((m, weight.shape[0]), dtype=x.dtype, device=x.device)
    if m:
        block = (DENSE_TILES.block_n, DENSE_BLOCK_K)
        _gemm(x.unsqueeze(1), weight, None, block, out.unsqueeze(1), config, num_sms)
    return out


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    *,
    config: TileConfig | None = None,
    num_sms: int | None = None,
) -> torch.Tensor:
    """torch_ref.fp8_grouped_linear in one launch: x [M, G, K] (any strides), weight [G*N, K]
    e4m3 whose rows g*N.. are group g's (its scale rows counted over the whole weight, so a
    group need not start on a block row) -> [M, G, N] in x's dtype; as ``fp8_linear`` per
    group, bitwise, for one tile shape and split."""
    m, groups, k = x.shape
    assert weight.shape[0] % groups == 0, f"weight {tuple(weight.shape)} in {groups} groups"
    _check_weight(weight, weight_scale, k, block)
    out = torch.empty((m, groups, weight.shape[0] // groups), dtype=x.dtype, device=x.device)
    if m:
        _gemm(x, weight, weight_scale, block, out, config, num_sms)
    return out


def _check_weight(
    weight: torch.Tensor, weight_scale: torch.Tensor, k: int, block: tuple[int, int]
) -> None:
    n = weight.shape[0]
    bn, bk = block
    assert weight.shape == (n, k), f"weight {tuple(weight.shape)}, x's K {k}"
    assert weight.dtype == torch.float8_e4m3fn, f"weight dtype {weight.dtype}"
    assert weight_scale.shape == (triton.cdiv(n, bn), triton.cdiv(k, bk)), (
        f"weight_scale {tuple(weight_scale.shape)} for weight {(n, k)} in {bn}x{bk} blocks"
    )
    assert weight_scale.dtype == torch.float32, f"weight_scale dtype {weight_scale.dtype}"
    assert bk >= 16 and bk & (bk - 1) == 0, f"bk = {bk} must be a power of two >= 16"


def _gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    block: tuple[int, int],
    out: torch.Tensor,
    config: TileConfig | None,
    num_sms: int | None,
    swiglu: tuple[torch.Tensor, float] | None = None,
) -> None:
    """out [M, G, N] (contiguous) = each group's x [M, G, K] slice times its weight rows; M > 0.
    ``swiglu`` (up [M, G, K] in x's strides, limit): of swiglu(x, up) instead. weight_scale
    None: a weight in x's dtype (``dense_linear``; block's bk the K step)."""
    m, groups, k = x.shape
    n = out.shape[2]
    bn, bk = block
    dense = weight_scale is None
    num_k_blocks = triton.cdiv(k, bk)
    config = config or (DENSE_TILES if dense else pick_tile_config(m))
    assert not (dense and config.swap_ab), "dense_linear has no swapped tiles"
    num_tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    num_sms = _num_sms(x.device) if num_sms is None else num_sms
    num_programs = config.programs_per_sm * num_sms
    split_k = _split_k(num_tiles * groups, num_k_blocks, config.max_split_k, num_programs)
    up, limit = swiglu if swiglu is not None else (x, 0.0)  # x: a pointer not read
    # Dense: the weight stands in for its scales, a pointer not read.
    scale, scale_strides = (weight, (0, 0)) if dense else (weight_scale, weight_scale.stride())
    if config.quantize_in_gemm or dense:
        a, a_scale = x, x  # a_scale is not read
        a_strides = (x.stride(0), x.stride(2), x.stride(1))  # (m, k, group)
        a_scale_strides = (0, 0, 0)
    else:
        # Row m * G + g of q is x[m, g]; its scales have the strides (1, M * G).
        rows_up = None if swiglu is None else (up.reshape(m * groups, k), limit)
        a, a_scale = quantize_activations(x.reshape(m * groups, k), bk, swiglu=rows_up)
        up = a  # not read: the GEMM takes q
        a_strides = (groups * k, 1, k)
        a_scale_strides = (groups, a_scale.stride(1), 1)
    if split_k == 1:
        c = out.unsqueeze(0)  # [1, M, G, N]
    else:  # laid out as out a split, so that one set of offsets serves both
        c = torch.empty((split_k, m, groups, n), dtype=torch.float32, device=x.device)
        assert num_tiles * groups <= MAX_TICKET_TILES, f"{num_tiles} x {groups} split tiles"
    _gemm_kernel[(num_tiles, split_k, groups)](
        a,
        up,
        a_scale,
        weight,
        scale,
        c,
        out,
        ticket_counters(x.device),
        m,
        n,
        *a_strides[:2],
        *a_scale_strides[:2],
        *weight.stride(),
        *scale_strides,
        c.stride(0),
        c.stride(1),
        c.stride(3),
        a_strides[2],
        a_scale_strides[2],
        c.stride(2),
        limit,
        K=k,
        BLOCKS_PER_SPLIT=num_k_blocks // split_k,
        SCALE_BLOCK_N=bn,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=bk,
        GROUP_M=config.group_m,
        QUANTIZE_A=config.quantize_in_gemm and not dense,
        ONE_ROW=(config.quantize_in_gemm or dense) and m == 1,
        ONE_SCALE=bn % config.block_n == 0 and (groups == 1 or n % config.block_n == 0),
        SWIGLU=swiglu is not None and config.quantize_in_gemm,
        SPLIT_K=split_k,
        DENSE=dense,
        SWAP_AB=config.swap_ab,
        DOT_PRECISION=dot_precision(x.dtype, for_16bit="tf32"),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl(a.device),
    )


def use_cublas(m: int, n: int, k: int) -> bool:
    """Whether cuBLAS's blockwise FP8 GEMM beats our kernel for x [M, K] and a weight [N, K]:
    from 65 rows (H100, benchmarks/RESULTS.md 2026-12-07, ninth session), on a weight of
    ``whole_blocks``. Up to 64 rows ours (one row: wo_b 14.5 µs against cuBLAS's 18; 32 rows
    on the swapped tiles: the fused x projections 11.9 against 15.4, wo_b 17.4 against 26.3);
    at 128 cuBLAS's (the fused x projections 16.1 against 20.2, the fused wq_b 26.3 against
    40.4)."""
    return m > 64 and whole_blocks(n, k)


def whole_blocks(n: int, k: int) -> bool:
    """Whether a weight [N, K] is whole 128 x 128 blocks, the only weights cuBLAS's recipe is
    given: with the tiny model's weights at ~720 rows it ran without an error and the engine's
    FP8 test fell to 0.11 top-1 agreement (which linear went wrong is not pinned; a plain
    32 x 64 one is right: RESULTS.md, 2026-12-07 tenth session)."""
    return n % FP8_BLOCK[0] == 0 and k % FP8_BLOCK[1] == 0


def cublas_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    swiglu: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """fp8_linear's function through cuBLAS's blockwise FP8 GEMM, on a weight of
    ``whole_blocks`` (asserted): ``scaled_mm_blockwise``."""
    assert whole_blocks(*weight.shape), (
        f"cuBLAS's blockwise FP8 on a {tuple(weight.shape)} weight of partial blocks"
    )
    return scaled_mm_blockwise(x, weight, weight_scale, swiglu)


def scaled_mm_blockwise(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    swiglu: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """``torch._scaled_mm`` with 1 x 128 activation and 128 x 128 weight scales (DeepSeek's
    recipe), whatever the weight's shape: x quantized by this module's quantizer, whose scales
    have the strides (1, M) cuBLAS asks for, into M rounded up to 16 rows (cuBLAS has no
    algorithm for odd M: the padding rows are computed, then dropped). ``swiglu``: as
    fp8_linear's, in the quantizer. CUDA, bf16 / fp16 x; raises RuntimeError where torch or
    cuBLAS refuses the shapes. The engine calls it through ``cublas_fp8_linear``."""
    m = x.shape[0]
    q, scale = quantize_activations(x, FP8_BLOCK[1], rows=-(-m // 16) * 16, swiglu=swiglu)
    out = torch._scaled_mm(
        q, weight.t(), scale_a=scale, scale_b=weight_scale.t(), out_dtype=x.dtype
    )
    return out[:m]


class TritonLinearBackend(Backend):
    """This module's GEMM on one CUDA device (or the interpreter's CPU), and cuBLAS's blockwise
    FP8 GEMM where ``use_cublas`` says it is faster (``cublas``: CUDA and no tile override;
    off for good once cuBLAS refuses the recipe). ``num_sms``: the SMs that split K fills;
    ``config``: a TileConfig for every call instead of the table's (for tuning; None in the
    engine)."""

    def __init__(
        self,
        device: torch.device,
        parallel: ParallelContext | None = None,
        *,
        config: TileConfig | None = None,
    ) -> None:
        super().__init__(device, parallel)
        self.num_sms = _num_sms(device)
        self.config = config
        self.cublas = device.type == "cuda" and config is None

    def fp8_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        block: tuple[int, int] = FP8_BLOCK,
        *,
        swiglu: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        if (
            self.cublas
            and tuple(block) == FP8_BLOCK
            and x.dtype in (torch.bfloat16, torch.float16)
            and use_cublas(x.shape[0], *weight.shape)
        ):
            try:
                return cublas_fp8_linear(x, weight, weight_scale, swiglu)
            except RuntimeError as error:  # this torch / cuBLAS lacks the recipe: ours from now
                self.cublas = False
                logger.warning("linear: cuBLAS blockwise FP8 refused (%s); Triton only", error)
        return fp8_linear(
            x, weight, weight_scale, block, swiglu=swiglu, config=self.config, num_sms=self.num_sms
        )

    def dense_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Ours up to DENSE_MAX_ROWS rows (one: batch-1 decode), cuBLAS's (F.linear) above."""
        if x.shape[0] > DENSE_MAX_ROWS:
            return F.linear(x, weight)
        return dense_linear(x, weight, num_sms=self.num_sms)

    def fp8_grouped_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        block: tuple[int, int] = FP8_BLOCK,
    ) -> torch.Tensor:
        m, groups, _ = x.shape
        if (
            self.cublas
            and x.dtype in (torch.bfloat16, torch.float16)
            and split_groups(m, weight.shape[0] // groups, block)
        ):
            return fp8_linear_per_group(self.fp8_linear, x, weight, weight_scale, block)
        return fp8_grouped_linear(
            x, weight, weight_scale, block, config=self.config, num_sms=self.num_sms
        )


# From this many rows a grouped linear runs as one GEMM a group (cuBLAS's or DeepGEMM's, whose
# large tiles beat ours there; the linear rule's 1,024 rows); below it, one launch for all.
GROUPED_SPLIT_ROWS = 1024


def split_groups(m: int, rows_per_group: int, block: tuple[int, int]) -> bool:
    """Whether a grouped linear of ``m`` rows runs a GEMM a group (``fp8_linear_per_group``):
    enough rows, and each group a whole number of weight block rows."""
    return m >= GROUPED_SPLIT_ROWS and rows_per_group % block[0] == 0


def fp8_linear_per_group(
    linear: Callable[..., torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int],
) -> torch.Tensor:
    """fp8_grouped_linear as ``linear(x_g, weight_g, scale_g, block)`` for each group g (its
    rows a whole number of block rows)."""
    m, groups, _ = x.shape
    n = weight.shape[0] // groups
    nb = n // block[0]
    out = torch.empty((m, groups, n), dtype=x.dtype, device=x.device)
    for g in range(groups):
        w, s = weight[g * n : (g + 1) * n], weight_scale[g * nb : (g + 1) * nb]
        out[:, g] = linear(x[:, g], w, s, block)
    return out
