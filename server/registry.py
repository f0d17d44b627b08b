"""The coordinator's soft state about nodes: who is there, how loaded, who is in rotation.

    node ──NodeRegistration──▶ NodeRegistry.register   (POST /internal/register)
    node ──NodeHeartbeat─────▶ NodeRegistry.heartbeat  (POST /internal/heartbeat)
    monitor task ────────────▶ NodeRegistry.expire     (every node_probe_interval_s)
                          └──▶ NodeRegistry.probe      (static and unresponsive nodes' /ready)
    request ─────────────────▶ NodeRegistry.select     (a RoutingPolicy over the routes: nodes
                                                         in rotation, and a prefill/decode pair,
                                                         whose context the request fits)
    a failed request ────────▶ NodeRegistry.mark_unresponsive

A route is a mixed node, or a (prefill node, decode node) pair (server/pairing.py): the least
loaded of each role in rotation, paired per request. An encode node is no route: a request with
images is wrapped with one (``encoder``; server/encoding.py). A node is in rotation while all of
these hold: its heartbeats arrive (``is_ready``; a registered node that misses them for
``heartbeat_timeout_s`` is kept, so that its next heartbeat brings it back), it answered its
last request or probe (``is_responsive``: a node whose connection fails, or whose engine refuses
work, leaves at once and is probed back in), its engine turns (``load.is_healthy``, carried by
every heartbeat), and it is not draining. A heartbeat from a node never registered is refused so
that the node registers again. Static nodes (given at construction, e.g. the in-process node of
``deepinfer serve``) send no heartbeats: they are probed every interval instead.

Who may speak for a node id (every node holds the same node token, so the registry, not the
token, tells them apart):

- a registration may not take a static node's id, nor the id of a live node (heartbeats within
  ``heartbeat_timeout_s``) at another URL; the same URL again is that node restarted;
- each registration gets a fresh lease id, and only heartbeats carrying it count;
- at most ``max_nodes`` registered nodes: a new one replaces the longest-silent expired node,
  or is refused when none has expired.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Container, Iterator, Sequence
from contextlib import contextmanager

from deepinfer.config import SchedulerConfig
from deepinfer.images import PromptImage
from deepinfer.server.cache_index import NO_HIT, CacheIndex, PrefixHit, prompt_keys
from deepinfer.server.pairing import PairedBackend, PairKeys, PairObserver
from deepinfer.server.protocol import NodeHeartbeat, NodeRegistration
from deepinfer.server.routing import (
    LeastLoadedPolicy,
    NodeBackend,
    NodeEntry,
    PairingPolicy,
    RouteRequest,
    RoutingPolicy,
    make_pairing,
)

logger = logging.getLogger(__name__)

BackendFactory = Callable[[str], NodeBackend]  # node URL -> backend
_PAIRED = ("prefill", "decode")


class UnknownNodeError(KeyError):
    """A heartbeat from a node that is not registered."""


class NoReadyNodeError(RuntimeError):
    """No node is in rotation."""


class NoFittingNodeError(ValueError):
    """Nodes are in rotation, but the request is longer than every one's context limit."""


class IdentityConflictError(Exception):
    """A registration for a node id that a static or another live node holds."""


class RegistryFullError(Exception):
    """A registration beyond ``max_nodes`` while every registered node is live."""


class WrongLeaseError(Exception):
    """A heartbeat for a node id without that node's current lease."""


class NodeRegistry:
    def __init__(
        self,
        heartbeat_timeout_s: float,
        backend_factory: BackendFactory | None = None,
        policy: RoutingPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        probe_timeout_s: float = 5.0,
        max_nodes: int = 256,
        pairing: PairingPolicy | None = None,
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.max_nodes = max_nodes
        self.backend_factory = backend_factory
        self.policy: RoutingPolicy = policy or LeastLoadedPolicy()
        self._clock = clock
        self._nodes: dict[str, NodeEntry] = {}
        self.pair_keys = PairKeys()
        self.pairing: PairingPolicy = pairing or make_pairing(self.policy)
        self.cache_index = CacheIndex()  # what registered nodes' prefix caches hold
        self.pair_observer: PairObserver | None = None  # the coordinator's metrics

    # ---- membership -----------------------------------------------------------------------

    def add_static(
        self,
        node_id: str,
        backend: NodeBackend,
        max_model_len: int,
        max_num_seqs: int = SchedulerConfig.max_num_seqs,
        role: str = "mixed",
    ) -> NodeEntry:
        entry = NodeEntry(node_id, backend, max_model_len, max_num_seqs, role=role, is_static=True)
        self._nodes[node_id] = entry
        logger.info(
            "static %s node %s in rotation (max_model_len=%d)", role, node_id, max_model_len
        )
        return entry

    def register(self, registration: NodeRegistration) -> NodeEntry:
        """Add a node, or refresh one that registers again (restarted, or expired and back);
        the entry's ``lease_id`` is new either way.

        Raises ValueError (a malformed registration, or this registry makes no backends),
        IdentityConflictError, RegistryFullError.
        """
        _check_registration(registration)
        entry = self._nodes.get(registration.node_id)
        self._check_identity(entry, registration)
        if entry is None or entry.url != registration.url:
            if self.backend_factory is None:
                raise ValueError("this coordinator takes no node registrations (static nodes only)")
            if entry is None:
                self._make_room()
            backend = self.backend_factory(registration.url)
            if entry is None:
                entry = NodeEntry(registration.node_id, backend, registration.max_model_len)
                self._nodes[registration.node_id] = entry
            entry.backend = backend
        # Updated in place: requests in flight hold this entry and count themselves off it.
        self.pair_keys.renew_node(entry.node_id)  # a restarted node's pairs are new
        entry.lease_id = secrets.token_urlsafe(16)
        entry.max_model_len = registration.max_model_len
        entry.max_num_seqs = registration.max_num_seqs
        entry.role = registration.role
        entry.model = registration.model
        entry.url = registration.url
        entry.load = registration.load
        entry.instance_id = registration.instance_id
        entry.rank, entry.num_ranks = registration.rank, registration.num_ranks
        entry.last_heartbeat = self._clock()
        entry.is_ready = True
        entry.is_responsive = True
        self.cache_index.add(entry.node_id, registration.cache)  # known once its snapshot arrives
        logger.info(
            "node %s registered: %s role=%s model=%s max_model_len=%d",
            entry.node_id,
            entry.url,
            entry.role,
            entry.model,
            entry.max_model_len,
        )
        return entry

    def _check_identity(self, entry: NodeEntry | None, registration: NodeRegistration) -> None:
        if entry is None:
            return
        if entry.is_static:
            raise IdentityConflictError(f"node id {entry.node_id!r} belongs to a static node")
        if entry.url != registration.url and self._is_live(entry):
            raise IdentityConflictError(
                f"node id {entry.node_id!r} is held by a live node at another URL; give this "
                "node another node.node_id"
            )

    def _is_live(self, entry: NodeEntry) -> bool:
        return self._clock() - entry.last_heartbeat <= self.heartbeat_timeout_s

    def _make_room(self) -> None:
        registered = [n for n in self._nodes.values() if not n.is_static]
        if len(registered) < self.max_nodes:
            return
        expired = [n for n in registered if not self._is_live(n)]
        if not expired:
            raise RegistryFullError(
                f"the node registry is full: {len(registered)} live nodes "
                f"(server.max_registered_nodes = {self.max_nodes})"
            )
        oldest = min(expired, key=lambda n: n.last_heartbeat)
        del self._nodes[oldest.node_id]
        self.cache_index.drop(oldest.node_id)
        logger.info("node %s forgotten to make room for a new registration", oldest.node_id)

    def holder(self, node_id: str, lease_id: str) -> NodeEntry:
        """The registered node that ``lease_id`` speaks for. Raises UnknownNodeError (register
        first) or WrongLeaseError."""
        entry = self._nodes.get(node_id)
        if entry is None:
            raise UnknownNodeError(node_id)
        if entry.is_static or not secrets.compare_digest(entry.lease_id, lease_id):
            raise WrongLeaseError(node_id)
        return entry

    def heartbeat(self, heartbeat: NodeHeartbeat) -> NodeEntry:
        """Raises UnknownNodeError (register first) or WrongLeaseError."""
        entry = self.holder(heartbeat.node_id, heartbeat.lease_id)
        if heartbeat.load.is_healthy != entry.load.is_healthy:
            if heartbeat.load.is_healthy:
                logger.info("node %s reports its engine healthy again", entry.node_id)
            else:
                logger.warning("node %s reports its engine failed: out of rotation", entry.node_id)
        entry.load = heartbeat.load
        entry.last_heartbeat = self._clock()
        if not entry.is_ready:
            logger.info("node %s heartbeats again", entry.node_id)
            entry.is_ready = True
            self.pair_keys.renew_node(entry.node_id)
        return entry

    def mark_unresponsive(self, entry: NodeEntry, reason: str) -> None:
        """A request found the node unreachable or refusing work: out of rotation until a
        probe finds it ready."""
        if entry.is_responsive:
            logger.warning("node %s out of rotation (%s); probing it", entry.node_id, reason)
            entry.is_responsive = False

    async def probe(self) -> None:
        """Ask the static nodes and the unresponsive ones whether they are ready (concurrently,
        each bounded by ``probe_timeout_s``), and set ``is_responsive`` from the answer."""
        entries = [e for e in self._nodes.values() if e.is_static or not e.is_responsive]
        answers = await asyncio.gather(*(self._probe(e) for e in entries))
        for entry, is_ready in zip(entries, answers, strict=True):
            if is_ready and not entry.is_responsive:
                logger.info("node %s answers its probe: back in rotation", entry.node_id)
                self.pair_keys.renew_node(entry.node_id)  # it may have restarted meanwhile
            elif not is_ready and entry.is_responsive:
                logger.warning("node %s is not ready when probed: out of rotation", entry.node_id)
            entry.is_responsive = is_ready

    async def _probe(self, entry: NodeEntry) -> bool:
        try:
            return await asyncio.wait_for(entry.backend.ready(), self.probe_timeout_s)
        except TimeoutError:
            return False
        except Exception as e:
            # A backend bug must not stop the monitor: the node just stays out of rotation.
            logger.warning("probing node %s failed: %s: %s", entry.node_id, type(e).__name__, e)
            return False

    def expire(self) -> list[str]:
        """Take nodes whose last heartbeat is too old out of rotation; return their ids."""
        now = self._clock()
        expired = []
        for entry in self._nodes.values():
            if entry.is_static or not entry.is_ready:
                continue
            if now - entry.last_heartbeat > self.heartbeat_timeout_s:
                entry.is_ready = False
                expired.append(entry.node_id)
                self.cache_index.forget(entry.node_id)  # resynchronized if it comes back
                logger.warning(
                    "node %s missed heartbeats for %.1f s: out of rotation",
                    entry.node_id,
                    now - entry.last_heartbeat,
                )
        return expired

    # ---- queries ------------------------------------------------------------------------------

    @property
    def nodes(self) -> Sequence[NodeEntry]:
        return list(self._nodes.values())

    def ready_nodes(self) -> list[NodeEntry]:
        """The nodes in rotation whose instance has every rank in rotation (a rank alone
        cannot serve: its steps need the others')."""
        in_rotation = [n for n in self._nodes.values() if n.is_in_rotation]
        return [n for n in in_rotation if n.instance not in self.instances_not_ready()]

    def instances_not_ready(self) -> dict[str, str]:
        """Lock-step instances that cannot serve, and why (their first missing or failed rank)."""
        ranks: dict[str, dict[int, NodeEntry]] = {}
        sizes: dict[str, int] = {}
        for node in self._nodes.values():
            if node.num_ranks > 1:
                ranks.setdefault(node.instance, {})[node.rank] = node
                sizes[node.instance] = max(sizes.get(node.instance, 1), node.num_ranks)
        down = {}
        for instance, by_rank in ranks.items():
            for rank in range(sizes[instance]):
                node = by_rank.get(rank)
                if node is None:
                    down[instance] = f"rank {rank} of {sizes[instance]} has not registered"
                    break
                if not node.is_in_rotation:
                    down[instance] = f"rank {rank} ({node.node_id}) is out of rotation"
                    break
        return down

    def routes(
        self, exclude: Container[str] = (), request: RouteRequest | None = None
    ) -> list[NodeEntry]:
        """Where ``request`` can go: every mixed node ready, and the pair the pairing policy
        makes of the prefill and decode nodes ready whose context it fits (none of them in
        ``exclude``). No request: where any request could."""
        request = request or RouteRequest((), 0)
        ready = [n for n in self.ready_nodes() if n.node_id not in exclude]
        routes = [n for n in ready if n.role == "mixed"]
        fits = [n for n in ready if n.max_model_len >= request.num_tokens]
        for nodes in (fits, ready):  # a pair that does not fit: refused as too long
            prefill = [n for n in nodes if n.role == "prefill"]
            decode = [n for n in nodes if n.role == "decode"]
            if prefill and decode:
                routes.append(self._pair(*self.pairing.pair(prefill, decode, request)))
                break
        return routes

    def route_request(
        self,
        prompt_token_ids: Sequence[int],
        num_tokens: int,
        cache_salt: str | None = None,
        *,
        looks_up: bool = True,
        images: Sequence[PromptImage] = (),
    ) -> RouteRequest:
        """A request as the policies see it, its hit on each node from the cache index (the
        prompt hashed once per block layout). ``looks_up`` False: the node computes every
        prompt token (it asks for prompt logprobs), so no node has a hit. ``images``: the
        spans of a prompt given with its images grown to their positions."""
        keys_by_layout: dict[tuple[bytes, int], list[int]] = {}
        hits: dict[str, PrefixHit] = {}

        def keys(node: NodeEntry) -> list[int]:
            cache = self.cache_index.node(node.node_id)
            if cache is None:
                return []
            name = (cache.layout.salt, cache.layout.block_size)
            if name not in keys_by_layout:
                keys_by_layout[name] = prompt_keys(
                    prompt_token_ids, cache.layout, cache_salt, images
                )
            return keys_by_layout[name]

        def hit(route: NodeEntry) -> PrefixHit:
            node = route.members[0] if route.members else route  # a pair: its prefill node
            if not looks_up:
                return NO_HIT
            if node.node_id not in hits:
                hits[node.node_id] = self.cache_index.hit(node.node_id, keys(node))
            return hits[node.node_id]

        def hold(route: NodeEntry) -> Callable[[], None]:
            node = route.members[0] if route.members else route
            return self.cache_index.hold(node.node_id, keys(node))

        return RouteRequest(prompt_token_ids, num_tokens, hit, hold)

    def _pair(self, p: NodeEntry, d: NodeEntry) -> NodeEntry:
        return NodeEntry(
            f"{p.node_id}+{d.node_id}",
            PairedBackend(p, d, self.pair_keys, self.pair_observer),
            min(p.max_model_len, d.max_model_len),
            d.max_num_seqs,
            role="pair",
            is_static=True,
            load=d.load,
            num_inflight=max(p.num_inflight, d.num_inflight),
            members=(p, d),
        )

    def serving_nodes(self) -> list[NodeEntry]:
        """The ready nodes some route uses (a prefill or decode node: while the other role
        has a ready node too)."""
        ready = self.ready_nodes()
        roles = {n.role for n in ready}
        pairs = {"prefill", "decode"} <= roles
        return [n for n in ready if n.role == "mixed" or (pairs and n.role in _PAIRED)]

    def encoder(self, exclude: Container[str] = ()) -> NodeEntry | None:
        """The encode node in rotation (not in ``exclude``) with the fewest images to encode,
        this coordinator's requests there first; None: requests encode where they run."""
        encoders = [
            n for n in self.ready_nodes() if n.role == "encode" and n.node_id not in exclude
        ]
        if not encoders:
            return None
        return min(encoders, key=lambda n: (n.num_inflight, n.load.num_waiting, n.node_id))

    @property
    def has_ready_node(self) -> bool:
        return bool(self.routes())

    def max_model_len(self) -> int:
        """The longest context a request may ask for: the largest of the routes' (``select``
        then picks one whose limit the request fits). Raises NoReadyNodeError."""
        routes = self.routes()
        if not routes:
            raise NoReadyNodeError("no node is ready")
        return max(n.max_model_len for n in routes)

    def has_candidate(self, request: RouteRequest, exclude: Container[str] = ()) -> bool:
        """Whether ``select(request, exclude)`` would find a node."""
        try:
            return bool(self._candidates(request, exclude))
        except (NoReadyNodeError, NoFittingNodeError):
            return False

    def max_num_seqs(self) -> int:
        """How many requests the serving nodes run at once, all together (0: none is ready);
        a pair's run on its decode node."""
        return sum(n.max_num_seqs for n in self.serving_nodes() if n.role != "prefill")

    @contextmanager
    def select(self, request: RouteRequest, exclude: Container[str] = ()) -> Iterator[NodeEntry]:
        """Pick a node for ``request`` among those in rotation whose context its
        ``num_tokens`` (prompt + the most it may generate) fits, not in ``exclude``, and count
        the request against it while the block runs. Raises NoReadyNodeError (none in
        rotation, or all excluded) or NoFittingNodeError (every limit is too small)."""
        fitting = self._candidates(request, exclude)
        entry = self.policy.select(fitting, request)
        counted = (entry, *entry.members)
        for node in counted:
            node.num_inflight += 1
        request.hit(entry)  # what it finds there without itself (memoized for the metrics)
        release = request.hold(entry)
        try:
            yield entry
        finally:
            release()
            for node in counted:
                node.num_inflight -= 1

    def _candidates(self, request: RouteRequest, exclude: Container[str]) -> list[NodeEntry]:
        """The routes (none of whose nodes is in ``exclude``) whose context the request's
        ``num_tokens`` fits (never empty). Raises NoReadyNodeError or NoFittingNodeError."""
        num_tokens = request.num_tokens
        ready = self.routes(exclude, request)
        if not ready:
            raise NoReadyNodeError("no node is ready")
        fitting = [n for n in ready if n.max_model_len >= num_tokens]
        pairs = [n for n in fitting if n.members]
        if pairs:  # prefill/decode nodes first; mixed nodes when no pair is ready
            return pairs
        if not fitting:
            raise NoFittingNodeError(
                f"This model's maximum context length is "
                f"{max(n.max_model_len for n in ready)} tokens. However, you requested "
                f"{num_tokens} tokens. Please reduce the length of the prompt or completion."
            )
        return fitting


_MAX_NODE_ID_CHARS = 128


def _check_registration(registration: NodeRegistration) -> None:
    node_id, url = registration.node_id, registration.url
    if not 0 < len(node_id) <= _MAX_NODE_ID_CHARS or not node_id.isprintable():
        raise ValueError(f"node_id must be 1 to {_MAX_NODE_ID_CHARS} printable characters")
    if not url.startswith(("http://", "https://")):
        raise ValueError("url must be an http:// or https:// URL")
    for key in ("max_model_len", "max_num_seqs", "num_ranks"):
        if getattr(registration, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(registration, key)}")
    if not 0 <= registration.rank < registration.num_ranks:
        last = registration.num_ranks - 1
        raise ValueError(f"rank must be in 0..{last}, got {registration.rank}")
