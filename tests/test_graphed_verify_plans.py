"""The plans of graphed steps with drafts (cuda_graphs.pad_spans, step_plan.plan_step with a
context bound, compress_plan.graphed_compress_plan): every request gets the same rows, its
tokens then pads. Such a step must read what the general plan of the real tokens reads and write
what it writes; pads and candidate windows that do not close may touch scratch rows only.

Checked on tags: every row a plan reads or writes is named by what it holds (a step token by
its slot and position, a cache row by its index), and the two plans' effects are compared for
random steps: the entries written (window, tokens pooled, the overlap half before them), the
overlap ring, the compressor buffer ring, the sliding-window ring, and what every real query
sees (window keys, visible entries, block table).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from deepinfer.engine.cuda_graphs import pad_spans
from deepinfer.model.batch import SeqSpan
from deepinfer.model.deepseek_v4.plan_inputs import CacheGeometry
from deepinfer.model.deepseek_v4.step_plan import plan_step

SCRATCH_SLOT, SCRATCH_BLOCK, BLOCK = 9, 99, 16
GEOMETRY = CacheGeometry(
    window=8,
    ring_size=11,
    block_size=BLOCK,
    ratios=(4, 16),
    dense_ratios=(16,),
    scratch_slot=SCRATCH_SLOT,
    scratch_block=SCRATCH_BLOCK,
    max_draft=3,
)
ROWS = 4  # 1 + 3 drafts
CACHE = SimpleNamespace(scratch_slot=SCRATCH_SLOT, scratch_block=SCRATCH_BLOCK, block_size=BLOCK)


def _tokens(seqs: list[SeqSpan]) -> list[tuple]:
    """Each step row's tag: (slot, position) of a real token, ("pad",) of a pad."""
    tags: list[tuple] = []
    for s in seqs:
        real = s.num_tokens - s.num_pad
        tags += [(s.slot, s.start_pos + j) if j < real else ("pad",) for j in range(s.num_tokens)]
    return tags


def _effects(host: dict[str, np.ndarray], seqs: list[SeqSpan]) -> dict[str, object]:
    """What a plan reads and writes, by tags, scratch rows left out."""
    tokens = _tokens(seqs)
    g = GEOMETRY
    ring = g.ring_size
    effects: dict[str, object] = {
        "ring": {
            int(d): tokens[s]
            for s, d in zip(host["ring_src"], host["ring_dst"], strict=True)
            if d // ring != SCRATCH_SLOT
        }
    }
    sees: dict[tuple, tuple] = {}
    for t, tag in enumerate(tokens):
        if tag == ("pad",) or tag[0] == SCRATCH_SLOT:
            continue
        keys = [tokens[r] for r in host["win_step"][t] if r >= 0]
        keys += [("ring", int(r)) for r in host["win_ring"][t] if r >= 0]
        visible = tuple(int(host[f"num_visible{m}"][t]) for m in g.ratios)
        sees[tag] = (sorted(keys, key=str), visible, _table(host, seqs, tag))
    effects["sees"] = sees
    for m in g.ratios:
        effects[m] = _compressor_effects(
            {k.removeprefix(f"c{m}."): v for k, v in host.items() if k.startswith(f"c{m}.")},
            tokens,
            m,
        )
    return effects


def _table(host: dict[str, np.ndarray], seqs: list[SeqSpan], tag: tuple) -> tuple:
    """The block-table columns a token's request has (its real blocks)."""
    [(b, seq)] = [(b, s) for b, s in enumerate(seqs) if s.slot == tag[0]]
    return tuple(host["block_table"][b, : len(seq.block_ids)].tolist())


def _compressor_effects(c: dict[str, np.ndarray], tokens: list[tuple], m: int) -> dict:
    g = GEOMETRY
    b, k, per_block = g.buffer_rows(m), g.overlap_windows(m), g.block_size // m
    src = [("buf", int(r)) for r in c["buf_rows"]] + tokens
    windows = [tuple(src[r] for r in row) for row in c["window_rows"]]
    candidates = [("ring", int(r)) for r in c["prev_slots"]] + windows
    previous = [
        candidates[p] if has else None for p, has in zip(c["prev_src"], c["has_prev"], strict=True)
    ]
    entries = {
        int(d): (int(c["window_ids"][w]), windows[w], previous[w] if m == 4 else None)
        for w, d in enumerate(c["entry_dst"])
        if d // per_block != SCRATCH_BLOCK
    }
    overlap = {}
    if m == 4:  # only the overlapping compressor keeps halves
        overlap = {
            int(d): windows[w]
            for w, d in zip(c["last_window"], c["prev_dst"], strict=True)
            if d // k != SCRATCH_SLOT
        }
    buffer = {
        int(d): src[s]
        for s, d in zip(c["left_src"], c["left_dst"], strict=True)
        if d // b != SCRATCH_SLOT and src[s] != ("buf", int(d))  # rewriting a row in place
    }
    return {"entries": entries, "overlap": overlap, "buffer": buffer}


def _random_step(rng: np.random.Generator) -> list[SeqSpan]:
    """1-4 requests, each its next token and 0-3 drafts, anywhere in its first 5 blocks, some
    with shared (protected) blocks or a window floor."""
    seqs, offset = [], 0
    for i in range(int(rng.integers(1, 5))):
        n = int(rng.integers(1, ROWS + 1))
        start = int(rng.integers(1, 5 * BLOCK - ROWS))
        blocks = [10 * i + j for j in range(-(-(start + n) // BLOCK))]
        protected = BLOCK * int(rng.integers(0, start // BLOCK + 1))
        floor = int(rng.choice([0, max(start - 5, 0)]))
        seqs.append(
            SeqSpan(offset, n, start, i, blocks, window_floor=floor, num_protected=protected)
        )
        offset += n
    return seqs


def test_a_graphed_step_reads_and_writes_what_the_step_of_its_real_tokens_does() -> None:
    rng = np.random.default_rng(0)
    seen_pads = seen_closing_drafts = 0
    for _ in range(300):
        seqs = _random_step(rng)
        bucket = 4
        padded = pad_spans(seqs, ROWS, bucket, CACHE)
        graphed = plan_step(padded, GEOMETRY, decode_context=5 * BLOCK)
        general = plan_step(seqs, GEOMETRY)
        assert _effects(graphed, padded) == _effects(general, seqs)
        seen_pads += sum(s.num_tokens < ROWS for s in seqs)
        # A window closed by a draft (not by the request's next token).
        seen_closing_drafts += sum(
            s.start_pos % 4 != 3 and (s.start_pos // 4 + 1) * 4 <= s.end_pos for s in seqs
        )
    assert seen_pads > 100 and seen_closing_drafts > 20  # the cases that matter did occur


def test_graphed_plans_with_drafts_have_one_layout() -> None:
    """Steps of the same bucket and rows, whatever their positions, drafts and pads, upload
    arrays of the same names and shapes (what a graph's replays rely on)."""
    rng = np.random.default_rng(1)
    layouts = set()
    for _ in range(20):
        padded = pad_spans(_random_step(rng), ROWS, 4, CACHE)
        plan = plan_step(padded, GEOMETRY, decode_context=5 * BLOCK)
        layouts.add(tuple((name, a.shape) for name, a in plan.items()))
    assert len(layouts) == 1
