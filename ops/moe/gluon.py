"""The grouped MoE's packed-expert GEMMs on Hopper in Gluon: the weights' upcast lands in the
registers of wgmma's A operand, with no pass through shared memory.

Triton's grouped kernels (triton.py, ``TileConfig.bits_upcast``) upcast each 32-bit word of
e2m1 codes to bf16 in registers, then Triton moves the values into the MMA's operand layout
through shared memory (a store, a barrier and ldmatrix a K step). Here the layouts are written
out, so the words are loaded where their values must end up:

    wgmma's A operand (bf16, k_width 2), one warp's 16 rows, per 16 K:
        lane 4 g + t holds rows g and g + 8, K pairs {2t, 2t + 1} and {2t + 8, 2t + 9}
    over a 128-input K tile, a thread holds 16 pairs a row: K = 32 i + 16 jh + 8 jl + 2 t + b

Thread t loads the four words 4t .. 4t + 3 of each of its rows (16 contiguous bytes; every
word of scale group t, one scale byte). ``MXFP4_BITS_ASM`` turns word 4t + i into four
registers, register j (= jl + 2 jh) holding codes j and j + 4 (b = 0, 1): exactly the thread's
pairs at K = 32 i + 16 jh + 8 jl + 2 t + b. So the weights are in the MMA's K order when their
activations are in the same order, ``mma_order``: position 32 i + 16 jh + 8 jl + 2 t + b of
each 128 holds input 32 t + 8 i + 4 b + 2 jh + jl. x is copied into it once a call (one
launch, triton_gemv.py's ``reorder_mma_order``; ``mma_order`` is its torch statement), and the
gate/up kernel stores h in it for the down kernel.

    x [T, D] --mma_order--> x' --_gate_up_kernel--> h [blocks * block_m, I] (mma order)
      --_down_kernel--> pair_out [T * k, D] (natural order, routing weight applied)

The alignment, the M blocks and the combine are triton.py's; only the two GEMMs differ. Tiles
(``TILES``): 16, 64 or 128 pairs an M block (the MMA's N), K steps of 128, and 64, 128 or 256
weight rows (one warpgroup's M, or two or four warpgroups sharing the activations' tile).

The K steps are fetched ahead in one of two ways (TileConfig.ring): the next step's words and
activations loaded into registers before the current step's MMAs (ring 0), or through a ring
of shared-memory stages filled by cp.async ring - 2 steps ahead. There each thread copies the
16 bytes of words it later reads back itself; a row's scale word and the activations' tile,
read by other threads and by every warp's MMA, are shared through the step's barrier. Each MMA
runs beside the next upcast (gate's beside up's; down's, from 64 pairs a block, beside the
next step's), so a stage refills only once the MMAs two steps back have retired.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from deepinfer.ops.moe.mxfp4_bits import MXFP4_BITS_ASM
from deepinfer.ops.moe.triton_gemv import mma_order_index

__all__ = ["TILES", "down", "down_ring", "gate_up", "mma_order", "runs_on"]

# The tiles, (block_m, block_n, block_k, num_warps) as triton.py's TileConfig names them:
# block_m pairs an M block (the MMA's N: 16 at decode, 64 or 128 at prefill), K steps of 128
# inputs, and 16 weight rows a warp (the MMA's M: one warpgroup of 4 warps takes 64 rows; two
# or four take 128 or 256 and share the activations' tile).
TILES = tuple(
    (block_m, block_n, 128, block_n // 16)
    for block_m in (16, 64, 128)
    for block_n in (64, 128, 256)
)
BLOCK_K = gl.constexpr(128)


@functools.cache
def runs_on(device: torch.device) -> bool:
    """Whether these kernels run on ``device``: a Hopper GPU (wgmma is SM90's)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def mma_order(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a multiple of 128) with each 128 inputs in the MMA's K order: input
    32 t + 8 i + 4 b + 2 jh + jl at 32 i + 16 jh + 8 jl + 2 t + b."""
    shape = x.shape
    tiles = x.reshape(*shape[:-1], shape[-1] // BLOCK_K.value, 4, 4, 2, 2, 2)  # (t, i, b, jh, jl)
    lead = tuple(range(len(shape)))  # the leading dims and the tile index
    return tiles.permute(*lead, lead[-1] + 2, lead[-1] + 4, lead[-1] + 5, lead[-1] + 1,
                         lead[-1] + 3).reshape(shape).contiguous()  # fmt: skip


@gluon.constexpr_function
def _words_layout(block_n):
    """[block_n rows, 4 (t), 4 (i)] words: thread 4 g + t of warp w holds rows 16 w + g (+ 8)
    and words 4 t .. 4 t + 3 (i in registers, the fastest: one 16-byte load a row)."""
    warps = [[16 << j, 0, 0] for j in range((block_n // 16).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=warps,
        block_bases=[],
        shape=[block_n, 4, 4],
    )


@gluon.constexpr_function
def _mma_layout(block_n, block_m):
    """The accumulator's layout: block_n weight rows, 16 a warp, by block_m pairs."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[block_n // 16, 1], instr_shape=[16, block_m, 16]
    )


@gluon.constexpr_function
def _a_layout(block_n, block_m):
    """wgmma's register A operand: the upcast weights [block_n rows, 128 inputs]."""
    return gl.DotOperandLayout(0, _mma_layout(block_n, block_m), k_width=2)


@gluon.constexpr_function
def _x_layout(block_n):
    """The activations' tile [block_m pairs, 128 inputs]: 8 contiguous inputs a thread."""
    return gl.BlockedLayout([1, 8], [2, 16], [block_n // 16, 1], [1, 0])


@gluon.constexpr_function
def _x_smem_layout(block_m):
    """The activations' tile in shared memory, wgmma's B operand (K contiguous)."""
    return gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_K], gl.bfloat16)


@gluon.jit
def _program(block_expert_ptr, N: gl.constexpr, BLOCK_N: gl.constexpr):
    """(M block, N tile, expert) of this program; the expert is negative past the last block."""
    num_tiles_n: gl.constexpr = N // BLOCK_N
    pid = gl.program_id(0)
    pid_m = pid // num_tiles_n
    return pid_m, pid % num_tiles_n, gl.load(block_expert_ptr + pid_m).to(gl.int64)


@gluon.jit
def _upcast(words, scales, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
    """words [BLOCK_N, 4, 4] uint32 in _words_layout, scales [BLOCK_N, 4] uint32 bytes (the
    slice without i) -> [BLOCK_N, BLOCK_K] bf16 in wgmma's A operand layout, K in mma order."""
    factors = (scales + 126) * 0x00800080  # 2 ** (s - 1) in both bf16 halves
    factors = gl.broadcast(gl.expand_dims(factors, 2), words)[0]
    v = gl.inline_asm_elementwise(
        MXFP4_BITS_ASM,
        "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        [words, factors],
        dtype=(gl.bfloat16,) * 8,
        is_pure=True,
        pack=1,
    )
    # (t, i) then b, jl, jh as the joins add them; K = 32 i + 16 jh + 8 jl + 2 t + b.
    low = gl.join(gl.join(v[0], v[4]), gl.join(v[1], v[5]))  # jh = 0: [BN, 4, 4, 2 b, 2 jl]
    high = gl.join(gl.join(v[2], v[6]), gl.join(v[3], v[7]))  # jh = 1
    a = gl.permute(gl.join(low, high), (0, 2, 5, 4, 1, 3))  # [BN, i, jh, jl, t, b]
    a = gl.reshape(a, (BLOCK_N, BLOCK_K))
    return gl.convert_layout(a, _a_layout(BLOCK_N, BLOCK_M), assert_trivial=True)


@gluon.jit
def _weight_offsets(
    expert, pid_n, stride_we, stride_wn, stride_se, stride_sn, BLOCK_N: gl.constexpr
):
    """This program's BLOCK_N weight rows in the first K tile: the offsets of words 4 t + i
    [BLOCK_N, 4, 4] (in words) and of scale bytes t [BLOCK_N, 4]."""
    words: gl.constexpr = _words_layout(BLOCK_N)
    scales: gl.constexpr = gl.SliceLayout(2, words)
    rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, scales))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, scales))
    i = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, words)))
    s_rows = _scale_rows(expert, pid_n, stride_se, stride_sn, BLOCK_N)
    s_offs = gl.expand_dims(s_rows, 1) + gl.expand_dims(t, 0)
    w_rows = expert * stride_we + gl.expand_dims(rows * stride_wn, 1) + gl.expand_dims(t, 0) * 4
    return gl.expand_dims(w_rows, 2) + gl.expand_dims(gl.expand_dims(i, 0), 1), s_offs


@gluon.jit
def _scale_rows(expert, pid_n, stride_se, stride_sn, BLOCK_N: gl.constexpr):
    """The offsets of this program's BLOCK_N rows of scales [BLOCK_N] (a thread's two rows,
    shared by the four threads t of a row)."""
    layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, _words_layout(BLOCK_N)))
    rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
    return expert * stride_se + rows * stride_sn


@gluon.jit
def _load_words(w_ptr, s_ptr, w_offs, s_offs):
    words = gl.load(w_ptr + w_offs).to(gl.uint32, bitcast=True)
    return words, gl.load(s_ptr + s_offs).to(gl.uint32)


@gluon.constexpr_function
def _ring_layout(rank):
    """A stage of a ring in shared memory (rank: a stage's), unswizzled: the words come back
    in the layout they were copied from."""
    return gl.SwizzledSharedLayout(1, 1, 1, list(range(rank - 1, -1, -1)))


@gluon.jit
def _ring_issue(w_smem, s_smem, w_ptr, s_ptr, w_offs, s_word_offs, stage, k, valid):
    """cp.async of one K step's words (16 bytes a row a thread) and its rows' scale words (the
    4 bytes of the step, one a row) into ``stage``; zeros where not valid."""
    w_mask = gl.full(w_offs.shape, valid, gl.int1, w_offs.type.layout)
    s_mask = gl.full(s_word_offs.shape, valid, gl.int1, s_word_offs.type.layout)
    async_copy.async_copy_global_to_shared(w_smem.index(stage), w_ptr + w_offs + k // 8, w_mask)
    async_copy.async_copy_global_to_shared(
        s_smem.index(stage), s_ptr + s_word_offs + k // 128, s_mask
    )


@gluon.jit
def _ring_words(w_smem, s_smem, stage, BLOCK_N: gl.constexpr):
    """One K step's words [BLOCK_N, 4, 4] and scale bytes [BLOCK_N, 4] (byte t of its row's
    scale word for thread t) from ``stage`` of the ring, as _load_words gives them. The words
    are the thread's own copies; the scale words another thread's (the stage's barrier)."""
    words: gl.constexpr = _words_layout(BLOCK_N)
    scales: gl.constexpr = gl.SliceLayout(2, words)
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, scales))
    w = w_smem.index(stage).load(words).to(gl.uint32, bitcast=True)
    s = s_smem.index(stage).load(gl.SliceLayout(1, scales)).to(gl.uint32, bitcast=True)
    return w, (gl.expand_dims(s, 1) >> gl.expand_dims(8 * t, 0).to(gl.uint32)) & 0xFF


@gluon.jit
def _ring_step(k, stage, K: gl.constexpr, RING: gl.constexpr):
    """Step k of a ring (in ``stage``) begins: wait for this thread's copies of it, then the
    barrier (every thread's copies landed; step k - 2's MMAs retired, so its stage refills).
    Returns the step to copy next (k + RING - 2, wrapped), whether it is one, and its stage."""
    async_copy.wait_group(RING - 3)
    fence_async_shared()
    gl.thread_barrier()
    ahead = k + (RING - 2) * BLOCK_K
    valid = ahead < K
    return gl.multiple_of(ahead % K, BLOCK_K), valid, (stage + RING - 2) % RING


@gluon.jit
def _down_ring_step(
    w_ring, s_ring, h_ring, w_ptr, s_ptr, w_offs, s_words, h_ptrs, k, stage,
    K: gl.constexpr, RING: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
):  # fmt: skip
    """The down ring's step k in ``stage``: wait for its copies, start step k + RING - 2's
    into the stage two behind (its MMA retired), and return step k's upcast operand."""
    ahead, valid, fill = _ring_step(k, stage, K, RING)
    _ring_issue(w_ring, s_ring, w_ptr, s_ptr, w_offs, s_words, fill, ahead, valid)
    h_mask = gl.full(h_ptrs.shape, valid, gl.int1, h_ptrs.type.layout)
    async_copy.async_copy_global_to_shared(h_ring.index(fill), h_ptrs + ahead, h_mask)
    async_copy.commit_group()
    w, scales = _ring_words(w_ring, s_ring, stage, BLOCK_N)
    return _upcast(w, scales, BLOCK_N, BLOCK_M)


@gluon.jit(do_not_specialize=["num_pairs", "num_blocks"])
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
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_hm,
    N: gl.constexpr,
    K: gl.constexpr,
    TOP_K: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    RING: gl.constexpr,
):
    """h[the block's rows, mma order of this program's BLOCK_N features] = swiglu(x w1^T, x w3^T),
    for x' (``mma_order``) and w1, w3 as int32 words [E, N, K / 8] with scale bytes [E, N,
    K / 32]. Padding rows read zeros and store swiglu(0, 0) = 0."""
    mma: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_M)
    x_layout: gl.constexpr = _x_layout(BLOCK_N)
    pid_m, pid_n, expert = _program(block_expert_ptr, N, BLOCK_N)
    if expert < 0:
        return

    # The block's 16 pairs, their tokens and x' rows.
    offs_xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
    pair_ids = gl.load(sorted_pair_ids_ptr + offs_xm)
    is_pair = gl.expand_dims(pair_ids < num_pairs, 1)
    token_ids = (pair_ids // TOP_K).to(gl.int64)
    offs_xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))
    x_ptrs = x_ptr + gl.expand_dims(token_ids * stride_xt, 1) + gl.expand_dims(offs_xk, 0)

    w_offs, s_offs = _weight_offsets(
        expert, pid_n, stride_we, stride_wn, stride_se, stride_sn, BLOCK_N
    )

    gate = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=mma)
    up = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=mma)
    if RING == 0:
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_K], _x_smem_layout(BLOCK_M))
        w1, s1 = _load_words(w1_ptr, s1_ptr, w_offs, s_offs)
        w3, s3 = _load_words(w3_ptr, s3_ptr, w_offs, s_offs)
        xt = gl.load(x_ptrs, mask=is_pair, other=0.0)
        for k in range(0, K, BLOCK_K):
            # The next tile's words and x in flight while this one is multiplied (the last
            # step reads the first tile again rather than past the row).
            next_k = gl.multiple_of((k + BLOCK_K) % K, BLOCK_K)
            next_w = w_offs + next_k // 8
            next_s = s_offs + next_k // 32
            w1_next, s1_next = _load_words(w1_ptr, s1_ptr, next_w, next_s)
            w3_next, s3_next = _load_words(w3_ptr, s3_ptr, next_w, next_s)
            xt_next = gl.load(x_ptrs + next_k, mask=is_pair, other=0.0)
            x_smem.store(xt)
            fence_async_shared()
            gl.thread_barrier()
            xs = x_smem.permute((1, 0))  # [BLOCK_K, BLOCK_M]
            gate = warpgroup_mma(_upcast(w1, s1, BLOCK_N, BLOCK_M), xs, gate, is_async=True)
            up = warpgroup_mma(_upcast(w3, s3, BLOCK_N, BLOCK_M), xs, up, is_async=True)
            gate, up = warpgroup_mma_wait(num_outstanding=0, deps=(gate, up))
            gl.thread_barrier()  # every warp's MMA done reading x before the next store
            w1, s1, w3, s3, xt = w1_next, s1_next, w3_next, s3_next, xt_next
    else:
        # The ring: stage j % RING holds step j's words, scale words and x, RING - 2 steps
        # ahead. Each MMA runs while the next operand is upcast: gate(k) beside up's
        # upcast, up(k) beside the next step's gate upcast. up(k) still reads stage k while
        # step k + 1 fills, so the copies run RING - 2 steps ahead, not RING - 1.
        x_ring = gl.allocate_shared_memory(
            gl.bfloat16, [RING, BLOCK_M, BLOCK_K], _x_smem_layout(BLOCK_M)
        )
        w1_ring = gl.allocate_shared_memory(gl.int32, [RING, BLOCK_N, 4, 4], _ring_layout(3))
        w3_ring = gl.allocate_shared_memory(gl.int32, [RING, BLOCK_N, 4, 4], _ring_layout(3))
        s1_ring = gl.allocate_shared_memory(gl.int32, [RING, BLOCK_N], _ring_layout(1))
        s3_ring = gl.allocate_shared_memory(gl.int32, [RING, BLOCK_N], _ring_layout(1))
        s_words = _scale_rows(expert, pid_n, stride_se, stride_sn, BLOCK_N)
        for j in gl.static_range(RING - 2):
            _ring_issue(w1_ring, s1_ring, w1_ptr, s1_ptr, w_offs, s_words, j, j * BLOCK_K, True)
            _ring_issue(w3_ring, s3_ring, w3_ptr, s3_ptr, w_offs, s_words, j, j * BLOCK_K, True)
            async_copy.async_copy_global_to_shared(x_ring.index(j), x_ptrs + j * BLOCK_K, is_pair)
            async_copy.commit_group()
        a3 = gl.zeros((BLOCK_N, BLOCK_K), gl.bfloat16, layout=_a_layout(BLOCK_N, BLOCK_M))
        stage = 0  # step k's stage
        for k in range(0, K, BLOCK_K):
            ahead, valid, fill = _ring_step(k, stage, K, RING)
            _ring_issue(w1_ring, s1_ring, w1_ptr, s1_ptr, w_offs, s_words, fill, ahead, valid)
            _ring_issue(w3_ring, s3_ring, w3_ptr, s3_ptr, w_offs, s_words, fill, ahead, valid)
            async_copy.async_copy_global_to_shared(
                x_ring.index(fill), x_ptrs + ahead, is_pair & valid
            )
            async_copy.commit_group()
            xs = x_ring.index(stage).permute((1, 0))  # [BLOCK_K, BLOCK_M]
            w1, s1 = _ring_words(w1_ring, s1_ring, stage, BLOCK_N)
            a1 = _upcast(w1, s1, BLOCK_N, BLOCK_M)
            gate = warpgroup_mma(a1, xs, gate, is_async=True)
            gate, up, a3 = warpgroup_mma_wait(num_outstanding=1, deps=(gate, up, a3))  # up(k-1)
            w3, s3 = _ring_words(w3_ring, s3_ring, stage, BLOCK_N)
            a3 = _upcast(w3, s3, BLOCK_N, BLOCK_M)
            up = warpgroup_mma(a3, xs, up, is_async=True)
            gate, up, a1 = warpgroup_mma_wait(num_outstanding=1, deps=(gate, up, a1))  # gate(k)
            stage = gl.where(stage == RING - 1, 0, stage + 1)
        gate, up, a3 = warpgroup_mma_wait(num_outstanding=0, deps=(gate, up, a3))
        async_copy.wait_group(0)

    gate = gl.minimum(gate, limit)
    up = gl.minimum(gl.maximum(up, -limit), limit)
    h = gate / (1.0 + gl.exp(-gate)) * up  # [BLOCK_N features, 16 pairs]

    # Feature f stored at its mma position (the x reorder's own index, triton_gemv.py).
    f = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    pos = mma_order_index(f)
    offs_hm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    h_ptrs = h_ptr + gl.expand_dims(offs_hm.to(gl.int64) * stride_hm, 0) + gl.expand_dims(pos, 1)
    gl.store(h_ptrs, h.to(gl.bfloat16))


@gluon.jit(do_not_specialize=["num_pairs", "num_blocks"])
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
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_om,
    N: gl.constexpr,
    K: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    RING: gl.constexpr,
):
    """pair_out[pair, this program's BLOCK_N outputs] = topk_weight[pair] * h[row] w2^T, h in mma
    order, w2 as int32 words [E, N, K / 8] with scale bytes [E, N, K / 32]."""
    mma: gl.constexpr = _mma_layout(BLOCK_N, BLOCK_M)
    x_layout: gl.constexpr = _x_layout(BLOCK_N)
    pid_m, pid_n, expert = _program(block_expert_ptr, N, BLOCK_N)
    if expert < 0:
        return

    offs_xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_layout))
    offs_xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_layout))
    h_ptrs = h_ptr + gl.expand_dims(offs_xm.to(gl.int64) * stride_hm, 1)
    h_ptrs = h_ptrs + gl.expand_dims(offs_xk, 0)
    w_offs, s_offs = _weight_offsets(
        expert, pid_n, stride_we, stride_wn, stride_se, stride_sn, BLOCK_N
    )

    acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, layout=mma)
    if RING == 0:
        h_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_K], _x_smem_layout(BLOCK_M))
        w2, s2 = _load_words(w2_ptr, s2_ptr, w_offs, s_offs)
        ht = gl.load(h_ptrs)
        for k in range(0, K, BLOCK_K):  # as the gate/up kernel's loop
            next_k = gl.multiple_of((k + BLOCK_K) % K, BLOCK_K)
            next_w = w_offs + next_k // 8
            w2_next, s2_next = _load_words(w2_ptr, s2_ptr, next_w, s_offs + next_k // 32)
            ht_next = gl.load(h_ptrs + next_k)
            h_smem.store(ht)
            fence_async_shared()
            gl.thread_barrier()
            hs = h_smem.permute((1, 0))
            acc = warpgroup_mma(_upcast(w2, s2, BLOCK_N, BLOCK_M), hs, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            gl.thread_barrier()
            w2, s2, ht = w2_next, s2_next, ht_next
    else:
        # As the gate/up kernel's ring. From 64 pairs a block each MMA runs beside the next
        # step's upcast; with one operand a step that takes two sets of registers, so the loop
        # takes two steps, each MMA its own instruction (with one, the compiler put the next
        # step's words into the registers the MMA in flight reads). At 16 pairs the MMA is
        # short and the second set would cost programs an SM (127 registers, not 70): each
        # MMA is waited for.
        h_ring = gl.allocate_shared_memory(
            gl.bfloat16, [RING, BLOCK_M, BLOCK_K], _x_smem_layout(BLOCK_M)
        )
        w2_ring = gl.allocate_shared_memory(gl.int32, [RING, BLOCK_N, 4, 4], _ring_layout(3))
        s2_ring = gl.allocate_shared_memory(gl.int32, [RING, BLOCK_N], _ring_layout(1))
        s_words = _scale_rows(expert, pid_n, stride_se, stride_sn, BLOCK_N)
        for j in gl.static_range(RING - 2):
            _ring_issue(w2_ring, s2_ring, w2_ptr, s2_ptr, w_offs, s_words, j, j * BLOCK_K, True)
            async_copy.async_copy_global_to_shared(h_ring.index(j), h_ptrs + j * BLOCK_K)
            async_copy.commit_group()
        stage = 0
        if BLOCK_M == 16:  # (down_ring: the launcher's side of this choice)
            for k in range(0, K, BLOCK_K):
                a = _down_ring_step(
                    w2_ring, s2_ring, h_ring, w2_ptr, s2_ptr, w_offs, s_words, h_ptrs, k, stage,
                    K, RING, BLOCK_N, BLOCK_M,
                )  # fmt: skip
                hs = h_ring.index(stage).permute((1, 0))
                acc = warpgroup_mma(a, hs, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                stage = gl.where(stage == RING - 1, 0, stage + 1)
        else:
            gl.static_assert(K % (2 * BLOCK_K) == 0, "the ring's down loop takes two K steps")
            a_odd = gl.zeros((BLOCK_N, BLOCK_K), gl.bfloat16, layout=_a_layout(BLOCK_N, BLOCK_M))
            for k in range(0, K, 2 * BLOCK_K):
                a_even = _down_ring_step(
                    w2_ring, s2_ring, h_ring, w2_ptr, s2_ptr, w_offs, s_words, h_ptrs, k, stage,
                    K, RING, BLOCK_N, BLOCK_M,
                )  # fmt: skip
                hs = h_ring.index(stage).permute((1, 0))
                acc = warpgroup_mma(a_even, hs, acc, is_async=True)
                acc, a_odd = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_odd))  # step k - 1
                stage = gl.where(stage == RING - 1, 0, stage + 1)
                a_odd = _down_ring_step(
                    w2_ring, s2_ring, h_ring, w2_ptr, s2_ptr, w_offs, s_words, h_ptrs, k + BLOCK_K,
                    stage, K, RING, BLOCK_N, BLOCK_M,
                )  # fmt: skip
                hs = h_ring.index(stage).permute((1, 0))
                acc = warpgroup_mma(a_odd, hs, acc, is_async=True)
                acc, a_even = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_even))  # step k
                stage = gl.where(stage == RING - 1, 0, stage + 1)
            acc, a_odd = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_odd))
        async_copy.wait_group(0)

    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    pair_ids = gl.load(sorted_pair_ids_ptr + offs_m)
    is_pair = pair_ids < num_pairs
    routing = gl.load(topk_weights_ptr + pair_ids, mask=is_pair, other=0.0)
    acc = acc * gl.expand_dims(routing.to(gl.float32), 0)
    offs_on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    out_ptrs = pair_out_ptr + gl.expand_dims(pair_ids.to(gl.int64) * stride_om, 0)
    out_ptrs = out_ptrs + gl.expand_dims(offs_on, 1)
    gl.store(out_ptrs, acc.to(gl.bfloat16), mask=gl.expand_dims(is_pair, 0))


def down_ring(ring: int, block_m: int, inter: int) -> int:
    """The down kernel's ring for a tile of ``block_m`` pairs over I = ``inter`` inputs: from 64
    pairs its ring loop takes two K steps, so where I holds an odd number of them (I / 128 odd:
    no V4 model) it runs the register prefetch (0) instead."""
    two_steps = block_m != 16
    return 0 if ring and two_steps and inter % (2 * BLOCK_K.value) else ring


def _scale_view(scales: torch.Tensor, ring: int) -> torch.Tensor:
    """The scale bytes as the kernels read them: bytes, or (the ring) int32 words of four, one a
    row a K step of 128."""
    assert ring == 0 or ring >= 3, f"ring {ring}: 0 (registers) or at least 3 stages"
    return scales.view(torch.int32) if ring else scales


def gate_up(
    x_mma: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    s1: torch.Tensor,
    s3: torch.Tensor,
    sorted_pair_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    top_k: int,
    limit: float,
    block_m: int,
    block_n: int,
    ring: int = 0,
) -> torch.Tensor:
    """h [num_blocks * block_m, I] bf16 in mma order: each block's pairs through swiglu(x w1^T,
    x w3^T). x_mma [T, D] bf16 in mma order; w1, w3 int32 words [E, I, D / 8]; s1, s3 scale
    bytes [E, I, D / 32]. ring: K steps in flight through shared memory (0: the next one, in
    registers)."""
    _, inter, words = w1.shape
    dim = words * 8
    num_blocks = block_expert.numel()
    assert inter % block_n == 0 and dim % BLOCK_K.value == 0, f"I {inter}, D {dim}"
    assert w1.stride() == w3.stride() and s1.stride() == s3.stride()
    assert w1.stride(2) == 1 and s1.stride(2) == 1 and x_mma.stride(1) == 1
    s1, s3 = _scale_view(s1, ring), _scale_view(s3, ring)
    h = torch.empty((num_blocks * block_m, inter), dtype=torch.bfloat16, device=x_mma.device)
    _gate_up_kernel[(num_blocks * (inter // block_n),)](
        x_mma, w1, w3, s1, s3, h, sorted_pair_ids, block_expert, num_pairs, num_blocks,
        float(limit), x_mma.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
        h.stride(0), N=inter, K=dim, TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, RING=ring,
        num_warps=block_n // 16,
    )  # fmt: skip
    return h


def down(
    h: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_pair_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    block_m: int,
    block_n: int,
    ring: int = 0,
) -> torch.Tensor:
    """pair_out [num_pairs, D] bf16: each pair's h row (mma order) times w2^T, times its
    routing weight. w2 int32 words [E, D, I / 8]; s2 scale bytes [E, D, I / 32]; topk_weights
    [num_pairs] fp32. ring as gate_up's (``down_ring``: where it applies)."""
    _, dim, words = w2.shape
    inter = words * 8
    num_blocks = block_expert.numel()
    assert dim % block_n == 0 and inter % BLOCK_K.value == 0, f"D {dim}, I {inter}"
    assert w2.stride(2) == 1 and s2.stride(2) == 1 and h.stride(1) == 1
    ring = down_ring(ring, block_m, inter)
    s2 = _scale_view(s2, ring)
    pair_out = torch.empty((num_pairs, dim), dtype=torch.bfloat16, device=h.device)
    _down_kernel[(num_blocks * (dim // block_n),)](
        h, w2, s2, pair_out, topk_weights, sorted_pair_ids, block_expert, num_pairs, num_blocks,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), pair_out.stride(0),
        N=dim, K=inter, BLOCK_M=block_m, BLOCK_N=block_n, RING=ring, num_warps=block_n // 16,
    )  # fmt: skip
    return pair_out
