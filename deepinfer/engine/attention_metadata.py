"""Index plans of one step for attention, the compressors and the indexer, built on the host.

    ForwardBatch.seqs (host ints, host block ids) -> StepMetadata (device index tensors)
                                                  -> every layer of the model

Everything that depends only on positions is known before the forward: which keys each query
sees in the sliding window, which compressed entries exist, which windows a compressor closes
and where its outputs go. It is computed once per step with numpy and uploaded in one copy, so
the layers run without Python loops over requests and without reading anything back.

Flat views the indices address (rows; ``S`` slots, ``R`` ring size, ``m`` ratio, ``pb`` =
block_size / m entries per block)::

    step rows        [T, d]          this step's tokens, in batch order
    ring             [S * R, hd]     row slot * R + position % R
    entry pool       [blocks * pb, d] row block * pb + entry % pb   (entry e of a request lives in
                                     block_table[e // pb])
    compressor buf   [S * (m-1), w]  row slot * (m-1) + i: the open window's i-th raw token
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.engine.forward_batch import ForwardBatch, SeqSpan


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


@dataclass
class StepMetadata:
    """Producer: ``build_metadata`` (host). Consumer: every layer (device tensors).

    token_req [T]: request (batch index) of each token. win_step_idx [T, Ws] / win_ring_idx
    [T, Wr]: step rows / ring rows of the window keys each query sees (-1 = none). ring_src /
    ring_dst: step rows -> ring rows written after attention (each request's last R tokens).
    Per ratio m: entry_rows[m] [B, N] entry-pool row of entry n of request b (0 past its entries);
    num_visible[m] [T] entries a query sees ((pos + 1) // m); visible_idx[m] [T, N] (dense ratios
    only: HCA attends to all of them) entry-pool rows of those entries, -1 past them;
    compress[m] the ratio's compressor plan.
    """

    token_req: torch.Tensor
    win_step_idx: torch.Tensor
    win_ring_idx: torch.Tensor
    ring_src: torch.Tensor
    ring_dst: torch.Tensor
    entry_rows: dict[int, torch.Tensor]
    num_visible: dict[int, torch.Tensor]
    visible_idx: dict[int, torch.Tensor]
    compress: dict[int, CompressPlan]


@dataclass(frozen=True)
class CacheGeometry:
    """What the plans need to know about the cache: sizes of the flat views above, and the
    scratch slot and block that padded requests and discarded writes of graphed steps use."""

    window: int
    ring_size: int
    block_size: int
    ratios: tuple[int, ...]
    dense_ratios: tuple[int, ...] = ()  # ratios of layers attending to every entry (HCA)
    scratch_slot: int = -1
    scratch_block: int = -1


Upload = Callable[[np.ndarray], torch.Tensor]


def build_metadata(
    batch: ForwardBatch, geometry: CacheGeometry, upload: Upload | None = None
) -> StepMetadata:
    """The step's plans. ``upload``: host int64 [n] -> the same on the model's device (the
    executor passes its pinned staging copy); default: a plain copy to input_ids' device."""
    if upload is None:
        device = batch.input_ids.device
        upload = lambda flat: torch.from_numpy(flat).to(device)  # noqa: E731
    host = plan_step(batch.seqs, geometry)
    return metadata_views(split_flat(upload(flatten(host)), host), geometry)


def plan_step(
    seqs: list[SeqSpan], geometry: CacheGeometry, decode_context: int | None = None
) -> dict[str, np.ndarray]:
    """Every index array of the step, host int64, by name.

    ``decode_context`` (decode steps captured in CUDA graphs: one token per request): shapes
    that depend only on the number of requests and this context bound (entry lists padded to
    decode_context // ratio), so one graph serves every step of that size; the compressors
    then pool a candidate window for every request and write the ones that did not close to
    the cache's scratch rows (``geometry.scratch_*``).
    """
    token_req = np.repeat(np.arange(len(seqs)), [s.num_tokens for s in seqs])
    win_step, win_ring, ring_src, ring_dst = _window_plan(seqs, geometry)
    host: dict[str, np.ndarray] = {
        "token_req": token_req,
        "win_step": win_step,
        "win_ring": win_ring,
        "ring_src": ring_src,
        "ring_dst": ring_dst,
    }
    positions = np.concatenate([np.arange(s.start_pos, s.end_pos) for s in seqs])
    for ratio in geometry.ratios:
        width = None if decode_context is None else max(1, decode_context // ratio)
        rows = _entry_rows(seqs, geometry.block_size // ratio, ratio, width)
        visible = (positions + 1) // ratio
        host[f"entry_rows{ratio}"] = rows
        host[f"num_visible{ratio}"] = visible
        if ratio in geometry.dense_ratios:  # CSA layers attend to the indexer's picks
            entry_ids = np.arange(rows.shape[1])
            host[f"visible_idx{ratio}"] = np.where(
                entry_ids[None, :] < visible[:, None], rows[token_req], -1
            )
        if decode_context is None:
            plan = _compress_plan(seqs, geometry, ratio)
        else:
            plan = _decode_compress_plan(seqs, geometry, ratio)
        for name, value in plan.items():
            host[f"c{ratio}.{name}"] = value
    return host


def flatten(host: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([a.astype(np.int64).ravel() for a in host.values()])


def split_flat(flat: torch.Tensor, host: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Views of ``flat`` (as ``flatten`` laid it out) shaped like the host arrays."""
    out, at = {}, 0
    for name, array in host.items():
        out[name] = flat[at : at + array.size].view(array.shape)
        at += array.size
    return out


def metadata_views(dev: dict[str, torch.Tensor], geometry: CacheGeometry) -> StepMetadata:
    """StepMetadata over the uploaded arrays, without copying them (a CUDA graph refills them
    in place between replays)."""
    return StepMetadata(
        token_req=dev["token_req"],
        win_step_idx=dev["win_step"],
        win_ring_idx=dev["win_ring"],
        ring_src=dev["ring_src"],
        ring_dst=dev["ring_dst"],
        entry_rows={m: dev[f"entry_rows{m}"] for m in geometry.ratios},
        num_visible={m: dev[f"num_visible{m}"] for m in geometry.ratios},
        visible_idx={m: dev[f"visible_idx{m}"] for m in geometry.dense_ratios},
        compress={
            m: CompressPlan(**{f: dev[f"c{m}.{f}"] for f in _PLAN_FIELDS}) for m in geometry.ratios
        },
    )


_PLAN_FIELDS = (
    "buf_rows",
    "window_rows",
    "window_ids",
    "prev_slots",
    "prev_src",
    "has_prev",
    "prev_dst",
    "last_window",
    "keep_windows",
    "entry_dst",
    "left_src",
    "left_dst",
)


def _window_plan(
    seqs: list[SeqSpan], geometry: CacheGeometry
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Query t at position p sees keys p - j, j < window, at or after the request's floor:
    from this step's rows when the key is new this step, else from the ring."""
    window, ring = geometry.window, geometry.ring_size
    max_new = max(s.num_tokens for s in seqs)
    step_parts, ring_parts, src_parts, dst_parts = [], [], [], []
    for seq in seqs:
        pos = np.arange(seq.start_pos, seq.end_pos)[:, None]
        key = pos - np.arange(window)[None, :]  # [n, window] key positions
        valid = key >= max(seq.window_floor, 0)
        new = key >= seq.start_pos
        step_parts.append(np.where(valid & new, seq.offset + key - seq.start_pos, -1)[:, :max_new])
        ring_parts.append(np.where(valid & ~new, seq.slot * ring + key % ring, -1))
        keep = min(seq.num_tokens, ring)
        kept = np.arange(seq.end_pos - keep, seq.end_pos)
        src_parts.append(seq.offset + kept - seq.start_pos)
        dst_parts.append(seq.slot * ring + kept % ring)
    # Columns past the widest window part are -1 everywhere: trim them (decode: 1 step column).
    win_step = np.concatenate(step_parts)[:, : min(window, max_new)]
    win_ring = np.concatenate(ring_parts)
    return win_step, win_ring, np.concatenate(src_parts), np.concatenate(dst_parts)


def _entry_rows(seqs: list[SeqSpan], per_block: int, ratio: int, width: int | None) -> np.ndarray:
    """[B, N] entry-pool row of entry n of each request; N = most entries in the batch, or
    ``width`` (which must hold them)."""
    counts = [s.end_pos // ratio for s in seqs]
    if width is None:
        width = max(max(counts), 1)
    assert max(counts) <= width, f"{max(counts)} entries do not fit a width of {width}"
    out = np.zeros((len(seqs), width), dtype=np.int64)
    for b, (seq, count) in enumerate(zip(seqs, counts, strict=True)):
        entries = np.arange(count)
        blocks = np.asarray(seq.block_ids, dtype=np.int64)[entries // per_block]
        out[b, :count] = blocks * per_block + entries % per_block
    return out


def _compress_plan(
    seqs: list[SeqSpan], geometry: CacheGeometry, ratio: int
) -> dict[str, np.ndarray]:
    m, per_block = ratio, geometry.block_size // ratio
    num_bufs = sum(s.start_pos % m for s in seqs)
    buf_rows, window_rows, window_ids, prev_slots, prev_src, has_prev = [], [], [], [], [], []
    last_window, keep_windows, entry_dst, left_src, left_dst = [], [], [], [], []
    buf_at = num_windows = 0
    for seq in seqs:
        nb = seq.start_pos % m
        first_window = seq.start_pos // m
        # src rows of the request's tokens from its open window's start, in position order.
        rows = np.concatenate(
            [np.arange(buf_at, buf_at + nb), num_bufs + seq.offset + np.arange(seq.num_tokens)]
        )
        buf_rows.append(seq.slot * (m - 1) + np.arange(nb))
        buf_at += nb
        closed = rows.shape[0] // m
        if closed:
            g = num_windows + np.arange(closed)
            ids = first_window + np.arange(closed)
            window_rows.append(rows[: closed * m].reshape(closed, m))
            window_ids.append(ids)
            prev_src.append(np.concatenate([[len(prev_slots)], g[:-1]]))
            has_prev.append(ids > 0)
            prev_slots.append(seq.slot)
            last_window.append(num_windows + closed - 1)
            # Entries of positions below num_protected sit in shared blocks: not rewritten.
            keep = ids >= -(-seq.num_protected // m)
            keep_windows.append(g[keep])
            blocks = np.asarray(seq.block_ids, dtype=np.int64)[ids[keep] // per_block]
            entry_dst.append(blocks * per_block + ids[keep] % per_block)
            num_windows += closed
        left = rows[closed * m :]
        left_src.append(left)
        left_dst.append(seq.slot * (m - 1) + np.arange(left.shape[0]))
    num_prev = len(prev_slots)
    # prev_src was written with request-local indices for the first window and global window
    # indices after it: move the window ones past the prev-state rows.
    fixed = []
    for part in prev_src:
        part = part.copy()
        part[1:] += num_prev
        fixed.append(part)

    def cat(parts: list, *shape: int) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros((0, *shape), dtype=np.int64)

    return {
        "buf_rows": cat(buf_rows),
        "window_rows": cat(window_rows, m),
        "window_ids": cat(window_ids),
        "prev_slots": np.asarray(prev_slots, dtype=np.int64),
        "prev_src": cat(fixed),
        "has_prev": cat(has_prev),
        "prev_dst": np.asarray(prev_slots, dtype=np.int64),
        "last_window": np.asarray(last_window, dtype=np.int64),
        "keep_windows": cat(keep_windows),
        "entry_dst": cat(entry_dst),
        "left_src": cat(left_src),
        "left_dst": cat(left_dst),
    }


def _decode_compress_plan(
    seqs: list[SeqSpan], geometry: CacheGeometry, ratio: int
) -> dict[str, np.ndarray]:
    """One token per request, shapes fixed by the number of requests: request i's candidate
    window is its slot's m - 1 buffered rows and its token. It closes when the token is the
    window's last (position % m == m - 1); otherwise its entry and its overlap state go to the
    scratch rows and the token joins the buffer."""
    m, per_block = ratio, geometry.block_size // ratio
    num = len(seqs)
    slots = np.asarray([s.slot for s in seqs], dtype=np.int64)
    pos = np.asarray([s.start_pos for s in seqs], dtype=np.int64)
    assert all(s.num_tokens == 1 for s in seqs), "the decode plan takes one token per request"
    closes = pos % m == m - 1
    ids = pos // m
    own_block = np.asarray([s.block_ids[i // per_block] for s, i in zip(seqs, ids, strict=True)])
    protected = ids < np.asarray([-(-s.num_protected // m) for s in seqs], dtype=np.int64)
    scratch_entry = geometry.scratch_block * per_block
    scratch_buf = geometry.scratch_slot * (m - 1)
    offsets = np.asarray([s.offset for s in seqs], dtype=np.int64)
    return {
        "buf_rows": (slots[:, None] * (m - 1) + np.arange(m - 1)[None, :]).ravel(),
        "window_rows": np.concatenate(
            [
                np.arange(num)[:, None] * (m - 1) + np.arange(m - 1),
                num * (m - 1) + offsets[:, None],
            ],
            axis=1,
        ),
        "window_ids": ids,
        "prev_slots": slots,
        "prev_src": np.arange(num),
        "has_prev": ids > 0,
        "prev_dst": np.where(closes, slots, geometry.scratch_slot),
        "last_window": np.arange(num),
        "keep_windows": np.arange(num),
        "entry_dst": np.where(
            closes & ~protected, own_block * per_block + ids % per_block, scratch_entry
        ),
        "left_src": num * (m - 1) + offsets,
        "left_dst": np.where(closes, scratch_buf, slots * (m - 1) + pos % m),
    }
