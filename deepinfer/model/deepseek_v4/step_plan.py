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
    compressor buf   [S * b, w]      a ring of raw tokens (b = m - 1 + max_draft rows;
                                     compress_plan.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.model.batch import ForwardBatch, SeqSpan, flatten, split_flat
from deepinfer.model.deepseek_v4.compress_plan import (
    CompressPlan,
    compress_plan,
    graphed_compress_plan,
)
from deepinfer.model.deepseek_v4.plan_inputs import CacheGeometry, Requests


@dataclass
class StepMetadata:
    """Producer: ``step_arrays`` + ``batch_views`` (or ``build_metadata``). Consumer: every
    layer (device tensors).

    token_req [T]: request (batch index) of each token. win_step_idx [T, Ws] / win_ring_idx
    [T, Wr]: step rows / ring rows of the window keys each query sees (-1 = none), uploaded
    with the plans, or for a long step derived on the device from ``window_plan`` by
    ``derive_lists``. ring_src /
    ring_dst: step rows -> ring rows written after attention (each request's last R tokens).
    ring_first (host): they may be written before it instead, with the keys' norm: every
    request has at most the ring's margin + 1 tokens (so no query of the step reads a ring row
    a token of the step replaces: that needs one ring size between them within a window), and
    so ring_src is every row in order.
    block_table [B, most blocks] (padded with block 0). Per ratio m: entry_ids[m] [N] 0..N-1 (N:
    the most entries in the batch, or the graph's bound), and each entry's block in the table
    (entry_block[m], clamped to the table) and row in the block (entry_offset[m]), both of the
    plan's shapes alone; num_visible[m] [T] entries a query sees ((pos + 1) // m); compress[m]
    the ratio's compressor plan. Derived on the device by ``derive_lists`` at the start
    of every forward (so a CUDA graph recomputes them): entry_rows[m] [B, N] entry-pool row of
    entry n of request b, and for dense ratios (HCA attends to every visible entry)
    visible_idx[m] [T, N], those rows, -1 past num_visible.
    """

    token_req: torch.Tensor
    win_step_idx: torch.Tensor | None
    win_ring_idx: torch.Tensor | None
    ring_src: torch.Tensor
    ring_dst: torch.Tensor
    block_table: torch.Tensor
    entry_ids: dict[int, torch.Tensor]
    entry_block: dict[int, torch.Tensor]
    entry_offset: dict[int, torch.Tensor]
    num_visible: dict[int, torch.Tensor]
    compress: dict[int, CompressPlan]
    per_block: dict[int, int]  # entries per block, by ratio (host ints)
    dense_ratios: tuple[int, ...]
    ring_first: bool = False
    window_plan: WindowPlan | None = None
    entry_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    visible_idx: dict[int, torch.Tensor] = field(default_factory=dict)
    _ring_window: torch.Tensor | None = None

    def derive_lists(self) -> None:
        """entry_rows and visible_idx from the block table, on the device (see above): a
        gather and one add a ratio, and for dense ratios a compare, a gather and a select;
        a long step's window lists from its WindowPlan."""
        self.derive_window_lists()
        for m, ids in self.entry_ids.items():
            blocks = self.block_table[:, self.entry_block[m]]  # [B, N]
            rows = torch.add(self.entry_offset[m], blocks, alpha=self.per_block[m])
            self.entry_rows[m] = rows
            if m in self.dense_ratios:
                visible = ids.unsqueeze(0) < self.num_visible[m].unsqueeze(1)  # [T, N]
                self.visible_idx[m] = torch.where(visible, rows[self.token_req], -1)

    def derive_window_lists(self) -> None:
        """A long step's win_step_idx and win_ring_idx from its WindowPlan (nothing when they
        came with the plans): what a forward reading only the window (the MTP layer) needs."""
        self._ring_window = None  # derived again from these, by the first layer that asks
        if self.window_plan is not None:
            self.win_step_idx, self.win_ring_idx = self.window_plan.lists(self.token_req)

    def ring_window(self) -> torch.Tensor:
        """Each query's window keys as rows of the ring alone, for a step whose keys are in
        the ring before attention (``ring_first``: step row s is ring row ring_dst[s]): [T, W]
        int32, W = Ws + Wr rounded up to a multiple of RING_WINDOW_COLUMNS, -1 = none. The
        step's keys come first, then the earlier ones, as the two lists order them (so a
        reference walks the keys in the same order either way). Derived on the device once a
        forward, at the first layer that asks (a CUDA graph captures it there)."""
        assert self.ring_first, "the ring holds this step's keys only in a ring_first step"
        if self._ring_window is None:
            step, ring = self.win_step_idx, self.win_ring_idx
            assert step is not None and ring is not None, "derive_lists runs first"
            in_ring = torch.where(step >= 0, self.ring_dst[step.clamp(min=0)], -1)
            columns = step.shape[1] + ring.shape[1]
            pad = -columns % RING_WINDOW_COLUMNS
            merged = torch.full(
                (step.shape[0], columns + pad), -1, dtype=torch.int32, device=step.device
            )
            merged[:, : step.shape[1]] = in_ring
            merged[:, step.shape[1] : columns] = ring
            self._ring_window = merged
        return self._ring_window


# ring_window's columns are a multiple of this: FlashMLA's sparse decode reads index lists in
# blocks of 64 (ops/attention/flashmla.py), and padding once a step spares a copy a layer.
RING_WINDOW_COLUMNS = 64

# From this many tokens a step's window lists are derived on the device (WindowPlan) rather
# than built on the host and uploaded: two [T, 128] int64 arrays, 16 MB at 8,192 tokens, which
# took 7 of the host's 8 ms planning such a step (benchmarks/step_plan_host.py). Below it the
# arrays are small (2 MB at 1,024 tokens) and the derivation's dozen launches would cost a short
# step more than they save (a judgement, not measured). CUDA-graph steps always upload.
WINDOW_ON_DEVICE_MIN_TOKENS = 1024


@dataclass
class WindowPlan:
    """What a long step's window lists are derived from (``_window_lists``' arithmetic in
    torch): per token its position [T]; per request [B] its first position this step, its
    window floor, the step row of position 0 (start - offset: position p of the step is row
    p - row0) and its ring's first row (slot * ring size); ``step_cols`` [Ws] 0..Ws - 1 (Ws:
    the step list's columns, min(window, the most tokens a request has))."""

    positions: torch.Tensor
    start: torch.Tensor
    floor: torch.Tensor
    row0: torch.Tensor
    ring0: torch.Tensor
    step_cols: torch.Tensor
    window: int
    ring_size: int

    def lists(self, token_req: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(win_step [T, Ws], win_ring [T, window]) as ``_window_lists`` builds them."""
        pos = self.positions.unsqueeze(1)
        start, floor = self.start[token_req].unsqueeze(1), self.floor[token_req].unsqueeze(1)
        key = pos - self.step_cols
        win_step = torch.where(
            key >= torch.maximum(start, floor), key - self.row0[token_req].unsqueeze(1), -1
        )
        key = pos - torch.arange(self.window, device=pos.device)
        old = (key < start) & (key >= floor)
        ring_rows = self.ring0[token_req].unsqueeze(1) + key % self.ring_size
        return win_step, torch.where(old, ring_rows, -1)


def build_metadata(
    batch: ForwardBatch, geometry: CacheGeometry, decode_context: int | None = None
) -> StepMetadata:
    """The plans of a batch built without them (a plain copy to input_ids' device); the
    executor builds its batches with ``step_arrays`` and ``batch_views`` instead.
    ``decode_context``: a decode graph's plans (``plan_step``), as the engine replays them."""
    host = plan_step(batch.seqs, geometry, decode_context)
    flat = torch.from_numpy(flatten(host)).to(batch.input_ids.device)
    return metadata_views(split_flat(flat, host), geometry)


def step_arrays(
    seqs: list[SeqSpan],
    token_ids: list[int],
    logits_indices: list[int],
    geometry: CacheGeometry,
    decode_context: int | None = None,
) -> dict[str, np.ndarray]:
    """Everything a step uploads, host int64 by name: the token ids, positions and logits rows,
    then ``plan_step``'s plans (one copy to the device, ``batch_views`` on the other side)."""
    host = {
        "input_ids": np.asarray(token_ids, dtype=np.int64),
        "positions": np.concatenate([np.arange(s.start_pos, s.end_pos) for s in seqs]),
        "logits_indices": np.asarray(logits_indices, dtype=np.int64),
    }
    host.update(plan_step(seqs, geometry, decode_context))
    return host


def batch_views(
    flat: torch.Tensor,
    host: dict[str, np.ndarray],
    seqs: list[SeqSpan],
    geometry: CacheGeometry,
) -> ForwardBatch:
    """The ForwardBatch over ``flat`` (``step_arrays`` uploaded): every tensor is a view of it,
    so a CUDA graph's replays read whatever was copied in last."""
    dev = split_flat(flat, host)
    return ForwardBatch(
        input_ids=dev["input_ids"],
        positions=dev["positions"],
        seqs=seqs,
        logits_indices=dev["logits_indices"],
        metadata=metadata_views(dev, geometry),
    )


def plan_step(
    seqs: list[SeqSpan], geometry: CacheGeometry, decode_context: int | None = None
) -> dict[str, np.ndarray]:
    """Every index array of the step, host int64, by name (vectorised over requests: the host
    cost per step must stay far below a decode step's device time).

    ``decode_context`` (steps captured in CUDA graphs: the same rows for every request, its
    tokens then pads, ``SeqSpan.num_pad``): shapes that depend only on the number of requests,
    their rows and this context bound (entry lists padded to decode_context // ratio), so one
    graph serves every step of that size; the compressors then pool candidate windows for every
    request and write the ones that did not close to the cache's scratch rows
    (``geometry.scratch_*``). A pad sees no entry past its request's last real token and leaves
    nothing in the cache.
    """
    # Graphed decode: the block table's width is fixed by the context bound as well.
    table_width = 0 if decode_context is None else -(-decode_context // geometry.block_size)
    reqs = Requests.of(seqs, table_width)
    ring_src, ring_dst = _ring_writes(reqs, geometry)
    host: dict[str, np.ndarray] = {
        "token_req": reqs.token_req,
        "ring_src": ring_src,
        "ring_dst": ring_dst,
        "block_table": reqs.table,
    }
    if decode_context is None and reqs.token_req.shape[0] >= WINDOW_ON_DEVICE_MIN_TOKENS:
        host.update(_window_inputs(reqs, geometry))
    else:
        host["win_step"], host["win_ring"] = _window_lists(reqs, geometry)
    # A pad sees what its request's last real token sees (never an entry it did not write).
    visible_pos = np.minimum(reqs.positions, reqs.real_end[reqs.token_req] - 1)
    for ratio in geometry.ratios:
        counts = reqs.real_end // ratio
        width = max(int(counts.max()), 1) if decode_context is None else decode_context // ratio
        assert counts.max() <= width, f"{counts.max()} entries do not fit a width of {width}"
        ids = np.arange(max(width, 1))
        per_block = geometry.block_size // ratio
        host[f"entry_ids{ratio}"] = ids
        host[f"entry_block{ratio}"] = np.minimum(ids // per_block, reqs.table.shape[1] - 1)
        host[f"entry_offset{ratio}"] = ids % per_block
        host[f"num_visible{ratio}"] = (visible_pos + 1) // ratio
        if decode_context is None:
            plan = compress_plan(reqs, geometry, ratio)
        else:
            plan = graphed_compress_plan(reqs, geometry, ratio)
        for name, value in plan.items():
            host[f"c{ratio}.{name}"] = value
    return host


def metadata_views(dev: dict[str, torch.Tensor], geometry: CacheGeometry) -> StepMetadata:
    """StepMetadata over the uploaded arrays, without copying them (a CUDA graph refills them
    in place between replays)."""
    most = _most_tokens(dev, geometry)
    one_token = most == 1 and not geometry.max_draft
    return StepMetadata(
        token_req=dev["token_req"],
        win_step_idx=dev.get("win_step"),
        win_ring_idx=dev.get("win_ring"),
        ring_src=dev["ring_src"],
        ring_dst=dev["ring_dst"],
        block_table=dev["block_table"],
        entry_ids={m: dev[f"entry_ids{m}"] for m in geometry.ratios},
        entry_block={m: dev[f"entry_block{m}"] for m in geometry.ratios},
        entry_offset={m: dev[f"entry_offset{m}"] for m in geometry.ratios},
        num_visible={m: dev[f"num_visible{m}"] for m in geometry.ratios},
        compress={
            m: CompressPlan(**{f: dev[f"c{m}.{f}"] for f in _PLAN_FIELDS}, one_token=one_token)
            for m in geometry.ratios
        },
        per_block={m: geometry.block_size // m for m in geometry.ratios},
        dense_ratios=geometry.dense_ratios,
        ring_first=(
            most is not None
            and most <= geometry.ring_size - geometry.window + 1
            and dev["ring_src"].shape[0] == dev["token_req"].shape[0]  # every token kept
        ),
        window_plan=None if "win_step" in dev else _window_views(dev, geometry),
    )


def _most_tokens(dev: dict[str, torch.Tensor], geometry: CacheGeometry) -> int | None:
    """The most tokens a request has this step, read from the plan's shapes (win_step has
    min(window, that many) columns, as many as win_step_cols has entries); None when it is
    the window or more."""
    columns = dev["win_step"].shape[1] if "win_step" in dev else dev["win_step_cols"].shape[0]
    return columns if columns < geometry.window else None


_PLAN_FIELDS = (
    "buf_rows",
    "window_rows",
    "window_ids",
    "prev_slots",
    "prev_src",
    "has_prev",
    "prev_dst",
    "last_window",
    "entry_dst",
    "left_src",
    "left_dst",
)


def _window_lists(reqs: Requests, geometry: CacheGeometry) -> tuple[np.ndarray, np.ndarray]:
    """Query t at position p sees keys p - j, j < window, at or after the request's floor:
    from this step's rows when the key is new this step, else from the ring."""
    window, ring = geometry.window, geometry.ring_size
    req, pos = reqs.token_req, reqs.positions
    start, floor = reqs.start[req], reqs.floor[req]
    max_new = int(reqs.num_tokens.max())
    # Columns past the widest window part are -1 everywhere: trimmed (decode: 1 step column).
    cols = np.arange(window)
    step_cols = cols[: min(window, max_new)]
    # Step keys: row (pos - c) - start + offset for c < window, where pos - c >= max(floor,
    # start). Only a token within a window of that bound has a column that fails it, so the
    # [T, columns] arithmetic is one subtraction and the masking touches those rows alone (a
    # long prefill chunk's first window of tokens).
    win_step = np.subtract.outer(pos - start + reqs.offset[req], step_cols)
    lowest = np.maximum(floor, start)
    near = _rows(pos - lowest < len(step_cols) - 1)
    key = pos[near, None] - step_cols
    win_step[near] = np.where(key >= lowest[near, None], win_step[near], -1)
    # Ring keys are older than the step and at or after the floor: only a token within a window
    # of its step's start has one. A step whose requests all start at their floor (a fresh
    # prompt) has none.
    win_ring = np.full((pos.shape[0], window), -1, dtype=np.int64)
    near = _rows((pos - start < window - 1) & (start > floor))
    if not isinstance(near, np.ndarray) or near.size:
        key = pos[near, None] - cols
        old = (key < start[near, None]) & (key >= floor[near, None])
        win_ring[near] = np.where(old, reqs.slot[req[near]][:, None] * ring + key % ring, -1)
    return win_step, win_ring


def _window_inputs(reqs: Requests, geometry: CacheGeometry) -> dict[str, np.ndarray]:
    """What WindowPlan derives ``_window_lists``' arrays from on the device."""
    columns = min(geometry.window, int(reqs.num_tokens.max()))
    return {
        "win_pos": reqs.positions,
        "win_start": reqs.start,
        "win_floor": reqs.floor,
        "win_row0": reqs.start - reqs.offset,
        "win_ring0": reqs.slot * geometry.ring_size,
        "win_step_cols": np.arange(columns),
    }


def _window_views(dev: dict[str, torch.Tensor], geometry: CacheGeometry) -> WindowPlan:
    return WindowPlan(
        positions=dev["win_pos"],
        start=dev["win_start"],
        floor=dev["win_floor"],
        row0=dev["win_row0"],
        ring0=dev["win_ring0"],
        step_cols=dev["win_step_cols"],
        window=geometry.window,
        ring_size=geometry.ring_size,
    )


def _ring_writes(reqs: Requests, geometry: CacheGeometry) -> tuple[np.ndarray, np.ndarray]:
    """After attention each request's last ring-size tokens are written to the ring (a pad's
    to the scratch slot's ring): their step rows, and their ring rows."""
    ring, pos, req = geometry.ring_size, reqs.positions, reqs.token_req
    kept = np.flatnonzero(pos >= reqs.end[req] - ring)  # batch rows = token indices
    slot = np.where(reqs.is_pad[kept], geometry.scratch_slot, reqs.slot[req[kept]])
    return kept, slot * ring + pos[kept] % ring


def _rows(mask: np.ndarray) -> np.ndarray | slice:
    """The rows where ``mask`` holds: their indices, or every row as a slice (decode: no
    gather and scatter of whole arrays)."""
    return slice(None) if mask.all() else np.flatnonzero(mask)
