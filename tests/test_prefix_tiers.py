"""Prefix hits served from the host and disk tiers (and after a restart) match a cold run;
corrupt or truncated disk files are ignored and the request is still right."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle import oracle_prompts
from test_prefix_cache import BASE, BLOCK, PARAMS, _assert_same, _diverging, _first, _llm

from deepinfer import LLM

NUM_BLOCKS = 22  # the first prompt and its reply need 20


@pytest.fixture(scope="module")
def cold(oracle_hf_dir: Path) -> LLM:
    return _llm(oracle_hf_dir, enable_prefix_caching=False)


def _evict_first_prompt(llm: LLM) -> None:
    """Run the first prompt, then another that needs every block of the pool."""
    llm.generate([_first()], PARAMS, use_tqdm=False)
    other = (oracle_prompts()[1] * 4)[: NUM_BLOCKS * BLOCK - PARAMS.max_tokens]
    llm.generate([other], PARAMS, use_tqdm=False)
    if llm.engine.tiers is not None:
        llm.engine.tiers.flush()


def _tier_hits(llm: LLM) -> dict[str, int]:
    return dict(llm.engine.scheduler.prefix.stats.cached_tokens_by_tier)


def _second(llm: LLM, cold: LLM) -> dict[str, int]:
    """Serve the diverging prompt, check it against the cold run, return the tier hit counts."""
    before = _tier_hits(llm)
    prompt = _diverging(8)
    out = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    _assert_same(out, cold.generate([prompt], PARAMS, use_tqdm=False)[0])
    after = _tier_hits(llm)
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def test_hit_from_the_host_tier(oracle_hf_dir: Path, cold: LLM) -> None:
    llm = _llm(oracle_hf_dir, num_blocks=NUM_BLOCKS, host_tier_gib=0.01)
    _evict_first_prompt(llm)
    assert _second(llm, cold) == {"device": 0, "host": BASE}


def test_hit_from_the_disk_tier_and_after_a_restart(
    oracle_hf_dir: Path, cold: LLM, tmp_path: Path
) -> None:
    llm = _llm(oracle_hf_dir, num_blocks=NUM_BLOCKS, host_tier_gib=0, disk_tier_dir=str(tmp_path))
    _evict_first_prompt(llm)
    assert _second(llm, cold) == {"device": 0, "disk": BASE}
    restarted = _llm(
        oracle_hf_dir, num_blocks=NUM_BLOCKS, host_tier_gib=0, disk_tier_dir=str(tmp_path)
    )
    assert _second(restarted, cold) == {"device": 0, "disk": BASE}


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_disk_files_are_ignored(
    oracle_hf_dir: Path, cold: LLM, tmp_path: Path, damage: str
) -> None:
    llm = _llm(oracle_hf_dir, num_blocks=NUM_BLOCKS, host_tier_gib=0, disk_tier_dir=str(tmp_path))
    _evict_first_prompt(llm)
    # Damage the file of the first prompt's 6th block: the chain then stops at 5 blocks.
    sixth = llm.engine.scheduler.prefix.cache.block_hashes(_make_request(llm), 6 * BLOCK)[5]
    path = llm.engine.tiers.disk.path("block", sixth)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    restarted = _llm(
        oracle_hf_dir, num_blocks=NUM_BLOCKS, host_tier_gib=0, disk_tier_dir=str(tmp_path)
    )
    assert _second(restarted, cold) == {"device": 0, "disk": 5 * BLOCK}
    assert restarted.engine.tiers.disk.stats.corrupt_files == 1


def _make_request(llm: LLM):
    from deepinfer.sampling_params import SamplingParams
    from deepinfer.scheduler.request import Request

    return Request("probe", _first(), SamplingParams(), cache_salt=None)


def test_fp8_kv_hit_from_the_host_tier(oracle_hf_dir: Path) -> None:
    """cache.kv_dtype = "fp8": the packed entries and rings go to the host tier and come back
    as they were (the hit gives the tokens of a cold FP8 run)."""
    cold = _llm(oracle_hf_dir, enable_prefix_caching=False, kv_dtype="fp8")
    llm = _llm(oracle_hf_dir, num_blocks=NUM_BLOCKS, host_tier_gib=0.01, kv_dtype="fp8")
    assert llm.engine.executor.kv_cache[1, "ring"].dtype == torch.uint8
    _evict_first_prompt(llm)
    assert _second(llm, cold) == {"device": 0, "host": BASE}
