"""The compressors' step plans: which windows each compression ratio closes this step, where
their entries go, and what stays in the open-window buffers (host numpy, vectorised).

Flat views the plans address (``S`` slots, ``m`` ratio, ``b`` = m - 1 + max_draft buffer rows
per slot, ``pb`` = block_size / m entries per block)::

    compressor buf   [S * b, w]        row slot * b + i: the open window's i-th raw token
    entry pool       [blocks * pb, d]  row block * pb + entry % pb
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
    prev_slots [R']: slot of each request that closes a window (their overlap state is read);
    prev_dst [R']: where the new overlap state goes (the same slots; scratch for a candidate);
    prev_src [W]: overlap (ratio 4) source of each window's previous-window half: i < R' is
    prev state row i, R' + g is window g of this step; has_prev [W]: False for a request's
    window 0 (zero kv, -inf gate); last_window [R']: each such request's last closed window
    (its Ca half becomes the slot's new overlap state); keep_windows / entry_dst: windows whose
    entries are written (not in shared prefix-cache blocks) and their entry-pool rows;
    left_src / left_dst: tokens of still-open windows, src rows -> buf rows.
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
    m, per_block = ratio, geometry.block_size // ratio
    b = geometry.buffer_rows(ratio)
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
    # Windows closed this step, in batch order: request wr, index w within the request's.
    wr = np.repeat(np.arange(closed.shape[0]), closed)
    g = np.arange(wr.shape[0])
    w = g - np.repeat(starts(closed), closed)
    ids = reqs.start[wr] // m + w
    closers = np.flatnonzero(closed)
    closer_index = np.cumsum(closed > 0) - 1
    keep = ids >= -(-reqs.protected[wr] // m)  # entries in shared prefix blocks are not rewritten
    left = ~in_window
    return {
        "buf_rows": (reqs.slot[r] * b + i)[from_buf],
        "window_rows": src[in_window].reshape(-1, m),
        "window_ids": ids,
        "prev_slots": reqs.slot[closers],
        "prev_src": np.where(w == 0, closer_index[wr], closers.shape[0] + g - 1),
        "has_prev": ids > 0,
        "prev_dst": reqs.slot[closers],
        "last_window": np.cumsum(closed)[closers] - 1,
        "keep_windows": g[keep],
        "entry_dst": reqs.entry_rows(wr[keep], ids[keep], per_block),
        "left_src": src[left],
        "left_dst": (reqs.slot[r] * b + i - closed[r] * m)[left],
    }


def decode_compress_plan(
    reqs: Requests, geometry: CacheGeometry, ratio: int
) -> dict[str, np.ndarray]:
    """One token per request, shapes fixed by the number of requests: request i's candidate
    window is its slot's m - 1 buffered rows and its token. It closes when the token is the
    window's last (position % m == m - 1); otherwise its entry and its overlap state go to the
    scratch rows and the token joins the buffer."""
    m, per_block = ratio, geometry.block_size // ratio
    b = geometry.buffer_rows(ratio)
    assert (reqs.num_tokens == 1).all(), "the decode plan takes one token per request"
    num = reqs.start.shape[0]
    slots, pos, offsets = reqs.slot, reqs.start, reqs.offset
    closes = pos % m == m - 1
    ids = pos // m
    protected = ids < -(-reqs.protected // m)
    own_entry = reqs.entry_rows(np.arange(num), ids, per_block)
    buffered = np.arange(num)[:, None] * (m - 1) + np.arange(m - 1)  # [B, m - 1] rows of src
    return {
        "buf_rows": (slots[:, None] * b + np.arange(m - 1)[None, :]).ravel(),
        "window_rows": np.concatenate([buffered, num * (m - 1) + offsets[:, None]], axis=1),
        "window_ids": ids,
        "prev_slots": slots,
        "prev_src": np.arange(num),
        "has_prev": ids > 0,
        "prev_dst": np.where(closes, slots, geometry.scratch_slot),
        "last_window": np.arange(num),
        "keep_windows": np.arange(num),
        "entry_dst": np.where(closes & ~protected, own_entry, geometry.scratch_block * per_block),
        "left_src": num * (m - 1) + offsets,
        "left_dst": np.where(closes, geometry.scratch_slot * b, slots * b + pos % m),
    }
