"""The compressors' pooling as Triton kernels: ``compress_windows``, a compressor's whole step
in three launches, and ``gated_pool``, the same pooling over windows already gathered.

``compress_windows`` reads each window's slots where they are (torch_ref gathers and
concatenates them first: ~30 small kernels for an overlapping compressor, every graphed decode
step, since a graph pools every request's candidate window)::

    slot source (CompressRows)            kernel reads
    buffer ring  src row r < nbuf         buf[buf_rows[r]]
    this step    src row r >= nbuf        kv / gate row r - nbuf (any row stride)
    overlap ring previous window's Ca     ring[prev_slots[prev_src[w]]] (CSA, first window)
    empty        window 0's previous      kv 0, gate -inf

    _compress_pool_kernel   one program a window: the slots as above, softmax-pooled online
                            over chunks of slots, normalised, roped: [W, d] in the buffer
                            ring's dtype, and each row into the entry pool; over
                            many slots (HCA's 128) a window's channels split over programs,
                            then _pool_finish_kernel normalises and rotates each row
    _compress_keep_kernel   the last windows' Ca halves -> the overlap ring (CSA)
    _compress_keep_kernel   the tokens a later step needs -> the buffer ring

The launches run in this order because each reads what a later one overwrites: the pool reads
ring rows the ring copy replaces (a request that closes K windows rewrites the row its first
window's previous half comes from), and a prefill chunk's ring copy can read buffer rows that
the buffer copy then fills with the chunk's open window. Within the buffer copy no row is read
by one program and written by another: a kept buffered token goes back to its own row.

A decode step (one token a request, no drafts kept: ``CompressRows.keep_in_pool``) runs all
three in the pool's launch: there the only row a keep replaces that a written window pools is
the ring row of that window's own previous half (one ring row a slot), which its program keeps
into after reading it (a barrier between); the buffer copy's rows are read by no written
window (a window's last token closes it and is not kept; a graphed candidate that does not
close pools into the scratch rows), so a program a kept token copies them alongside.

The values are torch_ref's conversions in its order (step rows to the ring's dtype, gates to
fp32 before the bias), so the result is bit for bit torch_ref's gathers followed by
``gated_pool`` with the rotation (this kernel over the gathered windows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.norm.torch_ref import CompressRows
from deepinfer.ops.triton_pdl import enter, pdl
from deepinfer.ops.triton_rope import rotate_pair

# Slots a chunk (HCA's 128 slots of 512 in 16 chunks of 8 x 512 values).
POOL_BLOCK_S = 8
# compress_windows over many slots (HCA's 128): a window's channels split over programs of
# POOL_SPLIT_D, chunks of POOL_SPLIT_BLOCK_S slots, then a launch that normalises each row. One
# program a window walked 128 slots in 16 dependent chunks: 125 us for a decode step's window on
# the H100. Decided by the slot count alone, so a window's entry is the same in any batch.
POOL_SPLIT_MIN_SLOTS = 32
POOL_SPLIT_D = 64
POOL_SPLIT_BLOCK_S = 32
POOL_SPLIT_WARPS = 4


@triton.jit
def div_rn(num, den):
    """IEEE division with broadcasting (Triton's ``/`` on fp32 is approximate on CUDA)."""
    num, den = tl.broadcast(num, den)
    return tl.math.div_rn(num, den)


@triton.jit
def _pool_step(m_i, l_i, acc, g, kv):
    """One chunk of slots [BLOCK_S, BLOCK_D] (fp32) into the online softmax: running max,
    sum and weighted sum per channel."""
    m_new = tl.maximum(m_i, tl.max(g, axis=0))
    # A channel whose slots so far are all empty keeps m = -inf: rescale by 1, add 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    e = tl.exp(g - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(e, axis=0)
    acc = acc * alpha + tl.sum(e * kv, axis=0)
    return m_new, l_i, acc


@triton.jit
def _pool_store(
    acc,
    l_i,
    w,
    offs_d,
    d_mask,
    weight_ptr,
    out_ptr,
    dim,
    eps,
    cos_ptr,
    sin_ptr,
    cos_stride,
    sin_stride,
    entries_ptr,
    entry_dst_ptr,
    entries_stride,
    BLOCK_D: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    STORE_ENTRY: tl.constexpr,
):
    """Window w's pooled row: rounded to the output dtype, RMS-normalised, and with
    ROPE_HALF > 0 its trailing 2 * ROPE_HALF channels rotated as ``_apply_rope_kernel`` does
    (pairs split from the row in registers); STORE_ENTRY: also to the entry pool's row
    entry_dst[w]."""
    pooled = div_rn(acc, l_i)
    pooled = pooled.to(out_ptr.dtype.element_ty).to(tl.float32)  # the reference's rounding
    pooled = tl.where(d_mask, pooled, 0.0)
    pooled = pooled * tl.rsqrt(tl.sum(pooled * pooled, axis=0) / dim + eps)
    weight = tl.load(weight_ptr + offs_d, mask=d_mask, other=0.0)
    out = (weight * pooled).to(out_ptr.dtype.element_ty)
    if ROPE_HALF > 0:
        even, odd = tl.split(tl.reshape(out.to(tl.float32), (BLOCK_D // 2, 2)))
        pairs = tl.arange(0, BLOCK_D // 2)
        first = dim // 2 - ROPE_HALF  # the first rope pair (the nope width is even)
        is_rope = (pairs >= first) & (pairs < dim // 2)
        angle = pairs - first
        cos = tl.load(cos_ptr + w * cos_stride + angle, mask=is_rope, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + w * sin_stride + angle, mask=is_rope, other=0.0).to(tl.float32)
        even, odd = rotate_pair(even, odd, cos, sin)
        rotated = tl.join(even, odd)
        rotated = tl.reshape(rotated, (BLOCK_D,)).to(out_ptr.dtype.element_ty)
        is_rope_d = (offs_d >= dim - 2 * ROPE_HALF) & d_mask
        out = tl.where(is_rope_d, rotated, out)
    tl.store(out_ptr + w * dim + offs_d, out, d_mask)
    if STORE_ENTRY:
        dst = tl.load(entry_dst_ptr + w).to(tl.int64)
        entry = out.to(entries_ptr.dtype.element_ty)
        tl.store(entries_ptr + dst * entries_stride + offs_d, entry, d_mask)


def _pool_tiles(num_slots: int, dim: int) -> tuple[int, int, int]:
    """(BLOCK_S, BLOCK_D, warps) of a pooling program."""
    block_d = triton.next_power_of_2(dim)
    block_s = min(POOL_BLOCK_S, triton.next_power_of_2(num_slots))
    return block_s, block_d, min(8, max(1, block_s * block_d // 512))


def _rope_tables(
    cos: torch.Tensor | None, sin: torch.Tensor | None, num_windows: int, dim: int
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """(rope pairs, cos, sin) with unit-stride rows, checked against the windows; (0, None,
    None) without rope."""
    if cos is None:
        return 0, None, None
    half = cos.shape[-1]
    assert sin is not None and cos.shape == sin.shape == (num_windows, half), (
        f"compress_windows: cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, {num_windows} windows"
    )
    assert 0 < 2 * half <= dim and dim % 2 == 0, f"compress_windows: rope {2 * half} of {dim}"
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    return half, cos, sin


def gated_pool(
    kv: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """The compressors' pooling: rms_norm(sum over slots of softmax(gate) * kv) per window.

    kv: [W, S, D]; gate: [W, S, D] logits (-inf = an empty slot); weight: [D]. Returns [W, D]
    in kv's dtype, as torch_ref.gated_pool up to rounding: the softmax is online over chunks of
    slots and the weighted sum stays fp32 (the reference rounds the weights and products to kv's
    dtype first); only the pooled row is rounded before the norm, as there. With cos and sin
    [W, rope_dim / 2] the rows then get ``apply_rope``'s rotation in the same launch (bit for
    bit the two ops'). It is ``compress_windows`` over windows already gathered: every slot a
    row of the buffer ring, nothing kept. Not a backend op (the engine calls compress_windows):
    the tests' pooling of torch_ref's gathers.
    """
    num_windows, num_slots, dim = kv.shape
    assert gate.shape == kv.shape, f"gated_pool: gate {tuple(gate.shape)}, kv {tuple(kv.shape)}"
    assert weight.shape == (dim,), f"gated_pool: weight {tuple(weight.shape)}, D = {dim}"
    slots = torch.arange(num_windows * num_slots, device=kv.device)
    none = slots[:0]
    buf_kv, buf_gate = kv.reshape(-1, dim).contiguous(), gate.reshape(-1, dim).contiguous()
    rows = CompressRows(buf_kv, buf_gate, slots, slots.view(num_windows, num_slots), none, none)
    return compress_windows(buf_kv[:0], buf_gate[:0], rows, None, weight, eps, cos, sin)


@triton.jit
def _src_rows(r, num_buf, buf_rows_ptr, is_src):
    """Rows of src = cat(buf[buf_rows], step rows): (in the buffer ring, its buffer row, in
    the step, its step row), each where ``is_src``."""
    in_buf = is_src & (r < num_buf)
    buf_row = tl.load(buf_rows_ptr + r, mask=in_buf, other=0)
    return in_buf, buf_row, is_src & (r >= num_buf), r - num_buf


# They change step to step.
@triton.jit(do_not_specialize=["num_buf", "num_ring_reads", "num_windows"])
def _compress_pool_kernel(
    kv_ptr,
    gate_ptr,
    stride_kv,
    stride_gate,
    buf_kv_ptr,
    buf_gate_ptr,
    buf_width,
    buf_rows_ptr,
    num_buf,
    num_windows,
    left_src_ptr,
    left_dst_ptr,
    prev_dst_ptr,
    window_rows_ptr,
    ring_kv_ptr,
    ring_gate_ptr,
    prev_slots_ptr,
    num_ring_reads,
    prev_src_ptr,
    has_prev_ptr,
    ape_ptr,
    weight_ptr,
    out_ptr,
    dim,
    eps,
    cos_ptr,
    sin_ptr,
    cos_stride,
    sin_stride,
    entries_ptr,
    entry_dst_ptr,
    entries_stride,
    M: tl.constexpr,
    OVERLAP: tl.constexpr,
    HAS_APE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    STORE_ENTRY: tl.constexpr,
    KEEP: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program w < num_windows, window w (program_id 1: its BLOCK_D channels from that block
    on): its M slots (2M overlapping: the previous window's Ca, then its own Cb) read where
    they are (module docstring), softmax-pooled online over chunks of BLOCK_S slots (running
    max, sum and weighted sum in fp32), then normalised and roped (``_pool_store``); SPLIT: the
    pooled channels only. KEEP (CompressRows.keep_in_pool): then, overlapping, its channels of
    its own Ca half to the overlap ring (row prev_dst[w]: the ring row its first slots came
    from, read above); and program num_windows + i keeps the buffer ring's row i."""
    enter(PDL)
    w = tl.program_id(0).to(tl.int64)
    if w >= num_windows:
        if KEEP:  # noqa: SIM102 (a constexpr: the program-id test is compiled only with it)
            if tl.program_id(1) == 0:
                _keep_row(
                    w - num_windows, kv_ptr, gate_ptr, stride_kv, stride_gate, buf_kv_ptr,
                    buf_gate_ptr, buf_width, buf_rows_ptr, num_buf, left_src_ptr, left_dst_ptr,
                    window_rows_ptr, buf_kv_ptr, buf_gate_ptr, buf_width, M, False, BLOCK_W,
                )  # fmt: skip
    else:
        _pool_window(
            w, kv_ptr, gate_ptr, stride_kv, stride_gate, buf_kv_ptr, buf_gate_ptr, buf_width,
            buf_rows_ptr, num_buf, prev_dst_ptr, window_rows_ptr, ring_kv_ptr, ring_gate_ptr,
            prev_slots_ptr, num_ring_reads, prev_src_ptr, has_prev_ptr, ape_ptr, weight_ptr,
            out_ptr, dim, eps, cos_ptr, sin_ptr, cos_stride, sin_stride, entries_ptr,
            entry_dst_ptr, entries_stride, M, OVERLAP, HAS_APE, SPLIT, BLOCK_S, BLOCK_D,
            ROPE_HALF, STORE_ENTRY, KEEP,
        )  # fmt: skip


@triton.jit
def _pool_window(
    w, kv_ptr, gate_ptr, stride_kv, stride_gate, buf_kv_ptr, buf_gate_ptr, buf_width,
    buf_rows_ptr, num_buf, prev_dst_ptr, window_rows_ptr, ring_kv_ptr, ring_gate_ptr,
    prev_slots_ptr, num_ring_reads, prev_src_ptr, has_prev_ptr, ape_ptr, weight_ptr, out_ptr,
    dim, eps, cos_ptr, sin_ptr, cos_stride, sin_stride, entries_ptr, entry_dst_ptr,
    entries_stride, M: tl.constexpr, OVERLAP: tl.constexpr, HAS_APE: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ROPE_HALF: tl.constexpr, STORE_ENTRY: tl.constexpr, KEEP: tl.constexpr,
):  # fmt: skip
    """``_compress_pool_kernel``'s window w."""
    NUM_SLOTS: tl.constexpr = 2 * M if OVERLAP else M
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < dim
    m_i = tl.full([BLOCK_D], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    buf_dtype = buf_kv_ptr.dtype.element_ty
    if OVERLAP:
        has_prev = tl.load(has_prev_ptr + w) != 0
        prev = tl.load(prev_src_ptr + w)  # < R': a ring read; else window prev - R' of this step
        from_ring = has_prev & (prev < num_ring_reads)
        ring_row = tl.load(prev_slots_ptr + prev, mask=from_ring, other=0)
        prev_window = prev - num_ring_reads
    for s0 in range(0, NUM_SLOTS, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        is_slot = offs_s < NUM_SLOTS
        if OVERLAP:
            is_prev = offs_s < M
            j = tl.where(is_prev, offs_s, offs_s - M)  # the slot's token in its window
            col = tl.where(is_prev, 0, dim)  # Ca or Cb columns
            window = tl.where(is_prev, prev_window, w)
            is_src = is_slot & (~is_prev | (has_prev & ~from_ring))
            is_ring = is_slot & is_prev & from_ring
        else:
            j = offs_s
            col = tl.zeros([BLOCK_S], dtype=tl.int64)
            window = w + tl.zeros([BLOCK_S], dtype=tl.int64)
            is_src = is_slot
            is_ring = is_slot & False
        r = tl.load(window_rows_ptr + window * M + j, mask=is_src, other=0)
        in_buf, buf_row, in_step, step_row = _src_rows(r, num_buf, buf_rows_ptr, is_src)
        cols = col[:, None] + offs_d[None, :]
        buf_mask = in_buf[:, None] & d_mask[None, :]
        step_mask = in_step[:, None] & d_mask[None, :]
        buf_off = buf_row[:, None] * buf_width + cols
        kv = tl.where(
            buf_mask,
            tl.load(buf_kv_ptr + buf_off, mask=buf_mask, other=0.0),
            tl.load(kv_ptr + step_row[:, None] * stride_kv + cols, mask=step_mask, other=0.0).to(
                buf_dtype
            ),
        ).to(tl.float32)
        g = tl.where(
            buf_mask,
            tl.load(buf_gate_ptr + buf_off, mask=buf_mask, other=0.0),
            tl.load(
                gate_ptr + step_row[:, None] * stride_gate + cols, mask=step_mask, other=0.0
            ).to(buf_gate_ptr.dtype.element_ty),
        ).to(tl.float32)
        if OVERLAP:
            ring_mask = is_ring[:, None] & d_mask[None, :]
            ring_off = (ring_row * M + j)[:, None] * dim + offs_d[None, :]
            ring_kv = tl.load(ring_kv_ptr + ring_off, mask=ring_mask, other=0.0)
            kv = tl.where(ring_mask, ring_kv.to(buf_dtype).to(tl.float32), kv)
            ring_g = tl.load(ring_gate_ptr + ring_off, mask=ring_mask, other=0.0)
            g = tl.where(ring_mask, ring_g.to(tl.float32), g)
        if HAS_APE:
            ape_mask = is_slot[:, None] & d_mask[None, :]
            g = g + tl.load(ape_ptr + j[:, None] * buf_width + cols, mask=ape_mask, other=0.0)
        valid = (is_src | is_ring)[:, None] & d_mask[None, :]
        g = tl.where(valid, g, float("-inf"))
        kv = tl.where(valid, kv, 0.0)
        m_i, l_i, acc = _pool_step(m_i, l_i, acc, g, kv)
    if SPLIT:  # the pooled channels, rounded as stored; _pool_finish_kernel normalises the row
        pooled = div_rn(acc, l_i).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + w * dim + offs_d, pooled, d_mask)
    else:
        _pool_store(
            acc,
            l_i,
            w,
            offs_d,
            d_mask,
            weight_ptr,
            out_ptr,
            dim,
            eps,
            cos_ptr,
            sin_ptr,
            cos_stride,
            sin_stride,
            entries_ptr,
            entry_dst_ptr,
            entries_stride,
            BLOCK_D,
            ROPE_HALF,
            STORE_ENTRY,
        )
    if KEEP and OVERLAP:
        # Every read of the ring row above lands before this window's Ca half replaces it:
        # token j's channels of this block to ring row prev_dst[w] * M + j.
        tl.debug_barrier()
        ring_row = tl.load(prev_dst_ptr + w) * M
        for j in tl.static_range(M):
            _copy_src_row(
                tl.load(window_rows_ptr + w * M + j), offs_d, d_mask, ring_row + j, kv_ptr,
                gate_ptr, stride_kv, stride_gate, buf_kv_ptr, buf_gate_ptr, buf_width,
                buf_rows_ptr, num_buf, ring_kv_ptr, ring_gate_ptr, dim,
            )  # fmt: skip


@triton.jit
def _pool_finish_kernel(
    out_ptr,
    weight_ptr,
    dim,
    eps,
    cos_ptr,
    sin_ptr,
    cos_stride,
    sin_stride,
    entries_ptr,
    entry_dst_ptr,
    entries_stride,
    BLOCK_D: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    STORE_ENTRY: tl.constexpr,
    PDL: tl.constexpr,
):
    """Window w's pooled row (a split pool's, rounded as stored), in place: ``_pool_store``'s
    norm and rotation of it (the division by a unit sum is exact)."""
    enter(PDL)
    w = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < dim
    pooled = tl.load(out_ptr + w * dim + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    one = tl.full([BLOCK_D], 1.0, dtype=tl.float32)
    _pool_store(
        pooled,
        one,
        w,
        offs_d,
        d_mask,
        weight_ptr,
        out_ptr,
        dim,
        eps,
        cos_ptr,
        sin_ptr,
        cos_stride,
        sin_stride,
        entries_ptr,
        entry_dst_ptr,
        entries_stride,
        BLOCK_D,
        ROPE_HALF,
        STORE_ENTRY,
    )


@triton.jit(do_not_specialize=["num_buf"])
def _compress_keep_kernel(
    kv_ptr,
    gate_ptr,
    stride_kv,
    stride_gate,
    buf_kv_ptr,
    buf_gate_ptr,
    buf_width,
    buf_rows_ptr,
    num_buf,
    src_ptr,
    dst_ptr,
    window_rows_ptr,
    dst_kv_ptr,
    dst_gate_ptr,
    dst_width,
    M: tl.constexpr,
    RING: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    """One kept row a program (``_keep_row``)."""
    enter(PDL)
    _keep_row(
        tl.program_id(0), kv_ptr, gate_ptr, stride_kv, stride_gate, buf_kv_ptr, buf_gate_ptr,
        buf_width, buf_rows_ptr, num_buf, src_ptr, dst_ptr, window_rows_ptr, dst_kv_ptr,
        dst_gate_ptr, dst_width, M, RING, BLOCK_W,
    )  # fmt: skip


@triton.jit
def _keep_row(
    i, kv_ptr, gate_ptr, stride_kv, stride_gate, buf_kv_ptr, buf_gate_ptr, buf_width,
    buf_rows_ptr, num_buf, src_ptr, dst_ptr, window_rows_ptr, dst_kv_ptr, dst_gate_ptr,
    dst_width, M: tl.constexpr, RING: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Kept row i: the buffer ring's (RING False: src row src[i] -> buffer row dst[i], all
    columns) or the overlap ring's (RING: token i % M of window src[i // M] -> ring row
    dst[i // M] * M + i % M, its first dst_width columns, the Ca half)."""
    if RING:
        window = tl.load(src_ptr + i // M)
        r = tl.load(window_rows_ptr + window * M + i % M)
        dst_row = tl.load(dst_ptr + i // M) * M + i % M
    else:
        r = tl.load(src_ptr + i)
        dst_row = tl.load(dst_ptr + i)
    cols = tl.arange(0, BLOCK_W)
    _copy_src_row(
        r, cols, cols < dst_width, dst_row, kv_ptr, gate_ptr, stride_kv, stride_gate,
        buf_kv_ptr, buf_gate_ptr, buf_width, buf_rows_ptr, num_buf, dst_kv_ptr, dst_gate_ptr,
        dst_width,
    )  # fmt: skip


@triton.jit
def _copy_src_row(
    r, cols, mask, dst_row, kv_ptr, gate_ptr, stride_kv, stride_gate, buf_kv_ptr, buf_gate_ptr,
    buf_width, buf_rows_ptr, num_buf, dst_kv_ptr, dst_gate_ptr, dst_width,
):  # fmt: skip
    """Columns ``cols`` (where ``mask``) of src row r, the buffer ring's or the step's (in the
    buffer ring's dtypes, as torch_ref converts them), to row dst_row of dst (dst_width wide)."""
    in_buf, buf_row, in_step, step_row = _src_rows(r, num_buf, buf_rows_ptr, True)
    buf_dtype = buf_kv_ptr.dtype.element_ty
    kv = tl.where(
        in_buf,
        tl.load(buf_kv_ptr + buf_row * buf_width + cols, mask=mask & in_buf, other=0.0),
        tl.load(kv_ptr + step_row * stride_kv + cols, mask=mask & in_step, other=0.0).to(buf_dtype),
    )
    gate = tl.where(
        in_buf,
        tl.load(buf_gate_ptr + buf_row * buf_width + cols, mask=mask & in_buf, other=0.0),
        tl.load(gate_ptr + step_row * stride_gate + cols, mask=mask & in_step, other=0.0).to(
            buf_gate_ptr.dtype.element_ty
        ),
    )
    dst = dst_row.to(tl.int64) * dst_width + cols
    tl.store(dst_kv_ptr + dst, kv.to(dst_kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_gate_ptr + dst, gate.to(dst_gate_ptr.dtype.element_ty), mask=mask)


def _entry_store(rows: CompressRows, num_windows: int, dim: int) -> bool:
    """Whether ``rows`` asks for the entries in its entry pool too (its shapes checked)."""
    if rows.entries is None:
        return False
    entries, dst = rows.entries, rows.entry_dst
    assert dst is not None and dst.shape == (num_windows,), "compress_windows: entry_dst"
    assert entries.dim() == 2 and entries.shape[1] == dim and entries.stride(1) == 1, (
        f"compress_windows: entries {tuple(entries.shape)} strides {entries.stride()}, d {dim}"
    )
    return True


def compress_windows(
    kv: torch.Tensor,
    gate: torch.Tensor,
    rows: CompressRows,
    ape: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """torch_ref.compress_windows in three launches (module docstring): the windows' entries
    [W, d] in the buffer ring's dtype (and in ``rows.entries`` where given, from the same
    store), then the overlap ring's and the buffer ring's rows; with ``rows.keep_in_pool``, all
    in the pooling's launch."""
    num_windows, m = rows.window_rows.shape
    width, dim = rows.buf_kv.shape[1], weight.shape[0]
    overlap = rows.ring_kv is not None
    assert kv.shape == gate.shape == (kv.shape[0], width), (
        f"compress_windows: kv {tuple(kv.shape)}, gate {tuple(gate.shape)}, width {width}"
    )
    assert width == (2 * dim if overlap else dim), f"compress_windows: width {width}, d {dim}"
    assert kv.stride(1) == gate.stride(1) == 1, "compress_windows: kv, gate columns strided"
    assert rows.buf_kv.is_contiguous() and rows.buf_gate.is_contiguous()
    assert ape is None or ape.shape == (m, width), f"compress_windows: ape {ape.shape}"
    half, cos, sin = _rope_tables(cos, sin, num_windows, dim)
    num_buf, num_left = rows.buf_rows.shape[0], rows.left_src.shape[0]
    common = (kv, gate, kv.stride(0), gate.stride(0), rows.buf_kv, rows.buf_gate, width)
    out = torch.empty((num_windows, dim), dtype=rows.buf_kv.dtype, device=kv.device)
    num_ring_keeps = rows.last_window.shape[0] if rows.last_window is not None else 0
    keep = rows.keep_in_pool
    if keep and overlap:
        assert num_ring_keeps == num_windows, "keep_in_pool: every window's Ca half kept"
    if num_windows or (keep and num_left):
        ring = rows.buf_kv  # dummy pointers without a ring, never read
        ring_kv, ring_gate = (rows.ring_kv, rows.ring_gate) if overlap else (ring, ring)
        assert ring_kv is not None and ring_gate is not None
        # Index pointers not read (with no window to pool, the keeps' rows: not empty).
        index = rows.window_rows if num_windows else rows.left_src
        prev_slots, prev_src, has_prev = (
            (rows.prev_slots, rows.prev_src, rows.has_prev) if overlap else (index,) * 3
        )
        assert prev_slots is not None and prev_src is not None and has_prev is not None
        prev_dst = rows.prev_dst if keep and overlap else index
        left_src, left_dst = (rows.left_src, rows.left_dst) if keep and num_left else (index,) * 2
        assert prev_dst is not None
        num_slots = 2 * m if overlap else m
        split = num_slots >= POOL_SPLIT_MIN_SLOTS
        if split:
            block_d = min(POOL_SPLIT_D, triton.next_power_of_2(dim))
            block_s = min(POOL_SPLIT_BLOCK_S, triton.next_power_of_2(num_slots))
            num_warps = POOL_SPLIT_WARPS
        else:
            block_s, block_d, num_warps = _pool_tiles(num_slots, dim)
        # Pointers not read: without rope, a bias or the entry pool (out, or with no window
        # to pool, a tensor that is not empty: the keeps' launch takes no null pointer).
        dummy = out if num_windows else rows.buf_kv
        rope = (
            cos if half else dummy,
            sin if half else dummy,
            cos.stride(0) if half else 0,
            sin.stride(0) if half else 0,
        )
        store = _entry_store(rows, num_windows, dim)
        entry = (dummy, index, 0)
        if store:
            entry = (rows.entries, rows.entry_dst, rows.entries.stride(0))
        weight = weight.float().contiguous()
        programs = num_windows + (num_left if keep else 0)
        _compress_pool_kernel[(programs, triton.cdiv(dim, block_d))](
            *common,
            rows.buf_rows,
            num_buf,
            num_windows,
            left_src,
            left_dst,
            prev_dst,
            rows.window_rows,
            ring_kv,
            ring_gate,
            prev_slots,
            prev_slots.shape[0],
            prev_src,
            has_prev,
            dummy if ape is None else ape.float().contiguous(),
            weight,
            dummy,
            dim,
            eps,
            *rope,
            *entry,
            M=m,
            OVERLAP=overlap,
            HAS_APE=ape is not None,
            SPLIT=split,
            BLOCK_S=block_s,
            BLOCK_D=block_d,
            ROPE_HALF=half,
            STORE_ENTRY=store and not split,
            KEEP=keep,
            BLOCK_W=triton.next_power_of_2(width),
            num_warps=num_warps,
            **pdl(out.device),
        )
        if split and num_windows:
            block_d = triton.next_power_of_2(dim)
            _pool_finish_kernel[(num_windows,)](
                out,
                weight,
                dim,
                eps,
                *rope,
                *entry,
                BLOCK_D=block_d,
                ROPE_HALF=half,
                STORE_ENTRY=store,
                num_warps=min(8, max(1, block_d // 256)),
                **pdl(out.device),
            )
    if keep:
        return out
    if overlap and num_ring_keeps:
        assert rows.prev_dst is not None and rows.ring_kv is not None
        _compress_keep_kernel[(num_ring_keeps * m,)](
            *common,
            rows.buf_rows,
            num_buf,
            rows.last_window,
            rows.prev_dst,
            rows.window_rows,
            rows.ring_kv,
            rows.ring_gate,
            dim,
            M=m,
            RING=True,
            BLOCK_W=triton.next_power_of_2(dim),
            **pdl(out.device),
        )
    if num_left:
        _compress_keep_kernel[(num_left,)](
            *common,
            rows.buf_rows,
            num_buf,
            rows.left_src,
            rows.left_dst,
            rows.window_rows,
            rows.buf_kv,
            rows.buf_gate,
            width,
            M=m,
            RING=False,
            BLOCK_W=triton.next_power_of_2(width),
            **pdl(out.device),
        )
    return out
