"""DeepSeek-V4's cache spec: exact sizes (placement through block tables: test_v4_step_plan.py)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.deepseek_v4.args import ModelArgs
from deepinfer.model.deepseek_v4.cache import cache_spec
from deepinfer.model.deepseek_v4.tiny import TINY_CONFIG


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return ModelArgs.from_dict(TINY_CONFIG)


def test_sizes_of_the_tiny_model(args: ModelArgs) -> None:
    # Layers [sliding, CSA(4), HCA(16), CSA, HCA, sliding], hd 64, ihd 32, window 8.
    lay = cache_spec(args, block_size=128, ring_margin=16)
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
        cache_spec(args, block_size=24, ring_margin=0)
