"""RMSNorm, RoPE and the hyper-connection mixing as Triton kernels; RoPE tables from torch_ref.

Same signatures and semantics as ``torch_ref`` (the oracle). All statistics and mixing math run
in fp32 whatever the input dtype; only the outputs that torch_ref returns in x's dtype are cast
back. Runs on CUDA; the CPU tests run the same kernels through Triton's interpreter.

apply_rope is one launch reading x once and writing a new tensor once: the program that rotates
a row's rope slice also copies its nope columns, so no torch.cat follows. rms_norm_rope is the
norm and the rotation in one launch; rms_norm_rope_pair runs it for a layer's queries and keys
in one launch (``_norm_rope_block`` a program).

hc_pre is two launches and never reads a value back to the host, so it captures in a CUDA graph:

    x [T, hc, D] --_hc_mix_kernel--> partials [SPLIT_K, T, M_PAD]  x_flat @ fn^T over one K split
                                     sumsq    [SPLIT_K, T]         sum of x_flat^2 over that split
    partials, sumsq, x --_hc_sinkhorn_collapse_kernel--> post [T, hc], comb [T, hc, hc],
                                                          collapsed [T, D]
                                                          (RMS-normalised in place: block_norm)

The RMS norm of a token's flattened streams (K = hc * D values) is one scalar, so
``mix = (x_flat @ fn^T) * rsqrt(sum(x_flat^2) / K + eps)``: one pass over x yields both factors.
One row of partials (M = (2 + hc) * hc mix columns, padded to a power of two):

    | pre_w: hc | post_w: hc | comb_w: hc * hc, row i then column j | pad to M_PAD |

Decode (T = 1) splits K over up to 64 programs so that many SMs read the 1.5 MB of fn, each
multiplying on the CUDA cores (a tl.dot tile would be 16 tokens with one used), and splits D over
several programs in the second kernel. Up to HC_SINKHORN_APART_MAX_TOKENS tokens one more program
a token computes the post gates and the 4x4 Sinkhorn (20 iterations of in-warp reductions) while
the others collapse their D slices with pre alone; above it each program recomputes the Sinkhorn
rather than staging it through memory. Prefill tiles tokens for tl.dot.

Loop trip counts (K per split, D per program, Sinkhorn iterations, apply_rope's nope width,
gated_pool's slots) are constexpr: the interpreter cannot loop to a runtime bound under numpy 2,
and they take few values (a dozen variants over T = 1 .. 16K; apply_rope's D is 512 or 128 in V4;
4 x 2 or 128 slots), each compiled once.

A backend is one module per op family (``ops/registry.py``); the family's ops share the fp32
rules and the interpreter constraints above. The compressors' pooling lives in ``triton_pool.py``:
this module's backend re-exports ``compress_windows``, and the module ``gated_pool`` (the same
kernel over gathered windows, which the tests pool torch_ref's gathers with).
``TritonNormBackend`` at the end is the backend object: it keeps the device's SM count, which
sizes the decode launches, and calls the launchers with it.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from deepinfer.ops.norm.torch_ref import rope_cos_sin, rope_inv_freq
from deepinfer.ops.norm.triton_pool import compress_windows, gated_pool
from deepinfer.ops.norm.triton_pool import div_rn as _div_rn
from deepinfer.ops.registry import Backend, ParallelContext
from deepinfer.ops.triton_pdl import enter, pdl
from deepinfer.ops.triton_rope import rotate, rotate_pair
from deepinfer.ops.triton_tickets import MAX_TICKET_TILES, arrive, depart, ticket_counters
from deepinfer.ops.triton_utils import dot_precision, num_sms

__all__ = [
    "TritonNormBackend",
    "apply_rope",
    "compress_windows",
    "gated_pool",
    "hc_head",
    "hc_post",
    "hc_post_pre",
    "hc_pre",
    "hc_pre_shifted",
    "rms_norm",
    "rms_norm_rope",
    "rope_cos_sin",
    "rope_inv_freq",
]

RMS_NORM_MAX_N = 65536  # a row is held in registers: one read of x
# Tiles of the hc kernels; module attributes so that the CPU tests can shrink them to reach the
# split and loop paths at tiny shapes.
# The mix: tokens and K a program (8 warps from 64 tokens up, else 4); no register spills on
# sm_90 up to 128 x 64 or 64 x 128. The Sinkhorn/collapse kernel: one warp, so that the 4 x 4
# reductions of its 20 iterations stay in-warp shuffles.
# benchmarks/hc_tiles.py on the H200 (RESULTS.md 2026-11-30): hc_pre at T = 8192 in 405 µs
# instead of 818 (64 x 32, four warps). On the H100 with approximate division (2026-12-06), one
# warp where decode splits a token's D over programs too: 14.3 µs instead of 16.8 at T = 1,
# 24.2 instead of 31.3 at T = 128.
HC_BLOCK_T = 128
HC_BLOCK_K = 64
HC_BLOCK_D = 512
HC_SINKHORN_WARPS = 1
HC_MAX_SPLIT_K = 64
# hc_post_pre: hc_post's launch also computes the next sub-layer's mix (hc_mix's partials) up to
# this many tokens, each program over slices of HC_POST_MIX_BLOCK_D channels of every stream
# (fn's [mix, hc, BLOCK_D] tile multiplied on the CUDA cores, summed over the streams at once).
# Above it, hc_post and hc_pre's two launches. H100, 2026-12-07 (benchmarks/RESULTS.md,
# hc_tiles.py --post-pre; µs for the exit and the next entry, a program a token): 128 channels
# 17.3 / 17.5 / 19.6 at T = 1 / 2 / 4 against 19.7 / 22.1 / 22.1 in three launches. Each token's
# program re-reads fn: the earlier kernel lost from 8 tokens (35.9 against 22.7), 2x at 32.
HC_POST_MIX_MAX_TOKENS = 4
HC_POST_MIX_BLOCK_D = 128
# One token (decode, deterministic steps): the mix's K a program step on the CUDA cores (0: the
# tl.dot path, a 16-token tile with one row used).
HC_ONE_TOKEN_BLOCK_K = 128
# Sinkhorn's divisions: IEEE (div_rn) or CUDA's approximate fp32 division (<= 2 ulp). Each IEEE
# division compiles to a fast path, a check and a branch to a slow path, and ptxas runs them one
# after another: the 20 iterations' 8 divisions a thread took ~0.55 µs an iteration on the H100
# (hc_tiles.py --iters 1,20: 24.8 µs at T = 1 with IEEE division, 16.6 approximate, 14.2 with
# one iteration; the mixes within 2e-7 of each other).
HC_SINKHORN_PRECISE_DIV = False
# Up to this many tokens, a token's Sinkhorn (and post gates) runs in a program of its own, beside
# the programs that collapse its D slices with pre alone: the collapse and its row norm no longer
# wait behind the 20 iterations.
HC_SINKHORN_APART_MAX_TOKENS = 256
# apply_rope: nope columns per tile (V4's 448 are one tile of 512) and row values per program
# (8 heads of 512, 16 per thread at 8 warps); the CPU tests shrink them to reach the loops.
ROPE_BLOCK_D = 1024
ROPE_TILE = 4096


# The interpreter (CPU) gets a small stand-in for the SMs to fill.
_num_sms = functools.partial(num_sms, cpu_stand_in=4)
# 16-bit inputs are exact in tf32, so tf32x3 keeps the fp32 weights' precision on tensor cores.
_dot_precision = functools.partial(dot_precision, for_16bit="tf32x3")


def _split_d(num_tokens: int, dim: int, num_sms: int) -> tuple[int, int, int]:
    """(BLOCK_D, D per program, programs per token): enough programs to fill the device at
    decode, one program per token (looping over D) once tokens alone fill it."""
    block_d = min(HC_BLOCK_D, triton.next_power_of_2(dim))
    num_blocks = triton.cdiv(dim, block_d)
    per_token = max(1, min(num_blocks, 2 * num_sms // num_tokens))
    d_per_program = triton.cdiv(num_blocks, per_token) * block_d
    return block_d, d_per_program, triton.cdiv(dim, d_per_program)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    weight_ptr,
    y_ptr,
    num_rows,
    n,
    x_row_stride,
    eps,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < num_rows)[:, None] & (cols < n)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=1) / n
    x = x * tl.rsqrt(mean_sq + eps)[:, None]
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols, mask=cols < n, other=0.0)
        x = weight[None, :] * x
    tl.store(y_ptr + rows[:, None] * n + cols[None, :], x.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm with fp32 statistics; ``weight`` None is the unweighted variant.

    x: [..., N] any float dtype, N <= 65536; weight: [N] (multiplied in fp32 before the cast
    back). Returns a contiguous tensor of x's shape and dtype.
    """
    n = x.shape[-1]
    assert n <= RMS_NORM_MAX_N, f"rms_norm: row of {n} > {RMS_NORM_MAX_N} values"
    assert weight is None or weight.shape == (n,), f"rms_norm: weight {weight.shape}, N = {n}"
    rows = x.reshape(-1, n)  # [M, N]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = rows.shape[0]
    if num_rows == 0 or n == 0:
        return y
    block_m, block_n, num_warps = _rms_tiles(num_rows, n)
    has_weight = weight is not None
    weight = weight.float().contiguous() if has_weight else rows  # a dummy pointer if None
    _rms_norm_kernel[(triton.cdiv(num_rows, block_m),)](
        rows,
        weight,
        y,
        num_rows,
        n,
        rows.stride(0),
        eps,
        HAS_WEIGHT=has_weight,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        **pdl(rows.device),
    )
    return y


def _rms_tiles(num_rows: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of an RMSNorm over rows of n: rms_norm's and
    rms_norm_rope's, so that both reduce a row's squares in the same order."""
    block_n = triton.next_power_of_2(n)
    block_m = min(triton.next_power_of_2(num_rows), max(1, 2048 // block_n))
    return block_m, block_n, min(16, max(1, block_m * block_n // 256))


@triton.jit
def _apply_rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    num_rows,
    num_heads,
    x_token_stride,
    x_head_stride,
    cos_stride,
    sin_stride,
    DIM: tl.constexpr,
    NOPE: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    """BLOCK_R rows (a row: one token's one head) of x: the nope columns copied in tiles of
    BLOCK_D, the rope slice loaded as [BLOCK_R, BLOCK_HALF, 2] (pair i: even, odd) and rotated."""
    enter(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < num_rows
    rows = rows.to(tl.int64)
    tokens = rows // num_heads
    x_rows = x_ptr + tokens * x_token_stride + (rows - tokens * num_heads) * x_head_stride
    y_rows = y_ptr + rows * DIM
    for d0 in tl.static_range(0, NOPE, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = row_mask[:, None] & (cols < NOPE)[None, :]
        x = tl.load(x_rows[:, None] + cols[None, :], mask=mask)
        tl.store(y_rows[:, None] + cols[None, :], x, mask=mask)

    pairs = tl.arange(0, BLOCK_HALF)  # angle i
    pair_mask = row_mask[:, None] & (pairs < HALF)[None, :]  # [BLOCK_R, BLOCK_HALF]
    cos = tl.load(cos_ptr + tokens[:, None] * cos_stride + pairs[None, :], mask=pair_mask)
    sin = tl.load(sin_ptr + tokens[:, None] * sin_stride + pairs[None, :], mask=pair_mask)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    rope_cols = NOPE + 2 * pairs[:, None] + tl.arange(0, 2)[None, :]  # [BLOCK_HALF, 2]
    mask = pair_mask[:, :, None]  # rope_cols < DIM where pairs < HALF
    x = tl.load(x_rows[:, None, None] + rope_cols[None, :, :], mask=mask, other=0.0)
    even, odd = tl.split(x.to(tl.float32))  # [BLOCK_R, BLOCK_HALF] each
    even, odd = rotate_pair(even, odd, cos, sin)
    y = tl.join(even, odd)
    tl.store(y_rows[:, None, None] + rope_cols[None, :, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _rope_rows(
    op: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, ..., D] as rows [T, H, D] (a view where the strides allow, else a contiguous copy)
    and cos, sin [T, rope_dim / 2] with unit column stride, checked for ``op``."""
    num_tokens, dim, half = x.shape[0], x.shape[-1], cos.shape[-1]
    assert x.dim() >= 2 and 0 < 2 * half <= dim, f"{op}: x {tuple(x.shape)}, rope_dim {2 * half}"
    assert cos.shape == (num_tokens, half) and sin.shape == (num_tokens, half), (
        f"{op}: cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, x {tuple(x.shape)}"
    )
    heads = x.reshape(num_tokens, math.prod(x.shape[1:-1]), dim)
    if heads.stride(-1) != 1:
        heads = heads.contiguous()
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    return heads, cos, sin


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_sms: int | None = None
) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of x (fp32 math).

    x: [T, ..., D] laid out ``[nope | rope]``, any float dtype; pairs (2i, 2i+1) of the rope slice
    rotate by angle i. cos/sin: [T, rope_dim / 2] (fp32); pass ``-sin`` for the inverse rotation.
    Returns a new contiguous tensor of x's shape and dtype (nope copied, rope rounded once); x is
    not modified. Reads x in place when its last dim has stride 1 and the dims between T and D
    flatten to one stride (any [T, D] or [T, H, D] slice), else from a contiguous copy.
    ``num_sms``: the SMs decode's row blocks fill (default: x's device's).

    One launch, one program per BLOCK_R rows (a row: one token's one head; a block of heads of
    one token for q, a block of tokens for kv), each row's nope in tiles of up to ROPE_BLOCK_D:

        x [T, H, D] -> rows [T * H, D]    row r = token r // H, head r % H
        row:  | nope: D - rope_dim, copied | rope: rope_dim, (2i, 2i+1) rotated by angle i |
    """
    heads, cos, sin = _rope_rows("apply_rope", x, cos, sin)
    (num_tokens, num_heads, dim), half = heads.shape, cos.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return y
    nope = dim - 2 * half
    num_sms = _num_sms(x.device) if num_sms is None else num_sms
    row_width = triton.next_power_of_2(dim)
    block_r = min(triton.next_power_of_2(num_rows), max(1, ROPE_TILE // row_width))
    # Decode: smaller tiles until two programs per SM (or one row per program).
    while block_r > 1 and triton.cdiv(num_rows, block_r) < 2 * num_sms:
        block_r //= 2
    _apply_rope_kernel[(triton.cdiv(num_rows, block_r),)](
        heads,
        cos,
        sin,
        y,
        num_rows,
        num_heads,
        heads.stride(0),
        heads.stride(1),
        cos.stride(0),
        sin.stride(0),
        DIM=dim,
        NOPE=nope,
        HALF=half,
        BLOCK_R=block_r,
        BLOCK_D=min(ROPE_BLOCK_D, triton.next_power_of_2(max(1, nope))),
        BLOCK_HALF=triton.next_power_of_2(max(1, half)),
        num_warps=min(8, max(1, block_r * row_width // 512)),
        **pdl(heads.device),
    )
    return y


@triton.jit
def _norm_rope_block(
    x_ptr, weight_ptr, cos_ptr, sin_ptr, y_ptr, target_ptr, target_rows_ptr, block, num_rows,
    num_heads, x_token_stride, x_head_stride, cos_stride, sin_stride, target_stride, eps,
    N: tl.constexpr, NOPE: tl.constexpr, HAS_WEIGHT: tl.constexpr, STORE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Rows block * BLOCK_M + [0, BLOCK_M) (a row: one token's one head) normalised as
    ``_rms_norm_kernel`` does and rounded to y's dtype, then their rope slice rotated as
    ``_apply_rope_kernel`` does: each channel's pair partner (channel ^ 1) is loaded and
    normalised alongside, so the two launches' values come out of one. STORE (one head): row t
    also to target's row target_rows[t]."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    rows = rows.to(tl.int64)
    tokens = rows // num_heads
    x_rows = x_ptr + tokens * x_token_stride + (rows - tokens * num_heads) * x_head_stride
    mask = row_mask[:, None] & (cols < N)[None, :]
    x = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=1) / N
    inv_rms = tl.rsqrt(mean_sq + eps)[:, None]
    is_rope = (cols >= NOPE) & (cols < N)
    partner = NOPE + ((cols - NOPE) ^ 1)  # the other channel of a rope pair
    rope_mask = row_mask[:, None] & is_rope[None, :]
    xp = tl.load(x_rows[:, None] + partner[None, :], mask=rope_mask, other=0.0).to(tl.float32)
    y = x * inv_rms
    yp = xp * inv_rms
    if HAS_WEIGHT:
        y = tl.load(weight_ptr + cols, mask=cols < N, other=0.0)[None, :] * y
        yp = tl.load(weight_ptr + partner, mask=is_rope, other=0.0)[None, :] * yp
    dtype = y_ptr.dtype.element_ty
    y = y.to(dtype).to(tl.float32)  # what rms_norm stores and apply_rope reads
    yp = yp.to(dtype).to(tl.float32)
    pair = (cols - NOPE) // 2
    angle = tokens[:, None] * cos_stride + pair[None, :]
    cos = tl.load(cos_ptr + angle, mask=rope_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tokens[:, None] * sin_stride + pair[None, :], mask=rope_mask, other=0.0)
    sin = sin.to(tl.float32)
    even = ((cols - NOPE) % 2 == 0)[None, :]
    rotated = rotate(y, yp, cos, tl.where(even, -sin, sin))
    out = tl.where(is_rope[None, :], rotated, y)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], out.to(dtype), mask=mask)
    if STORE:
        dst = tl.load(target_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        target = target_ptr + dst[:, None] * target_stride + cols[None, :]
        tl.store(target, out.to(target_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr, weight_ptr, cos_ptr, sin_ptr, y_ptr, target_ptr, target_rows_ptr, num_rows,
    num_heads, x_token_stride, x_head_stride, cos_stride, sin_stride, target_stride, eps,
    N: tl.constexpr, NOPE: tl.constexpr, HAS_WEIGHT: tl.constexpr, STORE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One ``_norm_rope_block`` a program."""
    enter(PDL)
    _norm_rope_block(
        x_ptr, weight_ptr, cos_ptr, sin_ptr, y_ptr, target_ptr, target_rows_ptr,
        tl.program_id(0), num_rows, num_heads, x_token_stride, x_head_stride, cos_stride,
        sin_stride, target_stride, eps, N, NOPE, HAS_WEIGHT, STORE, BLOCK_M, BLOCK_N,
    )  # fmt: skip


@triton.jit
def _rms_norm_rope_pair_kernel(
    x_ptr, x_weight_ptr, x_out_ptr, x_rows, x_heads, x_token_stride, x_head_stride, x_blocks,
    k_ptr, k_weight_ptr, k_out_ptr, k_rows, k_token_stride, target_ptr, target_rows_ptr,
    target_stride, cos_ptr, sin_ptr, cos_stride, sin_stride, eps,
    N: tl.constexpr, NOPE: tl.constexpr, X_WEIGHT: tl.constexpr, K_WEIGHT: tl.constexpr,
    STORE: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Programs [0, x_blocks): x's blocks of BLOCK_X rows; the rest: k's (one head) of BLOCK_K,
    with its store."""
    enter(PDL)
    block = tl.program_id(0)
    if block < x_blocks:
        _norm_rope_block(
            x_ptr, x_weight_ptr, cos_ptr, sin_ptr, x_out_ptr, x_ptr, x_ptr, block, x_rows,
            x_heads, x_token_stride, x_head_stride, cos_stride, sin_stride, 0, eps, N, NOPE,
            X_WEIGHT, False, BLOCK_X, BLOCK_N,
        )  # fmt: skip
    else:
        _norm_rope_block(
            k_ptr, k_weight_ptr, cos_ptr, sin_ptr, k_out_ptr, target_ptr, target_rows_ptr,
            block - x_blocks, k_rows, 1, k_token_stride, 0, cos_stride, sin_stride,
            target_stride, eps, N, NOPE, K_WEIGHT, STORE, BLOCK_K, BLOCK_N,
        )  # fmt: skip


def _norm_rope_args(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """rms_norm_rope's x as rows [T, H, D], cos, sin (``_rope_rows``), the weight as fp32 (x
    itself as a dummy pointer without one) and the store's target and rows (x and cos, not
    read, without one), checked for ``op``."""
    heads, cos, sin = _rope_rows(op, x, cos, sin)
    num_tokens, num_heads, dim = heads.shape
    target, target_rows = store if store is not None else (heads, cos)  # not read without it
    if store is not None:
        assert num_heads == 1 and target.dim() == 2 and target.shape[1] == dim, (
            f"{op}: store into {tuple(target.shape)} from x {tuple(x.shape)}"
        )
        assert target.stride(1) == 1 and target_rows.shape == (num_tokens,), (
            f"{op}: target strides {target.stride()}, rows {tuple(target_rows.shape)}"
        )
    assert dim <= RMS_NORM_MAX_N, f"{op}: row of {dim} > {RMS_NORM_MAX_N} values"
    assert weight is None or weight.shape == (dim,), f"{op}: weight {weight.shape}"
    weight = weight.float().contiguous() if weight is not None else heads
    return heads, cos, sin, weight, target, target_rows


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    store: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``apply_rope(rms_norm(x, weight, eps), cos, sin)`` in one launch, the same values: x
    [T, ..., D] (the norm over D, the rope on its trailing 2 * cos.shape[-1] channels); cos/sin
    [T, rope_dim / 2]. Returns a new contiguous tensor of x's shape and dtype. ``store``
    (target [R, D] with unit column stride, rows [T]) for x [T, D]: each token's row also
    written to target[rows[t]] by the same launch."""
    heads, cos, sin, w, target, target_rows = _norm_rope_args(
        "rms_norm_rope", x, weight, cos, sin, store
    )
    num_tokens, num_heads, dim = heads.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return y
    block_m, block_n, num_warps = _rms_tiles(num_rows, dim)
    _rms_norm_rope_kernel[(triton.cdiv(num_rows, block_m),)](
        heads, w, cos, sin, y, target, target_rows, num_rows, num_heads, heads.stride(0),
        heads.stride(1), cos.stride(0), sin.stride(0), target.stride(0), eps, N=dim,
        NOPE=dim - 2 * cos.shape[-1], HAS_WEIGHT=weight is not None, STORE=store is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **pdl(heads.device),
    )  # fmt: skip
    return y


def rms_norm_rope_pair(
    x: torch.Tensor,
    k: torch.Tensor,
    weights: tuple[torch.Tensor | None, torch.Tensor | None],
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    store: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm_rope`` of x [T, ..., D] and of k [T, D] (each its own weight of ``weights``;
    one eps, one table of angles; ``store``: k's), in one launch: x's row blocks, then k's.
    A layer's queries and keys. x's rows come out as ``rms_norm_rope``'s; k's in tiles of
    x's launch (the same values on the CPU; on CUDA a row's sum of squares may round apart in
    its last bit, as k's own launch's tiles change with T and these do not)."""
    heads, cos, sin, x_weight, _, _ = _norm_rope_args(
        "rms_norm_rope_pair", x, weights[0], cos, sin, None
    )
    keys, _, _, k_weight, target, target_rows = _norm_rope_args(
        "rms_norm_rope_pair", k, weights[1], cos, sin, store
    )
    num_tokens, num_heads, dim = heads.shape
    assert k.shape == (num_tokens, dim), f"rms_norm_rope_pair: x {tuple(x.shape)}, k {k.shape}"
    x_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return x_out, k_out
    block_x, block_n, num_warps = _rms_tiles(num_tokens * num_heads, dim)
    block_k = min(triton.next_power_of_2(num_tokens), block_x)
    x_blocks = triton.cdiv(num_tokens * num_heads, block_x)
    _rms_norm_rope_pair_kernel[(x_blocks + triton.cdiv(num_tokens, block_k),)](
        heads, x_weight, x_out, num_tokens * num_heads, num_heads, heads.stride(0),
        heads.stride(1), x_blocks, keys, k_weight, k_out, num_tokens, keys.stride(0), target,
        target_rows, target.stride(0), cos, sin, cos.stride(0), sin.stride(0), eps, N=dim,
        NOPE=dim - 2 * cos.shape[-1], X_WEIGHT=weights[0] is not None,
        K_WEIGHT=weights[1] is not None, STORE=store is not None, BLOCK_X=block_x,
        BLOCK_K=block_k, BLOCK_N=block_n, num_warps=num_warps, **pdl(heads.device),
    )  # fmt: skip
    return x_out, k_out


@triton.jit
def _hc_mix_kernel(
    x_ptr,
    fn_ptr,
    partials_ptr,
    sumsq_ptr,
    num_tokens,
    k,
    MIX_SIZE: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """partials[s, t, m] = sum over split s of x_flat[t, :] * fn[m, :]; sumsq[s, t] likewise.
    BLOCK_T 1 (one token): fp32 products on the CUDA cores, summed once after the loop."""
    enter(PDL)
    split = tl.program_id(1)
    if BLOCK_T == 1:
        cols = tl.arange(0, M_PAD)
        prods = tl.zeros([M_PAD, BLOCK_K], dtype=tl.float32)
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, K_PER_SPLIT, BLOCK_K):
            ks = split * K_PER_SPLIT + k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < k
            x = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            fn = tl.load(
                fn_ptr + cols[:, None] * k + ks[None, :],
                mask=(cols < MIX_SIZE)[:, None] & k_mask[None, :],
                other=0.0,
            )  # [M_PAD, BLOCK_K]
            prods += fn * x[None, :]
            squares += x * x
        tl.store(partials_ptr + split * M_PAD + cols, tl.sum(prods, axis=1))
        tl.store(sumsq_ptr + split, tl.sum(squares, axis=0))
        return
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    cols = tl.arange(0, M_PAD)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * k
    acc = tl.zeros([BLOCK_T, M_PAD], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    for k0 in tl.range(0, K_PER_SPLIT, BLOCK_K):
        ks = k_begin + k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        x = tl.load(x_rows + ks[None, :], mask=token_mask[:, None] & k_mask[None, :], other=0.0)
        x = x.to(tl.float32)  # [BLOCK_T, BLOCK_K]
        fn_t = tl.load(
            fn_ptr + cols[None, :] * k + ks[:, None],
            mask=k_mask[:, None] & (cols < MIX_SIZE)[None, :],
            other=0.0,
        )  # [BLOCK_K, M_PAD]
        acc = tl.dot(x, fn_t, acc, input_precision=PRECISION)
        sumsq += tl.sum(x * x, axis=1)
    row = split * num_tokens + tokens
    tl.store(partials_ptr + row[:, None] * M_PAD + cols[None, :], acc, mask=token_mask[:, None])
    tl.store(sumsq_ptr + row, sumsq, mask=token_mask)


@triton.jit
def _sinkhorn_div(num, den, PRECISE: tl.constexpr):
    """num / den, IEEE-rounded when PRECISE, else CUDA's approximate fp32 division (within 2
    ulp, no branch: ptxas serialises each IEEE division behind its slow-path check)."""
    if PRECISE:
        return _div_rn(num, den)
    return num / den


@triton.jit
def _hc_post_comb(
    rows,
    stream_mask,
    is_split,
    i,
    j,
    inv_rms,
    scale_ptr,
    base_ptr,
    post_ptr,
    comb_ptr,
    t,
    writer,
    hc_eps,
    HC: tl.constexpr,
    SINKHORN_ITERS: tl.constexpr,
    PRECISE_DIV: tl.constexpr,
):
    """A token's post gates and its Sinkhorn-balanced comb from the mix's partial rows, stored
    where ``writer``."""
    is_stream = i < HC
    is_comb = is_stream[:, None] & (j < HC)[None, :]
    comb_cols = 2 * HC + i[:, None] * HC + j[None, :]  # [HC_PAD, HC_PAD] into a partials row
    post_w = tl.sum(tl.load(rows[:, None] + HC + i[None, :], mask=stream_mask, other=0.0), axis=0)
    comb_mask = is_split[:, None, None] & is_comb[None]
    comb_w = tl.load(rows[:, None, None] + comb_cols[None, :, :], mask=comb_mask, other=0.0)
    comb_w = tl.sum(comb_w, axis=0)
    post_b = tl.load(base_ptr + HC + i, mask=is_stream, other=0.0)
    comb_b = tl.load(base_ptr + comb_cols, mask=is_comb, other=0.0)
    post = 2 * tl.sigmoid(post_w * inv_rms * tl.load(scale_ptr + 1) + post_b)
    logits = comb_w * inv_rms * tl.load(scale_ptr + 2) + comb_b
    logits = tl.where((j < HC)[None, :], logits, float("-inf"))  # padded rows stay finite
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = _sinkhorn_div(e, tl.sum(e, axis=1)[:, None], PRECISE_DIV)  # softmax over each row
    comb = tl.where(is_comb, comb + hc_eps, 0.0)
    # first pass: columns only
    comb = _sinkhorn_div(comb, tl.sum(comb, axis=0)[None, :] + hc_eps, PRECISE_DIV)
    for _ in range(SINKHORN_ITERS - 1):
        comb = _sinkhorn_div(comb, tl.sum(comb, axis=1)[:, None] + hc_eps, PRECISE_DIV)
        comb = _sinkhorn_div(comb, tl.sum(comb, axis=0)[None, :] + hc_eps, PRECISE_DIV)
    tl.store(post_ptr + t * HC + i, post, mask=is_stream & writer)
    comb_ptrs = comb_ptr + t * HC * HC + i[:, None] * HC + j[None, :]
    tl.store(comb_ptrs, comb, mask=is_comb & writer)


@triton.jit
def _hc_sinkhorn_collapse_kernel(
    x_ptr,
    partials_ptr,
    sumsq_ptr,
    scale_ptr,
    base_ptr,
    post_ptr,
    comb_ptr,
    collapsed_ptr,
    prev_pre_ptr,
    pre_out_ptr,
    norm_w_ptr,
    row_sumsq_ptr,
    counters_ptr,
    num_tokens,
    dim,
    k,
    hc_eps,
    norm_eps,
    block_eps,
    SHIFTED: tl.constexpr,
    HEAD: tl.constexpr,
    NORM: tl.constexpr,
    APART: tl.constexpr,
    D_PROGRAMS: tl.constexpr,
    D_PROGRAMS_PAD: tl.constexpr,
    D_ROW: tl.constexpr,
    HC: tl.constexpr,
    HC_PAD: tl.constexpr,
    M_PAD: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    SINKHORN_ITERS: tl.constexpr,
    PRECISE_DIV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_PER_PROGRAM: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token, one slice of D: the mix, its gates and Sinkhorn in registers, then the
    collapse of the slice. The program holding the first slice writes post and comb (and, when
    SHIFTED, pre). APART: the token's D_PROGRAMS collapse programs compute pre alone, and one
    more program (the grid's last on axis 1) computes and writes those, at the same time.
    SHIFTED: the slice collapses with the previous sub-layer's pre (prev_pre [T, hc]) and this
    token's own pre goes to pre_out [T, hc]. HEAD: a hyper-connection head (``hc_head``): the
    mix is pre's alone (scale [1]), and there is no post, comb or Sinkhorn.
    NORM: the block input RMS-normalised in place (weight norm_w, eps block_eps) over the
    rounded values, as torch_ref's rms_norm of the collapse: each program adds its slice's
    squares; with one program a token it normalises its row after a barrier, else the token's
    last program (a ticket, as the FP8 GEMM's split K) adds the D_PROGRAMS sums in order and
    normalises the whole row, read back from L2 (ops/triton_tickets.py)."""
    enter(PDL)
    t = tl.program_id(0)
    program = tl.program_id(1)
    i = tl.arange(0, HC_PAD)  # stream, and comb's row
    j = tl.arange(0, HC_PAD)  # comb's column
    is_stream = i < HC
    # The slice's first tile, loaded before the mixes so that its latency hides under theirs
    # (the Sinkhorn program's is past the row: masked off).
    t64 = t.to(tl.int64)
    d_begin = program * D_PER_PROGRAM
    d = d_begin + tl.arange(0, BLOCK_D)
    x_rows = x_ptr + (t64 * HC + i[:, None]) * dim
    x = tl.load(x_rows + d[None, :], mask=is_stream[:, None] & (d < dim)[None, :], other=0.0)

    splits = tl.arange(0, SPLIT_PAD)
    is_split = splits < SPLIT_K
    rows = partials_ptr + (splits * num_tokens + t) * M_PAD  # [SPLIT_PAD]
    stream_mask = is_split[:, None] & is_stream[None, :]
    pre_w = tl.sum(tl.load(rows[:, None] + i[None, :], mask=stream_mask, other=0.0), axis=0)
    sumsq = tl.load(sumsq_ptr + splits * num_tokens + t, mask=is_split, other=0.0)
    sumsq = tl.sum(sumsq, axis=0)
    inv_rms = tl.rsqrt(sumsq / k + norm_eps)
    pre_b = tl.load(base_ptr + i, mask=is_stream, other=0.0)
    pre = tl.sigmoid(pre_w * inv_rms * tl.load(scale_ptr) + pre_b) + hc_eps

    if not HEAD:
        writer = program == (D_PROGRAMS if APART else 0)
        if writer | (not APART):  # apart, only its own program computes them
            _hc_post_comb(
                rows, stream_mask, is_split, i, j, inv_rms, scale_ptr, base_ptr, post_ptr,
                comb_ptr, t, writer, hc_eps, HC, SINKHORN_ITERS, PRECISE_DIV,
            )  # fmt: skip
        if SHIFTED:
            tl.store(pre_out_ptr + t * HC + i, pre, mask=is_stream & writer)
            pre = tl.load(prev_pre_ptr + t * HC + i, mask=is_stream, other=0.0)

    if program < D_PROGRAMS:
        out_row = collapsed_ptr + t64 * dim
        squares = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in tl.range(0, D_PER_PROGRAM, BLOCK_D):
            d = d_begin + d0 + tl.arange(0, BLOCK_D)
            d_mask = d < dim
            y = tl.sum(pre[:, None] * x.to(tl.float32), axis=0)
            y = y.to(collapsed_ptr.dtype.element_ty)
            next_d = d + BLOCK_D  # the next tile's load before this one's store
            next_mask = (next_d < dim) & (d0 + BLOCK_D < D_PER_PROGRAM)
            x = tl.load(
                x_rows + next_d[None, :], mask=is_stream[:, None] & next_mask[None, :], other=0.0
            )
            tl.store(out_row + d, y, mask=d_mask)
            if NORM:
                squares += tl.where(d_mask, y.to(tl.float32) * y.to(tl.float32), 0.0)
        if NORM:
            row_sum = tl.sum(squares, axis=0)
            if D_PROGRAMS == 1:
                tl.debug_barrier()  # the row's stores, by every thread, before they are read
                _norm_row(out_row, norm_w_ptr, row_sum, dim, block_eps, BLOCK_D, D_ROW)
            else:
                tl.store(row_sumsq_ptr + t * D_PROGRAMS + program, row_sum)
                if arrive(counters_ptr + t, D_PROGRAMS):
                    programs = tl.arange(0, D_PROGRAMS_PAD)
                    sums = tl.load(
                        row_sumsq_ptr + t * D_PROGRAMS + programs,
                        mask=programs < D_PROGRAMS,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    row_sum = tl.sum(sums, axis=0)
                    _norm_row(out_row, norm_w_ptr, row_sum, dim, block_eps, BLOCK_D, D_ROW)
                    depart(counters_ptr + t)


@triton.jit
def _norm_row(row_ptr, w_ptr, sum_sq, dim, eps, BLOCK_D: tl.constexpr, D_ROW: tl.constexpr):
    """row[:dim] = w * (row * rsqrt(sum_sq / dim + eps)), in place, read through L2 (.cg): the
    rms_norm of torch_ref on a row whose squares sum to sum_sq. Each tile's loads are issued
    before the previous tile's store."""
    inv_rms = tl.rsqrt(sum_sq / dim + eps)
    d = tl.arange(0, BLOCK_D)
    h = tl.load(row_ptr + d, mask=d < dim, other=0.0, cache_modifier=".cg")
    w = tl.load(w_ptr + d, mask=d < dim, other=0.0)
    for d0 in tl.range(0, D_ROW, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        y = (w * (h.to(tl.float32) * inv_rms)).to(row_ptr.dtype.element_ty)
        next_d = d + BLOCK_D
        h = tl.load(row_ptr + next_d, mask=next_d < dim, other=0.0, cache_modifier=".cg")
        w = tl.load(w_ptr + next_d, mask=next_d < dim, other=0.0)
        tl.store(row_ptr + d, y, mask=d < dim)


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    *,
    block_norm: tuple[torch.Tensor, float] | None = None,
    num_sms: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Manifold-constrained hyper-connection, entry side.

    x: [T, hc, D]; fn: [(2+hc)*hc, hc*D]; scale: [3]; base: [(2+hc)*hc]. Returns (post [T, hc]
    fp32, comb [T, hc, hc] fp32 doubly stochastic by Sinkhorn, block input [T, D] =
    sum_i pre[i] * x[i] in x's dtype). All mixing math in fp32. ``block_norm`` (weight [D],
    eps): the block input RMS-normalised with them in the same launch (torch_ref's). ``num_sms``:
    the SMs the K and D splits fill (default: x's device's).
    """
    post, comb, collapsed, _ = _hc_pre(
        x, None, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, num_sms, block_norm
    )
    return post, comb, collapsed


def hc_pre_shifted(
    x: torch.Tensor,
    prev_pre: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    *,
    block_norm: tuple[torch.Tensor, float] | None = None,
    num_sms: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shifted variant (torch_ref.hc_pre_shifted): the block input collapses x with
    ``prev_pre`` [T, hc] fp32; returns (pre, post, comb, block input), pre this sub-layer's;
    ``block_norm`` as hc_pre's."""
    post, comb, collapsed, pre = _hc_pre(
        x, prev_pre, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, num_sms, block_norm
    )
    assert pre is not None
    return pre, post, comb, collapsed


def hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    *,
    block_norm: tuple[torch.Tensor, float] | None = None,
    num_sms: int | None = None,
) -> torch.Tensor:
    """A hyper-connection head (torch_ref.hc_head): x [T, hc, D] -> [T, D], and with
    ``block_norm`` the final norm, in hc_pre's two launches (the mix, then the collapse with
    pre's gate alone)."""
    _, _, collapsed, _ = _hc_pre(
        x, None, fn, scale, base, 0, hc_eps, norm_eps, num_sms, block_norm, head=True
    )
    return collapsed


def _check_fn(fn: torch.Tensor, mix_size: int, k: int) -> torch.Tensor:
    """fn [mix_size, k] ((2+hc)*hc or, for a head, hc rows; k = hc*D) in fp32, checked."""
    assert fn.shape == (mix_size, k), f"hc: fn {tuple(fn.shape)}, expected {(mix_size, k)}"
    return fn.float().contiguous()


def _mix_pad(mix_size: int) -> int:
    """A partials row's width: the mix's columns padded for tl.dot and tl.arange."""
    return max(16, triton.next_power_of_2(mix_size))


# The mix's partial sums as the Sinkhorn/collapse kernel reads them: partials [splits, T, M_PAD]
# and sumsq [splits, T] fp32, and the number of splits.
HcMix = tuple[torch.Tensor, torch.Tensor, int]


def _hc_pre(
    x: torch.Tensor,
    prev_pre: torch.Tensor | None,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    num_sms: int | None,
    block_norm: tuple[torch.Tensor, float] | None = None,
    mix: HcMix | None = None,
    head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Both entry sides: (post, comb, block input, this sub-layer's pre when shifted). ``mix``:
    x's mix already computed (hc_post_pre's), else _hc_mix_kernel's launch computes it. head:
    a hyper-connection head's (``hc_head``; post and comb are not written)."""
    num_tokens, hc, dim = x.shape
    mix_size, k = (hc if head else (2 + hc) * hc), hc * dim
    fn = _check_fn(fn, mix_size, k)
    assert scale.numel() == (1 if head else 3) and base.numel() == mix_size, (
        f"hc: scale {tuple(scale.shape)}, base {tuple(base.shape)} for hc = {hc}"
    )
    x = x.contiguous()
    scale, base = (t.float().contiguous() for t in (scale, base))
    post = torch.empty(num_tokens, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(num_tokens, hc, hc, dtype=torch.float32, device=x.device)
    collapsed = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device)
    shifted = prev_pre is not None
    pre_out = torch.empty_like(post) if shifted else None
    if num_tokens == 0:
        return post, comb, collapsed, pre_out
    if prev_pre is not None:
        assert prev_pre.shape == (num_tokens, hc), f"hc_pre: prev_pre {tuple(prev_pre.shape)}"
        prev_pre = prev_pre.float().contiguous()
    num_sms = _num_sms(x.device) if num_sms is None else num_sms
    partials, sumsq, split_k = _hc_mix(x, fn, num_sms) if mix is None else mix
    m_pad = partials.shape[-1]

    block_d, d_per_program, num_d_programs = _split_d(num_tokens, dim, num_sms)
    apart = not head and num_tokens <= HC_SINKHORN_APART_MAX_TOKENS
    if block_norm is not None:
        norm_weight, block_eps = block_norm[0].float().contiguous(), float(block_norm[1])
        assert norm_weight.shape == (dim,), f"hc_pre: norm weight {tuple(norm_weight.shape)}"
        row_sumsq = post  # not read with one program a token
        if num_d_programs > 1:  # each program's sum of squares, then the token's last adds them
            assert num_tokens <= MAX_TICKET_TILES, f"hc_pre: {num_tokens} tokens to normalise"
            row_sumsq = post.new_empty(num_tokens, num_d_programs)
    else:
        norm_weight, block_eps, row_sumsq = post, 0.0, post  # not read
    _hc_sinkhorn_collapse_kernel[(num_tokens, num_d_programs + apart)](
        x,
        partials,
        sumsq,
        scale,
        base,
        post,
        comb,
        collapsed,
        prev_pre if shifted else post,
        pre_out if shifted else post,
        norm_weight,
        row_sumsq,
        ticket_counters(x.device),
        num_tokens,
        dim,
        k,
        hc_eps,
        norm_eps,
        block_eps,
        SHIFTED=shifted,
        HEAD=head,
        NORM=block_norm is not None,
        APART=apart,
        D_PROGRAMS=num_d_programs,
        D_PROGRAMS_PAD=triton.next_power_of_2(num_d_programs),
        D_ROW=triton.cdiv(dim, block_d) * block_d,
        HC=hc,
        HC_PAD=triton.next_power_of_2(hc),
        M_PAD=m_pad,
        SPLIT_K=split_k,
        SPLIT_PAD=triton.next_power_of_2(split_k),
        SINKHORN_ITERS=sinkhorn_iters,
        PRECISE_DIV=HC_SINKHORN_PRECISE_DIV,
        BLOCK_D=block_d,
        D_PER_PROGRAM=d_per_program,
        num_warps=HC_SINKHORN_WARPS,
        **pdl(x.device),
    )
    return post, comb, collapsed, pre_out


def _hc_mix(x: torch.Tensor, fn: torch.Tensor, num_sms: int) -> HcMix:
    """x's mix with fn (fp32, checked), split over K: one launch of _hc_mix_kernel."""
    num_tokens, hc, dim = x.shape
    mix_size, k = fn.shape[0], hc * dim
    if num_tokens == 1 and HC_ONE_TOKEN_BLOCK_K:  # the CUDA cores' path
        block_t, block_k = 1, min(HC_ONE_TOKEN_BLOCK_K, triton.next_power_of_2(k))
    else:
        block_t = min(HC_BLOCK_T, max(16, triton.next_power_of_2(num_tokens)))  # tl.dot: >= 16
        block_k = max(16, min(HC_BLOCK_K, triton.next_power_of_2(k)))  # tl.dot needs >= 16
    num_t_blocks, num_k_blocks = triton.cdiv(num_tokens, block_t), triton.cdiv(k, block_k)
    split_k = 1
    while num_t_blocks * split_k < num_sms and 2 * split_k <= min(HC_MAX_SPLIT_K, num_k_blocks):
        split_k *= 2
    m_pad = _mix_pad(mix_size)
    partials = torch.empty(split_k, num_tokens, m_pad, dtype=torch.float32, device=x.device)
    sumsq = torch.empty(split_k, num_tokens, dtype=torch.float32, device=x.device)
    _hc_mix_kernel[(num_t_blocks, split_k)](
        x,
        fn,
        partials,
        sumsq,
        num_tokens,
        k,
        MIX_SIZE=mix_size,
        M_PAD=m_pad,
        BLOCK_T=block_t,
        BLOCK_K=block_k,
        K_PER_SPLIT=triton.cdiv(num_k_blocks, split_k) * block_k,
        PRECISION=_dot_precision(x.dtype),
        num_warps=8 if block_t >= 64 else 4,
        **pdl(x.device),
    )
    return partials, sumsq, split_k


@triton.jit
def _hc_post_kernel(
    out_ptr,
    x_ptr,
    post_ptr,
    comb_ptr,
    new_ptr,
    fn_ptr,
    partials_ptr,
    sumsq_ptr,
    num_tokens,
    dim,
    HC: tl.constexpr,
    HC_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_PER_PROGRAM: tl.constexpr,
    MIX: tl.constexpr,
    MIX_SIZE: tl.constexpr,
    M_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """new[t, k, d] = post[t, k] * out[t, d] + sum_j comb[t, j, k] * x[t, j, d], in fp32.

    Grid (T, slices of D_PER_PROGRAM channels). MIX: the next hc_pre's mix over the slice too,
    from new as rounded (what _hc_mix_kernel would read): partials[s, t, m] = sum over slice s
    of every stream of new[t] * fn[m], sumsq[s, t] the slice's squares, fn [MIX_SIZE, HC * dim]
    fp32."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    streams = tl.arange(0, HC_PAD)  # k
    is_stream = streams < HC
    split = tl.program_id(1)
    d_begin = split * D_PER_PROGRAM
    mix = tl.arange(0, M_PAD)
    fn_rows = fn_ptr + mix.to(tl.int64)[:, None, None] * (HC * dim)
    post = tl.load(post_ptr + t * HC + streams, mask=is_stream, other=0.0)
    prods = tl.zeros([M_PAD, BLOCK_D], dtype=tl.float32)
    squares = tl.zeros([BLOCK_D], dtype=tl.float32)
    for d0 in tl.range(0, D_PER_PROGRAM, BLOCK_D):
        d = d_begin + d0 + tl.arange(0, BLOCK_D)
        d_mask = d < dim
        mixed = tl.zeros([HC_PAD, BLOCK_D], dtype=tl.float32)
        for src in tl.static_range(HC):  # j
            x = tl.load(x_ptr + (t * HC + src) * dim + d, mask=d_mask, other=0.0)
            weight = tl.load(comb_ptr + (t * HC + src) * HC + streams, mask=is_stream, other=0.0)
            mixed += weight[:, None] * x.to(tl.float32)[None, :]
        out = tl.load(out_ptr + t * dim + d, mask=d_mask, other=0.0).to(tl.float32)
        new = (post[:, None] * out[None, :] + mixed).to(new_ptr.dtype.element_ty)
        new_mask = is_stream[:, None] & d_mask[None, :]
        tl.store(new_ptr + (t * HC + streams[:, None]) * dim + d[None, :], new, mask=new_mask)
        if MIX:  # new is 0 where masked: no term from the padding
            v = new.to(tl.float32)
            fn = tl.load(
                fn_rows + (streams[:, None] * dim + d[None, :])[None, :, :],
                mask=(mix < MIX_SIZE)[:, None, None] & new_mask[None, :, :],
                other=0.0,
            )  # [M_PAD, HC_PAD, BLOCK_D]
            prods += tl.sum(fn * v[None, :, :], axis=1)
            squares += tl.sum(v * v, axis=0)
    if MIX:
        row = split * num_tokens + t
        tl.store(partials_ptr + row * M_PAD + mix, tl.sum(prods, axis=1))
        tl.store(sumsq_ptr + row, tl.sum(squares, axis=0))


def hc_post(
    out: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    num_sms: int | None = None,
) -> torch.Tensor:
    """Hyper-connection, exit side: new[k] = post[k] * out + sum_j comb[j, k] * x[j].

    out: [T, D]; x: [T, hc, D]; post: [T, hc] fp32; comb: [T, hc, hc] fp32 -> [T, hc, D] in
    x's dtype (computed in fp32, rounded once). ``num_sms``: the SMs the D split fills (default:
    x's device's).
    """
    num_sms = _num_sms(x.device) if num_sms is None else num_sms
    return _hc_post(out, x, post, comb, num_sms)[0]


def hc_post_pre(
    out: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
    *,
    block_norm: tuple[torch.Tensor, float] | None = None,
    num_sms: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sub-layer's exit and the next one's entry: ``hc_post(out, x, post, comb)`` and
    ``hc_pre`` of its result with the next sub-layer's fn, scale, base and block_norm; returns
    (new x, post, comb, block input). Two launches up to HC_POST_MIX_MAX_TOKENS tokens (the
    mix computed in hc_post's), else three."""
    num_sms = _num_sms(x.device) if num_sms is None else num_sms
    hc, dim = x.shape[1:]
    fn = _check_fn(fn, (2 + hc) * hc, hc * dim)
    fused = x.shape[0] <= HC_POST_MIX_MAX_TOKENS
    new, mixed = _hc_post(out, x, post, comb, num_sms, fn if fused else None)
    entry = _hc_pre(
        new, None, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, num_sms, block_norm, mixed
    )
    return new, *entry[:3]


def _hc_post(
    out: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    num_sms: int,
    fn: torch.Tensor | None = None,
) -> tuple[torch.Tensor, HcMix | None]:
    """hc_post's launch; with ``fn`` (fp32, checked) it computes the new x's mix too."""
    num_tokens, hc, dim = x.shape
    mix_size = (2 + hc) * hc
    assert out.shape == (num_tokens, dim), f"hc_post: out {tuple(out.shape)}, x {tuple(x.shape)}"
    assert post.shape == (num_tokens, hc) and comb.shape == (num_tokens, hc, hc), (
        f"hc_post: post {tuple(post.shape)}, comb {tuple(comb.shape)}, x {tuple(x.shape)}"
    )
    out, x = out.contiguous(), x.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    new = torch.empty_like(x)
    if num_tokens == 0:
        return new, None
    if fn is None:
        block_d, d_per_program, num_d_programs = _split_d(num_tokens, dim, num_sms)
        partials = sumsq = new  # not written: MIX is constexpr
    else:
        # Slices of BLOCK_D channels, at most HC_MAX_SPLIT_K of them (the Sinkhorn kernel sums
        # its partials in registers).
        block_d = min(HC_POST_MIX_BLOCK_D, triton.next_power_of_2(dim))
        num_blocks = triton.cdiv(dim, block_d)
        d_per_program = triton.cdiv(num_blocks, min(num_blocks, HC_MAX_SPLIT_K)) * block_d
        num_d_programs = triton.cdiv(dim, d_per_program)
        partials = torch.empty(
            num_d_programs, num_tokens, _mix_pad(mix_size), dtype=torch.float32, device=x.device
        )
        sumsq = torch.empty(num_d_programs, num_tokens, dtype=torch.float32, device=x.device)
    _hc_post_kernel[(num_tokens, num_d_programs)](
        out,
        x,
        post,
        comb,
        new,
        new if fn is None else fn,
        partials,
        sumsq,
        num_tokens,
        dim,
        HC=hc,
        HC_PAD=triton.next_power_of_2(hc),
        BLOCK_D=block_d,
        D_PER_PROGRAM=d_per_program,
        MIX=fn is not None,
        MIX_SIZE=mix_size,
        M_PAD=_mix_pad(mix_size),
        # The mix's fn tile is M_PAD x HC_PAD x BLOCK_D values: 104 registers a thread at 128
        # channels and 8 warps on sm_90, no spills (scripts/sm90_compile.py).
        num_warps=4 if fn is None else min(8, max(4, block_d // 8)),
        **pdl(out.device),
    )
    return new, None if fn is None else (partials, sumsq, num_d_programs)


class TritonNormBackend(Backend):
    """This module's kernels on one CUDA device (or the interpreter's CPU). ``num_sms``: the SMs
    that apply_rope's row blocks and hc_pre's and hc_post's splits fill at decode."""

    rms_norm = staticmethod(rms_norm)
    rms_norm_rope = staticmethod(rms_norm_rope)
    rms_norm_rope_pair = staticmethod(rms_norm_rope_pair)
    compress_windows = staticmethod(compress_windows)
    rope_inv_freq = staticmethod(rope_inv_freq)
    rope_cos_sin = staticmethod(rope_cos_sin)

    def __init__(self, device: torch.device, parallel: ParallelContext | None = None) -> None:
        super().__init__(device, parallel)
        self.num_sms = _num_sms(device)

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin, num_sms=self.num_sms)

    def hc_pre(
        self,
        x: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        sinkhorn_iters: int,
        hc_eps: float,
        norm_eps: float,
        *,
        block_norm: tuple[torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hc_pre(
            x, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps,
            block_norm=block_norm, num_sms=self.num_sms,
        )  # fmt: skip

    def hc_pre_shifted(
        self,
        x: torch.Tensor,
        prev_pre: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        sinkhorn_iters: int,
        hc_eps: float,
        norm_eps: float,
        *,
        block_norm: tuple[torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return hc_pre_shifted(
            x, prev_pre, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps,
            block_norm=block_norm, num_sms=self.num_sms,
        )  # fmt: skip

    def hc_post(
        self, out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        return hc_post(out, x, post, comb, num_sms=self.num_sms)

    def hc_head(
        self,
        x: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        hc_eps: float,
        norm_eps: float,
        *,
        block_norm: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        return hc_head(
            x, fn, scale, base, hc_eps, norm_eps, block_norm=block_norm, num_sms=self.num_sms
        )

    def hc_post_pre(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        sinkhorn_iters: int,
        hc_eps: float,
        norm_eps: float,
        *,
        block_norm: tuple[torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return hc_post_pre(
            out, x, post, comb, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps,
            block_norm=block_norm, num_sms=self.num_sms,
        )  # fmt: skip
