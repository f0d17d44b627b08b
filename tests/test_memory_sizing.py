"""KV cache sizing from a memory budget: blocks take what the state slots and snapshots leave,
capped at what max_num_seqs requests of max_model_len can use (the CUDA profile is in tests/gpu).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer import LLM
from deepinfer.config import CacheConfig
from deepinfer.engine.memory import fit_num_blocks


def test_fit_num_blocks() -> None:
    assert fit_num_blocks(1000, bytes_per_block=100, fixed_bytes=250, max_useful=99) == 7
    assert fit_num_blocks(1000, bytes_per_block=100, fixed_bytes=250, max_useful=5) == 5
    assert fit_num_blocks(1000, bytes_per_block=100, fixed_bytes=950, max_useful=99) == 0
    assert fit_num_blocks(-10, bytes_per_block=100, fixed_bytes=0, max_useful=99) == 0


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, float("nan")])
def test_gpu_memory_utilization_is_checked(value: float) -> None:
    with pytest.raises(ValueError, match=r"cache.gpu_memory_utilization must be in \(0, 1\]"):
        CacheConfig(gpu_memory_utilization=value)
    assert CacheConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0


def test_cpu_budget_holds_blocks_slots_and_snapshots(oracle_hf_dir: Path) -> None:
    # 16 MiB: 8.3 MiB of state slots and snapshots, then room for ~280 of the 512 blocks that
    # 64 requests of 1024 tokens could use.
    budget = 16 * 2**20
    llm = LLM(
        model=oracle_hf_dir, device="cpu", max_model_len=1024, memory_budget_gib=budget / 2**30
    )
    kv = llm.engine.executor.kv_cache
    per_block = kv.spec.bytes_per_block(kv.dtype)
    used = (
        kv.num_blocks * per_block
        + kv.num_slots * kv.spec.bytes_per_slot(kv.dtype)
        + kv.num_snapshots * kv.bytes_per_snapshot
    )
    assert (kv.num_slots, kv.num_snapshots) == (64, 128)
    assert kv.num_blocks < 512 and 0 <= budget - used < per_block
    assert llm.engine.executor.memory_profile is None


def test_cpu_budget_too_small_is_named(oracle_hf_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"cache.memory_budget_gib=1e-05 leaves .* no room"):
        LLM(model=oracle_hf_dir, device="cpu", max_model_len=1024, memory_budget_gib=1e-5)
