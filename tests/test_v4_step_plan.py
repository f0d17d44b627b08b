"""The step's index plans, exactly: window keys from the step and the ring, ring writes, entry
rows through block tables, and the compressors' windows, overlap sources and leftovers."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import torch

from deepinfer.model.batch import ForwardBatch, SeqSpan, flatten, split_flat
from deepinfer.model.deepseek_v4.step_plan import (
    CacheGeometry,
    StepMetadata,
    build_metadata,
    metadata_views,
    plan_step,
)

# Window 8, ring 12 (margin 4), blocks of 16 tokens: 4 CSA entries or 1 HCA entry per block.
GEOMETRY = CacheGeometry(
    window=8, ring_size=12, block_size=16, ratios=(4, 16), dense_ratios=(16,), scratch_block=9
)


def _metadata(*seqs: SeqSpan) -> StepMetadata:
    num_tokens = sum(s.num_tokens for s in seqs)
    positions = torch.cat([torch.arange(s.start_pos, s.end_pos) for s in seqs])
    batch = ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=positions,
        seqs=list(seqs),
        logits_indices=torch.zeros(0, dtype=torch.int64),
    )
    meta = build_metadata(batch, GEOMETRY)
    meta.derive_lists()
    return meta


def _list(t: torch.Tensor) -> list:
    return t.tolist()


def test_entries_follow_the_block_table() -> None:
    meta = _metadata(SeqSpan(0, 40, 0, 1, [5, 2, 0]))
    # CSA: entry e -> block_ids[e // 4] * 4 + e % 4; 10 entries after 40 tokens.
    assert _list(meta.entry_rows[4]) == [[20, 21, 22, 23, 8, 9, 10, 11, 0, 1]]
    assert _list(meta.entry_rows[16]) == [[5, 2]]  # HCA: one entry per block
    # Token p sees entries 0..(p+1)//m - 1.
    assert _list(meta.num_visible[4][[0, 2, 3, 39]]) == [0, 0, 1, 10]
    assert _list(meta.visible_idx[16][[14, 15, 31, 39]]) == [[-1, -1], [5, -1], [5, 2], [5, 2]]
    plan = meta.compress[4]
    assert _list(plan.window_rows) == np.arange(40).reshape(10, 4).tolist()
    assert _list(plan.window_ids) == list(range(10))
    assert _list(plan.entry_dst) == [20, 21, 22, 23, 8, 9, 10, 11, 0, 1]
    assert _list(plan.has_prev) == [False] + [True] * 9  # window 0 has no previous window
    # Source of window g's previous half: the slot's state (row 0) for the first, else g - 1.
    assert _list(plan.prev_src) == [0] + [1 + g for g in range(9)]
    assert _list(plan.prev_slots) == [1] and _list(plan.last_window) == [9]
    assert plan.left_src.numel() == 0 and plan.buf_rows.numel() == 0


def test_window_keys_come_from_the_step_and_the_ring() -> None:
    # Decode at position 29, slot 1: itself from the step, 28..22 from the ring rows 12 + p % 12.
    meta = _metadata(SeqSpan(0, 1, 29, 1, [0, 1]))
    assert _list(meta.win_step_idx) == [[0]]
    assert _list(meta.win_ring_idx) == [[-1] + [12 + p % 12 for p in range(28, 21, -1)]]
    assert _list(meta.ring_src) == [0] and _list(meta.ring_dst) == [12 + 29 % 12]


def test_a_long_chunk_keeps_the_last_ring_rows_and_reads_older_keys_from_the_ring() -> None:
    # Tokens 5..34 of slot 0 after a 2-token decode of slot 1 (batch rows 2..31).
    meta = _metadata(SeqSpan(0, 2, 40, 1, [0, 1, 2]), SeqSpan(2, 30, 5, 0, [3, 4, 5]))
    assert _list(meta.ring_src[2:]) == list(range(2 + 18, 2 + 30))  # positions 23..34
    assert _list(meta.ring_dst[2:]) == [p % 12 for p in range(23, 35)]
    step, ring = meta.win_step_idx, meta.win_ring_idx
    assert step.shape == (32, 8)  # the widest window part: a full window of new keys
    # Position 7 (row 4): new keys 7, 6, 5 (rows 4, 3, 2), then 4..0 from slot 0's ring.
    assert _list(step[4]) == [4, 3, 2, -1, -1, -1, -1, -1]
    assert _list(ring[4]) == [-1, -1, -1, 4, 3, 2, 1, 0]
    # Position 20 (row 17): all 8 keys are new.
    assert _list(step[17]) == list(range(17, 9, -1)) and _list(ring[17]) == [-1] * 8
    # The decode request's second token sees the first from the step.
    assert _list(step[1][:2]) == [1, 0] and _list(ring[1][:2]) == [-1, -1]


def test_keys_below_the_window_floor_are_not_attended() -> None:
    # A replay from an empty slot at 8: positions 10, 11 see 8..11 and nothing before 8.
    meta = _metadata(SeqSpan(0, 2, 10, 0, [0], window_floor=8))
    assert _list(meta.win_step_idx) == [[0, -1], [1, 0]]
    assert _list(meta.win_ring_idx) == [[-1, 9, 8] + [-1] * 5, [-1, -1, 9, 8] + [-1] * 4]


def test_compressor_plan_with_buffered_tokens_and_protected_entries() -> None:
    # Slot 2 resumes at 6: positions 4, 5 are buffered (rows 2*3 + 0, 1); tokens 6..12 are new.
    meta = _metadata(SeqSpan(0, 7, 6, 2, [7], num_protected=8))
    plan = meta.compress[4]
    assert _list(plan.buf_rows) == [6, 7]
    # src = [buf 4, buf 5, new 6..12] -> windows [4..7] (id 1) and [8..11] (id 2); 12 is left.
    assert _list(plan.window_rows) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _list(plan.window_ids) == [1, 2]
    assert _list(plan.has_prev) == [True, True]
    assert _list(plan.prev_src) == [0, 1]  # the slot's state, then window 0 of the step
    # Entry 1 covers positions 4..7 < num_protected 8: it sits in a shared block, not
    # rewritten (its write goes to the scratch block's row).
    assert _list(plan.entry_dst) == [GEOMETRY.scratch_block * 4, 7 * 4 + 2]
    assert _list(plan.left_src) == [8] and _list(plan.left_dst) == [2 * 3 + 0]
    # HCA (16): positions 0..5 are buffered, 0..12 stay open (rewritten to rows 30..42).
    hca = meta.compress[16]
    assert _list(hca.buf_rows) == [2 * 15 + i for i in range(6)]
    assert hca.num_windows == 0
    assert _list(hca.left_src) == list(range(13))
    assert _list(hca.left_dst) == [30 + i for i in range(13)]


def test_graphed_decode_plans_have_one_layout() -> None:
    """A graph replays one layout: with a context bound, the plans of any decode step of the
    same size have the same arrays and shapes (block tables cut or padded to the bound)."""
    geometry = dataclasses.replace(GEOMETRY, scratch_slot=9, scratch_block=99)

    def layout(*seqs: SeqSpan) -> list[tuple[str, tuple[int, ...]]]:
        plan = plan_step(list(seqs), geometry, decode_context=256)
        return [(name, array.shape) for name, array in plan.items()]

    short = layout(SeqSpan(0, 1, 5, 1, [3]), SeqSpan(1, 1, 0, 2, [4]))
    long = layout(SeqSpan(0, 1, 200, 0, list(range(20))), SeqSpan(1, 1, 47, 3, [7, 8, 9]))
    assert short == long
    assert dict(short)["block_table"] == (2, 256 // 16)


def test_entry_lists_of_a_graphed_step_follow_the_block_table() -> None:
    """With a context bound the entry lists are as wide as the bound, past a short request's
    blocks (the table's padding): the plan's entry_block / entry_offset give every column the
    row ``block_table[min(n // pb, last)] * pb + n % pb`` (the derivation before they came
    with the plan), and the dense ratio's visible lists cut it at num_visible."""
    geometry = dataclasses.replace(GEOMETRY, scratch_slot=9, scratch_block=99)
    seqs = [SeqSpan(0, 1, 5, 1, [3]), SeqSpan(1, 1, 47, 3, [7, 8, 9])]
    host = plan_step(seqs, geometry, decode_context=256)
    dev = split_flat(torch.from_numpy(flatten(host)), host)
    meta = metadata_views(dev, geometry)
    meta.derive_lists()
    table = meta.block_table
    for m in geometry.ratios:
        pb, ids = geometry.block_size // m, meta.entry_ids[m]
        assert ids.numel() == 256 // m
        blocks = table[:, (ids // pb).clamp(max=table.shape[1] - 1)]
        assert torch.equal(meta.entry_rows[m], blocks * pb + ids % pb)
    visible = ids.unsqueeze(0) < meta.num_visible[16].unsqueeze(1)
    expected = torch.where(visible, meta.entry_rows[16][meta.token_req], -1)
    assert torch.equal(meta.visible_idx[16], expected)
    assert _list(meta.visible_idx[16][:, :4]) == [[-1, -1, -1, -1], [7, 8, 9, -1]]


def test_flat_copy_starts_every_array_16_bytes_apart() -> None:
    """flatten / split_flat: each array comes back as it went (shape and values), its view
    16-byte aligned whatever the sizes before it (Triton compiles a kernel per alignment)."""
    host = {
        "a": np.arange(3),
        "b": np.array([[True, False, True], [False, True, True]]),
        "c": np.array([7]),
        "d": np.zeros((0,), dtype=np.int64),
        "e": np.arange(5) - 9,
    }
    flat = torch.from_numpy(flatten(host))
    views = split_flat(flat, host)
    assert flat.shape == (4 + 6 + 2 + 0 + 6,)
    for name, array in host.items():
        assert np.array_equal(views[name].numpy(), array.astype(np.int64)), name
        assert (views[name].data_ptr() - flat.data_ptr()) % 16 == 0, name


def test_kernels_get_their_step_arrays_16_byte_aligned(tmp_path: Path) -> None:
    """Through the engine (prefill chunks, mixed and decode steps of many sizes): every tensor a
    kernel op receives that is not a parameter starts at a multiple of 16 bytes. On CUDA,
    Triton compiles a kernel once per pattern of aligned pointers: before the step's plan arrays
    were aligned, compress_windows alone came with 34 sets of misaligned arguments over 24
    such requests (a compilation each, seconds, while a step waits; benchmarks/RESULTS.md).
    The recorder is benchmarks/triton_variants.py's."""
    import random

    from deepinfer import LLM, SamplingParams
    from deepinfer.model.tiny import make_tiny_model

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_variants.py"
    spec = importlib.util.spec_from_file_location("triton_variants", path)
    assert spec is not None and spec.loader is not None
    variants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variants)
    llm = LLM(
        model=make_tiny_model(tmp_path / "tiny", seed=1),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=96,
    )
    patterns = variants.record_alignment(llm.engine.executor.kernels)
    rng = random.Random(0)
    lengths = [rng.randrange(4, 200) for _ in range(10)]
    prompts = [[0] + [rng.randrange(3, 128000) for _ in range(n)] for n in lengths]
    params = [SamplingParams(max_tokens=rng.randrange(2, 20), ignore_eos=True) for _ in prompts]
    llm.generate(prompts, params, use_tqdm=False)
    watched = {"compress_windows", "sparse_attention", "indexer_select"}
    assert watched <= patterns.keys()
    assert variants.misaligned(patterns) == {}
    assert all(found == {frozenset()} for found in patterns.values())


def test_window_rope_tables_fold_the_ratio_into_the_frequencies_exactly() -> None:
    """The model's compressor RoPE tables take window_ids * (ratio * f) for window_ids * ratio
    times f (one launch fewer a ratio), and int positions times fp32 f without a cast launch:
    bitwise the same tables, for V4's power-of-two ratios, up to 2^20 windows."""
    from deepinfer.model.deepseek_v4.args import ModelArgs
    from deepinfer.model.deepseek_v4.tiny import TINY_CONFIG
    from deepinfer.ops.norm import rope_cos_sin, rope_inv_freq

    args = ModelArgs.from_dict(TINY_CONFIG)
    inv_freq = rope_inv_freq(args.compress_rope, args.rope_head_dim)
    window_ids = torch.cat([torch.arange(0, 4096), torch.randint(0, 1 << 20, (4096,))])
    for ratio in (args.csa_ratio, args.hca_ratio):
        positions = (window_ids * ratio).float()
        expected = ((positions[:, None] * inv_freq[None, :]).cos(),
                    (positions[:, None] * inv_freq[None, :]).sin())  # fmt: skip
        folded = rope_cos_sin(window_ids, inv_freq * ratio)
        assert all(torch.equal(a, b) for a, b in zip(folded, expected, strict=True)), ratio


def test_the_ring_is_written_with_the_keys_norm_only_where_no_query_reads_a_replaced_row() -> None:
    """ring_first: every request has at most the ring's margin + 1 tokens (here window 8, ring
    12: margin 4), and then every token is kept in order. A decode step and a 5-token step
    qualify; a 6-token step does not (a token of it would replace ring row (p - 12) % 12 that
    the step's first query still reads), nor a prefill longer than the ring."""
    assert _metadata(SeqSpan(0, 1, 30, 0, [0, 1, 2]), SeqSpan(1, 1, 9, 1, [3])).ring_first
    five = _metadata(SeqSpan(0, 5, 30, 0, [0, 1, 2]))
    assert five.ring_first and _list(five.ring_src) == [0, 1, 2, 3, 4]
    assert not _metadata(SeqSpan(0, 6, 30, 0, [0, 1, 2])).ring_first
    assert not _metadata(SeqSpan(0, 20, 0, 0, [0, 1])).ring_first


def test_a_ring_first_step_reads_no_ring_row_it_writes() -> None:
    """The claim behind ring_first, checked on the plans: over random steps of 1 to 8 tokens a
    request (window 8, ring 12: margin 4), wherever ring_first holds no query's ring key is a
    row the step writes (ring_dst); and steps just past the margin do read such rows somewhere
    (the rule is not vacuous)."""
    rng = np.random.default_rng(5)
    clashes = 0
    for _ in range(300):
        num = int(rng.integers(1, 4))
        sizes = rng.integers(1, 9, size=num)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        seqs = [
            SeqSpan(int(o), int(n), int(rng.integers(0, 40)), slot, [slot, slot + 3, slot + 6])
            for slot, (o, n) in enumerate(zip(offsets, sizes, strict=True))
        ]
        meta = _metadata(*seqs)
        reads = set(meta.win_ring_idx[meta.win_ring_idx >= 0].tolist())
        clash = bool(reads & set(meta.ring_dst.tolist()))
        assert not (meta.ring_first and clash), [(s.start_pos, s.num_tokens) for s in seqs]
        clashes += clash
    assert clashes > 0


def test_a_decode_steps_keeps_replace_no_row_another_window_pools() -> None:
    """The claim behind CompressRows.keep_in_pool, checked on the plans of random decode steps
    (one token a request, no drafts), graphed and not: every window's Ca half is kept
    (last_window is every window), no buffer row a written window pools is one the buffer
    keep replaces, and the only ring row a keep replaces that a written window reads is the
    one that window's own keep replaces."""
    geometry = dataclasses.replace(GEOMETRY, scratch_slot=9, scratch_block=99)
    rng = np.random.default_rng(7)
    checked = {"buffer reads": 0, "ring reads": 0}  # the checks had something to check
    for graphed in (False, True):
        for _ in range(100):
            slots = rng.permutation(8)[: int(rng.integers(1, 5))]
            seqs = [
                SeqSpan(i, 1, int(rng.integers(0, 60)), int(slot), [int(slot), int(slot) + 10])
                for i, slot in enumerate(slots)
            ]
            host = plan_step(seqs, geometry, decode_context=256 if graphed else None)
            for m in geometry.ratios:
                c = {k.removeprefix(f"c{m}."): v for k, v in host.items() if k.startswith(f"c{m}.")}
                b, k = geometry.buffer_rows(m), geometry.overlap_windows(m)
                written = c["entry_dst"] // (geometry.block_size // m) != geometry.scratch_block
                num_buf = c["buf_rows"].shape[0]
                pooled = {
                    int(c["buf_rows"][r]) for w in np.flatnonzero(written)
                    for r in c["window_rows"][w] if r < num_buf
                }  # fmt: skip
                kept = {int(d) for d in c["left_dst"] if d // b != geometry.scratch_slot}
                assert not pooled & kept, (graphed, m, [(s.start_pos, s.slot) for s in seqs])
                checked["buffer reads"] += len(pooled)
                if m != 4:
                    continue
                assert list(c["last_window"]) == list(range(c["window_rows"].shape[0]))
                reads = {
                    int(w): int(c["prev_slots"][c["prev_src"][w]])
                    for w in np.flatnonzero(written & c["has_prev"])
                    if c["prev_src"][w] < c["prev_slots"].shape[0]
                }
                for w, row in reads.items():
                    writers = np.flatnonzero(c["prev_dst"] == row)
                    assert set(writers.tolist()) <= {w}, (graphed, w, row, writers)
                    assert row // k != geometry.scratch_slot
                checked["ring reads"] += len(reads)
    assert min(checked.values()) > 0, checked


def test_a_long_steps_window_lists_derived_on_the_device_are_the_hosts(monkeypatch) -> None:
    """From WINDOW_ON_DEVICE_MIN_TOKENS tokens the window lists are derived on the device
    (WindowPlan); set to 0 and to never, the same random steps (chunks at and past their window
    floors, several requests, trailing pads) give the same lists and every other array alike."""
    from deepinfer.model.deepseek_v4 import step_plan

    rng = np.random.default_rng(0)

    def lists(seqs: list[SeqSpan], threshold: int) -> tuple[dict, StepMetadata]:
        monkeypatch.setattr(step_plan, "WINDOW_ON_DEVICE_MIN_TOKENS", threshold)
        host = plan_step(seqs, GEOMETRY)
        meta = metadata_views(split_flat(torch.from_numpy(flatten(host)), host), GEOMETRY)
        meta.derive_lists()
        return host, meta

    for _ in range(200):
        seqs, offset = [], 0
        for slot in range(int(rng.integers(1, 4))):
            num = int(rng.integers(1, 40))
            start = int(rng.integers(0, 60))
            floor = int(rng.integers(0, start + 1)) if rng.random() < 0.5 else 0
            pad = int(rng.integers(0, min(num, 3))) if rng.random() < 0.2 else 0
            blocks = list(range(1 + slot * 8, 1 + slot * 8 + -(-(start + num) // 16)))
            seqs.append(SeqSpan(offset, num, start, slot, blocks, window_floor=floor, num_pad=pad))
            offset += num
        host_plan, host_meta = lists(seqs, 1 << 30)
        device_plan, device_meta = lists(seqs, 0)
        assert device_meta.window_plan is not None and host_meta.window_plan is None
        assert "win_step" not in device_plan and "win_step" in host_plan
        assert torch.equal(device_meta.win_step_idx, host_meta.win_step_idx), seqs
        assert torch.equal(device_meta.win_ring_idx, host_meta.win_ring_idx), seqs
        assert device_meta.ring_first == host_meta.ring_first
        shared = set(host_plan) & set(device_plan)
        assert shared == {k for k in host_plan if not k.startswith("win_")}
        assert all(np.array_equal(host_plan[k], device_plan[k]) for k in shared)
