"""Benchmark workloads built from the DeepSeek V4 tokenizer: lengths, sharing, trace blocks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from deepinfer.bench import datasets
from deepinfer.bench.datasets import TraceRecord


@pytest.fixture(scope="module")
def gen() -> datasets.PromptTextGenerator:
    return datasets.text_generator(None)


def _num_tokens(gen: datasets.PromptTextGenerator, text: str) -> int:
    return len(gen.tokenizer.encode(text, add_special_tokens=False).ids)


def _shared_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def test_pool_excludes_special_and_partial_utf8(gen: datasets.PromptTextGenerator) -> None:
    special = set(gen.tokenizer.get_added_tokens_decoder())
    assert special and not special & set(gen.pool.tolist())
    pieces = gen.tokenizer.decode_batch([[int(i)] for i in gen.pool[:2000]])
    assert all("\ufffd" not in p for p in pieces)


def test_random_prompts_encode_to_requested_lengths(gen: datasets.PromptTextGenerator) -> None:
    rng = np.random.default_rng(0)
    sessions = datasets.random_sessions(gen, rng, 40, 200, 50, range_ratio=0.5, prefix_len=30)
    turns = [s.turns[0] for s in sessions]
    assert all(25 <= t.max_tokens <= 75 for t in turns)
    assert all(30 + 100 <= t.num_prompt_tokens <= 30 + 300 for t in turns)
    assert len({t.num_prompt_tokens for t in turns}) > 10  # the range ratio is used
    # Exact for (nearly) all: re-encoding is adjusted until the length matches.
    exact = sum(_num_tokens(gen, t.user) == t.num_prompt_tokens for t in turns)
    assert exact >= 38, f"only {exact}/40 prompts encode to their requested length"
    # The random prefix is shared text (30 tokens: more than 30 characters).
    assert _shared_len(turns[0].user, turns[1].user) > 30


def test_prefix_repetition_vllm_semantics(gen: datasets.PromptTextGenerator) -> None:
    rng = np.random.default_rng(1)
    sessions = datasets.prefix_repetition_sessions(gen, rng, 13, 64, 16, 3, 7)
    assert len(sessions) == 12  # 13 // 3 per prefix
    turns = [s.turns[0] for s in sessions]
    assert {(t.num_prompt_tokens, t.max_tokens) for t in turns} == {(80, 7)}
    # Three groups of four sharing a 64-token prefix; shuffled, so not in blocks of four.
    groups = Counter(t.user[:60] for t in turns)
    assert sorted(groups.values()) == [4, 4, 4]
    order = [t.user[:60] for t in turns]
    assert any(order[i] != order[i + 1] for i in (0, 1, 2, 4, 5, 6, 8, 9, 10))  # shuffled
    with pytest.raises(ValueError, match="num-prefixes"):
        datasets.prefix_repetition_sessions(gen, rng, 2, 64, 16, 3, 7)


def test_shared_prefix_groups(gen: datasets.PromptTextGenerator) -> None:
    rng = np.random.default_rng(2)
    sessions = datasets.shared_prefix_sessions(gen, rng, 3, 5, 100, 20, 9)
    assert len(sessions) == 15
    assert sorted(Counter(s.system for s in sessions).values()) == [5, 5, 5]
    assert all(_num_tokens(gen, s.system or "") == 100 for s in sessions)
    assert {(s.turns[0].num_prompt_tokens, s.turns[0].max_tokens) for s in sessions} == {(120, 9)}
    assert len({s.turns[0].user for s in sessions}) == 15


def test_multi_turn_shape(gen: datasets.PromptTextGenerator) -> None:
    sessions = datasets.multi_turn_sessions(gen, np.random.default_rng(3), 4, 3, 10, 5)
    assert [len(s.turns) for s in sessions] == [3, 3, 3, 3]
    assert len({t.user for s in sessions for t in s.turns}) == 12
    assert {(t.num_prompt_tokens, t.max_tokens) for s in sessions for t in s.turns} == {(10, 5)}


def test_trace_equal_hash_ids_give_equal_text(gen: datasets.PromptTextGenerator) -> None:
    records = [
        TraceRecord(0.0, 1024 + 100, 5, (1, 2, 3)),
        TraceRecord(50.0, 1024 + 300, 6, (1, 2, 4)),
        TraceRecord(80.0, 600, 7, (2, 5)),
        TraceRecord(90.0, 400, 8, ()),  # no hash ids: all unique text
    ]
    sessions = datasets.trace_sessions(gen, records, seed=0)
    texts = [s.turns[0].user for s in sessions]
    assert [s.arrival_s for s in sessions] == [0.0, 0.05, 0.08, 0.09]
    assert [(s.turns[0].num_prompt_tokens, s.turns[0].max_tokens) for s in sessions] == [
        (1124, 5),
        (1324, 6),
        (600, 7),
        (400, 8),
    ]
    again = datasets.trace_sessions(gen, records[2:3], seed=0)[0].turns[0].user
    assert again == texts[2]  # a block's text depends only on (seed, hash id)
    # Record 2 starts with block 2, found in records 0 and 1 right after block 1.
    at = texts[0].find(texts[2][:500])
    assert at > 1000 and texts[1].find(texts[2][:500]) == at
    # Records 0 and 1 share blocks 1 and 2 (1024 tokens), then differ (block 3 vs 4).
    shared = _shared_len(texts[0], texts[1])
    assert at + 500 < shared < len(texts[0])
    assert abs(_num_tokens(gen, texts[0][:shared]) - 1024) <= 2
    assert _shared_len(texts[3], texts[0]) < 50
    for n, text in zip((1124, 1324, 600, 400), texts, strict=True):
        assert abs(_num_tokens(gen, text) - n) <= 4  # block seams may merge a few tokens
    assert datasets.trace_sessions(gen, records, seed=1)[0].turns[0].user != texts[0]


def test_read_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
        "\n"
        '{"timestamp": 5, "input_length": 20, "output_length": 3, "hash_ids": [1, 2]}\n'
        '{"timestamp": 9, "input_length": 30}\n'
    )
    assert datasets.read_trace(path, 2) == [
        TraceRecord(0.0, 10, 2, (1,)),
        TraceRecord(5.0, 20, 3, (1, 2)),
    ]
    with pytest.raises(ValueError, match=r"t.jsonl:4"):
        datasets.read_trace(path)
