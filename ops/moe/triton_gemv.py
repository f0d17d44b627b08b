"""Routed experts at decode as matrix-vector products in Triton: one (token, slot) pair a program.

At a few tokens a step almost every routed expert sees one pair, so ``triton.py``'s grouped GEMMs
fill 16-row tensor-core tiles with one useful row, the packed path upcasts e2m1 into the MMA's
operand layout for all sixteen, and the alignment (sort, searchsorted, scatter) costs launches
of its own. Here a program takes one pair and BLOCK_N output rows of its expert's matrix, reads
the bytes once, turns them into values with a few integer ops and one conversion, and multiplies
them on the CUDA cores in fp32. Data flow, all on x's device, shapes only (a CUDA graph
captures it):

    x [T, D], topk_ids [T, k], w1, w3 [E, I, D]    --_gate_up_kernel-->  h [T * k, I] fp32
    h, topk_ids, topk_weights [T, k], w2 [E, D, I] --_down_kernel----->  out [T, D]

    grid: gate/up (pair, I tile), down (token, D tile) or, up to down_split_tokens tokens,
    (token, D tile, slot)

The down kernel adds a token's k pairs in slot order in fp32, each pair's weighted output rounded
to x's dtype first, as ``triton.py``'s combine does, so there are no per-pair rows and no combine
launch. At one token a program per (token, D tile) would loop over all k experts' rows, each
step waiting on its loads; split over the slots, each program reads one expert's rows, and the
tile's last program (a ticket, ops/triton_tickets.py) adds the k rounded products in slot
order: the same fp32 sums as the loop, bitwise. A token's output depends only on its own routing
and the tile sizes: it is bitwise the same alone or in any batch that runs the same
``GemvConfig`` (the slot split included). Each kernel loads the next step's weights before it
computes on the current ones, so a step's loads are in flight while the last step's arithmetic
runs.

Packed weights (``Mxfp4Weight``) are read as 32-bit words, 8 inputs a word, 4 words a scale
group, each thread taking whole groups (16-byte loads):

    word w of group g (inputs 32g + 8w .. 32g + 8w + 7), nibble j = input 32g + 8w + j:
        bits  31..28  27..24  23..20  19..16  15..12  11..8   7..4    3..0
        nibble  7       6       5       4       3       2       1       0

An e2m1 nibble (sign bit 3, exponent bits 2-1, mantissa bit 0) becomes the fp16 with bits
(n & 8) << 12 | (n & 7) << 9: its exponent bits land in fp16's exponent and its mantissa bit at
the top of fp16's, so that fp16 is the e2m1 value times 2 ** -14 exactly (nibble 1, 0.5, becomes
the subnormal 2 ** -15). Nibbles j and j + 4 sit 16 bits apart, so two shifts and two masks place
both in the two fp16 halves of one register (``_nibble_pair``). A group's 32 products are summed
in fp32 and multiplied by 2 ** (byte - 127 + 14), a power of two whose fp32 bits are
(byte + 14) << 23: exact for every scale byte up to 240. The values are ``dequantize_mxfp4``'s;
only the order of the sums differs from the dense kernels'.

The down kernel reads h nibble-major within each group, as the gate/up kernel writes it (input
32g + 8w + j at 32g + 4j + w), so the h values that meet nibble j of a group's four words are
four consecutive floats. h holds fp32 values rounded to x's dtype (the reference's rounding).

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
from deepinfer.ops.streams import Pending, ready
from deepinfer.ops.triton_pdl import enter, pdl
from deepinfer.ops.triton_swiglu import swiglu
from deepinfer.ops.triton_tickets import MAX_TICKET_TILES, arrive, depart, ticket_counters

__all__ = [
    "GemvConfig",
    "decode_moe",
    "down",
    "gate_up",
    "mma_order_index",
    "nibble_major",
    "pair_order",
    "pick_block_k",
    "reorder_mma_order",
    "reorder_nibble_major",
    "reorder_pair_order",
    "residual_rows",
    "store_output",
]

_MAX_SCALE_BYTE = tl.constexpr(240)  # (byte + 14) << 23 stays a finite fp32 up to here


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the decode MoE: block_n output rows a program and block_k inputs a step, with
    num_warps, for the gate/up kernel and (down_*) the down kernel; up to down_split_tokens
    tokens, the down kernel takes a program per (token, slot) instead of per token; from
    reorder_x_tokens tokens (0: never), packed gate/up reads x copied into h's nibble-major
    order (8-byte x loads for 2-byte gathers, for one more launch)."""

    block_n: int
    block_k: int
    num_warps: int
    down_block_n: int
    down_block_k: int
    down_num_warps: int
    down_split_tokens: int = 0
    reorder_x_tokens: int = 0


def pick_block_k(block_k: int, k: int) -> int:
    """The largest of block_k, block_k / 2, ... (>= 32) that divides k."""
    while block_k > MXFP4_BLOCK and k % block_k:
        block_k //= 2
    assert k % block_k == 0, f"{k} inputs are not whole {block_k}-input steps"
    return block_k


@triton.jit
def _nibble_major_index(i):
    """Where input i (32g + 8w + j) sits in h's nibble-major order: 32g + 4j + w."""
    return (i // 32) * 32 + (i % 8) * 4 + (i % 32) // 8


@triton.jit
def _pair_order_index(i):
    """Where input i (8w + j) sits in the grouped kernels' bits pair order (``triton.py``'s
    ``_in_pair_order``): 8w + 2 (j % 4) + j // 4, so that inputs j and j + 4 of each 8 are
    side by side."""
    return (i // 8) * 8 + (i % 4) * 2 + (i % 8) // 4


@triton.jit
def mma_order_index(i):
    """Where input i (32t + 8i' + 4b + 2jh + jl of its 128) sits in gluon.py's ``mma_order``:
    32i' + 16jh + 8jl + 2t + b, the K order of wgmma's register operand (the x reorder's index
    here, and where gluon.py's gate/up kernel stores each feature of h)."""
    q = i % 128
    position = 32 * ((q // 8) % 4) + 16 * ((q // 2) % 2) + 8 * (q % 2) + 2 * (q // 32)
    return i - q + position + (q // 4) % 2


@triton.jit
def _nibble_pair(words, J: tl.constexpr):
    """Nibbles J and J + 4 (J < 4) of each uint32 word as fp32 e2m1 values times 2 ** -14."""
    mag = words << (9 - 4 * J) if J <= 2 else words >> (4 * J - 9)
    sign = words << (12 - 4 * J)
    halves = (mag & 0x0E000E00) | (sign & 0x80008000)  # two fp16: nibble J low, J + 4 high
    low = halves.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    high = (halves >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return low, high


@triton.jit
def _load_weights(w_ptr, w_rows, k_start, BLOCK_K: tl.constexpr, W_FP4: tl.constexpr):
    """The step's weights: packed, uint32 words [BLOCK_N, BLOCK_K / 8] (w_ptr the int32 view);
    dense, [BLOCK_N, BLOCK_K] values. w_rows [BLOCK_N]: row offsets in w_ptr's elements."""
    if W_FP4:
        offs = k_start // 8 + tl.arange(0, BLOCK_K // 8)
        return tl.load(w_ptr + w_rows[:, None] + offs[None, :]).to(tl.uint32, bitcast=True)
    else:
        offs = k_start + tl.arange(0, BLOCK_K)
        return tl.load(w_ptr + w_rows[:, None] + offs[None, :])


@triton.jit
def _group_sums(w, x_ptr, k_start, BLOCK_K: tl.constexpr, W_FP4: tl.constexpr,
                X_NIBBLE_MAJOR: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_K / 32] fp32: each scale group's 32 products of w (``_load_weights``)
    and x (x_ptr at the row's input 0), packed values times 2 ** -14. X_NIBBLE_MAJOR: x is in
    h's order (module docstring), else in input order."""
    G: tl.constexpr = BLOCK_K // 32
    if W_FP4:
        word = k_start // 8 + tl.arange(0, BLOCK_K // 8)  # [W]
        if X_NIBBLE_MAJOR:
            x_words = x_ptr + (word // 4) * 32 + word % 4  # nibble 0 of each word
            nibble_step: tl.constexpr = 4
        else:
            x_words = x_ptr + word * 8
            nibble_step: tl.constexpr = 1
        acc = tl.zeros(w.shape, dtype=tl.float32)  # [BLOCK_N, W]
        for j in tl.static_range(4):
            low, high = _nibble_pair(w, j)
            acc += low * tl.load(x_words + j * nibble_step).to(tl.float32)[None, :]
            acc += high * tl.load(x_words + (j + 4) * nibble_step).to(tl.float32)[None, :]
        return tl.sum(acc.reshape(acc.shape[0], G, 4), axis=2)
    else:
        k = k_start + tl.arange(0, BLOCK_K)
        if X_NIBBLE_MAJOR:
            k = _nibble_major_index(k)
        prod = w.to(tl.float32) * tl.load(x_ptr + k).to(tl.float32)[None, :]
        return tl.sum(prod.reshape(prod.shape[0], G, 32), axis=2)


@triton.jit
def _group_scales(s_ptr, s_rows, k_start, BLOCK_K: tl.constexpr, W_FP4: tl.constexpr):
    """[BLOCK_N, BLOCK_K / 32] fp32: 2 ** (byte - 113) for each group's scale byte (packed),
    else 1. s_rows [BLOCK_N]: the rows' offsets in s_ptr."""
    G: tl.constexpr = BLOCK_K // 32
    if W_FP4:
        exps = tl.load(s_ptr + s_rows[:, None] + (k_start // 32 + tl.arange(0, G))[None, :])
        exps = tl.minimum(exps.to(tl.uint32), _MAX_SCALE_BYTE)
        return ((exps + 14) << 23).to(tl.float32, bitcast=True)
    else:
        return tl.full((s_rows.shape[0], G), 1.0, tl.float32)


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
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_hm,
    N: tl.constexpr,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_FP4: tl.constexpr,
    X_NIBBLE_MAJOR: tl.constexpr,
    PDL: tl.constexpr,
):
    """h[pair, N tile] = swiglu(x[token] @ w1[e]^T, x[token] @ w3[e]^T), N = I, K = D; inputs
    contiguous along K (w strides in w_ptr's elements: int32 words when packed); x in h's
    order (X_NIBBLE_MAJOR, packed only) or the inputs'."""
    enter(PDL)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // TOP_K) * stride_xt
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)  # wrapped rows keep the loads in bounds; not stored
    w_rows = expert * stride_we + rows * stride_wn
    s_rows = expert * stride_se + rows * stride_sn

    gate = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
    w1 = _load_weights(w1_ptr, w_rows, 0, BLOCK_K, W_FP4)
    w3 = _load_weights(w3_ptr, w_rows, 0, BLOCK_K, W_FP4)
    for k_start in range(0, K, BLOCK_K):
        k_next = (k_start + BLOCK_K) % K  # the last step loads the first again: unused
        w1_next = _load_weights(w1_ptr, w_rows, k_next, BLOCK_K, W_FP4)
        w3_next = _load_weights(w3_ptr, w_rows, k_next, BLOCK_K, W_FP4)
        gate += _group_sums(w1, x_row, k_start, BLOCK_K, W_FP4, X_NIBBLE_MAJOR) * (
            _group_scales(s1_ptr, s_rows, k_start, BLOCK_K, W_FP4)
        )
        up += _group_sums(w3, x_row, k_start, BLOCK_K, W_FP4, X_NIBBLE_MAJOR) * (
            _group_scales(s3_ptr, s_rows, k_start, BLOCK_K, W_FP4)
        )
        w1 = w1_next
        w3 = w3_next

    h = swiglu(tl.sum(gate, axis=1), tl.sum(up, axis=1), limit)
    h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    offs_h = _nibble_major_index(offs_n) if W_FP4 else offs_n
    tl.store(h_ptr + pair * stride_hm + offs_h, h, mask=offs_n < N)


@triton.jit
def _down_kernel(
    h_ptr,
    w2_ptr,
    s2_ptr,
    out_ptr,
    residual_ptr,
    part_ptr,
    counters_ptr,
    topk_ids_ptr,
    topk_weights_ptr,
    stride_hm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    stride_rt,
    N: tl.constexpr,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_FP4: tl.constexpr,
    SPLIT_SLOTS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[token, N tile] = sum over slots j = 0..k-1, in that order, in fp32, of
    round(topk_weight[pair] * h[pair] @ w2[e]^T), pair = token * k + j; N = D, K = I. The loop
    runs over (slot, K step) so that the next slot's first weights load during the last step.
    SPLIT_SLOTS: a program per slot (grid axis 2) stores its rounded product in part [T * k, N]
    fp32 and takes a ticket; the tile's last program adds the k of them in slot order, as the
    loop would (0 + p_0 + p_1 + ...: the same fp32 sums, bitwise), and resets the counter.
    RESIDUAL: the token's residual row is added to its output (``store_output``)."""
    enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)
    out_dtype = out_ptr.dtype.element_ty
    STEPS: tl.constexpr = K // BLOCK_K
    SLOTS: tl.constexpr = 1 if SPLIT_SLOTS else TOP_K
    first = token * TOP_K + tl.program_id(2)  # the first pair this program takes

    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    part = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
    expert = tl.load(topk_ids_ptr + first).to(tl.int64)
    w = _load_weights(w2_ptr, expert * stride_we + rows * stride_wn, 0, BLOCK_K, W_FP4)
    for step in range(SLOTS * STEPS):
        pair = first + step // STEPS
        k_start = (step % STEPS) * BLOCK_K
        following = (step + 1) % (SLOTS * STEPS)  # the last step loads the first again: unused
        next_expert = tl.load(topk_ids_ptr + first + following // STEPS).to(tl.int64)
        w_next = _load_weights(
            w2_ptr, next_expert * stride_we + rows * stride_wn, (following % STEPS) * BLOCK_K,
            BLOCK_K, W_FP4,
        )  # fmt: skip
        s_rows = expert * stride_se + rows * stride_sn
        part += _group_sums(w, h_ptr + pair * stride_hm, k_start, BLOCK_K, W_FP4, W_FP4) * (
            _group_scales(s2_ptr, s_rows, k_start, BLOCK_K, W_FP4)
        )
        if step % STEPS == STEPS - 1:
            weight = tl.load(topk_weights_ptr + pair).to(tl.float32)
            acc += (tl.sum(part, axis=1) * weight).to(out_dtype).to(tl.float32)
            part = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
        w = w_next
        expert = next_expert
    in_n = offs_n < N
    if SPLIT_SLOTS:  # a ticket (ops/triton_tickets.py): the tile's last slot adds them all
        tl.store(part_ptr + first * N + offs_n, acc, mask=in_n)
        counter = counters_ptr + token * tl.num_programs(1) + tl.program_id(1)
        if arrive(counter, TOP_K):
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for slot in range(TOP_K):
                parts = part_ptr + (token * TOP_K + slot) * N + offs_n
                acc += tl.load(parts, mask=in_n, other=0.0, cache_modifier=".cg")
            store_output(
                out_ptr + token * stride_ot + offs_n, residual_ptr + token * stride_rt + offs_n,
                acc, in_n, RESIDUAL,
            )  # fmt: skip
            depart(counter)
    else:
        store_output(
            out_ptr + token * stride_ot + offs_n, residual_ptr + token * stride_rt + offs_n, acc,
            in_n, RESIDUAL,
        )  # fmt: skip


@triton.jit
def store_output(out_ptrs, residual_ptrs, acc, mask, RESIDUAL: tl.constexpr):
    """The MoE's fp32 sums acc rounded to out's dtype; RESIDUAL: then the residual row added
    and rounded again, as ``routed + residual`` of two tensors in that dtype computes."""
    dtype = out_ptrs.dtype.element_ty
    out = acc.to(dtype)
    if RESIDUAL:
        out = (out.to(tl.float32) + tl.load(residual_ptrs, mask=mask).to(tl.float32)).to(dtype)
    tl.store(out_ptrs, out, mask=mask)


def decode_moe(
    x: torch.Tensor,
    weights: tuple[tuple[torch.Tensor, torch.Tensor | None], ...],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float,
    config: GemvConfig,
    residual: torch.Tensor | Pending | None = None,
) -> torch.Tensor:
    """``triton.fused_moe`` for few tokens: x [T, D]; weights ((w1, s1), (w2, s2), (w3, s3)),
    each the weight's tensor (packed bytes [E, N, K/2] or dense [E, N, K], contiguous along K)
    and its scale bytes (None when dense); topk_ids [T, k]; topk_weights [T, k] fp32;
    residual [T, D] in x's dtype (or ``Pending``: joined before the down launch) or None, added
    to the output. Returns [T, D] in x's dtype."""
    (w1, s1), (w2, s2), (w3, s3) = weights
    reorder = s1 is not None and 0 < config.reorder_x_tokens <= x.shape[0]
    x_in = reorder_nibble_major(x) if reorder else x
    h = gate_up(x_in, (w1, s1), (w3, s3), topk_ids, limit, config, x_nibble_major=reorder)
    return down(h, (w2, s2), topk_ids, topk_weights, x.dtype, config, residual)


# The orders _reorder_kernel writes (its ORDER).
_NIBBLE_MAJOR, _PAIR_ORDER, _MMA_ORDER = 0, 1, 2


@triton.jit
def _reorder_kernel(x_ptr, out_ptr, stride_x, D: tl.constexpr, BLOCK: tl.constexpr,
                    ORDER: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Row t of x to row t of out in h's nibble-major order (``nibble_major``, ORDER 0), the
    grouped kernels' pair order (``pair_order``, 1) or gluon.py's ``mma_order`` (2)."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    in_d = d < D
    row = tl.load(x_ptr + t * stride_x + d, mask=in_d)
    if ORDER == 2:
        target = mma_order_index(d)
    elif ORDER == 1:
        target = _pair_order_index(d)
    else:
        target = _nibble_major_index(d)
    tl.store(out_ptr + t * D + target, row, mask=in_d)


def reorder_nibble_major(x: torch.Tensor) -> torch.Tensor:
    """``nibble_major(x)`` for x [T, D] in one launch (the decode step's graph keeps it in the
    programmatic-launch chain)."""
    return _reorder(x, _NIBBLE_MAJOR)


def reorder_pair_order(x: torch.Tensor) -> torch.Tensor:
    """``pair_order(x)`` for x [T, D] in one launch (the grouped kernels' bits path)."""
    return _reorder(x, _PAIR_ORDER)


def reorder_mma_order(x: torch.Tensor) -> torch.Tensor:
    """gluon.py's ``mma_order(x)`` for x [T, D] (D a multiple of 128) in one launch (its
    kernels' activations)."""
    assert x.shape[1] % 128 == 0, f"x {tuple(x.shape)}: not whole 128-input K steps"
    return _reorder(x, _MMA_ORDER)


def _reorder(x: torch.Tensor, order: int) -> torch.Tensor:
    assert x.stride(1) == 1 and x.shape[1] % MXFP4_BLOCK == 0, f"x {tuple(x.shape)}"
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _reorder_kernel[(x.shape[0],)](
            x, out, x.stride(0), D=x.shape[1], BLOCK=block, ORDER=order, num_warps=4,
            **pdl(x.device),
        )  # fmt: skip
    return out


def nibble_major(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] with each group of 32 in h's order (module docstring): input 32g + 8w + j
    at 32g + 4j + w."""
    groups = x.shape[-1] // MXFP4_BLOCK
    grouped = x.reshape(*x.shape[:-1], groups, 4, 8)
    return grouped.transpose(-1, -2).reshape(x.shape).contiguous()


def pair_order(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] with each 8 inputs in the grouped kernels' pair order (``_pair_order_index``):
    inputs 0, 4, 1, 5, 2, 6, 3, 7."""
    eights = x.reshape(*x.shape[:-1], x.shape[-1] // 8, 2, 4)
    return eights.transpose(-1, -2).reshape(x.shape).contiguous()


def _operand(w: torch.Tensor, s: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight as the kernels read it, its scales): packed bytes as int32 words (8 inputs a
    word); a dense weight stands in for the scales it does not have (never read)."""
    assert w.stride(2) == 1, f"weights must be contiguous along K, strides {w.stride()}"
    return (w, w) if s is None else (w.view(torch.int32), s)


def gate_up(
    x: torch.Tensor,
    w1: tuple[torch.Tensor, torch.Tensor | None],
    w3: tuple[torch.Tensor, torch.Tensor | None],
    topk_ids: torch.Tensor,
    limit: float,
    config: GemvConfig,
    *,
    x_nibble_major: bool = False,
) -> torch.Tensor:
    """h [T * k, I] fp32 (nibble-major in each group of 32 when packed; module docstring) of
    x [T, D] and each pair's expert (w1, w3: (weight, scales) as in ``decode_moe``).
    ``x_nibble_major``: x's D is in that order too (``nibble_major(x)``; packed experts)."""
    packed = w1[1] is not None
    assert packed or not x_nibble_major, "x in nibble-major order needs packed experts"
    (w1, s1), (w3, s3) = _operand(*w1), _operand(*w3)
    assert x.stride(1) == 1, f"x must be contiguous along D, strides {x.stride()}"
    num_pairs = topk_ids.numel()
    dim, inter = x.shape[1], w1.shape[1]
    h = torch.empty((num_pairs, inter), dtype=torch.float32, device=x.device)
    _gate_up_kernel[(num_pairs, triton.cdiv(inter, config.block_n))](
        x,
        w1,
        w3,
        s1,
        s3,
        h,
        topk_ids.reshape(-1).contiguous(),
        float(limit),
        x.stride(0),
        *w1.stride()[:2],
        *s1.stride()[:2],
        h.stride(0),
        N=inter,
        K=dim,
        TOP_K=topk_ids.shape[1],
        BLOCK_N=config.block_n,
        BLOCK_K=pick_block_k(config.block_k, dim),
        W_FP4=packed,
        X_NIBBLE_MAJOR=x_nibble_major,
        num_warps=config.num_warps,
        **pdl(x.device),
    )
    return h


def residual_rows(
    residual: torch.Tensor | Pending | None, out: torch.Tensor
) -> torch.Tensor | None:
    """The rows a MoE's last launch adds to out [T, D] (the shared expert's), or None: joined
    from the side stream where they were made there (ops/streams.py), checked against out,
    contiguous along D. Call it right before that launch."""
    residual = ready(residual)
    if residual is not None:
        assert residual.shape == out.shape and residual.dtype == out.dtype, (
            f"residual {tuple(residual.shape)} {residual.dtype}, out {tuple(out.shape)} {out.dtype}"
        )
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
    return residual


def down(
    h: torch.Tensor,
    w2: tuple[torch.Tensor, torch.Tensor | None],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    dtype: torch.dtype,
    config: GemvConfig,
    residual: torch.Tensor | Pending | None = None,
) -> torch.Tensor:
    """out [T, D] in ``dtype``: each token's slots' h (``gate_up``'s) through their experts' w2
    ((weight, scales) as in ``decode_moe``), weighted and added in slot order; plus
    ``residual`` [T, D] in ``dtype`` (``store_output``) when given."""
    packed = w2[1] is not None
    w2, s2 = _operand(*w2)
    num_tokens, top_k = topk_ids.shape
    dim, inter = w2.shape[1], h.shape[1]
    out = torch.empty((num_tokens, dim), dtype=dtype, device=h.device)
    residual = residual_rows(residual, out)
    num_tiles = triton.cdiv(dim, config.down_block_n)
    split = num_tokens <= config.down_split_tokens and num_tokens * num_tiles <= MAX_TICKET_TILES
    if split:  # a program per slot; their rounded products meet in part
        part = torch.empty((num_tokens * top_k, dim), dtype=torch.float32, device=h.device)
    else:
        part = out  # not read
    _down_kernel[(num_tokens, num_tiles, top_k if split else 1)](
        h,
        w2,
        s2,
        out,
        out if residual is None else residual,
        part,
        ticket_counters(h.device),
        topk_ids.reshape(-1).contiguous(),
        topk_weights.reshape(-1).contiguous(),
        h.stride(0),
        *w2.stride()[:2],
        *s2.stride()[:2],
        out.stride(0),
        0 if residual is None else residual.stride(0),
        N=dim,
        K=inter,
        TOP_K=top_k,
        BLOCK_N=config.down_block_n,
        BLOCK_K=pick_block_k(config.down_block_k, inter),
        W_FP4=packed,
        SPLIT_SLOTS=split,
        RESIDUAL=residual is not None,
        num_warps=config.down_num_warps,
        **pdl(h.device),
    )
    return out
