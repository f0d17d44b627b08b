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
    rows (scratch for a candidate that did not close); entry_dst [W]: each window's entry-pool
    row (the scratch block's for one in a shared prefix-cache block, which is not rewritten);
    left_src / left_dst: tokens the buffer ring keeps, src rows -> buf rows. one_token (host):
    every request has one token this step and the cache keeps no drafts (CompressRows'
    keep_in_pool).
    """

    buf_rows: torch.Tensor
    window_rows: torch.Tensor
    window_ids: torch.Tensor
    prev_slots: torch.Tensor
    prev_src: torch.Tensor
    has_prev: torch.Tensor
    prev_dst: torch.Tensor
    last_window: torch.Tensor
    entry_dst: torch.Tensor
    left_src: torch.Tensor
    left_dst: torch.Tensor
    one_token: bool = False

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
    assert keep.all() or geometry.scratch_block >= 0, "a window to discard and no scratch block"
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
        "entry_dst": np.where(
            keep, reqs.entry_rows(wr, ids, per_block), geometry.scratch_block * per_block
        ),
        "left_src": src[left],
        "left_dst": left_dst,
    }


def graphed_compress_plan(
    reqs: Requests, geometry: CacheGeometry, ratio: int
) -> dict[str, np.ndarray]:
    """Every request has the same q rows (its tokens, then pads), and the shapes depend only
    on the number of requests and q, so one CUDA graph serves every such step.

    Request i pools C = ceil(q / m) candidate windows, from its open window on (C <= k, the
    overlap ring's windows, as q - 1 <= max_draft): the slot's m - 1 buffered rows (read whether
    or not they hold a token), then its step rows, then filler rows past them. A candidate
    closes when its last position is a real token; one that does not writes its entry and its
    overlap half to the scratch rows. The buffer ring keeps what ``compress_plan`` keeps of the
    real tokens; every other step row goes to the scratch slot's rows. So a pad leaves nothing
    in the cache, and a step writes what ``compress_plan`` of its real tokens writes."""
    m, per_block, d = ratio, geometry.block_size // ratio, geometry.max_draft
    b, k = geometry.buffer_rows(ratio), geometry.overlap_windows(ratio)
    num = reqs.start.shape[0]
    q = int(reqs.num_tokens[0]) if num else 1
    assert (reqs.num_tokens == q).all(), "a graphed plan takes the same rows for every request"
    c = -(-q // m)
    assert c <= k, f"{c} candidate windows of ratio {m} do not fit an overlap ring of {k}"
    slots, start, end = reqs.slot, reqs.start, reqs.real_end
    first = start // m  # the open window
    ids = first[:, None] + np.arange(c)  # [B, C] candidate windows
    closes = (ids + 1) * m <= end[:, None]
    # Rows of src = cat(buf[buf_rows] (m - 1 per request), step rows) of each candidate's tokens.
    pos = ids[:, :, None] * m + np.arange(m)  # [B, C, m]
    at = start[:, None, None]
    num_buf = num * (m - 1)
    step_row = num_buf + reqs.offset[:, None, None]
    buffered = np.arange(num)[:, None, None] * (m - 1) + np.arange(m)
    rows = np.where(pos < at, buffered, np.where(pos < at + q, step_row + pos - at, step_row))
    # Window id's tokens are the stored ones q' = (m - 1) * id + j, j < m - 1: rows (q' % b).
    window_row = np.arange(m - 1)[None, :]  # [1, m - 1]
    if b != m - 1:  # at b = m - 1 every window starts at row 0
        window_row = (first[:, None] * (m - 1) + window_row) % b
    req = np.repeat(np.arange(num), c)
    g = np.arange(num * c)
    flat_ids, flat_closes = ids.ravel(), closes.ravel()
    written = flat_closes & (flat_ids >= -(-reqs.protected[req] // m))
    # Tokens the buffer ring keeps: real, not a window's last, from the window holding end - d on.
    token_pos, token_req = reqs.positions, reqs.token_req
    kept_from = (np.maximum(end - d, 0) // m * m)[token_req]
    kept = ~reqs.is_pad & (token_pos % m != m - 1) & (token_pos >= kept_from)
    scratch = geometry.scratch_slot
    return {
        "buf_rows": (slots[:, None] * b + window_row).ravel(),
        "window_rows": rows.reshape(-1, m),
        "window_ids": flat_ids,
        "prev_slots": slots * k + (first - 1) % k,
        "prev_src": np.where(g % c == 0, req, num + g - 1),
        "has_prev": flat_ids > 0,
        "prev_dst": np.where(flat_closes, slots[req] * k + flat_ids % k, scratch * k),
        "last_window": g,
        "entry_dst": np.where(
            written,
            reqs.entry_rows(req, flat_ids, per_block),
            geometry.scratch_block * per_block,
        ),
        "left_src": num_buf + np.arange(token_pos.shape[0]),
        "left_dst": np.where(kept, _buffer_rows(slots[token_req], token_pos, m, b), scratch * b),
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
