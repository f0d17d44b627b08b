"""The coordinator's soft state about nodes: who is there, how loaded, who is in rotation.

    node ──NodeRegistration──▶ NodeRegistry.register   (POST /internal/register)
    node ──NodeHeartbeat─────▶ NodeRegistry.heartbeat  (POST /internal/heartbeat)
    reaper task ─────────────▶ NodeRegistry.expire     (every heartbeat_timeout_s / 4)
    request ─────────────────▶ NodeRegistry.select     (a RoutingPolicy over the ready nodes)

A registered node that misses heartbeats for ``heartbeat_timeout_s`` is taken out of rotation
(kept, so that its next heartbeat brings it back); a heartbeat from a node never registered is
refused so that the node registers again. Static nodes (given at construction, e.g. the
in-process node of ``deepinfer serve``) never expire.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from deepinfer.server.protocol import NodeHeartbeat, NodeLoad, NodeRegistration
from deepinfer.server.routing import LeastLoadedPolicy, NodeBackend, RoutingPolicy

logger = logging.getLogger(__name__)

BackendFactory = Callable[[str], NodeBackend]  # node URL -> backend


class UnknownNodeError(KeyError):
    """A heartbeat from a node that is not registered."""


class NoReadyNodeError(RuntimeError):
    """No node is in rotation."""


@dataclass
class NodeEntry:
    """One node in the registry. ``num_inflight`` counts this coordinator's requests there."""

    node_id: str
    backend: NodeBackend
    max_model_len: int
    role: str = "mixed"
    model: str = ""
    url: str = ""
    is_static: bool = False
    load: NodeLoad = field(default_factory=NodeLoad)
    last_heartbeat: float = 0.0
    is_ready: bool = True
    num_inflight: int = 0

    @property
    def load_score(self) -> int:
        return max(self.num_inflight, self.load.num_running + self.load.num_waiting)


class NodeRegistry:
    def __init__(
        self,
        heartbeat_timeout_s: float,
        backend_factory: BackendFactory | None = None,
        policy: RoutingPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.backend_factory = backend_factory
        self.policy: RoutingPolicy = policy or LeastLoadedPolicy()
        self._clock = clock
        self._nodes: dict[str, NodeEntry] = {}

    # ---- membership -----------------------------------------------------------------------

    def add_static(self, node_id: str, backend: NodeBackend, max_model_len: int) -> NodeEntry:
        entry = NodeEntry(node_id, backend, max_model_len, is_static=True)
        self._nodes[node_id] = entry
        logger.info("static node %s in rotation (max_model_len=%d)", node_id, max_model_len)
        return entry

    def register(self, registration: NodeRegistration) -> NodeEntry:
        """Add a node, or refresh one that registers again (restarted, or expired and back).

        Raises ValueError when this registry makes no backends (static nodes only).
        """
        entry = self._nodes.get(registration.node_id)
        if entry is None or entry.url != registration.url:
            if self.backend_factory is None:
                raise ValueError("this coordinator takes no node registrations (static nodes only)")
            backend = self.backend_factory(registration.url)
            if entry is None:
                entry = NodeEntry(registration.node_id, backend, registration.max_model_len)
                self._nodes[registration.node_id] = entry
            entry.backend = backend
        # Updated in place: requests in flight hold this entry and count themselves off it.
        entry.max_model_len = registration.max_model_len
        entry.role = registration.role
        entry.model = registration.model
        entry.url = registration.url
        entry.load = registration.load
        entry.last_heartbeat = self._clock()
        entry.is_ready = True
        logger.info(
            "node %s registered: %s role=%s model=%s max_model_len=%d",
            entry.node_id,
            entry.url,
            entry.role,
            entry.model,
            entry.max_model_len,
        )
        return entry

    def heartbeat(self, heartbeat: NodeHeartbeat) -> NodeEntry:
        entry = self._nodes.get(heartbeat.node_id)
        if entry is None:
            raise UnknownNodeError(heartbeat.node_id)
        entry.load = heartbeat.load
        entry.last_heartbeat = self._clock()
        if not entry.is_ready:
            logger.info("node %s is back in rotation", entry.node_id)
            entry.is_ready = True
        return entry

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
        # Prefill/decode nodes join once P/D pairing exists; today only mixed nodes serve alone.
        return [
            n
            for n in self._nodes.values()
            if n.is_ready and n.role == "mixed" and not n.load.is_draining
        ]

    @property
    def has_ready_node(self) -> bool:
        return bool(self.ready_nodes())

    def max_model_len(self) -> int:
        """The context limit a request must fit: the smallest of the ready nodes', so that any
        of them can take it. Raises NoReadyNodeError."""
        ready = self.ready_nodes()
        if not ready:
            raise NoReadyNodeError("no node is ready")
        return min(n.max_model_len for n in ready)

    @contextmanager
    def select(self, num_prompt_tokens: int) -> Iterator[NodeEntry]:
        """Pick a node and count the request against it while the block runs."""
        ready = self.ready_nodes()
        if not ready:
            raise NoReadyNodeError("no node is ready")
        entry = self.policy.select(ready, num_prompt_tokens)
        entry.num_inflight += 1
        try:
            yield entry
        finally:
            entry.num_inflight -= 1
