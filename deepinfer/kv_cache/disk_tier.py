"""Disk tier of the KV cache: payloads as files in a directory, possibly a shared NFS/3FS mount.

    HostTier LRU victims --put--> bounded queue --> writer threads --> <dir>/<kind>/<kk>/<key>.kv
    caller <-------------------------------- get (synchronous read + verify) ----------'

Paths are ``directory/<kind>/<key hex[:2]>/<key hex>.kv``; the file format (self-describing, with
magic, version, salt, kind, key, dtypes, shapes and a crc32) is drawn in ``kv_file.py``. Several
nodes may share the directory, so every node reuses every node's prefixes: a node reads any file at
the path of a key it wants, whoever wrote it.

Writes are asynchronous and atomic: ``put`` queues the payload and returns at once (a full queue
drops the write, counted in ``stats.dropped_writes``); a writer thread streams the file to a unique
temp name in the target directory, optionally fsyncs, then ``os.replace``s it into place, so a
reader sees either no file or a whole one. Until written, a payload is served from memory.

Capacity policy (approximate LRU by mtime): the tier indexes the ``.kv`` files it knows about (a
scan at start, ordered by mtime, plus its own writes and successful reads) with their sizes. A
write sets a file's mtime and a hit touches it, so the order survives restarts. After each write,
the least recently used indexed files are removed until their total is within ``capacity_bytes``;
a file is only removed if it starts with our magic. Each node bounds only the files it knows about:
with N nodes on one mount give each a share of the budget (or one node the whole budget).

A file that cannot be read as the asked-for payload is ignored with one warning per file and counted
in ``stats.corrupt_files``; it is removed if it has our magic but is broken (corrupt, truncated,
misplaced), and left alone if it is foreign (no magic, another version or another salt).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

from deepinfer.kv_cache.events import CacheEventLog
from deepinfer.kv_cache.kv_file import MAGIC, KVFileError, decode, encode_chunks
from deepinfer.kv_cache.tiers import Payload, TierStats, payload_nbytes

logger = logging.getLogger(__name__)

_KIND_RE = re.compile(r"[a-z][a-z0-9_]*")
_TIER_ID_FILE = "tier-id"
_STALE_TMP_SECONDS = 3600.0  # a temp file this old belongs to a crashed writer, on any node

_WriteJob = tuple[Path, str, bytes, Payload]


class DiskTier:
    """Payload store in ``directory``, bounded by ``capacity_bytes`` of file sizes.

    ``salt`` fingerprints the model, weights and cache format: files written under another salt
    are foreign. Payload tensors handed to ``put`` must not be modified until written (HostTier's
    evicted copies satisfy this). Tensors returned by ``get`` are CPU tensors that the caller
    only reads: views of the freshly read file, or the pending payload itself.
    """

    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        salt: bytes,
        *,
        num_writers: int = 1,
        max_pending_writes: int = 64,
        fsync: bool = False,
    ) -> None:
        if capacity_bytes < 0 or num_writers < 1 or max_pending_writes < 1:
            raise ValueError(
                f"DiskTier needs capacity_bytes >= 0, num_writers >= 1, max_pending_writes >= 1; "
                f"got {capacity_bytes}, {num_writers}, {max_pending_writes}"
            )
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.salt = salt
        self.fsync = fsync
        self._init_state()
        self._init_index()
        self._init_writers(num_writers, max_pending_writes)

    def _init_state(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # guards everything below
        self._index: OrderedDict[Path, int] = OrderedDict()  # path -> size, LRU first
        self._num_bytes = 0
        self._pending: dict[Path, Payload] = {}  # queued or being written
        self._warned: set[Path] = set()  # ignored files already logged and counted
        self._stats = TierStats()
        self._closed = False
        self._events: CacheEventLog | None = None  # the node's, when it publishes to a router

    def _init_index(self) -> None:
        found: list[tuple[int, Path, int]] = []
        now = time.time()
        for kind_dir in _subdirs(self.directory):
            for shard_dir in _subdirs(kind_dir):
                for entry in os.scandir(shard_dir):
                    st = entry.stat(follow_symlinks=False)
                    if entry.name.endswith(".kv"):
                        found.append((st.st_mtime_ns, Path(entry.path), st.st_size))
                    elif entry.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_SECONDS:
                        _unlink(Path(entry.path))
        for _, path, size in sorted(found):
            self._index[path] = size
            self._num_bytes += size
        logger.info(
            "disk KV tier %s: %d files, %.1f MiB of %.1f MiB",
            self.directory,
            len(found),
            self._num_bytes / 2**20,
            self.capacity_bytes / 2**20,
        )
        with self._lock:
            victims = self._select_victims()
        self._remove(victims)

    def _init_writers(self, num_writers: int, max_pending_writes: int) -> None:
        self._queue: queue.Queue[_WriteJob | None] = queue.Queue(maxsize=max_pending_writes)
        self._writers = [
            threading.Thread(target=self._writer_loop, name=f"kv-disk-writer-{i}", daemon=True)
            for i in range(num_writers)
        ]
        for t in self._writers:
            t.start()

    def path(self, kind: str, key: bytes) -> Path:
        """Where the (kind, key) file lives."""
        if not _KIND_RE.fullmatch(kind) or not 0 < len(key) < 256:
            raise ValueError(f"bad disk tier entry name: kind={kind!r}, key={key.hex()!r}")
        hex_key = key.hex()
        return self.directory / kind / hex_key[:2] / f"{hex_key}.kv"

    def put(self, kind: str, key: bytes, payload: Payload) -> None:
        """Queue an asynchronous write and return at once.

        Skipped when the key is already pending or known on disk (same key and salt means same
        content); dropped and counted when the queue is full, the payload exceeds the whole tier,
        or the tier is closed.
        """
        path = self.path(kind, key)
        with self._lock:
            if path in self._pending:
                return
            if path in self._index:
                self._index.move_to_end(path)
                return
            reason = None
            if self._closed:
                reason = "tier closed"
            elif payload_nbytes(payload) > self.capacity_bytes:
                reason = "payload larger than the tier"
            else:
                try:
                    self._queue.put_nowait((path, kind, key, payload))
                except queue.Full:
                    reason = "writer queue full"
            if reason is not None:
                self._stats.dropped_writes += 1
                logger.debug("disk KV tier: dropped write of %s (%s)", path.name, reason)
                return
            self._pending[path] = payload
            self._record(True, [path])  # served from memory until written

    def get(self, kind: str, key: bytes) -> Payload | None:
        """Read and verify the payload synchronously (file I/O: keep it off the step path).

        Returns CPU tensors with the dtypes and shapes written, or None when absent or unreadable.
        """
        path = self.path(kind, key)
        with self._lock:
            pending = self._pending.get(path)
            if pending is not None:
                self._stats.hits += 1
                return pending
        start = time.perf_counter()
        try:
            buf = _read_all(path)
            payload = decode(buf, salt=self.salt, kind=kind, key=key)
        except FileNotFoundError:
            with self._lock:
                self._forget(path)
                self._record(False, [path])
                self._stats.misses += 1
            return None
        except (OSError, KVFileError) as e:
            self._ignore(path, e)
            return None
        with self._lock:
            self._stats.hits += 1
            self._stats.bytes_read += len(buf)
            self._stats.read_seconds += time.perf_counter() - start
            if path not in self._index:  # written by another node, or before our scan
                self._num_bytes += len(buf)
                self._record(True, [path])
            self._index[path] = len(buf)
            self._index.move_to_end(path)
        _touch(path)
        return payload

    def contains(self, kind: str, key: bytes) -> bool:
        """Pending write, or a file at the path (one stat; its contents are not checked)."""
        path = self.path(kind, key)
        with self._lock:
            if path in self._pending:
                return True
        return path.is_file()

    def flush(self) -> None:
        """Block until every queued write has finished (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes, then stop the writer threads. Later puts are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in self._writers:
            self._queue.put(None)  # after every queued job: the queue is FIFO
        for t in self._writers:
            t.join()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        """Files indexed (known to this node)."""
        with self._lock:
            return len(self._index)

    @property
    def num_bytes(self) -> int:
        """Total size of the indexed files."""
        with self._lock:
            return self._num_bytes

    @property
    def stats(self) -> TierStats:
        with self._lock:
            return self._stats.copy()

    def _writer_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(*job)
            finally:
                self._queue.task_done()

    def _write(self, path: Path, kind: str, key: bytes, payload: Payload) -> None:
        start = time.perf_counter()
        try:
            size = self._write_file(path, kind, key, payload)
        except Exception:  # a writer thread must survive any one failed write (disk full, ...)
            logger.warning("disk KV tier: writing %s failed", path, exc_info=True)
            with self._lock:
                self._pending.pop(path, None)
                self._record(False, [path])
            return
        with self._lock:
            self._pending.pop(path, None)
            self._forget(path)
            self._index[path] = size
            self._num_bytes += size
            self._warned.discard(path)
            self._stats.puts += 1
            self._stats.bytes_written += size
            self._stats.write_seconds += time.perf_counter() - start
            victims = self._select_victims()
        self._remove(victims)

    def _write_file(self, path: Path, kind: str, key: bytes, payload: Payload) -> int:
        """Write atomically: a unique temp name in the target directory, then os.replace."""
        path.parent.mkdir(parents=True, exist_ok=True)
        # Unique across the nodes sharing the mount and the threads of this one.
        tmp = path.with_name(f".{path.stem}.{secrets.token_hex(8)}.tmp")
        size = 0
        try:
            with open(tmp, "wb") as f:
                for chunk in encode_chunks(self.salt, kind, key, payload):
                    f.write(chunk)
                    size += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        return size

    def _ignore(self, path: Path, error: Exception) -> None:
        """Warn about and count an unreadable file once; remove it if it is our broken file."""
        removed = False
        if isinstance(error, KVFileError) and error.remove:
            removed = _unlink(path)
        with self._lock:
            self._stats.misses += 1
            # Forget it either way: a foreign file at our path gets overwritten by the next put.
            self._forget(path)
            self._record(False, [path])
            if path in self._warned:
                return
            self._stats.corrupt_files += 1
            if not removed:
                self._warned.add(path)
        action = "removed" if removed else "left in place"
        logger.warning("disk KV tier: ignoring %s (%s); %s", path, error, action)

    def _forget(self, path: Path) -> None:
        """Called with the lock held, as are the next two."""
        size = self._index.pop(path, None)
        if size is not None:
            self._num_bytes -= size

    def _select_victims(self) -> list[Path]:
        victims = []
        while self._num_bytes > self.capacity_bytes and self._index:
            path, size = self._index.popitem(last=False)
            self._num_bytes -= size
            victims.append(path)
        self._stats.evictions += len(victims)
        self._record(False, victims)
        return victims

    def _record(self, is_stored: bool, paths: list[Path]) -> None:
        if self._events is None:
            return
        keys = [bytes.fromhex(p.stem) for p in paths if p.parent.parent.name == "block"]
        if is_stored:
            self._events.stored("disk", keys)
        else:
            self._events.removed("disk", keys)

    def tier_id(self) -> str:
        """A name shared by every node that mounts this directory (random, kept in the file
        ``tier-id`` there; the first node to ask creates it), so that a router knows which
        nodes see the same files."""
        path = self.directory / _TIER_ID_FILE
        if not path.is_file():
            tmp = path.with_name(f".{_TIER_ID_FILE}.{secrets.token_hex(8)}.tmp")
            tmp.write_text(secrets.token_hex(16), encoding="ascii")
            try:
                os.link(tmp, path)  # atomic, and fails where another node was first
            except FileExistsError:
                pass
            finally:
                _unlink(tmp)
        return path.read_text(encoding="ascii").strip()

    def publish_to(self, events: CacheEventLog) -> None:
        """Record in ``events`` the blocks indexed now and every change from here on."""
        with self._lock:
            self._events = events
            self._record(True, list(self._index))

    def _remove(self, victims: list[Path]) -> None:
        for path in victims:
            try:
                with _open_regular(path) as f:
                    is_ours = f.read(len(MAGIC)) == MAGIC
            except FileNotFoundError:
                continue  # another node evicted it first
            except OSError as e:
                logger.warning("disk KV tier: cannot evict %s: %s", path, e)
                continue
            if is_ours:
                _unlink(path)
            else:
                logger.debug("disk KV tier: not evicting %s: no DeepInfer magic", path)


def _subdirs(directory: Path) -> list[Path]:
    return [Path(e.path) for e in os.scandir(directory) if e.is_dir(follow_symlinks=False)]


def _open_regular(path: Path):
    """Open ``path`` for reading only if it is a regular file: whatever else sits at a key's
    path on a shared directory (a FIFO, a device) must not block the step that reads it, so
    the open does not wait (O_NONBLOCK) and the file's type is checked before any read.
    Raises OSError (FileNotFoundError when absent)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(f"not a regular file (mode {stat.filemode(mode)})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_all(path: Path) -> bytearray:
    """The whole file in a writable buffer (decode hands out zero-copy tensor views of it)."""
    with _open_regular(path) as f:
        buf = bytearray(os.fstat(f.fileno()).st_size)
        view, filled = memoryview(buf), 0
        while filled < len(buf) and (n := f.readinto(view[filled:])):
            filled += n
    return buf[:filled] if filled < len(buf) else buf


def _touch(path: Path) -> None:
    """Bump the mtime so the LRU order survives restarts and is seen by other nodes."""
    try:
        os.utime(path)
    except OSError as e:
        logger.debug("disk KV tier: cannot touch %s: %s", path, e)


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as e:
        logger.warning("disk KV tier: cannot remove %s: %s", path, e)
        return False
    return True
