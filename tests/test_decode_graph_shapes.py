"""Which decode graphs exist: the batch and context buckets that start-up captures (cuda_graphs.py),
checked on the CPU; the captures themselves run in tests/gpu/test_gpu_parity.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepinfer.engine.cuda_graphs import DecodeGraphs, row_buckets


def _graphs(max_batch: int, max_positions: int | None, block_size: int = 128) -> DecodeGraphs:
    cache = SimpleNamespace(block_size=block_size, device="cpu")
    return DecodeGraphs(None, cache, max_batch, capture=False, max_positions=max_positions)


@pytest.mark.parametrize(
    ("max_positions", "buckets"),
    [
        (1_048_576, [256, 1024, 4096, 16384, 65536, 262144, 1048576]),
        (8192, [256, 1024, 4096, 8192]),
        (5000, [256, 1024, 4096, 5120]),  # the last one: the limit rounded up to a block
        (100, [256]),
    ],
)
def test_context_buckets_grow_fourfold_up_to_the_limit(
    max_positions: int, buckets: list[int]
) -> None:
    graphs = _graphs(128, max_positions)
    assert graphs.context_buckets == buckets
    assert graphs.buckets == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert len(graphs.shapes) == len(buckets) * 12
    # Every step lands in a bucket that start-up captured.
    for positions in (1, 255, 256, 257, 1025, max_positions):
        positions = min(positions, max_positions)
        assert graphs.context_bucket(positions) in buckets


def test_context_bucket_is_at_least_a_block() -> None:
    assert _graphs(4, 4096, block_size=512).context_bucket(1) == 1024
    assert _graphs(4, 4096).context_bucket(300) == 1024


def test_row_buckets_are_the_powers_of_two_up_to_the_most_tokens() -> None:
    assert row_buckets(1) == [1]
    assert row_buckets(4) == [1, 2, 4]
    assert row_buckets(6) == [1, 2, 4, 6]
    graphs = DecodeGraphs(None, SimpleNamespace(block_size=16, device="cpu"), 4, capture=False,
                          max_positions=1024, max_tokens=6)  # fmt: skip
    assert len(graphs.shapes) == len(graphs.buckets) * len(graphs.context_buckets) * 4
