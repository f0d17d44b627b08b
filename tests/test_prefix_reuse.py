"""Prefix caching in the scheduler (torch-free): exact block reuse and eviction order, salts,
snapshots, and a randomized run with shared and forked prefixes, aborts and tiny memory."""

from __future__ import annotations

import random

from deepinfer.config import SchedulerConfig
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.output import ModelRunnerOutput, SchedulerOutput
from deepinfer.scheduler.prefix_cache import chain_root, hash_block
from deepinfer.scheduler.prefix_reuse import PrefixCachingOptions
from deepinfer.scheduler.request import Request
from deepinfer.scheduler.scheduler import Scheduler

BS = 4


def _scheduler(num_blocks: int = 16, num_snapshots: int = 4, replay: int = 6, **kw) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=kw.pop("max_num_seqs", 4), max_num_batched_tokens=64),
        block_size=BS,
        num_blocks=num_blocks,
        num_state_slots=kw.pop("num_slots", 4),
        max_model_len=256,
        prefix_caching=PrefixCachingOptions(
            salt=b"model",
            num_snapshots=num_snapshots,
            snapshot_interval_blocks=kw.pop("interval", 0),
            replay_tokens=replay,
        ),
    )


def _request(rid: str, prompt: list[int], max_tokens: int = 1, salt: str | None = None) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, eos_token_id=None, cache_salt=salt)


def _step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    result = ModelRunnerOutput(
        sampled_token_ids={x.request_id: [token] for x in out.scheduled if x.do_sample}
    )
    s.update(out, result)
    s.check_integrity()
    return out


def _run_all(s: Scheduler) -> None:
    for _ in range(100):
        if not s.has_unfinished_requests():
            return
        _step(s)
    raise AssertionError("requests did not finish")


def test_hash_chain_depends_on_salt_and_every_earlier_token() -> None:
    root = chain_root(b"model", None)
    assert root != chain_root(b"model", "tenant-a") != chain_root(b"other", None)
    assert hash_block(root, [1, 2, 3, 4]) != hash_block(root, [1, 2, 3, 5])
    a = hash_block(hash_block(root, [1, 2, 3, 4]), [5, 6, 7, 8])
    b = hash_block(hash_block(root, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert a != b


def test_hit_reuses_exact_blocks_and_replays_from_the_bound() -> None:
    s = _scheduler(replay=6)
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks
    s.add_request(_request("a", prompt))
    first = _step(s).scheduled[0]
    # The chunk is cut at the prompt's last full block so its state can be snapshotted there.
    assert first.block_table == [0, 1, 2] and first.num_tokens == 12
    assert first.save_snapshot == 0
    _run_all(s)
    assert s.block_manager.num_used_blocks == 0 and s.block_manager.num_cached_blocks == 3
    s.add_request(_request("b", [*prompt[:13], 999, 998]))  # shares blocks 0-2 (12 tokens)
    chunk = _step(s).scheduled[0]
    # Hit 3 blocks; the prompt's snapshot (at 12) exists, so nothing is replayed.
    assert chunk.block_table[:3] == [0, 1, 2] and chunk.start_pos == 12
    assert chunk.restore_snapshot is not None and chunk.num_protected_tokens == 12
    assert chunk.window_floor == 0


def test_replay_without_snapshot_and_cache_salt_isolation() -> None:
    s = _scheduler(num_snapshots=0, replay=6)
    prompt = list(range(200, 217))  # 17 tokens: 4 full blocks
    s.add_request(_request("a", prompt))
    _run_all(s)
    s.add_request(_request("b", prompt))
    chunk = _step(s).scheduled[0]
    assert chunk.num_protected_tokens == 16 and chunk.start_pos == 10  # 16 - 6
    assert chunk.window_floor == 10 and chunk.restore_snapshot is None
    _run_all(s)
    s.add_request(_request("c", prompt, salt="tenant"))
    chunk = _step(s).scheduled[0]
    assert chunk.start_pos == 0 and chunk.num_protected_tokens == 0


def test_lru_eviction_order() -> None:
    s = _scheduler(num_blocks=6, num_snapshots=0)
    for rid, base in (("a", 10), ("b", 20)):
        s.add_request(_request(rid, [base + i for i in range(9)]))  # 2 full blocks + 1
        _run_all(s)
    # Freed tail first: a left [2, 1, 0] on the free list, b then [5, 4, 3] (b took 3, 4, 5).
    assert s.block_manager.num_cached_blocks == 4
    s.add_request(_request("c", [30 + i for i in range(5)]))  # needs 2 blocks: evicts LRU
    chunk = _step(s).scheduled[0]
    assert chunk.block_table == [2, 1]  # a's tail block (uncached) then a's second block
    assert s.prefix.cache.stats.num_evicted_blocks == 1
    _run_all(s)
    s.add_request(_request("a2", [10 + i for i in range(9)]))
    assert _step(s).scheduled[0].num_protected_tokens == 4  # a's first block is still cached


def test_randomized_sharing_forking_aborts_tiny_memory() -> None:
    rng = random.Random(7)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    for trial in range(40):
        s = _scheduler(
            num_blocks=rng.randrange(8, 20),
            num_snapshots=rng.randrange(0, 4),
            replay=rng.randrange(0, 10),
            interval=rng.randrange(0, 3),
            num_slots=rng.randrange(1, 4),
            max_num_seqs=3,
        )
        live: list[str] = []
        for i in range(30):
            if rng.random() < 0.5:
                stem = rng.choice(stems)
                prompt = stem[: rng.randrange(1, len(stem) + 1)]
                prompt = prompt + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
                rid = f"{trial}-{i}"
                s.add_request(_request(rid, prompt, max_tokens=rng.randrange(1, 9)))
                live.append(rid)
            if live and rng.random() < 0.15:
                s.abort_requests([live.pop(rng.randrange(len(live)))])
            out = s.schedule()
            for x in out.scheduled:
                if x.restore_snapshot is not None:  # never evicted while about to be read
                    assert x.restore_snapshot in s.prefix.snapshots._committed.values()
            tokens = {x.request_id: [rng.randrange(50)] for x in out.scheduled if x.do_sample}
            s.update(out, ModelRunnerOutput(sampled_token_ids=tokens))
            s.check_integrity()
        _run_all(s)
        assert s.block_manager.num_used_blocks == 0, trial
        assert s.state_slots.num_used_slots == 0, trial
        assert all(s.block_manager.ref_count(b) == 0 for b in range(s.block_manager.num_blocks))
        assert s.prefix.snapshots._num_pending == 0, trial
        assert not s.prefix.snapshots._pinned, trial
        s.check_integrity()
