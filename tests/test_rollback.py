"""Speculative decoding's rollback (deepinfer/model/deepseek_v4/cache.py): a step computes drafted
tokens after a request's next one, the rejected ones are rolled back, and the slot reads exactly
as if they had never been computed, with no data moved.

Exactness is checked where floating point allows it: CPU GEMMs round one token differently in
steps of different sizes (a chunked prefill differs from a whole one by ~1e-6), so a run whose
steps computed rejected drafts matches, bit for bit, a run whose steps had the same shapes and
other rejected tokens, and a plain run (the accepted tokens only, chunk by chunk) within
``PLAIN_TOL``. The plans' layout is checked exactly on tags: every row a step reads holds the
token of its last accepted computation.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from deepinfer.config import CacheConfig
from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import SeqSpan, flatten
from deepinfer.model.deepseek_v4.args import CSA, ModelArgs
from deepinfer.model.deepseek_v4.cache import cache_spec
from deepinfer.model.deepseek_v4.plan_inputs import CacheGeometry, Requests
from deepinfer.model.deepseek_v4.step_plan import plan_step
from deepinfer.model.deepseek_v4.tiny import TINY_CONFIG
from deepinfer.model.families import load_family
from deepinfer.ops import reference_kernels

FAMILY = load_family("deepseek_v4")
MAX_DRAFT, RING_MARGIN, BLOCK_SIZE = 3, 3, 16  # tiny window 8: ring of 11 rows
# Window 8, ring 11, ratios 4 (CSA: buffer ring 6 rows, overlap ring 2 windows) and 16 (HCA).
GEOMETRY = CacheGeometry(
    window=8, ring_size=11, block_size=16, ratios=(4, 16), dense_ratios=(16,), max_draft=MAX_DRAFT
)
PLAIN_TOL = 1e-5  # a plain run against a rollback run: rounding of differently sized steps


@pytest.fixture(scope="module")
def tiny_args() -> ModelArgs:
    return ModelArgs.from_dict(TINY_CONFIG)


@pytest.fixture(scope="module")
def every_expert_model() -> torch.nn.Module:
    """The tiny model with every token routed to every expert: a token's values then depend on
    the step's shapes and its own inputs only, not on the other tokens of the step."""
    args = ModelArgs.from_dict({**TINY_CONFIG, "n_routed_experts": 2, "num_experts_per_tok": 2})
    cpu = torch.device("cpu")
    weights = FAMILY.random_weights(args, 0, cpu, torch.float32, fp8_block=None)
    with torch.device("meta"):
        model = FAMILY.build_model(args, reference_kernels())
    model.load_state_dict(weights, strict=True, assign=True)
    FAMILY.init_buffers(model, cpu)
    return model.eval()


def _plan(*seqs: SeqSpan, decode_context: int | None = None) -> dict[str, list]:
    geometry = dataclasses.replace(GEOMETRY, scratch_slot=9, scratch_block=99)
    return {k: v.tolist() for k, v in plan_step(list(seqs), geometry, decode_context).items()}


def test_the_rings_keep_what_a_rollback_of_max_draft_needs() -> None:
    # Slot 1 computes 13..16 after 12 (buffered): window 3 (12..15) closes. Buffer ring of 6:
    # token p at row (p - p // 4) % 6, window ends (15) never stored: 12, 13, 14, 16 -> 3, 4, 5, 0.
    plan = _plan(SeqSpan(0, 4, 13, 1, [5]))
    assert plan["c4.buf_rows"] == [6 + 3]
    assert plan["c4.window_rows"] == [[0, 1, 2, 3]] and plan["c4.window_ids"] == [3]
    assert plan["c4.left_src"] == [0, 1, 2, 4] and plan["c4.left_dst"] == [9, 10, 11, 6]
    # Overlap ring of 2 windows: window 2's half is read from row 1 * 2 + 0, window 3's goes to
    # row 1 * 2 + 1, so rolled back to 15 (window 3 reopened) the next close still finds window 2.
    assert plan["c4.prev_slots"] == [2] and plan["c4.prev_dst"] == [3]
    assert plan["c4.last_window"] == [0] and plan["c4.entry_dst"] == [5 * 4 + 3]
    # HCA (16, buffer ring 18): 0..12 buffered, 0..15 close window 0, all but 15 are kept.
    assert plan["c16.buf_rows"] == [18 + p for p in range(13)]
    assert plan["c16.left_dst"] == [18 + p for p in range(15)] + [18 + 15]
    # A graphed decode step at 17 (window 4: 16 at row 0) reads the same rows.
    decode = _plan(SeqSpan(0, 1, 17, 1, [5, 6]), decode_context=64)
    assert decode["c4.buf_rows"] == [6, 7, 8] and decode["c4.left_dst"] == [6 + 1]
    assert decode["c4.prev_slots"] == [3] and decode["c4.prev_dst"] == [9 * 2]  # not closing
    # Two closed windows, both kept: 16..23 in one step (windows 4, 5 -> rows 2 + 0, 2 + 1).
    two = _plan(SeqSpan(0, 8, 16, 1, [5, 6]))
    assert two["c4.prev_slots"] == [3] and two["c4.prev_dst"] == [2, 3]


def test_at_max_draft_0_the_layout_is_unchanged(tiny_args: ModelArgs) -> None:
    spec = cache_spec(tiny_args, block_size=16, ring_margin=4)
    rows = {p.key: p.rows for p in spec.state}
    assert rows[1, "comp.buf_kv"] == 3 and rows[1, "comp.prev_kv"] == 4
    assert rows[2, "comp.buf_kv"] == 15 and spec.salt == "16:12"
    draft = cache_spec(tiny_args, block_size=16, ring_margin=4, max_draft=3)
    rows = {p.key: p.rows for p in draft.state}
    assert rows[1, "comp.buf_kv"] == 6 and rows[1, "comp.prev_kv"] == 8
    assert rows[1, "idx.prev_kv"] == 8 and rows[2, "comp.buf_kv"] == 18
    assert draft.salt == "16:12:draft3"  # other payload shapes: never reused from a tier
    # At d = 0 a buffered token's row is its index in the open window (row 1 * 3 + 1 for 5).
    plan = plan_step([SeqSpan(0, 2, 6, 1, [0])], dataclasses.replace(GEOMETRY, max_draft=0))
    assert plan["c4.buf_rows"].tolist() == [3 + 0, 3 + 1] and plan["c4.prev_dst"].tolist() == [1]


def test_margins_are_checked(tiny_args: ModelArgs) -> None:
    with pytest.raises(
        ValueError, match=r"cache.max_draft_tokens=4 must be <= cache.ring_margin=3"
    ):
        CacheConfig(max_draft_tokens=4, ring_margin=3)
    with pytest.raises(ValueError, match=r"cache.max_draft_tokens=4 must be <= cache.ring_margin"):
        cache_spec(tiny_args, block_size=16, ring_margin=3, max_draft=4)
    kv = _cache(tiny_args, max_draft=2)
    FAMILY.rollback(kv, 0, end_pos=10, num_tokens=2)
    with pytest.raises(ValueError, match="back by 3 tokens"):
        FAMILY.rollback(kv, 0, end_pos=10, num_tokens=3)
    with pytest.raises(ValueError, match="back by 1 tokens"):
        FAMILY.rollback(_cache(tiny_args, max_draft=0), 0, end_pos=10, num_tokens=1)


# --- The plans on tags: random steps, drafts and rollbacks, every read checked ---------------


class _TagCache:
    """The cache's rows as token tags, moved by a step's plans the way the model moves values
    (Attention.forward's ring, Compressor.forward's buffer and overlap rings, the entries)."""

    def __init__(self, geometry: CacheGeometry, num_slots: int, num_blocks: int) -> None:
        self.geometry = geometry
        g = geometry
        self.ring: list = [None] * ((num_slots + 1) * g.ring_size)
        self.buf = {m: [None] * ((num_slots + 1) * g.buffer_rows(m)) for m in g.ratios}
        self.prev = {m: [None] * ((num_slots + 1) * g.overlap_windows(m)) for m in g.ratios}
        self.pool = {m: [None] * ((num_blocks + 1) * (g.block_size // m)) for m in g.ratios}

    def step(
        self, plan: dict[str, np.ndarray], seqs: list[SeqSpan], tags: list, seen, graphed: bool
    ) -> None:
        """Run one step of tags ``tags`` [T] (``graphed``: fixed-shape decode plans);
        ``seen(req, pos)`` is the tag a read of position pos of request req must find."""
        reqs = Requests.of(seqs)
        for t, (req, pos) in enumerate(zip(reqs.token_req, reqs.positions, strict=True)):
            for c, row in enumerate(plan["win_ring"][t]):
                if row >= 0:
                    assert self.ring[row] == seen(req, pos - c), (pos, c)
            for c, row in enumerate(plan["win_step"][t]):
                if row >= 0:
                    assert tags[row] == seen(req, pos - c), (pos, c)
        for m in self.geometry.ratios:
            prefix = f"c{m}."
            ratio_plan = {k[len(prefix) :]: v for k, v in plan.items() if k.startswith(prefix)}
            self._compress(m, ratio_plan, reqs, tags, seen, graphed)
        for src, dst in zip(plan["ring_src"], plan["ring_dst"], strict=True):
            self.ring[dst] = tags[src]

    def _compress(
        self, m: int, plan: dict, reqs: Requests, tags: list, seen, graphed: bool
    ) -> None:
        buf, prev = self.buf[m], self.prev[m]
        src = [buf[row] for row in plan["buf_rows"]] + list(tags)
        windows = [tuple(src[x] for x in rows) for rows in plan["window_rows"]]
        candidates = [prev[row] for row in plan["prev_slots"]] + windows
        for g, (w, window) in enumerate(zip(plan["window_ids"], windows, strict=True)):
            req = _window_request(reqs, g, m, graphed)
            if req is None:
                continue  # a graphed candidate window that does not close
            assert window == tuple(seen(req, p) for p in range(w * m, w * m + m)), (m, w)
            if plan["has_prev"][g]:
                expected = tuple(seen(req, p) for p in range((w - 1) * m, w * m))
                assert candidates[plan["prev_src"][g]] == expected, (m, w)
        for dst, g in zip(plan["prev_dst"], plan["last_window"], strict=True):
            prev[dst] = windows[g]
        for dst, window in zip(plan["entry_dst"], windows, strict=True):
            self.pool[m][dst] = window
        for s, dst in zip(plan["left_src"], plan["left_dst"], strict=True):
            buf[dst] = src[s]


def _window_request(reqs: Requests, g: int, m: int, graphed: bool) -> int | None:
    """The request of window g of a step's plan (None: a graphed candidate that stays open)."""
    if graphed:
        return g if reqs.start[g] % m == m - 1 else None
    closed = (reqs.start % m + reqs.num_tokens) // m
    return int(np.searchsorted(np.cumsum(closed), g, side="right"))


def test_every_read_after_random_rollbacks_finds_an_accepted_token() -> None:
    rng = np.random.default_rng(0)
    num_slots, num_blocks = 3, 3 * 20
    geometry = dataclasses.replace(GEOMETRY, scratch_slot=num_slots, scratch_block=num_blocks)
    cache = _TagCache(geometry, num_slots, num_blocks)
    blocks = [list(range(s * 20, s * 20 + 20)) for s in range(num_slots)]
    accepted: list[list] = [[] for _ in range(num_slots)]  # tag of each computed position
    crossed = set()
    for step in range(400):
        slots = sorted(
            rng.choice(num_slots, size=int(rng.integers(1, num_slots + 1)), replace=False)
        )
        graphed = step % 3 == 0
        seqs, tags, offset = [], [], 0
        for slot in slots:
            if len(accepted[slot]) > 250:
                accepted[slot] = []  # a new request in the slot (no reset: it reads no old row)
            start = len(accepted[slot])
            n = 1 if graphed else int(rng.choice([1, 2, 3, 4, 4, 4, 9]))
            seqs.append(SeqSpan(offset, n, start, slot, blocks[slot]))
            tags += [(step, slot, start + i) for i in range(n)]
            offset += n

        def seen(req: int, pos: int, seqs=seqs, tags=tags, accepted=accepted) -> object:
            span = seqs[req]
            if pos >= span.start_pos:
                return tags[span.offset + pos - span.start_pos]
            return accepted[span.slot][pos]

        plan = plan_step(seqs, geometry, 320 if graphed else None)
        cache.step(plan, seqs, tags, seen, graphed)
        for span in seqs:
            new = tags[span.offset : span.offset + span.num_tokens]
            # Drafts: all but the first token may be rejected (a 9-token chunk is a prefill).
            keep = (
                span.num_tokens
                if span.num_tokens > 4
                else int(rng.integers(1, span.num_tokens + 1))
            )
            accepted[span.slot] += new[:keep]
            end = len(accepted[span.slot])
            for p in range(end, span.end_pos):
                crossed |= {m for m in (4, 16) if p % m == m - 1}
                crossed |= {"ring"} if p % 11 == 0 else set()
            _assert_entries_visible(cache, accepted[span.slot], blocks[span.slot], geometry)
    assert crossed == {4, 16, "ring"}, crossed  # rejected tokens closed windows and wrapped rings


def _assert_entries_visible(cache: _TagCache, accepted: list, blocks: list[int], geometry) -> None:
    for m in geometry.ratios:
        per_block = geometry.block_size // m
        for w in range(len(accepted) // m):
            row = blocks[w * m // geometry.block_size] * per_block + w % per_block
            assert cache.pool[m][row] == tuple(accepted[w * m : w * m + m]), (m, w)


# --- The model: a run with rolled-back drafts against runs without ---------------------------


def _cache(args: ModelArgs, max_draft: int = MAX_DRAFT) -> KVCache:
    spec = FAMILY.cache_spec(
        args, block_size=BLOCK_SIZE, ring_margin=RING_MARGIN, max_draft=max_draft
    )
    return KVCache(spec, num_blocks=8, num_slots=2, dtype=torch.float32, device=torch.device("cpu"))


BLOCKS = list(range(8))  # 128 positions in slot 0
PROMPT = [(7 * i + 3) % 1000 for i in range(13)]
# Verification steps (tokens computed, tokens accepted) from position 13 (1-token steps: graphed
# decode): rejected drafts close CSA windows (15, 27, 31, ...) and HCA windows (15, 31), and
# wrap the ring (33, 44).
# fmt: off
STEPS = [(4, 2), (4, 1), (1, 1), (1, 1), (4, 3), (4, 4), (3, 1), (4, 2), (4, 3), (4, 1),
         (4, 4), (4, 2), (4, 3), (2, 1), (4, 1), (4, 2), (4, 3), (4, 1), (3, 2), (4, 2)]
# fmt: on


def _accepted(i: int) -> int:
    return (11 * i + 5) % 1000 + 2


def _forward(
    model: torch.nn.Module, kv: KVCache, tokens: list[int], start: int, *, graphed: bool = False
) -> torch.Tensor:
    """Logits [n, V] of every token of one step of slot 0, through the executor's path (one
    upload of the host arrays; ``graphed``: the fixed-shape decode plans)."""
    n = len(tokens)
    seqs = [SeqSpan(0, n, start, 0, BLOCKS)]
    geometry = FAMILY.geometry(model.args, kv)
    host = FAMILY.step_arrays(seqs, tokens, list(range(n)), geometry, 128 if graphed else None)
    batch = FAMILY.batch_views(torch.from_numpy(flatten(host)), host, seqs, geometry)
    return model(batch, kv)


def _run(model: torch.nn.Module, kv: KVCache, rejected: int | None):
    """Prompt, then STEPS: with ``rejected`` (first id of the drafts), each step computes its
    accepted tokens and drafts after them, then rolls those back; None: the accepted tokens
    only. Yields after each step: (end, rolled back, logits of the accepted tokens)."""
    _forward(model, kv, PROMPT, 0)
    end, made = len(PROMPT), 0
    for num_tokens, num_accepted in STEPS:
        tokens = [_accepted(made + i) for i in range(num_accepted)]
        made += num_accepted
        if rejected is None:
            logits = _forward(model, kv, tokens, end, graphed=num_tokens == 1)
            num_back = num_tokens - num_accepted
        else:
            num_back = num_tokens - num_accepted
            drafts = [rejected + made + i for i in range(num_back)]
            logits = _forward(model, kv, tokens + drafts, end, graphed=num_tokens == 1)
            FAMILY.rollback(kv, 0, end_pos=end + num_tokens, num_tokens=num_back)
        end += num_accepted
        yield end, num_back, logits[:num_accepted]
    for i in range(4):  # decode on: graphed, then eager
        logits = _forward(model, kv, [_accepted(made + i)], end, graphed=i < 2)
        end += 1
        yield end, 0, logits


def _live_state(
    kv: KVCache, args: ModelArgs, end: int, ring_positions: list[int]
) -> dict[str, torch.Tensor]:
    """What later steps of slot 0 may read: the ring rows of ``ring_positions``, the buffer-ring
    rows of each open window, the overlap-ring window the next close reads, and the visible
    compressed entries (and indexer keys)."""
    live: dict[str, torch.Tensor] = {}
    ring_rows = [p % (args.sliding_window + RING_MARGIN) for p in ring_positions]
    for (layer, name), tensor in kv.tensors.items():
        slot = tensor[0]
        m = args.compress_ratio(layer)
        window = end // m * m if m else 0
        if name == "ring":
            live[f"{layer}.ring"] = slot[ring_rows]
        elif name.endswith((".buf_kv", ".buf_gate")):
            rows = slot.shape[0]
            live[f"{layer}.{name}"] = slot[[(p - p // m) % rows for p in range(window, end)]]
        elif name.endswith((".prev_kv", ".prev_gate")) and window:
            k = slot.shape[0] // m
            w = (end // m - 1) % k
            live[f"{layer}.{name}"] = slot[w * m : (w + 1) * m]
        elif name in ("entries", "index_keys"):
            per_block = BLOCK_SIZE // m
            rows = [
                BLOCKS[w * m // BLOCK_SIZE] * per_block + w % per_block for w in range(end // m)
            ]
            live[f"{layer}.{name}"] = tensor.flatten(0, 1)[rows]
    return live


def test_a_rolled_back_run_reads_as_if_its_drafts_were_never_computed(
    every_expert_model: torch.nn.Module,
) -> None:
    model, args = every_expert_model, every_expert_model.args
    assert CSA in args.layer_types and MAX_DRAFT <= RING_MARGIN
    kvs = [_cache(args) for _ in range(3)]
    plain = _run(model, kvs[0], rejected=None)
    drafted = _run(model, kvs[1], rejected=1000)
    other = _run(model, kvs[2], rejected=2000)  # the same shapes, other rejected tokens
    ring_size = args.sliding_window + RING_MARGIN
    compared, start, overwritten = set(), len(PROMPT), set()  # ring rows of rejected drafts
    for (end, back, a), (end_b, back_b, b), (_, _, c) in zip(plain, drafted, other, strict=True):
        assert (end, back) == (end_b, back_b)
        # Ring rows hold the positions [end - R, end) but those a later draft overwrote (rows
        # of positions before end - R + max_draft, older than any window reads).
        overwritten -= {p % ring_size for p in range(start, end)}
        overwritten |= {p % ring_size for p in range(end, end + back)}
        live = [p for p in range(max(end - ring_size, 0), end) if p % ring_size not in overwritten]
        assert all(
            p < end - ring_size + MAX_DRAFT for p in range(end - ring_size, end) if p not in live
        )
        start = end
        live_a, live_b, live_c = (_live_state(kv, args, end, live) for kv in kvs)
        assert torch.equal(b, c)
        torch.testing.assert_close(a, b, rtol=PLAIN_TOL, atol=PLAIN_TOL)
        for name, value in live_b.items():
            assert torch.equal(value, live_c[name]), (end, name)
            torch.testing.assert_close(live_a[name], value, rtol=PLAIN_TOL, atol=PLAIN_TOL)
        compared |= {name.split(".", 1)[1] for name in live_b}
        # The drafts did write: the ring rows of their positions differ between b and c.
        rows = [p % ring_size for p in range(end, end + back)]
        assert back == 0 or not torch.equal(kvs[1][0, "ring"][0, rows], kvs[2][0, "ring"][0, rows])
    assert compared == {"ring", "entries", "index_keys"} | {
        f"{prefix}.{part}"
        for prefix in ("comp", "idx")
        for part in ("buf_kv", "buf_gate", "prev_kv", "prev_gate")
    }
    # Rejected drafts closed CSA and HCA windows and wrapped the ring (rows p % 11 == 0).
    rejected, start = set(), len(PROMPT)
    for num_tokens, num_accepted in STEPS:
        start += num_accepted
        rejected |= set(range(start, start + num_tokens - num_accepted))
    assert 3 in {p % 4 for p in rejected} and 15 in {p % 16 for p in rejected}
    assert 0 in {p % ring_size for p in rejected}
