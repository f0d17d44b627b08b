"""Prefix reuse: what the scheduler does for prefix caching (torch-free).

On admission a request looks up the longest cached prefix of its full blocks (at most
``(num_tokens - 1) // block_size`` of them: its last token is always computed, for the logits;
fewer when the model recomputes a longer prompt tail, ``recompute_tokens``).
The hit's paged blocks (compressed KV, indexer keys) are reused as they are. Its state slot
cannot be rebuilt from the blocks: a token's sliding-window KV at layer l depends on the previous
``window - 1`` tokens at layer l-1, so the receptive field grows by ``window - 1`` per layer.

    hit boundary b = k * block_size
    ───────────────────────────────┬──────────────┬─────────────────────▶ positions
     blocks reused as they are     s              b      computed as usual
                                   └── replay ────┘
    s = the nearest snapshot boundary <= b           (restore the slot, replay s..b-1), else
    s = max(0, b - num_layers * (window - 1)) from an empty slot (keys before s masked)

Replayed tokens rebuild the rings and compressor state; the entries they would write belong to
the shared blocks and are not written again (``num_protected_tokens``). At a block boundary every
compressor's open window is empty (block_size is a multiple of every ratio), so the state at b
is exactly rings + CSA overlap state, all within the last ``window - 1`` tokens; a replay start
inside a compression window only disturbs entries that are protected anyway.

Snapshots are taken when a chunk ends at a block boundary: the last full block of the prompt,
the reused boundary after a replay, every ``snapshot_interval_blocks`` blocks of a long prefill
(prefill chunks are cut there), and, while decoding, the newest boundary, kept pending and
committed when the request finishes.
Requests asking for prompt logprobs skip the lookup (every prompt position must be computed).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from deepinfer.scheduler.block_manager import BlockManager
from deepinfer.scheduler.prefix_cache import PrefixCache
from deepinfer.scheduler.request import PrefixReuse, Request, RequestStatus
from deepinfer.scheduler.snapshots import SnapshotIndex


class LowerTiers(Protocol):
    """The host and disk tiers as the scheduler sees them (deepinfer.kv_cache.tiered.KVTiers).

    ``stage`` makes an entry ready for the executor (read from disk and checked, or taken from
    host memory) and names its tier, or returns None; a staged entry is held until the executor
    takes it or ``unstage`` drops it.
    """

    def stage(self, kind: str, key: bytes) -> str | None: ...

    def unstage(self, kind: str, key: bytes) -> None: ...


@dataclass(frozen=True)
class PrefixCachingOptions:
    """``salt`` names the model, its weights and the cache format; ``replay_tokens`` is
    ``num_layers * (window - 1)`` (tests may force it shorter to show the bound is real)."""

    salt: bytes
    num_snapshots: int
    snapshot_interval_blocks: int
    replay_tokens: int
    # The prompt's last tokens a hit never covers: 1 (the last token's logits), or more when
    # the model computes a prompt's tail by other rules (DeepSeek-V4.1's YoCo truncation).
    recompute_tokens: int = 1


@dataclass
class ReuseStats:
    num_replayed_tokens: int = 0
    cached_tokens_by_tier: Counter[str] = field(default_factory=Counter)


class PrefixReuseManager:
    """The scheduler's prefix caching: the cache, the snapshots, and each request's ``reuse``
    state (scheduler/request.py PrefixReuse) from admission to release."""

    def __init__(
        self,
        options: PrefixCachingOptions,
        block_manager: BlockManager,
        block_size: int,
        tiers: LowerTiers | None = None,
    ) -> None:
        self.options = options
        self.tiers = tiers
        self.block_size = block_size
        self.block_manager = block_manager
        self.cache = PrefixCache(block_manager, block_size, options.salt)
        self.snapshots = SnapshotIndex(options.num_snapshots)
        self.stats = ReuseStats()

    # -- admission ----------------------------------------------------------------------------

    def admit(self, request: Request) -> None:
        """Reuse the cached prefix of a request about to be admitted (no blocks held yet).

        Device blocks first; the chain then continues in the lower tiers, whose blocks get fresh
        device blocks and are loaded by the executor before this step's forward.
        """
        assert not request.block_table and request.num_computed_tokens == 0
        if request.sampling_params.prompt_logprobs is not None:
            return
        reuse = request.reuse
        limit = request.num_tokens - 1
        if self.options.recompute_tokens > 1:
            limit = min(limit, request.num_prompt_tokens - self.options.recompute_tokens)
        hashes = self.cache.block_hashes(request, max(0, limit))
        block_ids = self.cache.lookup(hashes)
        self.block_manager.reuse(block_ids)
        request.block_table = list(block_ids)
        reuse.cached_tokens_by_tier = {"device": len(block_ids) * self.block_size}
        self._load_from_lower_tiers(request, hashes)
        if not request.block_table:
            return
        boundary = len(request.block_table) * self.block_size
        start = self._restore_point(reuse, hashes[: len(request.block_table)])
        if start is None:
            start = max(0, boundary - self.options.replay_tokens)
            reuse.window_floor = start
        request.num_computed_tokens = start
        reuse.num_protected_tokens = boundary
        if request.num_preemptions == 0:  # usage reports what the prompt found in the cache
            request.num_cached_tokens = boundary
        reuse.num_replayed_tokens = boundary - start

    def _load_from_lower_tiers(self, request: Request, hashes: list[bytes]) -> None:
        if self.tiers is None:
            return
        for block_hash in hashes[len(request.block_table) :]:
            if not self.block_manager.can_allocate(1):
                break
            tier = self.tiers.stage("block", block_hash)
            if tier is None:
                break
            (block_id,) = self.block_manager.allocate(1)
            self.cache.register(block_id, block_hash)
            request.block_table.append(block_id)
            request.reuse.block_loads.append((block_id, block_hash))
            counts = request.reuse.cached_tokens_by_tier
            counts[tier] = counts.get(tier, 0) + self.block_size

    def _restore_point(self, reuse: PrefixReuse, hashes: list[bytes]) -> int | None:
        """The nearest snapshot at or before the hit boundary (device, then lower tiers), set up
        for restoring; None if there is none."""
        for k in range(len(hashes), 0, -1):
            snapshot_id = self.snapshots.get(hashes[k - 1])
            if snapshot_id is not None:
                reuse.restore_snapshot = snapshot_id
                self.snapshots.pin(snapshot_id)
                return k * self.block_size
            if self.tiers is not None and self.tiers.stage("snapshot", hashes[k - 1]):
                reuse.restore_snapshot_key = hashes[k - 1]
                return k * self.block_size
        return None

    def undo_admit(self, request: Request) -> None:
        """The admission failed after ``admit`` (too few free blocks): give the hit back."""
        reuse = request.reuse
        for block_id, block_hash in reuse.block_loads:
            # Never loaded: drop them from the cache before they return to the free list.
            self.cache.unregister(block_id)
            if self.tiers is not None:
                self.tiers.unstage("block", block_hash)
        reuse.block_loads = []
        if request.block_table:
            self.block_manager.free(request.block_table)
        request.block_table = []
        request.num_computed_tokens = reuse.num_protected_tokens = 0
        if request.num_preemptions == 0:
            request.num_cached_tokens = 0
        reuse.cached_tokens_by_tier = {}
        reuse.num_replayed_tokens = reuse.window_floor = 0
        if reuse.restore_snapshot is not None:
            self.snapshots.unpin(reuse.restore_snapshot)
        reuse.restore_snapshot = None
        if reuse.restore_snapshot_key is not None and self.tiers is not None:
            self.tiers.unstage("snapshot", reuse.restore_snapshot_key)
        reuse.restore_snapshot_key = None

    def on_admitted(self, request: Request) -> None:
        reuse = request.reuse
        if reuse.restore_snapshot is not None or reuse.restore_snapshot_key is not None:
            self.snapshots.stats.num_restored += 1
        reuse.pinned_snapshot = reuse.restore_snapshot
        self.stats.num_replayed_tokens += reuse.num_replayed_tokens
        self.stats.cached_tokens_by_tier.update(reuse.cached_tokens_by_tier)

    # -- chunks -------------------------------------------------------------------------------

    def clip_chunk(self, request: Request, start: int, end: int) -> int:
        """Cut a prefill chunk at the next boundary worth a snapshot, so the state exists there."""
        if self.options.num_snapshots == 0:
            return end
        boundary = self._next_prefill_snapshot(request, start)
        return min(end, boundary) if boundary is not None else end

    def _next_prefill_snapshot(self, request: Request, start: int) -> int | None:
        bs, interval = self.block_size, self.options.snapshot_interval_blocks
        last_prompt = request.num_prompt_tokens // bs * bs
        protected = request.reuse.num_protected_tokens
        # The reused boundary itself: after a replay the state there is exact, and a snapshot
        # spares the next hit the replay.
        candidates = [last_prompt, protected]
        if interval > 0:
            candidates.append((start // (bs * interval) + 1) * bs * interval)
        for boundary in sorted(candidates):
            # Below the reused boundary a replay may run from an empty slot: not exact there.
            wanted = start < boundary <= last_prompt and boundary >= protected
            if wanted and not self._has_snapshot(request, boundary):
                return boundary
        return None

    def _has_snapshot(self, request: Request, boundary: int) -> bool:
        hashes = self.cache.block_hashes(request, boundary)
        return hashes[-1] in self.snapshots

    def snapshot_after(self, request: Request, start: int, end: int) -> int | None:
        """A snapshot id for the state after the chunk [start, end), when one is wanted there."""
        bs = self.block_size
        if end % bs or end < request.reuse.num_protected_tokens or self.options.num_snapshots == 0:
            return None
        boundary_hash = self.cache.block_hashes(request, end)[-1]
        if boundary_hash in self.snapshots:
            return None
        is_prompt = end <= request.num_prompt_tokens
        if is_prompt and end != self._next_prefill_snapshot(request, start):
            return None
        reuse = request.reuse
        if not is_prompt and reuse.pending_snapshot is not None:
            # Overwrite the request's own pending snapshot: only its newest boundary is kept.
            snapshot_id, _ = reuse.pending_snapshot
            reuse.pending_snapshot = None
        else:
            snapshot_id = self.snapshots.allocate()
        if snapshot_id is not None:
            reuse.snapshot_saves.append((snapshot_id, boundary_hash, not is_prompt))
        return snapshot_id

    # -- after a step -------------------------------------------------------------------------

    def on_step_done(self, request: Request) -> None:
        """The step that computed the request's latest chunk ran: cache its full blocks and
        settle the snapshots it wrote."""
        self.cache.insert(request)
        reuse = request.reuse
        self._unpin(reuse)
        for snapshot_id, boundary_hash, keep_pending in reuse.snapshot_saves:
            if not keep_pending:
                self.snapshots.commit(snapshot_id, boundary_hash)
                continue
            if reuse.pending_snapshot is not None:
                self.snapshots.drop(reuse.pending_snapshot[0])
            reuse.pending_snapshot = (snapshot_id, boundary_hash)
        reuse.snapshot_saves = []

    def on_release(self, request: Request, status: RequestStatus) -> None:
        """The request gives up its slot: keep its newest decode boundary if it completed."""
        reuse = request.reuse
        self._unpin(reuse)
        for snapshot_id, _, _ in reuse.snapshot_saves:  # written by a step that was cut short
            self.snapshots.drop(snapshot_id)
        reuse.snapshot_saves = []
        if reuse.pending_snapshot is not None:
            snapshot_id, boundary_hash = reuse.pending_snapshot
            if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                self.snapshots.commit(snapshot_id, boundary_hash)
            else:
                self.snapshots.drop(snapshot_id)
            reuse.pending_snapshot = None
        reuse.window_floor = 0
        reuse.restore_snapshot = None

    def _unpin(self, reuse: PrefixReuse) -> None:
        if reuse.pinned_snapshot is not None:
            self.snapshots.unpin(reuse.pinned_snapshot)
            reuse.pinned_snapshot = None
