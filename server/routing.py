"""How the coordinator talks to nodes, what it knows of each, and which node gets a request.

    coordinator ──NodeBackend.generate(GenerateRequest)──▶ node   (TokenDelta per engine step)
                ──NodeBackend.abort([request_id])───────▶ node   (client gone, timeout, drain)
                ──NodeBackend.finish(request_id, stop)──▶ node   (a stop string matched on text)

``NodeBackend`` is what the coordinator needs from a node: ``server/node_client.py``'s
``NodeClient`` implements it over HTTP, the in-process ``serve`` implements it directly,
server/pairing.py's ``PairedBackend`` over a prefill and a decode node, and tests use scripted
fakes. ``NodeEntry`` is one node with its backend and load, as server/registry.py keeps it (or
a pair of them, made per request). ``RoutingPolicy`` picks one of the routes for a
``RouteRequest``: ``RoundRobinPolicy``, ``LeastLoadedPolicy`` or ``CacheAwarePolicy``
([routing] policy); ``PairingPolicy`` makes the pair of a prefill/decode route. The fleet
simulator runs the same policies on simulated nodes.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from deepinfer.config import RoutingConfig, SchedulerConfig
from deepinfer.server.cache_index import NO_HIT, PrefixHit
from deepinfer.server.protocol import GenerateRequest, NodeLoad, TokenDelta


class NodeError(Exception):
    """A node refused or failed a request; ``status`` is the HTTP status the API should answer
    (e.g. 400 for an unsupported output constraint, 503 for a node shutting down).

    ``is_node_failure``: the node itself failed, not the request (unreachable, the connection
    broke, its engine stopped or is draining): it leaves rotation, and a request that got no
    token yet may be retried on another node."""

    def __init__(self, status: int, message: str, *, is_node_failure: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.is_node_failure = is_node_failure
        # Which node failed, when the backend spans several (a prefill/decode pair): None is
        # the request's node.
        self.node: NodeEntry | None = None


@runtime_checkable
class NodeBackend(Protocol):
    """One node, as the coordinator sees it."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream the request's token deltas, one per engine step; the last one has
        ``finish_reason`` set. Raises ``NodeError`` when the node refuses or fails the request
        (before the first delta or mid-stream). Closing the iterator early does not end the
        request on the node: call ``abort`` or ``finish``."""
        ...

    async def abort(self, request_ids: Sequence[str]) -> None:
        """End these requests now and free their KV blocks; unknown ids are ignored."""
        ...

    async def finish(self, request_id: str, stop_reason: int | str | None) -> None:
        """End a request as finished with reason "stop" (a stop string matched on the
        coordinator's text side); ``stop_reason`` is the matched string when known."""
        ...

    async def ready(self) -> bool:
        """Whether the node takes requests now (its engine turns, it is not draining); False
        when it cannot be reached. The registry probes static and unresponsive nodes with it."""
        ...


@dataclass
class NodeEntry:
    """One node as the registry keeps it (server/registry.py) and a RoutingPolicy weighs it.
    ``num_inflight`` counts this coordinator's requests there."""

    node_id: str
    backend: NodeBackend
    max_model_len: int
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    role: str = "mixed"
    model: str = ""
    url: str = ""
    is_static: bool = False
    lease_id: str = ""
    load: NodeLoad = field(default_factory=NodeLoad)
    instance_id: str = ""  # the lock-step instance it is a rank of ("": its own)
    rank: int = 0
    num_ranks: int = 1
    last_heartbeat: float = 0.0
    is_ready: bool = True  # heartbeats arrive (static nodes: always)
    is_responsive: bool = True  # its last request or probe reached it and found it ready
    num_inflight: int = 0
    # A prefill node: prompt tokens of this coordinator's requests there not computed yet.
    num_prefill_tokens_inflight: int = 0
    # A prefill/decode pair (server/pairing.py): its two nodes, which count its requests too.
    members: tuple[NodeEntry, ...] = ()

    @property
    def is_in_rotation(self) -> bool:
        """It takes requests (a prefill or decode node: as one of a pair)."""
        return (
            self.is_ready
            and self.is_responsive
            and self.load.is_healthy
            and not self.load.is_draining
        )

    @property
    def instance(self) -> str:
        """The instance this node serves in: its ranks are routed to together."""
        return self.instance_id or self.node_id

    @property
    def load_score(self) -> int:
        return max(self.num_inflight, self.load.num_running + self.load.num_waiting)


@dataclass
class RouteRequest:
    """What a policy knows of the request it routes. Producer: NodeRegistry.route_request
    (the coordinator) or the fleet simulator; ``hit(node)`` is the prompt's prefix that node
    would find in its cache (a pair: its prefill node's), memoized per node."""

    prompt_token_ids: Sequence[int]
    num_tokens: int  # prompt + the most it may generate: the context a route must fit
    hit: Callable[[NodeEntry], PrefixHit] = lambda node: NO_HIT
    # The request goes to this route: count its prompt's blocks there until the returned
    # release is called (the request ended).
    hold: Callable[[NodeEntry], Callable[[], None]] = lambda node: _no_release

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def _no_release() -> None:
    pass


class RoutingPolicy(Protocol):
    def select(self, candidates: Sequence[NodeEntry], request: RouteRequest) -> NodeEntry:
        """Pick one of ``candidates`` (non-empty, all ready) for a new request. Candidates may
        be ranks of lock-step instances (``instance``, ``rank``): the choice is of both."""
        ...


class PairingPolicy(Protocol):
    def pair(
        self, prefill: Sequence[NodeEntry], decode: Sequence[NodeEntry], request: RouteRequest
    ) -> tuple[NodeEntry, NodeEntry]:
        """Pick a prefill node and a decode node (both non-empty, all ready) for a request."""
        ...


class LeastLoadedPairing:
    """The prefill node with the fewest prompt tokens still to compute (the larger of this
    coordinator's there and what the node last reported: it includes other coordinators'), or
    the one ``prefill_policy`` picks; and the decode node with the most KV room (its share of
    free blocks), then the fewest requests; ties to the lower id."""

    def __init__(self, prefill_policy: RoutingPolicy | None = None) -> None:
        self.prefill_policy = prefill_policy

    def pair(
        self, prefill: Sequence[NodeEntry], decode: Sequence[NodeEntry], request: RouteRequest
    ) -> tuple[NodeEntry, NodeEntry]:
        assert prefill and decode, "pair() needs a prefill node and a decode node"
        if self.prefill_policy is not None:
            p = self.prefill_policy.select(prefill, request)
        else:
            p = min(prefill, key=lambda n: (pending_prefill_tokens(n), n.node_id))
        d = min(decode, key=lambda n: (-kv_room(n), n.load_score, n.node_id))
        return p, d


def pending_prefill_tokens(node: NodeEntry) -> int:
    return max(node.num_prefill_tokens_inflight, node.load.num_prefill_tokens)


def kv_room(node: NodeEntry) -> float:
    """The share of a node's KV blocks free when it last reported (1.0 when it never did)."""
    total = node.load.num_total_blocks
    return node.load.num_free_blocks / total if total else 1.0


class RoundRobinPolicy:
    """Each node in turn (in id order), whatever its load or cache."""

    def __init__(self) -> None:
        self._turn = 0

    def select(self, candidates: Sequence[NodeEntry], request: RouteRequest) -> NodeEntry:
        assert candidates, "select() needs at least one ready node"
        ordered = sorted(candidates, key=lambda n: n.node_id)
        node = ordered[self._turn % len(ordered)]
        self._turn += 1
        return node


class LeastLoadedPolicy:
    """The least loaded instance, then its least loaded rank (one node: both are the node).

    A node's load is the larger of the requests this coordinator has in flight there (exact,
    immediate) and what the node last reported (running + waiting; it includes other
    coordinators' requests but is one heartbeat old); an instance's is its ranks' mean. Ties go
    to more free KV blocks, then to the lower id, so that the choice is deterministic.
    """

    def select(self, candidates: Sequence[NodeEntry], request: RouteRequest) -> NodeEntry:
        assert candidates, "select() needs at least one ready node"
        instances: dict[str, list[NodeEntry]] = {}
        for node in candidates:
            instances.setdefault(node.instance, []).append(node)

        def instance_key(item: tuple[str, list[NodeEntry]]) -> tuple:
            name, ranks = item
            load = sum(n.load_score for n in ranks) / len(ranks)
            return (load, -sum(n.load.num_free_blocks for n in ranks), name)

        _, ranks = min(instances.items(), key=instance_key)
        return min(ranks, key=lambda n: (n.load_score, -n.load.num_free_blocks, n.node_id))


class CacheAwarePolicy:
    """The node (or rank: each has its own cache) of least cost among those within the load
    guard (config.py RoutingConfig says how both are weighed); equal costs to the node nearest
    on a hash ring to the prompt's first ``affinity_tokens`` tokens, so that prompts beginning
    alike (a conversation's turns) land together, and a node joining or leaving moves only its
    share of them. ``num_guarded``: requests whose cheapest nodes were all
    left out by the guard."""

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self.num_guarded = 0

    def cost(self, node: NodeEntry, request: RouteRequest) -> float:
        c = self.config
        hit = request.hit(node)
        uncached = max(0, request.num_prompt_tokens - hit.num_tokens)
        work = uncached + c.host_hit_cost * hit.host + c.disk_hit_cost * hit.disk
        return work + pending_prefill_tokens(node) + c.request_cost_tokens * node.load_score

    def within_guard(self, candidates: Sequence[NodeEntry]) -> list[NodeEntry]:
        """The nodes whose load is not too far above the least loaded one's."""
        c, least = self.config, min(n.load_score for n in candidates)
        abs_bound, ratio_bound = least + c.balance_abs_requests, c.balance_ratio * least
        return [n for n in candidates if n.load_score <= abs_bound or n.load_score <= ratio_bound]

    def select(self, candidates: Sequence[NodeEntry], request: RouteRequest) -> NodeEntry:
        assert candidates, "select() needs at least one ready node"
        costs = {id(n): self.cost(n, request) for n in candidates}
        guarded = self.within_guard(candidates)
        best = min(costs[id(n)] for n in guarded)
        if min(costs.values()) < best:
            self.num_guarded += 1  # the cheapest nodes were all too loaded
        tied = [n for n in guarded if costs[id(n)] == best]
        if len(tied) == 1:
            return tied[0]
        point = self.affinity_point(request)
        return min(tied, key=lambda n: (ring_distance(point, n.node_id), n.node_id))

    def affinity_point(self, request: RouteRequest) -> int:
        """Where the request's first ``affinity_tokens`` tokens fall on the hash ring."""
        head = request.prompt_token_ids[: self.config.affinity_tokens]
        return _hash64(struct.pack(f"<{len(head)}I", *head))


RING_POINTS_PER_NODE = 16  # each node's points on the tie-break's ring: even shares


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=1 << 16)
def ring_points(node_id: str) -> tuple[int, ...]:
    """A node's points on the ring (consistent hashing with virtual nodes), sorted."""
    return tuple(sorted(_hash64(f"{node_id}#{i}".encode()) for i in range(RING_POINTS_PER_NODE)))


def ring_distance(point: int, node_id: str) -> int:
    """How far clockwise from ``point`` the node's nearest point is: among tied nodes the
    nearest wins, so a node joining or leaving moves only the prompts next to its points."""
    points = ring_points(node_id)
    i = bisect.bisect_left(points, point)
    return (points[i] if i < len(points) else points[0] + 2**64) - point


def make_policy(config: RoutingConfig) -> RoutingPolicy:
    """config.toml's [routing] policy."""
    if config.policy == "round_robin":
        return RoundRobinPolicy()
    if config.policy == "least_loaded":
        return LeastLoadedPolicy()
    return CacheAwarePolicy(config)


def make_pairing(policy: RoutingPolicy) -> PairingPolicy:
    """Prefill nodes chosen by a cache-aware policy (a prompt's hit is on its prefill node),
    else by the prompt tokens they have yet to compute."""
    return LeastLoadedPairing(policy if isinstance(policy, CacheAwarePolicy) else None)
