"""The compressors' step plans: which windows each compression ratio closes this step, where
their entries go, and what the buffer and overlap rings keep (host numpy, vectorised).

Flat views the plans address (``S`` slots, ``m`` ratio, ``b`` = m - 1 + max_draft buffer rows
per slot, ``k`` = 1 + ceil(max_draft / m) overlap windows per slot, ``pb`` = block_size / m
entries per block; cache.py draws the rings)::

    compressor buf   [S * b, w]        row slot * b + (p - p // m) % b: token p's raw kv / gate
    overlap ring     [S * k, m, d]     row slot * k + w % k: closed window w's Ca half
    entry pool       [blocks * pb, d]  row block * pb + entry % pb

A step ending at e keeps in the buffer ring every token (but windows' last ones) from the
window holding e - max_draft on, and in the overlap ring the last k windows it closes: what a
rollback of up to max_draft tokens needs (at max_draft = 0: the open window and the last
window, as without speculative decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.model.deepseek_v4.plan_inputs import CacheGeometry, Requests, starts


@dataclass
class CompressPlan:
    """One compression ratio's work in this step (shared by every compressor with that ratio).

    The compressor gathers ``src = cat(buf[buf_rows], step rows)`` [nbuf + T, w], then:
    window_rows [W, m]: rows of src forming each window closed this step (batch order);
    window_ids [W]: each window's index in its request (its entry id; rope position id * m);
    prev_slots [R']: overlap-ring row of the window before the first one each closing request
    closes (read); prev_src [W]: overlap (ratio 4) source of each window's previous-window
    half: i < R' is the ring row prev_slots[i], R' + g is window g of this step; has_prev [W]:
    False for a request's window 0 (zero kv, -inf gate); last_window [L] / prev_dst [L]: windows
    of this step whose Ca half the overlap ring keeps (each request's last k) and their ring
    rows (scratch for a candidate that did not close); keep_windows / entry_dst: windows whose
    entries are written (not in shared prefix-cache blocks) and their entry-pool rows;
    left_src / left_dst: tokens the buffer ring keeps, src rows -> buf rows.
    """

    buf_rows: torch.Tensor
    window_rows: torch.Tensor
    window_ids: torch.Tensor
    prev_slots: torch.Tensor
    prev_src: torch.Tensor
    has_prev: torch.Tensor
    prev_dst: torch.Tensor
    last_window: torch.Tensor
    keep_windows: torch.Tensor
    entry_dst: torch.Tensor
    left_src: torch.Tensor
    left_dst: torch.Tensor

    @property
    def num_windows(self) -> int:
        return self.window_rows.shape[0]


def compress_plan(reqs: Requests, geometry: CacheGeometry, ratio: int) -> dict[str, np.ndarray]:
    """The general plan (any chunk lengths); see CompressPlan for the fields."""
    m, per_block, d = ratio, geometry.block_size // ratio, geometry.max_draft
    b, k = geometry.buffer_rows(ratio), geometry.overlap_windows(ratio)
    buffered = reqs.start % m  # open-window tokens already in the slot
    total = buffered + reqs.num_tokens
    closed = total // m
    # Each request's tokens from its open window's start, as rows of src = cat(buf, step rows).
    r = np.repeat(np.arange(total.shape[0]), total)
    i = np.arange(r.shape[0]) - np.repeat(starts(total), total)
    from_buf = i < buffered[r]
    num_bufs = int(buffered.sum())
    src = np.where(
        from_buf,
        np.repeat(starts(buffered), total) + i,
        num_bufs + reqs.offset[r] + i - buffered[r],
    )
    in_window = i < closed[r] * m
    buf_rows, left, left_dst = _buffer_ring_plan(reqs, r, i, from_buf, in_window, m, b, d)
    # Windows closed this step, in batch order: request wr, index w within the request's.
    wr = np.repeat(np.arange(closed.shape[0]), closed)
    g = np.arange(wr.shape[0])
    w = g - np.repeat(starts(closed), closed)
    ids = reqs.start[wr] // m + w
    closers = np.flatnonzero(closed)
    closer_index = np.cumsum(closed > 0) - 1
    keep = ids >= -(-reqs.protected[wr] // m)  # entries in shared prefix blocks are not rewritten
    kept_windows = w >= closed[wr] - k  # each request's last k windows of the step
    return {
        "buf_rows": buf_rows,
        "window_rows": src[in_window].reshape(-1, m),
        "window_ids": ids,
        "prev_slots": reqs.slot[closers] * k + (reqs.start[closers] // m - 1) % k,
        "prev_src": np.where(w == 0, closer_index[wr], closers.shape[0] + g - 1),
        "has_prev": ids > 0,
        "prev_dst": reqs.slot[wr[kept_windows]] * k + ids[kept_windows] % k,
        "last_window": g[kept_windows],
        "keep_windows": g[keep],
        "entry_dst": reqs.entry_rows(wr[keep], ids[keep], per_block),
        "left_src": src[left],
        "left_dst": left_dst,
    }


def decode_compress_plan(
    reqs: Requests, geometry: CacheGeometry, ratio: int
) -> dict[str, np.ndarray]:
    """One token per request, shapes fixed by the number of requests: request i's candidate
    window is its slot's m - 1 buffered rows and its token. It closes when the token is the
    window's last (position % m == m - 1); otherwise its entry and its overlap state go to the
    scratch rows and the token joins the buffer ring."""
    m, per_block = ratio, geometry.block_size // ratio
    b, k = geometry.buffer_rows(ratio), geometry.overlap_windows(ratio)
    assert (reqs.num_tokens == 1).all(), "the decode plan takes one token per request"
    num = reqs.start.shape[0]
    slots, pos, offsets = reqs.slot, reqs.start, reqs.offset
    closes = pos % m == m - 1
    ids = pos // m
    protected = ids < -(-reqs.protected // m)
    own_entry = reqs.entry_rows(np.arange(num), ids, per_block)
    buffered = np.arange(num)[:, None] * (m - 1) + np.arange(m - 1)  # [B, m - 1] rows of src
    # Window id's tokens are the stored ones q = (m - 1) * id + j, j < m - 1: rows (q % b).
    window_row = np.arange(m - 1)[None, :]  # [1, m - 1]
    if b != m - 1:  # at b = m - 1 every window starts at row 0
        window_row = (ids[:, None] * (m - 1) + window_row) % b
    return {
        "buf_rows": (slots[:, None] * b + window_row).ravel(),
        "window_rows": np.concatenate([buffered, num * (m - 1) + offsets[:, None]], axis=1),
        "window_ids": ids,
        "prev_slots": slots * k + (ids - 1) % k,
        "prev_src": np.arange(num),
        "has_prev": ids > 0,
        "prev_dst": np.where(closes, slots * k + ids % k, geometry.scratch_slot * k),
        "last_window": np.arange(num),
        "keep_windows": np.arange(num),
        "entry_dst": np.where(closes & ~protected, own_entry, geometry.scratch_block * per_block),
        "left_src": num * (m - 1) + offsets,
        "left_dst": np.where(closes, geometry.scratch_slot * b, _buffer_rows(slots, pos, m, b)),
    }


def _buffer_ring_plan(
    reqs: Requests,
    r: np.ndarray,
    i: np.ndarray,
    from_buf: np.ndarray,
    in_window: np.ndarray,
    m: int,
    b: int,
    d: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The buffer ring's reads and writes of the general plan, over src index i of request r's
    tokens (from its open window's start; in_window: in a window closed this step): the rows
    of the buffered tokens, which tokens the ring keeps, and their rows.

    Kept: the tokens from the window holding end - d on, but windows' last ones. At d = 0 that
    is the still-open window, and token i of a window sits at row i: the same rows as
    ``_buffer_rows`` gives, without its per-token divisions."""
    if not d:
        buf_rows = (reqs.slot[r] * b + i)[from_buf]
        left = ~in_window
        return buf_rows, left, reqs.slot[r[left]] * b + i[left] % m
    pos = (reqs.start - reqs.start % m)[r] + i
    first = (np.maximum(reqs.end - d, 0) // m - reqs.start // m) * m
    left = (i >= first[r]) & (i % m != m - 1)
    buf_rows = _buffer_rows(reqs.slot[r[from_buf]], pos[from_buf], m, b)
    return buf_rows, left, _buffer_rows(reqs.slot[r[left]], pos[left], m, b)


def _buffer_rows(slots: np.ndarray, pos: np.ndarray, m: int, b: int) -> np.ndarray:
    """Buffer-ring rows of tokens at positions ``pos`` of slots ``slots``: the q-th token that
    is not a window's last, q = p - p // m, at row q % b (cache.py). A ratio-1 compressor
    without drafts has no ring (b = 0: every token closes its window): row 0, never written."""
    if not b:
        return np.zeros_like(pos)
    return slots * b + (pos - pos // m) % b
