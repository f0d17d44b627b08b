"""Routed experts at decode as matrix-vector products in Triton: one (token, slot) pair a program.

At a few tokens a step almost every routed expert sees one pair, so ``triton.py``'s grouped GEMMs
fill 16-row tensor-core tiles with one useful row, the packed path upcasts e2m1 into the MMA's
operand layout for all sixteen, and the alignment (sort, searchsorted, scatter) costs launches
of its own. Here a program takes one pair and BLOCK_N output rows of its expert's matrix, reads
the bytes once, turns them into values with a few integer ops and one conversion, and multiplies
them on the CUDA cores in fp32. Data flow, all on x's device, shapes only (a CUDA graph
captures it):

    x [T, D], topk_ids [T, k], w1, w3 [E, I, D]    --_gate_up_kernel-->  h [T * k, I]  (SwiGLU)
    h, topk_ids, topk_weights [T, k], w2 [E, D, I] --_down_kernel----->  out [T, D]

    grid: gate/up (pair, I tile), down (token, D tile)

The down kernel adds a token's k pairs in slot order in fp32, each pair's weighted output rounded
to x's dtype first, as ``triton.py``'s combine does, so there are no per-pair rows and no combine
launch. A token's output depends only on its own routing and the tile sizes: it is bitwise the
same alone or in any batch that runs the same ``GemvConfig``.

Weights: ``Mxfp4Weight`` or dense in x's dtype. An e2m1 code c (sign bit 3, exponent bits 2-1,
mantissa bit 0) becomes the fp16 with bits (c & 8) << 12 | (c & 7) << 9: its exponent bits land
in fp16's exponent and its mantissa bit at the top of fp16's, so that fp16 is the e2m1 value times
2 ** -14 exactly (code 1, 0.5, becomes the subnormal 2 ** -15). A group's 32 products are summed
in fp32 and multiplied by 2 ** (byte - 127 + 14), a power of two whose fp32 bits are
(byte + 14) << 23: exact for every scale byte up to 240. The values are ``dequantize_mxfp4``'s;
only the order of the sums differs from the dense kernels'.

K (D for gate/up, I for down) must be a multiple of BLOCK_K: ``pick_block_k`` takes the largest
of the config's BLOCK_K and its halves that divides K (V4's K are powers of two; MXFP4 rows are
whole groups of 32, so 32 always divides).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.ops.moe.torch_ref import MXFP4_BLOCK

__all__ = ["GemvConfig", "decode_moe", "pick_block_k"]

_MAX_SCALE_BYTE = tl.constexpr(240)  # (byte + 14) << 23 stays a finite fp32 up to here


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the decode MoE: block_n output rows a program and block_k inputs a step, for
    the gate/up kernel and (down_*) the down kernel; num_warps for both."""

    block_n: int
    block_k: int
    down_block_n: int
    down_block_k: int
    num_warps: int


def pick_block_k(block_k: int, k: int) -> int:
    """The largest of block_k, block_k / 2, ... (>= 32) that divides k."""
    while block_k > MXFP4_BLOCK and k % block_k:
        block_k //= 2
    assert k % block_k == 0, f"{k} inputs are not whole {block_k}-input steps"
    return block_k


@triton.jit
def _e2m1_times_2_pow_minus_14(codes):
    """e2m1 codes (0..15, any integer type) -> fp32 values times 2 ** -14, exactly."""
    c = codes.to(tl.uint16)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _step_dot(
    x_ptr,
    x_row,
    stride_xk,
    w_ptr,
    w_rows,
    stride_wk,
    s_ptr,
    s_rows,
    stride_sk,
    k_start,
    BLOCK_K: tl.constexpr,
    W_FP4: tl.constexpr,
):
    """sum over inputs k_start .. k_start + BLOCK_K - 1 of w[row, k] * x[k], fp32 [BLOCK_N].

    x_row: the offset of x's row (the token, or the pair's h row); w_rows, s_rows [BLOCK_N]: the
    offsets of the weight's rows and of their scale bytes (the expert included). Packed: byte b
    of a row holds inputs 2b (low nibble) and 2b + 1 (high), group g the bytes 16g .. 16g + 15.
    """
    if W_FP4:
        offs_g = tl.arange(0, BLOCK_K // 32)
        byte = k_start // 2 + offs_g[:, None] * 16 + tl.arange(0, 16)[None, :]  # [G, 16]
        packed = tl.load(w_ptr + w_rows[:, None, None] + byte[None, :, :] * stride_wk)
        x_even = tl.load(x_ptr + x_row + 2 * byte * stride_xk).to(tl.float32)  # [G, 16]
        x_odd = tl.load(x_ptr + x_row + (2 * byte + 1) * stride_xk).to(tl.float32)
        low = _e2m1_times_2_pow_minus_14(packed & 0xF)  # [BLOCK_N, G, 16]
        high = _e2m1_times_2_pow_minus_14(packed >> 4)
        groups = tl.sum(low * x_even[None, :, :] + high * x_odd[None, :, :], axis=2)  # [BN, G]
        exps = tl.load(s_ptr + s_rows[:, None] + (k_start // 32 + offs_g)[None, :] * stride_sk)
        exps = tl.minimum(exps.to(tl.uint32), _MAX_SCALE_BYTE)
        scales = ((exps + 14) << 23).to(tl.float32, bitcast=True)  # 2 ** (byte - 113)
        return tl.sum(groups * scales, axis=1)
    else:
        offs_k = k_start + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :] * stride_wk).to(tl.float32)
        x = tl.load(x_ptr + x_row + offs_k * stride_xk).to(tl.float32)
        return tl.sum(w * x[None, :], axis=1)


@triton.jit(do_not_specialize=["limit"])
def _gate_up_kernel(
    x_ptr,
    w1_ptr,
    w3_ptr,
    s1_ptr,
    s3_ptr,
    h_ptr,
    topk_ids_ptr,
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_FP4: tl.constexpr,
):
    """h[pair, N tile] = swiglu(x[token] @ w1[e]^T, x[token] @ w3[e]^T), N = I, K = D."""
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    x_row = (pair // TOP_K) * stride_xt
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)  # wrapped rows keep the loads in bounds; not stored
    w_rows = expert * stride_we + rows * stride_wn
    s_rows = expert * stride_se + rows * stride_sn

    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        gate += _step_dot(
            x_ptr, x_row, stride_xk, w1_ptr, w_rows, stride_wk, s1_ptr, s_rows, stride_sk,
            k_start, BLOCK_K, W_FP4,
        )  # fmt: skip
        up += _step_dot(
            x_ptr, x_row, stride_xk, w3_ptr, w_rows, stride_wk, s3_ptr, s_rows, stride_sk,
            k_start, BLOCK_K, W_FP4,
        )  # fmt: skip

    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    h_ptrs = h_ptr + pair * stride_hm + offs_n * stride_hn
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _down_kernel(
    h_ptr,
    w2_ptr,
    s2_ptr,
    out_ptr,
    topk_ids_ptr,
    topk_weights_ptr,
    stride_hm,
    stride_hk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_ot,
    stride_on,
    N: tl.constexpr,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_FP4: tl.constexpr,
):
    """out[token, N tile] = sum over slots j = 0..k-1, in that order, in fp32, of
    round(topk_weight[pair] * h[pair] @ w2[e]^T), pair = token * k + j; N = D, K = I."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)
    out_dtype = out_ptr.dtype.element_ty

    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
        w_rows = expert * stride_we + rows * stride_wn
        s_rows = expert * stride_se + rows * stride_sn
        part = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            part += _step_dot(
                h_ptr, pair * stride_hm, stride_hk, w2_ptr, w_rows, stride_wk, s2_ptr, s_rows,
                stride_sk, k_start, BLOCK_K, W_FP4,
            )  # fmt: skip
        weight = tl.load(topk_weights_ptr + pair).to(tl.float32)
        acc += (part * weight).to(out_dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + offs_n * stride_on, acc.to(out_dtype), offs_n < N)


def decode_moe(
    x: torch.Tensor,
    weights: tuple[tuple[torch.Tensor, torch.Tensor | None], ...],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float,
    config: GemvConfig,
) -> torch.Tensor:
    """``triton.fused_moe`` for few tokens: x [T, D]; weights ((w1, s1), (w2, s2), (w3, s3)),
    each the weight's tensor (packed bytes [E, N, K/2] or dense [E, N, K]) and its scale bytes
    (None when dense); topk_ids [T, k]; topk_weights [T, k] fp32. Returns [T, D] in x's dtype."""
    (w1, s1), (w2, s2), (w3, s3) = weights
    packed = s1 is not None
    num_tokens, dim = x.shape
    top_k = topk_ids.shape[1]
    inter = w1.shape[1]
    flat_ids = topk_ids.reshape(-1).contiguous()
    flat_weights = topk_weights.reshape(-1).contiguous()
    # A dense weight stands in for the scales it does not have (never read).
    s1, s2, s3 = (w if s is None else s for w, s in ((w1, s1), (w2, s2), (w3, s3)))
    dense_strides = (0, 0, 0)

    h = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    block_k = pick_block_k(config.block_k, dim)
    _gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, config.block_n))](
        x,
        w1,
        w3,
        s1,
        s3,
        h,
        flat_ids,
        float(limit),
        *x.stride(),
        *w1.stride(),
        *(s1.stride() if packed else dense_strides),
        *h.stride(),
        N=inter,
        K=dim,
        TOP_K=top_k,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        W_FP4=packed,
        num_warps=config.num_warps,
    )

    out = torch.empty((num_tokens, dim), dtype=x.dtype, device=x.device)
    block_k = pick_block_k(config.down_block_k, inter)
    _down_kernel[(num_tokens, triton.cdiv(dim, config.down_block_n))](
        h,
        w2,
        s2,
        out,
        flat_ids,
        flat_weights,
        *h.stride(),
        *w2.stride(),
        *(s2.stride() if packed else dense_strides),
        *out.stride(),
        N=dim,
        K=inter,
        TOP_K=top_k,
        BLOCK_N=config.down_block_n,
        BLOCK_K=block_k,
        W_FP4=packed,
        num_warps=config.num_warps,
    )
    return out
