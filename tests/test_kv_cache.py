"""KV cache layout: exact sizes, entry placement through block tables, ring wrap-around."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kv_cache.pool import KVCache, cache_layout
from deepinfer.model.config import ModelArgs
from deepinfer.model.tiny import TINY_CONFIG


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return ModelArgs.from_dict(TINY_CONFIG)


def test_sizes_of_the_tiny_model(args: ModelArgs) -> None:
    # Layers [sliding, CSA(4), HCA(16), CSA, HCA, sliding], hd 64, ihd 32, window 8.
    lay = cache_layout(args, block_size=128, ring_margin=16)
    csa_block = (128 // 4) * (64 + 32)  # compressed entries + indexer keys
    hca_block = (128 // 16) * 64
    assert lay.elements_per_block == 2 * csa_block + 2 * hca_block == 7168
    assert lay.bytes_per_block(torch.float32) == 28672
    assert lay.bytes_per_token(torch.bfloat16) == 7168 * 2 / 128
    ring = 6 * 24 * 64
    csa_slot = (2 * 3 * 128 + 2 * 4 * 64) + (2 * 3 * 64 + 2 * 4 * 32)
    hca_slot = 2 * 15 * 64
    assert lay.elements_per_slot == ring + 2 * csa_slot + 2 * hca_slot


def test_block_size_must_be_a_multiple_of_every_ratio(args: ModelArgs) -> None:
    with pytest.raises(ValueError, match="multiple of every compression ratio"):
        cache_layout(args, block_size=24, ring_margin=0)


def _cache(args: ModelArgs, num_blocks: int, num_slots: int, ring_margin: int) -> KVCache:
    return KVCache(
        args,
        num_blocks=num_blocks,
        num_slots=num_slots,
        block_size=16,
        ring_margin=ring_margin,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_entries_follow_the_block_table(args: ModelArgs) -> None:
    cache = _cache(args, num_blocks=6, num_slots=1, ring_margin=0)
    pool = cache.compressed_kv[1]  # CSA: 16 / 4 = 4 entries per block
    assert pool.shape == (6, 4, 64)
    table = torch.tensor([5, 2, 0])
    entries = torch.arange(10 * 64, dtype=torch.float32).view(10, 64)
    cache.write_entries(pool, table, 4, 0, entries[:3])
    cache.write_entries(pool, table, 4, 3, entries[3:])
    assert torch.equal(pool[5], entries[0:4])
    assert torch.equal(pool[2], entries[4:8])
    assert torch.equal(pool[0, :2], entries[8:10])
    assert torch.equal(cache.read_entries(pool, table, 4, 10), entries)
    assert pool[1].abs().sum() == 0 and pool[3].abs().sum() == 0


def test_window_ring_wraps(args: ModelArgs) -> None:
    cache = _cache(args, num_blocks=1, num_slots=2, ring_margin=4)
    assert cache.ring_size == 12
    kv = torch.arange(30, dtype=torch.float32).unsqueeze(1).expand(30, 64)
    cache.write_window(0, 1, 0, kv[:5])
    cache.write_window(0, 1, 5, kv[5:30])  # longer than the ring: only the last 12 are kept
    assert torch.equal(cache.read_window(0, 1, 23, 30)[:, 0], torch.arange(23.0, 30.0))
    assert torch.equal(cache.read_window(0, 1, 18, 30)[:, 0], torch.arange(18.0, 30.0))
    assert cache.window_ring[0][0].abs().sum() == 0  # the other slot is untouched
