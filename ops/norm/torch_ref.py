"""RMSNorm and rotary embedding, torch reference (the oracle; runs anywhere)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from deepinfer.ops.registry import Backend


class RopeParams(Protocol):
    """One RoPE flavour as a model family's arguments describe it (e.g. DeepSeek-V4's
    ``RopeArgs``): plain (``rope_type`` "default") or YaRN."""

    @property
    def theta(self) -> float: ...
    @property
    def rope_type(self) -> str: ...
    @property
    def factor(self) -> float: ...
    @property
    def original_max_position_embeddings(self) -> int: ...
    @property
    def beta_fast(self) -> float: ...
    @property
    def beta_slow(self) -> float: ...
    @property
    def truncate(self) -> bool: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm with fp32 statistics; ``weight`` None is the unweighted variant.

    x: [..., N] any float dtype; weight: [N] fp32 (kept fp32, multiplied before the cast back).
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        xf = weight.float() * xf
    return xf.to(dtype)


def gated_pool(
    kv: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The compressors' pooling: rms_norm(sum over slots of softmax(gate) * kv) per window.

    kv: [W, S, D] (a window of S slots); gate: [W, S, D] logits (any float dtype, -inf = an
    empty slot), softmaxed over the slots per channel in fp32; weight: [D] the norm's. The
    weights are rounded to kv's dtype before the product, as the model's reference does.
    Returns [W, D] in kv's dtype.
    """
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    return rms_norm((kv * weights).sum(dim=1), weight, eps)


@dataclass(frozen=True)
class CompressRows:
    """Where one compressor's step reads and writes its rows: its state tensors and the step
    plan's indices (deepseek_v4/compress_plan.py's CompressPlan says what each index holds).
    Producer: the model's compressors; consumer: ``compress_windows``; device tensors.

    The step's rows are ``src = cat(buf_kv[buf_rows], kv)`` [nbuf + T, w] (gate alike)::

        window w, slot j (< m)     src[window_rows[w, j]]           [W, m]
        overlapping (CSA, w = 2d): slots [previous window's Ca | this window's Cb], the
        previous one from this step (prev_src >= R') or the ring (ring rows prev_slots)
        kept for later steps      src[left_src] -> buf[left_dst]     the buffer ring
                                  Ca of windows last_window -> ring rows prev_dst

    buf_kv / buf_gate: [R, w] the buffer ring (flat); ring_kv / ring_gate: [S * K, m, d] the
    overlap ring, raw (without the gate's bias), None when the compressor does not overlap
    (then prev_slots .. prev_dst are None too). entries / entry_dst: the entry pool [rows, d]
    (dense) that window w's entry is also written to, at row entry_dst[w]; None: not written.
    keep_in_pool: the step's keeps may run with its pooling (a backend's one launch): every
    request has one token and no drafts are kept (CompressPlan.one_token), so every window's
    Ca half is kept (last_window is every window, in order) into the ring row its own pooling
    read, if any, and no other window reads a row a keep writes but discarded candidates'.
    """

    buf_kv: torch.Tensor
    buf_gate: torch.Tensor
    buf_rows: torch.Tensor
    window_rows: torch.Tensor
    left_src: torch.Tensor
    left_dst: torch.Tensor
    ring_kv: torch.Tensor | None = None
    ring_gate: torch.Tensor | None = None
    prev_slots: torch.Tensor | None = None
    prev_src: torch.Tensor | None = None
    has_prev: torch.Tensor | None = None
    last_window: torch.Tensor | None = None
    prev_dst: torch.Tensor | None = None
    entries: torch.Tensor | None = None
    entry_dst: torch.Tensor | None = None
    keep_in_pool: bool = False

    @property
    def num_windows(self) -> int:
        return self.window_rows.shape[0]


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
    """A compressor's step: the entries of the windows it closes, and its rings kept.

    kv, gate: [T, w] this step's projections (any row stride); ape: [m, w] fp32, the gate's
    position bias (None: none); weight: [d] the entries' norm. Each window's slots are softmax
    pooled per channel (``gated_pool``), normalised, and with ``cos``, ``sin`` [W, rope / 2]
    rotated to the window's position. Returns [W, d] in the buffer ring's dtype, also written
    to ``rows.entries`` where given. Then the overlap ring keeps the last windows' Ca halves and
    the buffer ring its tokens (``rows``).
    """
    buf_kv, buf_gate = rows.buf_kv, rows.buf_gate
    src_kv = torch.cat([buf_kv[rows.buf_rows], kv.to(buf_kv.dtype)])  # [nbuf + T, w]
    src_gate = torch.cat([buf_gate[rows.buf_rows], gate.to(buf_gate.dtype)])
    pooled = src_kv.new_empty(0, weight.shape[0])
    if rows.num_windows:
        win_kv = src_kv[rows.window_rows]  # [W, m, w]
        raw_gate = src_gate[rows.window_rows]
        win_gate = raw_gate if ape is None else raw_gate + ape
        if rows.ring_kv is not None:
            win_kv, win_gate = _overlap(win_kv, raw_gate, win_gate, ape, rows)
        pooled = gated_pool(win_kv, win_gate, weight, eps)  # [W, d]
        if cos is not None:
            assert sin is not None, "compress_windows: cos without sin"
            pooled = apply_rope(pooled, cos, sin)
        if rows.entries is not None:
            assert rows.entry_dst is not None, "compress_windows: entries without entry_dst"
            rows.entries[rows.entry_dst] = pooled.to(rows.entries.dtype)
    buf_kv[rows.left_dst] = src_kv[rows.left_src]
    buf_gate[rows.left_dst] = src_gate[rows.left_src]
    return pooled


def _overlap(
    win_kv: torch.Tensor,
    raw_gate: torch.Tensor,
    win_gate: torch.Tensor,
    ape: torch.Tensor | None,
    rows: CompressRows,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[W, m, 2d] -> [W, 2m, d]: slots [previous window's Ca | this window's Cb].

    The previous window is the one before in this step, or the slot's overlap ring for a
    request's first window of the step; a request's window 0 has none (zero kv, -inf gate).
    The last windows' Ca halves go to the ring; gates are kept without the bias, which is
    added again (bit-identically) when they are used.
    """
    assert rows.ring_kv is not None and rows.ring_gate is not None
    assert rows.prev_slots is not None and rows.prev_src is not None
    assert rows.has_prev is not None and rows.last_window is not None
    assert rows.prev_dst is not None
    dim = rows.ring_kv.shape[-1]
    ring_kv, ring_gate = rows.ring_kv, rows.ring_gate  # [S * K, m, d]: row slot * K + w % K
    ring_gate_biased = ring_gate[rows.prev_slots]
    if ape is not None:
        ring_gate_biased = ring_gate_biased + ape[:, :dim]
    cand_kv = torch.cat([ring_kv[rows.prev_slots], win_kv[..., :dim]])  # [R' + W, m, d]
    cand_gate = torch.cat([ring_gate_biased, win_gate[..., :dim]])
    has_prev = rows.has_prev.view(-1, 1, 1).bool()
    prev_kv = torch.where(has_prev, cand_kv[rows.prev_src], 0)
    prev_gate = torch.where(has_prev, cand_gate[rows.prev_src], float("-inf"))
    ring_kv[rows.prev_dst] = win_kv[rows.last_window, :, :dim].to(ring_kv.dtype)
    ring_gate[rows.prev_dst] = raw_gate[rows.last_window, :, :dim].to(ring_gate.dtype)
    new_kv = torch.cat([prev_kv.to(win_kv.dtype), win_kv[..., dim:]], dim=1)  # [W, 2m, d]
    new_gate = torch.cat([prev_gate.to(win_gate.dtype), win_gate[..., dim:]], dim=1)
    return new_kv, new_gate


def rope_inv_freq(rope: RopeParams, rope_dim: int) -> torch.Tensor:
    """Inverse frequencies [rope_dim / 2] fp32: plain RoPE, or YaRN without mscale.

    YaRN: pairs below the low correction dim keep their frequency (extrapolation), pairs above
    the high one are divided by ``factor`` (interpolation), a linear ramp in between. V4 never
    scales cos/sin (attention factor 1).
    """
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    pos_freqs = rope.theta**exponents
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type != "yarn":
        return inv_freq

    def correction_dim(num_rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (rope_dim * math.log(orig / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated = 1.0 / (rope.factor * pos_freqs)
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rope_dim / 2] fp32 for int positions [T] (an int times an fp32 tensor is
    the int as fp32 times it: no launch of its own for the cast)."""
    freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of x (fp32 math).

    x: [T, ..., D] laid out ``[nope | rope]``; pairs (2i, 2i+1) of the rope slice rotate by
    angle i. cos/sin: [T, rope_dim / 2]; pass ``-sin`` for the inverse rotation.
    """
    rope_dim = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]  # [T, ..., rope_dim / 2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    store: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``apply_rope(rms_norm(x, weight, eps), cos, sin)``: a query's or a key's norm, then its
    RoPE (one launch on Triton). ``store`` (target [R, D], rows [T]) for x [T, D]: each token's
    result also written to target[rows[t]] (a window ring, from the same launch on Triton)."""
    y = apply_rope(rms_norm(x, weight, eps), cos, sin)
    if store is not None:
        target, rows = store
        target[rows] = y.to(target.dtype)
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
    """``rms_norm_rope`` of x [T, ..., D] and of k [T, D], each with its own weight of
    ``weights``, the same eps and angles; ``store``: k's. A layer's queries and keys (one
    launch on Triton)."""
    return (
        rms_norm_rope(x, weights[0], eps, cos, sin),
        rms_norm_rope(k, weights[1], eps, cos, sin, store=store),
    )


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Manifold-constrained hyper-connection, entry side.

    x: [T, hc, D]; fn: [(2+hc)*hc, hc*D]; scale: [3]; base: [(2+hc)*hc]. Returns (post [T, hc],
    comb [T, hc, hc] doubly stochastic by Sinkhorn, block input [T, D] = sum_i pre[i] * x[i]
    in x's dtype). All mixing math in fp32. ``block_norm`` (weight [D], eps): the block input
    through ``rms_norm`` with them, the sub-layer's own norm (one launch with the collapse on
    Triton).
    """
    pre, post, comb = hc_mixes(x, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps)
    return post, comb, _block_input(hc_collapse(x, pre), block_norm)


def _block_input(
    collapsed: torch.Tensor, block_norm: tuple[torch.Tensor, float] | None
) -> torch.Tensor:
    return collapsed if block_norm is None else rms_norm(collapsed, *block_norm)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shifted hyper-connection (DeepSeek-V4.1), entry side: the block input collapses x with
    the *previous* sub-layer's pre (``prev_pre`` [T, hc] fp32), and this sub-layer's pre, from
    the same mixes as ``hc_pre``, is returned for the next one. Returns (pre [T, hc], post,
    comb, block input [T, D]); ``block_norm`` as ``hc_pre``'s."""
    pre, post, comb = hc_mixes(x, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps)
    return pre, post, comb, _block_input(hc_collapse(x, prev_pre), block_norm)


def hc_mixes(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, hc], post [T, hc], comb [T, hc, hc]) fp32 from the RMS-normalised flat streams."""
    hc = x.shape[1]
    flat = rms_norm(x.flatten(1).float(), None, norm_eps)  # [T, hc*D]
    mix = F.linear(flat, fn.float())  # [T, (2+hc)*hc]
    pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1)
    comb = comb + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)  # first pass normalises columns only
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    *,
    block_norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """A hyper-connection head (the model's last, and each MTP layer's): [T, hc, D] -> [T, D],
    the streams' sum weighted by pre = sigmoid(mix * scale + base) + hc_eps, the mix fn [hc,
    hc*D] of the RMS-normalised flat streams (hc_pre's pre gate alone: no post, no Sinkhorn).
    scale: [1]; base: [hc]. ``block_norm`` (weight [D], eps): the sum through ``rms_norm`` with
    them (the final norm before the LM head)."""
    flat = rms_norm(x.flatten(1).float(), None, norm_eps)  # [T, hc*D]
    mix = F.linear(flat, fn.float())  # [T, hc]
    pre = torch.sigmoid(mix * scale.float() + base.float()) + hc_eps
    return _block_input(hc_collapse(x, pre), block_norm)


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[T, hc, D] -> [T, D]: sum_i pre[:, i] * x[:, i] (fp32 weights), in x's dtype."""
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


def hc_post(
    out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Hyper-connection, exit side: new[k] = post[k] * out + sum_j comb[j, k] * x[j].

    out: [T, D]; x: [T, hc, D]; post: [T, hc] fp32; comb: [T, hc, hc] fp32 -> [T, hc, D].
    """
    dtype = x.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), x)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sub-layer's exit and the next one's entry: x' = hc_post(out, x, post, comb), then
    hc_pre(x', fn, ...) with the next sub-layer's parameters. Returns (x', post, comb, block
    input). A fast backend computes the next mix in the exit's launch."""
    new = hc_post(out, x, post, comb)
    return new, *hc_pre(
        new, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps, block_norm=block_norm
    )


class TorchRefNormBackend(Backend):
    """The oracle as a backend object: this module's functions; it keeps no state."""

    rms_norm = staticmethod(rms_norm)
    apply_rope = staticmethod(apply_rope)
    rms_norm_rope = staticmethod(rms_norm_rope)
    rms_norm_rope_pair = staticmethod(rms_norm_rope_pair)
    hc_pre = staticmethod(hc_pre)
    hc_pre_shifted = staticmethod(hc_pre_shifted)
    hc_post = staticmethod(hc_post)
    hc_post_pre = staticmethod(hc_post_pre)
    hc_head = staticmethod(hc_head)
    compress_windows = staticmethod(compress_windows)
    rope_inv_freq = staticmethod(rope_inv_freq)
    rope_cos_sin = staticmethod(rope_cos_sin)
