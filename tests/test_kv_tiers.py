"""Host and disk tiers of the KV cache: LRU order, exact round trips, broken and foreign files."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from deepinfer.kv_cache.disk_tier import DiskTier
from deepinfer.kv_cache.kv_file import MAGIC
from deepinfer.kv_cache.tiers import HostTier, payload_nbytes

SALT = b"model-fingerprint-v1"


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def block(i: int, numel: int = 16) -> list[torch.Tensor]:
    """A 2-tensor payload of 2 * numel * 4 bytes whose values identify i."""
    return [torch.full((numel,), float(i)), torch.arange(numel, dtype=torch.int32) + i]


def mixed_payload() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g),
        torch.randn(4, 7, 2, generator=g).to(torch.bfloat16),
        torch.randint(-(2**62), 2**62, (9,), generator=g, dtype=torch.int64),
        torch.randn(2, 6, generator=g).t(),  # non-contiguous
        torch.tensor(1.5, dtype=torch.bfloat16),  # 0-dim
        torch.empty(0, 4, dtype=torch.float32),  # empty
        torch.randn(1, 1, 1, 3, generator=g),
        torch.randn(5, 3, generator=g).to(torch.float8_e4m3fn),
        torch.tensor([True, False, True]),
    ]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Same dtypes, shapes and bit patterns (bf16 must round-trip exactly)."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert torch.equal(bits(x), bits(y))


# ---------------------------------------------------------------------------------------- host


def test_host_lru_eviction_order_and_capacity() -> None:
    size = payload_nbytes(block(0))  # 128 bytes
    tier = HostTier(3 * size, pin_memory=False)
    for i in range(3):
        assert tier.put("block", key(i), block(i)) == []
    assert tier.get("block", key(0)) is not None  # order now 1, 2, 0
    evicted = tier.put("block", key(3), block(3))
    assert [(k, kk) for k, kk, _ in evicted] == [("block", key(1))]
    assert_same(evicted[0][2], block(1))
    evicted = tier.put("snapshot", key(4), block(4, numel=32))  # 2 entries' worth
    assert [kk for _, kk, _ in evicted] == [key(2), key(0)]
    assert tier.keys() == [("block", key(3)), ("snapshot", key(4))]
    assert tier.num_bytes == 3 * size and len(tier) == 2
    assert tier.get("block", key(1)) is None
    s = tier.stats
    assert (s.hits, s.misses, s.puts, s.evictions) == (1, 1, 5, 3)


def test_host_copies_replaces_and_pops() -> None:
    tier = HostTier(1000, pin_memory=False)
    src = block(1)
    tier.put("block", key(1), src)
    src[0].fill_(-1.0)  # the caller's pool row is reused: the tier must hold its own copy
    assert_same(tier.get("block", key(1)), block(1))
    tier.put("block", key(1), block(2))  # same key: replaced, counted once
    assert tier.num_bytes == payload_nbytes(block(2)) and len(tier) == 1
    assert tier.contains("block", key(1)) and not tier.contains("snapshot", key(1))
    assert_same(tier.pop("block", key(1)), block(2))
    assert tier.pop("block", key(1)) is None
    assert (len(tier), tier.num_bytes) == (0, 0)


def test_host_oversized_payload_comes_straight_back() -> None:
    tier = HostTier(100, pin_memory=False)
    payload = block(7)  # 128 bytes
    assert tier.put("block", key(7), payload) == [("block", key(7), payload)]
    assert len(tier) == 0 and tier.stats.dropped_writes == 1


def test_host_pin_memory_flag() -> None:
    tier = HostTier(1000, pin_memory=True)
    tier.put("block", key(0), block(0))
    stored = tier.get("block", key(0))
    assert tier.pin_memory == torch.cuda.is_available()
    assert stored[0].is_pinned() == tier.pin_memory
    assert_same(stored, block(0))


# ---------------------------------------------------------------------------------------- disk


def written(tier: DiskTier, kind: str, k: bytes, payload: list[torch.Tensor]) -> Path:
    tier.put(kind, k, payload)
    tier.flush()
    path = tier.path(kind, k)
    assert path.is_file()
    return path


def test_disk_round_trip_exact(tmp_path: Path) -> None:
    payload = mixed_payload()
    with DiskTier(tmp_path, 1 << 20, SALT, num_writers=2) as tier:
        path = written(tier, "snapshot", key(1), payload)
        assert path == tmp_path / "snapshot" / key(1).hex()[:2] / f"{key(1).hex()}.kv"
        assert_same(tier.get("snapshot", key(1)), payload)
        assert tier.get("block", key(1)) is None  # kinds are separate namespaces
        s = tier.stats
        assert (s.hits, s.misses, s.puts, s.bytes_written) == (1, 1, 1, path.stat().st_size)
        assert s.bytes_read == path.stat().st_size and s.corrupt_files == 0
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*"))


def test_disk_pending_write_is_served_and_counted(tmp_path: Path, monkeypatch) -> None:
    tier = DiskTier(tmp_path, 1 << 20, SALT, max_pending_writes=1)
    started, release = threading.Event(), threading.Event()
    real_write = tier._write_file

    def slow_write(*args):
        started.set()
        release.wait(5)
        return real_write(*args)

    monkeypatch.setattr(tier, "_write_file", slow_write)
    tier.put("block", key(1), block(1))
    assert started.wait(5)  # the writer holds job 1, the queue is empty
    tier.put("block", key(2), block(2))  # fills the queue (max 1)
    tier.put("block", key(3), block(3))  # dropped
    tier.put("block", key(1), block(1))  # already pending: skipped, not dropped
    assert tier.contains("block", key(1)) and tier.contains("block", key(2))
    assert not tier.contains("block", key(3))
    assert_same(tier.get("block", key(2)), block(2))  # from memory before it is written
    assert tier.stats.dropped_writes == 1
    release.set()
    tier.close()
    assert tier.get("block", key(3)) is None
    assert_same(tier.get("block", key(1)), block(1))
    assert (tier.stats.puts, len(tier)) == (2, 2)
    tier.put("block", key(4), block(4))  # after close: dropped
    assert tier.stats.dropped_writes == 2


def test_disk_restart_finds_files(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1 << 20, SALT) as tier:
        written(tier, "block", key(1), block(1))
        size = tier.num_bytes
    with DiskTier(tmp_path, 1 << 20, SALT) as tier:
        assert (len(tier), tier.num_bytes) == (1, size)
        assert tier.contains("block", key(1))
        assert_same(tier.get("block", key(1)), block(1))


def test_disk_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1 << 20, SALT) as probe:
        size = written(probe, "block", key(0), block(0)).stat().st_size
    with DiskTier(tmp_path, 3 * size, SALT) as tier:
        written(tier, "block", key(1), block(1))
        written(tier, "block", key(2), block(2))
        assert tier.get("block", key(0)) is not None  # order now 1, 2, 0
        written(tier, "block", key(3), block(3))
        assert not tier.path("block", key(1)).exists()
        assert [tier.contains("block", key(i)) for i in range(4)] == [True, False, True, True]
        assert (tier.num_bytes, tier.stats.evictions) == (3 * size, 1)
    # A restart with a smaller budget evicts by mtime: 2 is the oldest left.
    for age, i in enumerate((2, 0, 3)):
        os.utime(tier.path("block", key(i)), (1000 + age, 1000 + age))
    with DiskTier(tmp_path, 2 * size, SALT) as tier:
        assert [tier.contains("block", key(i)) for i in range(4)] == [True, False, False, True]


def test_disk_eviction_spares_files_without_magic(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1 << 20, SALT) as probe:
        size = written(probe, "block", key(0), block(0)).stat().st_size
    foreign = probe.path("block", key(0))
    foreign.write_bytes(b"x" * size)  # same size, no magic, oldest
    os.utime(foreign, (1000, 1000))
    with DiskTier(tmp_path, size, SALT) as tier:
        written(tier, "block", key(1), block(1))
        assert foreign.read_bytes() == b"x" * size and tier.num_bytes == size


def _flip_data_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF  # inside the last tensor's data
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-20])


def _truncate_into_magic(path: Path) -> None:
    path.write_bytes(MAGIC[:5])


@pytest.mark.parametrize("damage", [_flip_data_byte, _truncate, _truncate_into_magic])
def test_disk_broken_file_is_ignored_and_removed(tmp_path: Path, caplog, damage) -> None:
    with DiskTier(tmp_path, 1 << 20, SALT) as tier:
        path = written(tier, "block", key(1), block(1))
        damage(path)
        with caplog.at_level(logging.WARNING, logger="deepinfer.kv_cache.disk_tier"):
            assert tier.get("block", key(1)) is None
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        assert str(path) in caplog.records[0].getMessage()
        assert not path.exists()
        assert (tier.stats.corrupt_files, tier.stats.misses) == (1, 1)
        assert tier.get("block", key(1)) is None  # now simply absent
        assert (tier.stats.corrupt_files, tier.stats.misses, len(tier)) == (1, 2, 0)
        written(tier, "block", key(1), block(1))  # the next put rewrites it
        assert_same(tier.get("block", key(1)), block(1))


def test_disk_wrong_key_is_removed(tmp_path: Path, caplog) -> None:
    with DiskTier(tmp_path, 1 << 20, SALT) as tier:
        path = written(tier, "block", key(1), block(1))
        renamed = tier.path("block", key(2))
        renamed.parent.mkdir(parents=True, exist_ok=True)
        path.rename(renamed)
        with caplog.at_level(logging.WARNING):
            assert tier.get("block", key(2)) is None
        assert "not its path's entry" in caplog.text
        assert not renamed.exists() and tier.stats.corrupt_files == 1


def test_disk_wrong_salt_is_ignored_and_kept(tmp_path: Path, caplog) -> None:
    with DiskTier(tmp_path, 1 << 20, SALT) as tier:
        path = written(tier, "block", key(1), block(1))
    with DiskTier(tmp_path, 1 << 20, b"other-model") as other, caplog.at_level(logging.WARNING):
        assert other.get("block", key(1)) is None
        assert other.get("block", key(1)) is None  # logged and counted once per file
        assert path.exists() and "is not ours" in caplog.text
        assert len(caplog.records) == 1
        s = other.stats
        assert (s.corrupt_files, s.misses, s.hits) == (1, 2, 0)
        written(other, "block", key(1), block(5))  # its own put overwrites the foreign file
        assert_same(other.get("block", key(1)), block(5))


def test_disk_garbage_without_magic_is_kept(tmp_path: Path, caplog) -> None:
    with DiskTier(tmp_path, 1 << 20, SALT) as tier:
        path = tier.path("block", key(1))
        path.parent.mkdir(parents=True)
        path.write_bytes(b"not a kv file at all, but someone's data")
        with caplog.at_level(logging.WARNING):
            assert tier.get("block", key(1)) is None
        assert "no DeepInfer KV magic" in caplog.text and "left in place" in caplog.text
        assert path.read_bytes() == b"not a kv file at all, but someone's data"
        assert tier.stats.corrupt_files == 1


def test_disk_other_version_is_kept(tmp_path: Path, caplog) -> None:
    with DiskTier(tmp_path, 1 << 20, SALT) as tier:
        path = written(tier, "block", key(1), block(1))
        raw = bytearray(path.read_bytes())
        raw[len(MAGIC)] += 1  # version u16 right after the magic
        path.write_bytes(bytes(raw))
        with caplog.at_level(logging.WARNING):
            assert tier.get("block", key(1)) is None
        assert "format version 2" in caplog.text and path.exists()


def test_disk_stale_temp_files_are_cleaned_at_start(tmp_path: Path) -> None:
    shard = tmp_path / "block" / "ab"
    shard.mkdir(parents=True)
    stale, fresh = shard / ".ab12.dead.tmp", shard / ".ab34.live.tmp"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    os.utime(stale, (1000, 1000))
    with DiskTier(tmp_path, 1 << 20, SALT) as tier:
        assert len(tier) == 0
    assert not stale.exists() and fresh.exists()


def test_disk_fifo_at_a_key_neither_blocks_nor_is_read(tmp_path: Path, caplog) -> None:
    """Opening a FIFO for reading waits for a writer: a get() on the scheduling path would hang
    every request. Only regular files are opened, and the open itself does not wait."""
    with DiskTier(tmp_path, 1 << 20, SALT) as tier:
        path = tier.path("block", key(1))
        path.parent.mkdir(parents=True)
        os.mkfifo(path)
        results: list[object] = []
        reader = threading.Thread(target=lambda: results.append(tier.get("block", key(1))))
        with caplog.at_level(logging.WARNING):
            reader.start()
            reader.join(timeout=5.0)
        assert not reader.is_alive(), "get() blocked on a FIFO"
        assert results == [None]
        assert "not a regular file" in caplog.text and "left in place" in caplog.text
        assert path.is_fifo() and tier.stats.corrupt_files == 1
        # A put over it replaces it with a real file that reads back.
        tier.put("block", key(1), block(1))
        tier.flush()
        assert_same(tier.get("block", key(1)), block(1))
