"""A node's side of the coordinator's cache view: it posts its prefix cache's events.

    engine threads ──stored/removed──▶ CacheEventLog (deepinfer/kv_cache/events.py)
    CachePublisher, every node.cache_event_interval_s while registered:
        new lease, or told so ──▶ POST /internal/cache_snapshot  CacheSnapshot(seq, held)
        otherwise             ──▶ POST /internal/cache_events    CacheEventBatch(first_seq, ...)
                              ◀── CacheSync: acknowledged up to applied_seq, or needs_snapshot

The registration loop (server/node.py) hands the publisher each new lease. A new lease means a
coordinator that knows nothing of this node yet (it started, or forgot the node): a snapshot
comes first. Events stay pending until acknowledged, so a failed post is sent again (the
coordinator skips what it already applied); past ``max_pending_events`` the log drops them and
the next message is a snapshot. Never raises: routing works (by load) without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from deepinfer.kv_cache.events import TIERS, CacheEventLog
from deepinfer.server.protocol import (
    CacheEventBatch,
    CacheSnapshot,
    CacheSync,
    NodeLease,
    decode,
    encode,
)

logger = logging.getLogger(__name__)

_MAX_EVENTS_PER_MESSAGE = 4096
_MAX_RETRY_S = 30.0


# What fits the coordinator's message limit (64 MiB, ~9 bytes a key).
MAX_SNAPSHOT_KEYS = 6_000_000


def _bounded(seq: int, held: dict[str, list[int]]) -> tuple[int, dict[str, list[int]]]:
    """A snapshot within MAX_SNAPSHOT_KEYS: the device's blocks first, then the host's, then
    the disk's. Left out blocks only make the coordinator predict shorter hits there."""
    room, out = MAX_SNAPSHOT_KEYS, {}
    for tier in TIERS:
        keys = held.get(tier, [])
        if len(keys) > room:
            logger.warning(
                "cache snapshot: %d of the %s tier's %d blocks left out (the coordinator takes "
                "%d at most)", len(keys) - room, tier, len(keys), MAX_SNAPSHOT_KEYS,
            )  # fmt: skip
            keys = keys[:room]
        if keys:
            out[tier] = keys
        room -= len(keys)
    return seq, out


class CachePublisher:
    def __init__(self, events: CacheEventLog, interval_s: float) -> None:
        self.events = events
        self.interval_s = interval_s
        self.lease: NodeLease | None = None  # the registration loop's current lease
        self._synced_lease_id: str | None = None  # the lease the coordinator has a snapshot for
        self._wake = asyncio.Event()

    def new_lease(self, lease: NodeLease | None) -> None:
        self.lease = lease
        self._wake.set()

    async def run(self, session: aiohttp.ClientSession, base: str) -> None:
        backoff_s = self.interval_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), backoff_s)
            self._wake.clear()
            lease = self.lease
            if lease is None:
                continue
            try:
                await self._publish(session, base, lease)
                backoff_s = self.interval_s
            except Exception as e:
                # Posted again next time (events stay pending until acknowledged).
                logger.warning(
                    "posting cache events to %s failed (%s: %s); retrying in %.1f s",
                    base, type(e).__name__, e, min(backoff_s * 2, _MAX_RETRY_S),
                    exc_info=not isinstance(e, aiohttp.ClientError | TimeoutError),
                )  # fmt: skip
                backoff_s = min(backoff_s * 2, _MAX_RETRY_S)

    async def _publish(self, session: aiohttp.ClientSession, base: str, lease: NodeLease) -> None:
        while True:
            pending = self.events.pending(_MAX_EVENTS_PER_MESSAGE)
            if self._synced_lease_id != lease.lease_id or pending is None:
                seq, held = _bounded(*self.events.snapshot())
                message = CacheSnapshot(
                    node_id=lease.node_id, lease_id=lease.lease_id, seq=seq, held=held
                )
                sync = await self._post(session, f"{base}/internal/cache_snapshot", message)
                if sync is None or sync.needs_snapshot:
                    return
                self._synced_lease_id = lease.lease_id
                logger.info(
                    "cache snapshot sent to %s: %s blocks after event %d",
                    base, sum(map(len, held.values())), seq,
                )  # fmt: skip
                continue
            first_seq, events = pending
            if not events:
                return
            batch = CacheEventBatch(
                node_id=lease.node_id, lease_id=lease.lease_id, first_seq=first_seq, events=events
            )
            sync = await self._post(session, f"{base}/internal/cache_events", batch)
            if sync is None:
                return
            if sync.needs_snapshot:
                self._synced_lease_id = None
                continue
            self.events.acknowledge(sync.applied_seq)
            if len(events) < _MAX_EVENTS_PER_MESSAGE:
                return

    async def _post(
        self, session: aiohttp.ClientSession, url: str, message: CacheEventBatch | CacheSnapshot
    ) -> CacheSync | None:
        """The coordinator's answer; None when it does not hold our lease (the registration
        loop registers again and hands over the new lease)."""
        async with session.post(url, data=encode(message)) as r:
            if r.status in (403, 404):
                self._synced_lease_id = None
                return None
            r.raise_for_status()
            return decode(await r.read(), CacheSync)
