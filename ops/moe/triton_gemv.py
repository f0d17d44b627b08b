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
    (token, D tile, slot); from expert_tokens tokens, both (expert, tile)

Expert-major (``_expert_gate_up_kernel``, ``_expert_down_kernel``): past a few tokens experts
repeat (T = 32: 192 pairs on ~135 of 256 experts; T = 128: 768 on ~243), and a program a pair
reads and decodes an expert's tile once per pair. A program per (expert, tile) instead takes
its expert's pairs, listed once by ``expert_lists`` (one launch: a compare and a prefix sum an
expert; no sort), in passes of up to four: each K step's weights are loaded and each nibble
plane decoded once, then multiplied with every pair's x of the pass. Each pair's sums are the
per-pair kernels', op for op, so the output is bitwise theirs. The down products meet through
the slot split's tickets.

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
from deepinfer.ops.triton_pdl import enter, pdl
from deepinfer.ops.triton_tickets import MAX_TICKET_TILES, arrive, depart, ticket_counters

__all__ = [
    "GemvConfig",
    "decode_moe",
    "down",
    "expert_lists",
    "gate_up",
    "nibble_major",
    "pick_block_k",
    "reorder_nibble_major",
]

_MAX_SCALE_BYTE = tl.constexpr(240)  # (byte + 14) << 23 stays a finite fp32 up to here


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the decode MoE: block_n output rows a program and block_k inputs a step, with
    num_warps, for the gate/up kernel and (down_*) the down kernel; up to down_split_tokens
    tokens, the down kernel takes a program per (token, slot) instead of per token; from
    reorder_x_tokens tokens (0: never), packed gate/up reads x copied into h's nibble-major
    order (8-byte x loads for 2-byte gathers, for one more launch); from expert_tokens tokens
    (0: never), both kernels take a program per (expert, tile) instead of per pair, reading and
    decoding each weight tile once for up to expert_pass (down: down_expert_pass) <= 4 of the
    expert's pairs at a time (more pairs a pass, more registers)."""

    block_n: int
    block_k: int
    num_warps: int
    down_block_n: int
    down_block_k: int
    down_num_warps: int
    down_split_tokens: int = 0
    reorder_x_tokens: int = 0
    expert_tokens: int = 0
    expert_pass: int = 4
    down_expert_pass: int = 4


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
    and x (x_ptr at the row's input 0), packed values times 2 ** -14 (``_pass_sums`` of one
    row)."""
    sums, _, _, _ = _pass_sums(
        w, x_ptr, x_ptr, x_ptr, x_ptr, k_start, BLOCK_K, W_FP4, X_NIBBLE_MAJOR, 1
    )
    return sums


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


@triton.jit
def _expert_tile(expert, stride_we, stride_wn, stride_se, stride_sn, N: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """The program's N tile (offs_n [BLOCK_N], axis 1 of the grid) of ``expert``'s matrix: its
    rows' offsets in the weights and in the scales. Rows past N wrap (the loads stay in
    bounds; their results are not stored)."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)
    expert = expert.to(tl.int64)
    return offs_n, expert * stride_we + rows * stride_wn, expert * stride_se + rows * stride_sn


@triton.jit
def _store_h(gate, up, limit, h_row, offs_n, x_ptr, N: tl.constexpr, W_FP4: tl.constexpr):
    """One pair's h for the N tile from its gate and up group sums [BLOCK_N, G]: the clamped
    SwiGLU, rounded to x's dtype, stored in h's order (nibble-major when packed)."""
    gate = tl.minimum(tl.sum(gate, axis=1), limit)
    up = tl.sum(up, axis=1)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = (gate * tl.sigmoid(gate) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    offs_h = _nibble_major_index(offs_n) if W_FP4 else offs_n
    tl.store(h_row + offs_h, h, mask=offs_n < N)


@triton.jit
def _slot_ticket(acc, pair, tile, num_tiles, part_ptr, counters_ptr, out_ptr, offs_n, stride_ot,
                 N: tl.constexpr, TOP_K: tl.constexpr):  # fmt: skip
    """One pair's rounded product acc [BLOCK_N] fp32 into part [T * k, N], then a ticket
    (ops/triton_tickets.py) on its token's tile: the last of the token's k adds their products
    in slot order (0 + p_0 + p_1 + ...), stores the token's output and resets the counter."""
    in_n = offs_n < N
    token = pair // TOP_K
    tl.store(part_ptr + pair * N + offs_n, acc, mask=in_n)
    counter = counters_ptr + token * num_tiles + tile
    if arrive(counter, TOP_K):
        acc = tl.zeros_like(acc)
        for slot in range(TOP_K):
            parts = part_ptr + (token * TOP_K + slot) * N + offs_n
            acc += tl.load(parts, mask=in_n, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + token * stride_ot + offs_n, acc.to(out_ptr.dtype.element_ty), mask=in_n)
        depart(counter)


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
    offs_n, w_rows, s_rows = _expert_tile(
        expert, stride_we, stride_wn, stride_se, stride_sn, N, BLOCK_N
    )

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

    _store_h(gate, up, limit, h_ptr + pair * stride_hm, offs_n, x_ptr, N, W_FP4)


@triton.jit
def _down_kernel(
    h_ptr,
    w2_ptr,
    s2_ptr,
    out_ptr,
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
    N: tl.constexpr,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_FP4: tl.constexpr,
    SPLIT_SLOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[token, N tile] = sum over slots j = 0..k-1, in that order, in fp32, of
    round(topk_weight[pair] * h[pair] @ w2[e]^T), pair = token * k + j; N = D, K = I. The loop
    runs over (slot, K step) so that the next slot's first weights load during the last step.
    SPLIT_SLOTS: a program per slot (grid axis 2) stores its rounded product in part [T * k, N]
    fp32 and takes a ticket; the tile's last program adds the k of them in slot order, as the
    loop would (0 + p_0 + p_1 + ...: the same fp32 sums, bitwise), and resets the counter."""
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
    if SPLIT_SLOTS:  # the tile's last slot adds them all
        _slot_ticket(
            acc, first, tl.program_id(1), tl.num_programs(1), part_ptr, counters_ptr, out_ptr,
            offs_n, stride_ot, N, TOP_K,
        )  # fmt: skip
    else:
        tl.store(out_ptr + token * stride_ot + offs_n, acc.to(out_dtype), mask=offs_n < N)


@triton.jit
def _expert_lists_kernel(topk_ids_ptr, lists_ptr, counts_ptr, num_pairs, PAIRS: tl.constexpr,
                         PDL: tl.constexpr):  # fmt: skip
    """Program e lists expert e's pairs in pair order: counts[e] of them, in lists[e, :] (a
    compare and a prefix sum over topk_ids; PAIRS: a power of two >= num_pairs)."""
    enter(PDL)
    expert = tl.program_id(0)
    offs = tl.arange(0, PAIRS)
    ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
    hits = (ids == expert).to(tl.int32)
    rank = tl.cumsum(hits, axis=0) - hits
    row = lists_ptr + expert.to(tl.int64) * num_pairs
    tl.store(row + rank, offs, mask=hits > 0)
    tl.store(counts_ptr + expert, tl.sum(hits, axis=0))


@triton.jit
def _pass_sums(w, x0, x1, x2, x3, k_start, BLOCK_K: tl.constexpr, W_FP4: tl.constexpr,
               X_NIBBLE_MAJOR: tl.constexpr, PASS: tl.constexpr):  # fmt: skip
    """Each scale group's 32 products ([BLOCK_N, BLOCK_K / 32] fp32, packed values times
    2 ** -14) of w (``_load_weights``) with each of the x rows x0 .. x(PASS - 1) (pointers at
    the rows' input 0; the others are not read, their sums are x0's). X_NIBBLE_MAJOR: x is in
    h's order (module docstring), else in input order. Each weight is decoded once: the nibble
    loop runs outside the rows', so two decoded planes are live at a time, and a row's sums
    are the same ops whatever the pass."""
    G: tl.constexpr = BLOCK_K // 32
    if W_FP4:
        word = k_start // 8 + tl.arange(0, BLOCK_K // 8)  # [W]
        if X_NIBBLE_MAJOR:
            offs = (word // 4) * 32 + word % 4  # nibble 0 of each word
            STEP: tl.constexpr = 4
        else:
            offs = word * 8
            STEP: tl.constexpr = 1
        a0 = tl.zeros(w.shape, dtype=tl.float32)  # [BLOCK_N, W]
        a1 = tl.zeros(w.shape, dtype=tl.float32)
        a2 = tl.zeros(w.shape, dtype=tl.float32)
        a3 = tl.zeros(w.shape, dtype=tl.float32)
        for j in tl.static_range(4):
            low, high = _nibble_pair(w, j)
            a0 += low * tl.load(x0 + offs + j * STEP).to(tl.float32)[None, :]
            a0 += high * tl.load(x0 + offs + (j + 4) * STEP).to(tl.float32)[None, :]
            if PASS > 1:
                a1 += low * tl.load(x1 + offs + j * STEP).to(tl.float32)[None, :]
                a1 += high * tl.load(x1 + offs + (j + 4) * STEP).to(tl.float32)[None, :]
            if PASS > 2:
                a2 += low * tl.load(x2 + offs + j * STEP).to(tl.float32)[None, :]
                a2 += high * tl.load(x2 + offs + (j + 4) * STEP).to(tl.float32)[None, :]
            if PASS > 3:
                a3 += low * tl.load(x3 + offs + j * STEP).to(tl.float32)[None, :]
                a3 += high * tl.load(x3 + offs + (j + 4) * STEP).to(tl.float32)[None, :]
        rows: tl.constexpr = w.shape[0]
        s0 = tl.sum(a0.reshape(rows, G, 4), axis=2)
        s1 = tl.sum(a1.reshape(rows, G, 4), axis=2) if PASS > 1 else s0
        s2 = tl.sum(a2.reshape(rows, G, 4), axis=2) if PASS > 2 else s0
        s3 = tl.sum(a3.reshape(rows, G, 4), axis=2) if PASS > 3 else s0
        return s0, s1, s2, s3
    else:
        k = k_start + tl.arange(0, BLOCK_K)
        if X_NIBBLE_MAJOR:
            k = _nibble_major_index(k)
        rows: tl.constexpr = w.shape[0]
        values = w.to(tl.float32)
        s0 = tl.sum((values * tl.load(x0 + k).to(tl.float32)[None, :]).reshape(rows, G, 32), 2)
        s1 = s0
        s2 = s0
        s3 = s0
        if PASS > 1:
            s1 = tl.sum((values * tl.load(x1 + k).to(tl.float32)[None, :]).reshape(rows, G, 32), 2)
        if PASS > 2:
            s2 = tl.sum((values * tl.load(x2 + k).to(tl.float32)[None, :]).reshape(rows, G, 32), 2)
        if PASS > 3:
            s3 = tl.sum((values * tl.load(x3 + k).to(tl.float32)[None, :]).reshape(rows, G, 32), 2)
        return s0, s1, s2, s3


@triton.jit
def _gate_up_pass(
    x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, pair_row, first, w_rows, s_rows, offs_n,
    limit, stride_xt, stride_hm, N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PASS: tl.constexpr, W_FP4: tl.constexpr,
    X_NIBBLE_MAJOR: tl.constexpr,
):  # fmt: skip
    """h of the expert's pairs first .. first + PASS - 1 (PASS <= 4) for the N tile: each K
    step's weights are loaded and decoded once and meet every pair's x. Each pair's sums are
    the per-pair kernel's, op for op."""
    p0 = tl.load(pair_row + first).to(tl.int64)
    p1 = tl.load(pair_row + first + 1).to(tl.int64) if PASS > 1 else p0
    p2 = tl.load(pair_row + first + 2).to(tl.int64) if PASS > 2 else p0
    p3 = tl.load(pair_row + first + 3).to(tl.int64) if PASS > 3 else p0
    x0 = x_ptr + (p0 // TOP_K) * stride_xt
    x1 = x_ptr + (p1 // TOP_K) * stride_xt
    x2 = x_ptr + (p2 // TOP_K) * stride_xt
    x3 = x_ptr + (p3 // TOP_K) * stride_xt
    G: tl.constexpr = BLOCK_K // 32
    g0 = tl.zeros((BLOCK_N, G), tl.float32)
    g1 = tl.zeros((BLOCK_N, G), tl.float32)
    g2 = tl.zeros((BLOCK_N, G), tl.float32)
    g3 = tl.zeros((BLOCK_N, G), tl.float32)
    u0 = tl.zeros((BLOCK_N, G), tl.float32)
    u1 = tl.zeros((BLOCK_N, G), tl.float32)
    u2 = tl.zeros((BLOCK_N, G), tl.float32)
    u3 = tl.zeros((BLOCK_N, G), tl.float32)
    w1 = _load_weights(w1_ptr, w_rows, 0, BLOCK_K, W_FP4)
    w3 = _load_weights(w3_ptr, w_rows, 0, BLOCK_K, W_FP4)
    for k_start in range(0, K, BLOCK_K):
        k_next = (k_start + BLOCK_K) % K  # the last step loads the first again: unused
        w1_next = _load_weights(w1_ptr, w_rows, k_next, BLOCK_K, W_FP4)
        w3_next = _load_weights(w3_ptr, w_rows, k_next, BLOCK_K, W_FP4)
        sc1 = _group_scales(s1_ptr, s_rows, k_start, BLOCK_K, W_FP4)
        sc3 = _group_scales(s3_ptr, s_rows, k_start, BLOCK_K, W_FP4)
        s0, s1, s2, s3 = _pass_sums(w1, x0, x1, x2, x3, k_start, BLOCK_K, W_FP4,
                                    X_NIBBLE_MAJOR, PASS)  # fmt: skip
        t0, t1, t2, t3 = _pass_sums(w3, x0, x1, x2, x3, k_start, BLOCK_K, W_FP4,
                                    X_NIBBLE_MAJOR, PASS)  # fmt: skip
        g0 += s0 * sc1
        u0 += t0 * sc3
        if PASS > 1:
            g1 += s1 * sc1
            u1 += t1 * sc3
        if PASS > 2:
            g2 += s2 * sc1
            u2 += t2 * sc3
        if PASS > 3:
            g3 += s3 * sc1
            u3 += t3 * sc3
        w1 = w1_next
        w3 = w3_next
    _store_h(g0, u0, limit, h_ptr + p0 * stride_hm, offs_n, x_ptr, N, W_FP4)
    if PASS > 1:
        _store_h(g1, u1, limit, h_ptr + p1 * stride_hm, offs_n, x_ptr, N, W_FP4)
    if PASS > 2:
        _store_h(g2, u2, limit, h_ptr + p2 * stride_hm, offs_n, x_ptr, N, W_FP4)
    if PASS > 3:
        _store_h(g3, u3, limit, h_ptr + p3 * stride_hm, offs_n, x_ptr, N, W_FP4)


@triton.jit(do_not_specialize=["num_pairs", "limit"])
def _expert_gate_up_kernel(
    x_ptr,
    w1_ptr,
    w3_ptr,
    s1_ptr,
    s3_ptr,
    h_ptr,
    lists_ptr,
    counts_ptr,
    num_pairs,
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
    PASS_MAX: tl.constexpr,
    W_FP4: tl.constexpr,
    X_NIBBLE_MAJOR: tl.constexpr,
    PDL: tl.constexpr,
):
    """``_gate_up_kernel``'s h, a program per (expert, N tile): the expert's pairs in passes of
    up to PASS_MAX <= 4 (``_gate_up_pass``); an expert without pairs returns at once."""
    enter(PDL)
    expert = tl.program_id(0)
    count = tl.load(counts_ptr + expert)  # its pairs: lists[expert, :count]
    if count == 0:
        return
    pair_row = lists_ptr + expert.to(tl.int64) * num_pairs
    offs_n, w_rows, s_rows = _expert_tile(
        expert, stride_we, stride_wn, stride_se, stride_sn, N, BLOCK_N
    )
    first = count * 0
    while first < count:  # (a for loop over count: Triton's interpreter cannot, under numpy 2.4)
        step = tl.minimum(count - first, PASS_MAX)  # the pass: up to PASS_MAX pairs
        if step == 4:
            if PASS_MAX >= 4:
                _gate_up_pass(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, pair_row, first,
                              w_rows, s_rows, offs_n, limit, stride_xt, stride_hm, N, K, TOP_K,
                              BLOCK_N, BLOCK_K, 4, W_FP4, X_NIBBLE_MAJOR)  # fmt: skip
        elif step == 3:
            if PASS_MAX >= 3:
                _gate_up_pass(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, pair_row, first,
                              w_rows, s_rows, offs_n, limit, stride_xt, stride_hm, N, K, TOP_K,
                              BLOCK_N, BLOCK_K, 3, W_FP4, X_NIBBLE_MAJOR)  # fmt: skip
        elif step == 2:
            if PASS_MAX >= 2:
                _gate_up_pass(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, pair_row, first,
                              w_rows, s_rows, offs_n, limit, stride_xt, stride_hm, N, K, TOP_K,
                              BLOCK_N, BLOCK_K, 2, W_FP4, X_NIBBLE_MAJOR)  # fmt: skip
        else:
            _gate_up_pass(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, pair_row, first,
                          w_rows, s_rows, offs_n, limit, stride_xt, stride_hm, N, K, TOP_K,
                          BLOCK_N, BLOCK_K, 1, W_FP4, X_NIBBLE_MAJOR)  # fmt: skip
        first += step


@triton.jit
def _down_pass(
    h_ptr, w2_ptr, s2_ptr, out_ptr, part_ptr, counters_ptr, topk_weights_ptr, pair_row, first,
    w_rows, s_rows, offs_n, stride_hm, stride_ot, N: tl.constexpr, K: tl.constexpr,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PASS: tl.constexpr,
    W_FP4: tl.constexpr,
):  # fmt: skip
    """The weighted, rounded products of the expert's pairs first .. first + PASS - 1 for the
    N tile, each handed to its token's ticket (``_slot_ticket``). Each pair's sums are the
    per-pair kernel's, op for op."""
    p0 = tl.load(pair_row + first).to(tl.int64)
    p1 = tl.load(pair_row + first + 1).to(tl.int64) if PASS > 1 else p0
    p2 = tl.load(pair_row + first + 2).to(tl.int64) if PASS > 2 else p0
    p3 = tl.load(pair_row + first + 3).to(tl.int64) if PASS > 3 else p0
    h0 = h_ptr + p0 * stride_hm
    h1 = h_ptr + p1 * stride_hm
    h2 = h_ptr + p2 * stride_hm
    h3 = h_ptr + p3 * stride_hm
    G: tl.constexpr = BLOCK_K // 32
    a0 = tl.zeros((BLOCK_N, G), tl.float32)
    a1 = tl.zeros((BLOCK_N, G), tl.float32)
    a2 = tl.zeros((BLOCK_N, G), tl.float32)
    a3 = tl.zeros((BLOCK_N, G), tl.float32)
    w = _load_weights(w2_ptr, w_rows, 0, BLOCK_K, W_FP4)
    for k_start in range(0, K, BLOCK_K):
        w_next = _load_weights(w2_ptr, w_rows, (k_start + BLOCK_K) % K, BLOCK_K, W_FP4)
        sc = _group_scales(s2_ptr, s_rows, k_start, BLOCK_K, W_FP4)
        s0, s1, s2, s3 = _pass_sums(w, h0, h1, h2, h3, k_start, BLOCK_K, W_FP4, W_FP4, PASS)
        a0 += s0 * sc
        if PASS > 1:
            a1 += s1 * sc
        if PASS > 2:
            a2 += s2 * sc
        if PASS > 3:
            a3 += s3 * sc
        w = w_next
    _down_ticket(a0, p0, topk_weights_ptr, part_ptr, counters_ptr, out_ptr, offs_n, stride_ot,
                 N, TOP_K)  # fmt: skip
    if PASS > 1:
        _down_ticket(a1, p1, topk_weights_ptr, part_ptr, counters_ptr, out_ptr, offs_n,
                     stride_ot, N, TOP_K)  # fmt: skip
    if PASS > 2:
        _down_ticket(a2, p2, topk_weights_ptr, part_ptr, counters_ptr, out_ptr, offs_n,
                     stride_ot, N, TOP_K)  # fmt: skip
    if PASS > 3:
        _down_ticket(a3, p3, topk_weights_ptr, part_ptr, counters_ptr, out_ptr, offs_n,
                     stride_ot, N, TOP_K)  # fmt: skip


@triton.jit
def _down_ticket(sums, pair, topk_weights_ptr, part_ptr, counters_ptr, out_ptr, offs_n, stride_ot,
                 N: tl.constexpr, TOP_K: tl.constexpr):  # fmt: skip
    """A pair's group sums [BLOCK_N, G] weighted and rounded to out's dtype (as the per-pair
    kernel's), to its token's ticket."""
    weight = tl.load(topk_weights_ptr + pair).to(tl.float32)
    product = (tl.sum(sums, axis=1) * weight).to(out_ptr.dtype.element_ty).to(tl.float32)
    _slot_ticket(product, pair, tl.program_id(1), tl.num_programs(1), part_ptr, counters_ptr,
                 out_ptr, offs_n, stride_ot, N, TOP_K)  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs"])
def _expert_down_kernel(
    h_ptr,
    w2_ptr,
    s2_ptr,
    out_ptr,
    part_ptr,
    counters_ptr,
    lists_ptr,
    counts_ptr,
    topk_weights_ptr,
    num_pairs,
    stride_hm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    N: tl.constexpr,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PASS_MAX: tl.constexpr,
    W_FP4: tl.constexpr,
    PDL: tl.constexpr,
):
    """``_down_kernel``'s out with the slot split's tickets, a program per (expert, N tile):
    the expert's pairs in passes of up to PASS_MAX <= 4 (``_down_pass``)."""
    enter(PDL)
    expert = tl.program_id(0)
    count = tl.load(counts_ptr + expert)  # its pairs: lists[expert, :count]
    if count == 0:
        return
    pair_row = lists_ptr + expert.to(tl.int64) * num_pairs
    offs_n, w_rows, s_rows = _expert_tile(
        expert, stride_we, stride_wn, stride_se, stride_sn, N, BLOCK_N
    )
    first = count * 0
    while first < count:  # (a for loop over count: Triton's interpreter cannot, under numpy 2.4)
        step = tl.minimum(count - first, PASS_MAX)  # the pass: up to PASS_MAX pairs
        if step == 4:
            if PASS_MAX >= 4:
                _down_pass(h_ptr, w2_ptr, s2_ptr, out_ptr, part_ptr, counters_ptr, topk_weights_ptr,
                           pair_row, first, w_rows, s_rows, offs_n, stride_hm, stride_ot, N, K,
                           TOP_K, BLOCK_N, BLOCK_K, 4, W_FP4)  # fmt: skip
        elif step == 3:
            if PASS_MAX >= 3:
                _down_pass(h_ptr, w2_ptr, s2_ptr, out_ptr, part_ptr, counters_ptr, topk_weights_ptr,
                           pair_row, first, w_rows, s_rows, offs_n, stride_hm, stride_ot, N, K,
                           TOP_K, BLOCK_N, BLOCK_K, 3, W_FP4)  # fmt: skip
        elif step == 2:
            if PASS_MAX >= 2:
                _down_pass(h_ptr, w2_ptr, s2_ptr, out_ptr, part_ptr, counters_ptr, topk_weights_ptr,
                           pair_row, first, w_rows, s_rows, offs_n, stride_hm, stride_ot, N, K,
                           TOP_K, BLOCK_N, BLOCK_K, 2, W_FP4)  # fmt: skip
        else:
            _down_pass(h_ptr, w2_ptr, s2_ptr, out_ptr, part_ptr, counters_ptr, topk_weights_ptr,
                       pair_row, first, w_rows, s_rows, offs_n, stride_hm, stride_ot, N, K,
                       TOP_K, BLOCK_N, BLOCK_K, 1, W_FP4)  # fmt: skip
        first += step


def decode_moe(
    x: torch.Tensor,
    weights: tuple[tuple[torch.Tensor, torch.Tensor | None], ...],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float,
    config: GemvConfig,
) -> torch.Tensor:
    """``triton.fused_moe`` for few tokens: x [T, D]; weights ((w1, s1), (w2, s2), (w3, s3)),
    each the weight's tensor (packed bytes [E, N, K/2] or dense [E, N, K], contiguous along K)
    and its scale bytes (None when dense); topk_ids [T, k]; topk_weights [T, k] fp32. Returns
    [T, D] in x's dtype."""
    (w1, s1), (w2, s2), (w3, s3) = weights
    reorder = s1 is not None and 0 < config.reorder_x_tokens <= x.shape[0]
    x_in = reorder_nibble_major(x) if reorder else x
    pairs = expert_lists(topk_ids, w1.shape[0]) if _expert_major(config, x.shape[0]) else None
    h = gate_up(
        x_in, (w1, s1), (w3, s3), topk_ids, limit, config, x_nibble_major=reorder,
        expert_pairs=pairs,
    )  # fmt: skip
    return down(h, (w2, s2), topk_ids, topk_weights, x.dtype, config, expert_pairs=pairs)


@triton.jit
def _reorder_kernel(x_ptr, out_ptr, stride_x, D: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):  # fmt: skip
    """Row t of x to row t of out in h's nibble-major order (``nibble_major``)."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    in_d = d < D
    row = tl.load(x_ptr + t * stride_x + d, mask=in_d)
    tl.store(out_ptr + t * D + _nibble_major_index(d), row, mask=in_d)


def reorder_nibble_major(x: torch.Tensor) -> torch.Tensor:
    """``nibble_major(x)`` for x [T, D] in one launch (the decode step's graph keeps it in the
    programmatic-launch chain)."""
    assert x.stride(1) == 1 and x.shape[1] % MXFP4_BLOCK == 0, f"x {tuple(x.shape)}"
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _reorder_kernel[(x.shape[0],)](
            x, out, x.stride(0), D=x.shape[1], BLOCK=block, num_warps=4, **pdl(x.device)
        )
    return out


def nibble_major(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] with each group of 32 in h's order (module docstring): input 32g + 8w + j
    at 32g + 4j + w."""
    groups = x.shape[-1] // MXFP4_BLOCK
    grouped = x.reshape(*x.shape[:-1], groups, 4, 8)
    return grouped.transpose(-1, -2).reshape(x.shape).contiguous()


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
    expert_pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """h [T * k, I] fp32 (nibble-major in each group of 32 when packed; module docstring) of
    x [T, D] and each pair's expert (w1, w3: (weight, scales) as in ``decode_moe``).
    ``x_nibble_major``: x's D is in that order too (``nibble_major(x)``; packed experts).
    ``expert_pairs``: ``expert_lists(topk_ids, E)``'s, where the expert-major kernel runs
    (made here if None)."""
    packed = w1[1] is not None
    assert packed or not x_nibble_major, "x in nibble-major order needs packed experts"
    (w1, s1), (w3, s3) = _operand(*w1), _operand(*w3)
    assert x.stride(1) == 1, f"x must be contiguous along D, strides {x.stride()}"
    num_pairs = topk_ids.numel()
    dim, inter = x.shape[1], w1.shape[1]
    h = torch.empty((num_pairs, inter), dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).contiguous()
    common = {
        "N": inter,
        "K": dim,
        "TOP_K": topk_ids.shape[1],
        "BLOCK_N": config.block_n,
        "BLOCK_K": pick_block_k(config.block_k, dim),
        "W_FP4": packed,
        "X_NIBBLE_MAJOR": x_nibble_major,
        "num_warps": config.num_warps,
        **pdl(x.device),
    }
    tiles = triton.cdiv(inter, config.block_n)
    if _expert_major(config, topk_ids.shape[0]):
        lists, counts = (
            expert_pairs if expert_pairs is not None else expert_lists(topk_ids, w1.shape[0])
        )
        _expert_gate_up_kernel[(w1.shape[0], tiles)](
            x, w1, w3, s1, s3, h, lists, counts, num_pairs, float(limit), x.stride(0),
            *w1.stride()[:2], *s1.stride()[:2], h.stride(0), PASS_MAX=config.expert_pass,
            **common,
        )  # fmt: skip
    else:
        _gate_up_kernel[(num_pairs, tiles)](
            x, w1, w3, s1, s3, h, flat_ids, float(limit), x.stride(0), *w1.stride()[:2],
            *s1.stride()[:2], h.stride(0), **common,
        )  # fmt: skip
    return h


def _expert_major(config: GemvConfig, num_tokens: int) -> bool:
    """Whether ``num_tokens`` tokens take a program per (expert, tile) (GemvConfig)."""
    return 0 < config.expert_tokens <= num_tokens


def expert_lists(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's pairs for the expert-major kernels, in one launch: lists [E, T * k] int32
    (row e: expert e's pair ids in pair order, counts[e] of them; the rest unwritten) and
    counts [E] int32."""
    num_pairs = topk_ids.numel()
    lists = torch.empty((num_experts, num_pairs), dtype=torch.int32, device=topk_ids.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=topk_ids.device)
    _expert_lists_kernel[(num_experts,)](
        topk_ids.reshape(-1).contiguous(), lists, counts, num_pairs,
        PAIRS=max(256, triton.next_power_of_2(num_pairs)), **pdl(topk_ids.device),
    )  # fmt: skip
    return lists, counts


def down(
    h: torch.Tensor,
    w2: tuple[torch.Tensor, torch.Tensor | None],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    dtype: torch.dtype,
    config: GemvConfig,
    *,
    expert_pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """out [T, D] in ``dtype``: each token's slots' h (``gate_up``'s) through their experts' w2
    ((weight, scales) as in ``decode_moe``), weighted and added in slot order.
    ``expert_pairs``: as ``gate_up``'s."""
    packed = w2[1] is not None
    w2, s2 = _operand(*w2)
    num_tokens, top_k = topk_ids.shape
    dim, inter = w2.shape[1], h.shape[1]
    out = torch.empty((num_tokens, dim), dtype=dtype, device=h.device)
    num_tiles = triton.cdiv(dim, config.down_block_n)
    fits = num_tokens * num_tiles <= MAX_TICKET_TILES
    expert_major = _expert_major(config, num_tokens) and fits
    split = expert_major or (num_tokens <= config.down_split_tokens and fits)
    if split:  # a program per slot or expert; the rounded products meet in part
        part = torch.empty((num_tokens * top_k, dim), dtype=torch.float32, device=h.device)
    else:
        part = out  # not read
    flat_ids = topk_ids.reshape(-1).contiguous()
    flat_weights = topk_weights.reshape(-1).contiguous()
    common = {
        "N": dim,
        "K": inter,
        "TOP_K": top_k,
        "BLOCK_N": config.down_block_n,
        "BLOCK_K": pick_block_k(config.down_block_k, inter),
        "W_FP4": packed,
        "num_warps": config.down_num_warps,
        **pdl(h.device),
    }
    counters = ticket_counters(h.device)
    if expert_major:
        lists, counts = (
            expert_pairs if expert_pairs is not None else expert_lists(topk_ids, w2.shape[0])
        )
        _expert_down_kernel[(w2.shape[0], num_tiles)](
            h, w2, s2, out, part, counters, lists, counts, flat_weights, flat_ids.numel(),
            h.stride(0), *w2.stride()[:2], *s2.stride()[:2], out.stride(0),
            PASS_MAX=config.down_expert_pass, **common,
        )  # fmt: skip
    else:
        _down_kernel[(num_tokens, num_tiles, top_k if split else 1)](
            h, w2, s2, out, part, counters, flat_ids, flat_weights, h.stride(0),
            *w2.stride()[:2], *s2.stride()[:2], out.stride(0), SPLIT_SLOTS=split, **common,
        )  # fmt: skip
    return out
