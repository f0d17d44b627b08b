"""The coordinator's view of every node's prefix cache, built from the nodes' event streams.

    node ──CacheEventBatch (first_seq, events)──▶ CacheIndex.apply   (/internal/cache_events)
         ◀──CacheSync (applied_seq | needs_snapshot)──
    node ──CacheSnapshot (seq, what each tier holds)──▶ CacheIndex.load (/internal/cache_snapshot)
    request ──prompt_keys(token ids, layout, cache_salt)──▶ CacheIndex.hit(node, keys) ─▶ PrefixHit

Per node: the sequence number applied last and the block keys (deepinfer/kv_cache/events.py
``block_key``) its device and host tiers hold. A disk tier is one set per (tier id, salt), shared
by the nodes that mount it: any of them storing or removing a file changes it for all, since any
of them reads any file there. A node starts (registers) with nothing applied: its first batch is
answered "needs snapshot", as is a batch that leaves a gap; a batch that repeats events already
applied (a retried post) applies only the new ones. A node that leaves (expires, is forgotten,
registers again) loses its entries; a disk tier's set goes with the last node mounting it.

``hit`` mirrors the node's own lookup (scheduler/prefix_reuse.py ``admit``): the longest prefix
of the prompt's full blocks (its last token excluded) on the device, then the run of blocks that
continues it in the host or disk tier. With every event applied and no request in flight there,
it is what the node will report as the request's cached tokens. Blocks of requests routed to a
node and still running count too (``hold``), apart (``PrefixHit.in_flight``): the node has them
once those prompts are computed, which a request queued behind them finds.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

from deepinfer.images import PromptImage, images_key
from deepinfer.kv_cache.events import CacheEvent, CacheLayout, block_key
from deepinfer.scheduler.prefix_cache import chain_root, hash_block

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixHit:
    """Prompt tokens a node would find in each tier of its cache; ``in_flight``: in blocks
    that requests routed there and still running have in their prompts, not yet published as
    stored (being computed, or their events on the way)."""

    device: int = 0
    host: int = 0
    disk: int = 0
    in_flight: int = 0

    @property
    def num_tokens(self) -> int:
        return self.device + self.host + self.disk + self.in_flight


NO_HIT = PrefixHit()


def prompt_keys(
    token_ids: Sequence[int],
    layout: CacheLayout,
    cache_salt: str | None,
    images: Sequence[PromptImage] = (),
) -> list[int]:
    """The block keys a node with ``layout`` looks up for a prompt: its full blocks before
    the last token (which is always computed). ``images``: the spans of a prompt whose images
    are grown to their positions (a block that overlaps one is keyed by its digest too)."""
    keys, parent = [], chain_root(layout.salt, cache_salt)
    bs = layout.block_size
    for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
        ids = token_ids[start : start + bs]
        parent = hash_block(parent, ids, images_key(images, start, start + bs))
        keys.append(block_key(parent))
    return keys


def walk_prefix(
    keys: Sequence[int],
    device: Container[int],
    in_flight: Container[int],
    host: Container[int],
    disk: Container[int],
    block_size: int,
) -> PrefixHit:
    """A node's lookup (scheduler/prefix_reuse.py ``admit``) on sets of block keys: the run of
    blocks on the device (or in flight there), then the run continuing it in host or disk."""
    num_device = num_in_flight = 0
    for key in keys:
        if key in device:
            num_device += 1
        elif key in in_flight:
            num_in_flight += 1
        else:
            break
    num_host = num_disk = 0
    for key in keys[num_device + num_in_flight :]:
        if key in host:
            num_host += 1
        elif key in disk:
            num_disk += 1
        else:
            break
    bs = block_size
    return PrefixHit(num_device * bs, num_host * bs, num_disk * bs, num_in_flight * bs)


@dataclass
class _DiskSet:
    keys: set[int] = field(default_factory=set)
    nodes: set[str] = field(default_factory=set)


@dataclass
class NodeCache:
    layout: CacheLayout
    disk: _DiskSet | None
    applied_seq: int | None = None  # None: the next message must be a snapshot
    device: set[int] = field(default_factory=set)
    host: set[int] = field(default_factory=set)
    in_flight: Counter[int] = field(default_factory=Counter)  # key -> requests routed there
    num_events: int = 0
    num_resyncs: int = 0

    def tier(self, name: str) -> set[int] | None:
        if name == "disk":
            return self.disk.keys if self.disk is not None else None
        return self.device if name == "device" else self.host


class CacheIndex:
    def __init__(self) -> None:
        self._nodes: dict[str, NodeCache] = {}
        self._disks: dict[tuple[str, bytes], _DiskSet] = {}

    def add(self, node_id: str, layout: CacheLayout | None) -> None:
        """A node (re)registered: it starts with nothing known (it sends a snapshot next)."""
        self.drop(node_id)
        if layout is None:
            return
        disk = None
        if layout.disk_tier_id:
            disk = self._disks.setdefault((layout.disk_tier_id, layout.salt), _DiskSet())
            disk.nodes.add(node_id)
        self._nodes[node_id] = NodeCache(layout, disk)

    def drop(self, node_id: str) -> None:
        """The node left: forget its entries (and its disk tier's, if it was the last there)."""
        node = self._nodes.pop(node_id, None)
        if node is None or node.disk is None:
            return
        node.disk.nodes.discard(node_id)
        if not node.disk.nodes:
            del self._disks[node.layout.disk_tier_id, node.layout.salt]

    def forget(self, node_id: str) -> None:
        """The node's entries may be stale (it missed heartbeats): keep its layout, drop its
        entries, and ask for a snapshot when it speaks again."""
        node = self._nodes.get(node_id)
        if node is not None:
            self.add(node_id, node.layout)

    def hold(self, node_id: str, keys: Sequence[int]) -> Callable[[], None]:
        """A request with these prompt blocks was routed to the node: count them as (about to
        be) there until the returned release is called, when the request ends. So requests
        sharing a prefix that arrive together find each other before any block is published."""
        node = self._nodes.get(node_id)
        if node is None or not keys:
            return lambda: None
        node.in_flight.update(keys)

        def release() -> None:
            node.in_flight.subtract(keys)
            for key in keys:
                if node.in_flight[key] <= 0:
                    del node.in_flight[key]

        return release

    def node(self, node_id: str) -> NodeCache | None:
        return self._nodes.get(node_id)

    def nodes(self) -> list[tuple[str, NodeCache]]:
        return list(self._nodes.items())

    # -- the nodes' messages ----------------------------------------------------------------

    def apply(self, node_id: str, first_seq: int, events: Sequence[CacheEvent]) -> int | None:
        """Apply a batch; returns the sequence number applied last, or None when the node must
        send a snapshot (none yet, or a gap before ``first_seq``)."""
        node = self._nodes.get(node_id)
        if node is None:
            return None
        if node.applied_seq is None or first_seq > node.applied_seq + 1:
            if node.applied_seq is not None:
                logger.info(
                    "node %s cache events: gap (applied up to %d, got %d on): resynchronizing",
                    node_id, node.applied_seq, first_seq,
                )  # fmt: skip
                node.applied_seq = None
            node.num_resyncs += 1
            return None
        for event in events[node.applied_seq + 1 - first_seq :]:
            keys = node.tier(event.tier)
            if keys is None:
                continue  # a disk event from a node that reported no disk tier
            if event.is_stored:
                keys.update(event.keys)
            else:
                keys.difference_update(event.keys)
            node.num_events += 1
        node.applied_seq = max(node.applied_seq, first_seq + len(events) - 1)
        return node.applied_seq

    def load(self, node_id: str, seq: int, held: dict[str, list[int]]) -> bool:
        """Replace what the node holds by a snapshot taken after its event ``seq``; False for
        a node that reported no cache. A disk tier's set only grows by it: the other nodes on
        it know files this one does not."""
        node = self._nodes.get(node_id)
        if node is None:
            return False
        node.device = set(held.get("device", ()))
        node.host = set(held.get("host", ()))
        if node.disk is not None:
            node.disk.keys.update(held.get("disk", ()))
        node.applied_seq = seq
        return True

    # -- routing ----------------------------------------------------------------------------

    def hit(self, node_id: str, keys: Sequence[int]) -> PrefixHit:
        """The prompt tokens (of ``prompt_keys`` for the node's layout) it would find."""
        node = self._nodes.get(node_id)
        if node is None or node.applied_seq is None:
            return NO_HIT
        disk = node.disk.keys if node.disk is not None else ()
        return walk_prefix(
            keys, node.device, node.in_flight, node.host, disk, node.layout.block_size
        )
