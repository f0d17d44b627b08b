"""The coordinator's parts alone: admission queue, routing policy, node registry, SSE error
events, and `deepinfer coordinator` exiting 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time

import aiohttp
import msgspec
import pytest
from coordinator_fakes import TOKENIZER_PATH, FakeBackend
from processes import free_port

from deepinfer.server.admission import AdmissionController, DrainingError, QueueFullError
from deepinfer.server.errors import ApiError, ErrorFlavor, sse_error_event
from deepinfer.server.protocol import NodeHeartbeat, NodeLoad, NodeRegistration
from deepinfer.server.registry import (
    IdentityConflictError,
    NodeRegistry,
    NoFittingNodeError,
    NoReadyNodeError,
    RegistryFullError,
    WrongLeaseError,
)
from deepinfer.server.routing import LeastLoadedPolicy, NodeEntry, RouteRequest

# ---- admission -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_admission_is_fifo_bounded_and_cancellable() -> None:
    admission = AdmissionController(
        max_running=1, max_queued_requests=2, max_queued_prompt_tokens=100
    )
    order: list[str] = []
    release_a = asyncio.Event()

    async def run(name: str, num_tokens: int, hold: asyncio.Event | None = None) -> None:
        async with admission.admit(num_tokens):
            order.append(name)
            if hold is not None:
                await hold.wait()

    a = asyncio.create_task(run("a", 10, release_a))
    await asyncio.sleep(0)
    b = asyncio.create_task(run("b", 40))
    c = asyncio.create_task(run("c", 50))
    await asyncio.sleep(0)
    assert (admission.num_running, admission.num_waiting, admission.num_waiting_tokens) == (
        1,
        2,
        90,
    )
    with pytest.raises(QueueFullError, match="2 already waiting"):
        async with admission.admit(1):
            pass
    c.cancel()  # a waiter that gives up leaves the queue and its tokens
    await asyncio.sleep(0)
    assert (admission.num_waiting, admission.num_waiting_tokens) == (1, 40)
    with pytest.raises(QueueFullError, match="40 waiting \\+ 61 in this request"):
        async with admission.admit(61):
            pass
    d = asyncio.create_task(run("d", 60))
    await asyncio.sleep(0)
    release_a.set()
    await asyncio.gather(a, b, d)
    assert order == ["a", "b", "d"]  # slots pass to the oldest waiter
    assert (admission.num_running, admission.num_waiting, admission.num_waiting_tokens) == (0, 0, 0)
    assert await admission.wait_idle(0.1) is True
    admission.start_draining()
    with pytest.raises(DrainingError):
        async with admission.admit(1):
            pass


# ---- routing and the registry -----------------------------------------------------------------


def _route(num_tokens: int) -> RouteRequest:
    """A request of ``num_tokens`` positions, as the routing policies see it."""
    return RouteRequest((), num_tokens)


def _entry(node_id: str, inflight: int, running: int, free_blocks: int) -> NodeEntry:
    entry = NodeEntry(node_id, FakeBackend(), max_model_len=1024)
    entry.num_inflight = inflight
    entry.load = NodeLoad(num_running=running, num_free_blocks=free_blocks)
    return entry


def test_least_loaded_policy() -> None:
    policy = LeastLoadedPolicy()
    a, b, c = _entry("a", 3, 0, 10), _entry("b", 0, 2, 10), _entry("c", 1, 2, 50)
    assert (
        policy.select([a, b, c], _route(100)).node_id == "c"
    )  # loads 3, 2, 2: more free blocks wins
    assert policy.select([a, b], _route(100)).node_id == "b"
    assert policy.select([_entry("y", 0, 0, 0), _entry("x", 0, 0, 0)], _route(1)).node_id == "x"


def _node(registry: NodeRegistry, node_id: str, role: str, **load: int) -> NodeEntry:
    registration = NodeRegistration(
        node_id=node_id, url=f"http://{node_id}", role=role, model="m", max_model_len=1024
    )
    entry = registry.register(registration)
    entry.load = NodeLoad(**load)
    return entry


def test_pairs_by_pending_prompt_tokens_and_kv_room_and_mixed_only_without_a_pair() -> None:
    registry = NodeRegistry(10.0, lambda url: FakeBackend())
    mixed = _node(registry, "m0", "mixed")
    # Prefill nodes: the fewest prompt tokens still to compute, reported or sent from here.
    _node(registry, "p0", "prefill", num_prefill_tokens=5000)
    p1 = _node(registry, "p1", "prefill", num_prefill_tokens=300)
    p2 = _node(registry, "p2", "prefill", num_prefill_tokens=200)
    p2.num_prefill_tokens_inflight = 900  # this coordinator's, not in p2's last report yet
    # Decode nodes: the largest share of free KV blocks, then the fewest requests.
    _node(registry, "d0", "decode", num_free_blocks=100, num_total_blocks=1000, num_running=1)
    _node(registry, "d1", "decode", num_free_blocks=800, num_total_blocks=1000, num_running=9)
    d2 = _node(registry, "d2", "decode", num_free_blocks=80, num_total_blocks=100, num_running=2)
    with registry.select(_route(100)) as chosen:
        assert chosen.node_id == "p1+d2" and chosen.members == (p1, d2)
        assert p1.num_inflight == d2.num_inflight == 1 and mixed.num_inflight == 0
    assert p1.num_inflight == d2.num_inflight == 0
    with registry.select(_route(100), exclude=["p1", "d2"]) as chosen:
        assert chosen.node_id == "p2+d1"  # p2's 900 tokens in flight < p0's 5000
    # No decode node in rotation: the mixed node takes the requests, and /ready's reason says so.
    for node in registry.nodes:
        if node.role == "decode":
            registry.mark_unresponsive(node, "test")
    with registry.select(_route(100)) as chosen:
        assert chosen is mixed
    assert [n.node_id for n in registry.serving_nodes()] == ["m0"]
    assert registry.max_num_seqs() == mixed.max_num_seqs


def test_ranks_route_by_instance_then_rank_and_only_when_complete() -> None:
    registry = NodeRegistry(10.0, lambda url: FakeBackend())

    def rank(node_id: str, instance: str, r: int, running: int = 0) -> NodeEntry:
        registration = NodeRegistration(
            node_id=node_id, url=f"http://{node_id}", role="mixed", model="m", max_model_len=64,
            instance_id=instance, rank=r, num_ranks=2, load=NodeLoad(num_running=running),
        )  # fmt: skip
        return registry.register(registration)

    a0 = rank("a0", "A", 0, running=1)
    assert registry.ready_nodes() == []  # rank 1 of A has not registered: A takes nothing
    assert registry.instances_not_ready() == {"A": "rank 1 of 2 has not registered"}
    a1 = rank("a1", "A", 1, running=5)
    b0, b1 = rank("b0", "B", 0, running=2), rank("b1", "B", 1, running=2)
    # A's ranks average 3, B's 2: instance B, then its lower id (loads tie).
    with registry.select(_route(10)) as chosen:
        assert chosen is b0
    a1.load = NodeLoad(num_running=0)  # A now averages 0.5: instance A, its least loaded rank
    with registry.select(_route(10)) as chosen:
        assert chosen is a1
    b1.load = NodeLoad(is_healthy=False)  # a failed rank takes its whole instance out
    assert {n.node_id for n in registry.ready_nodes()} == {"a0", "a1"}
    assert registry.instances_not_ready() == {"B": "rank 1 (b1) is out of rotation"}
    assert a0.instance == "A" and b0.num_ranks == 2
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.1"):
        registry.register(msgspec.structs.replace(_registration("x", "http://x"), rank=2,
                                                  num_ranks=2))  # fmt: skip


def test_registry_heartbeats_expiry_and_roles() -> None:
    now = [100.0]
    made: list[str] = []

    def factory(url: str) -> FakeBackend:
        made.append(url)
        return FakeBackend()

    registry = NodeRegistry(heartbeat_timeout_s=10.0, backend_factory=factory, clock=lambda: now[0])
    with pytest.raises(NoReadyNodeError):
        registry.max_model_len()
    registry.add_static("static-0", FakeBackend(), 4096)
    registration = NodeRegistration(
        node_id="n1", url="http://n1", role="mixed", model="m", max_model_len=2048
    )
    entry = registry.register(registration)
    registry.register(NodeRegistration(node_id="p", url="http://p", role="prefill", model="m",
                                       max_model_len=99))  # fmt: skip
    assert [n.node_id for n in registry.ready_nodes()] == ["static-0", "n1", "p"]
    # A prefill node serves only in a pair: with no decode node it is no route.
    assert [n.node_id for n in registry.routes()] == ["static-0", "n1"]
    assert [n.node_id for n in registry.serving_nodes()] == ["static-0", "n1"]
    assert registry.max_model_len() == 4096  # the largest: select() finds a node that fits
    with registry.select(_route(10)) as chosen:
        assert chosen is entry  # both idle: the lower node id
        assert registry.register(registration) is entry  # re-registration keeps the entry...
        assert entry.num_inflight == 1  # ...and the count of requests in flight there
    assert entry.num_inflight == 0
    assert made == ["http://n1", "http://p"]  # same URL: the backend is kept

    now[0] += 10.5
    assert registry.expire() == ["n1", "p"]
    assert [n.node_id for n in registry.ready_nodes()] == ["static-0"]
    registry.heartbeat(
        NodeHeartbeat(node_id="n1", load=NodeLoad(num_waiting=3), lease_id=entry.lease_id)
    )
    assert entry.is_ready and entry.load.num_waiting == 3
    with pytest.raises(KeyError):
        registry.heartbeat(NodeHeartbeat(node_id="zz", load=NodeLoad()))


@pytest.mark.asyncio
async def test_registry_routes_by_limit_health_and_probes() -> None:
    registry = NodeRegistry(heartbeat_timeout_s=10.0, backend_factory=lambda url: FakeBackend())
    static = FakeBackend()
    registry.add_static("static-0", static, 4096)
    small = registry.register(
        NodeRegistration(node_id="n1", url="http://n1", role="mixed", model="m", max_model_len=2)
    )
    # A node with a tiny limit takes what fits it, and limits no one else.
    with registry.select(_route(2)) as chosen:
        assert chosen is small
    with registry.select(_route(3)) as chosen:
        assert chosen.node_id == "static-0"
    with pytest.raises(NoFittingNodeError, match="maximum context length is 4096 tokens"):
        registry.select(_route(4097)).__enter__()
    # Engine health rides on heartbeats: a failed engine leaves rotation at once.
    registry.heartbeat(
        NodeHeartbeat(node_id="n1", lease_id=small.lease_id, load=NodeLoad(is_healthy=False))
    )
    assert [n.node_id for n in registry.ready_nodes()] == ["static-0"]
    registry.heartbeat(NodeHeartbeat(node_id="n1", lease_id=small.lease_id, load=NodeLoad()))
    # A request that found a node unreachable takes it out; a probe that finds it ready brings
    # it back. Static nodes are probed every time.
    registry.mark_unresponsive(small, "connection refused")
    small.backend.is_ready = static.is_ready = False
    await registry.probe()
    assert registry.ready_nodes() == []
    assert not registry.has_candidate(_route(2))
    small.backend.is_ready = static.is_ready = True
    await registry.probe()
    assert [n.node_id for n in registry.ready_nodes()] == ["static-0", "n1"]
    assert registry.has_candidate(_route(2), exclude=["static-0"])
    assert not registry.has_candidate(_route(3), exclude=["static-0"])


def _registration(node_id: str, url: str, max_num_seqs: int = 8) -> NodeRegistration:
    return NodeRegistration(
        node_id=node_id, url=url, role="mixed", model="m", max_model_len=64,
        max_num_seqs=max_num_seqs,
    )  # fmt: skip


def test_registry_identity_leases_and_size_cap() -> None:
    now = [0.0]
    registry = NodeRegistry(10.0, lambda url: FakeBackend(), clock=lambda: now[0], max_nodes=2)
    registry.add_static("static-0", FakeBackend(), 64, max_num_seqs=16)
    with pytest.raises(IdentityConflictError, match="'static-0' belongs to a static node"):
        registry.register(_registration("static-0", "http://evil"))
    a = registry.register(_registration("a", "http://a"))
    assert registry.max_num_seqs() == 16 + 8
    with pytest.raises(IdentityConflictError, match="'a' is held by a live node at another URL"):
        registry.register(_registration("a", "http://evil"))
    # Only a's own lease speaks for it: not a guess, not another node's, not the static node.
    b = registry.register(_registration("b", "http://b", max_num_seqs=4))
    for node_id, lease_id in (("a", ""), ("a", "guess"), ("a", b.lease_id), ("static-0", "")):
        heartbeat = NodeHeartbeat(
            node_id=node_id, load=NodeLoad(is_draining=True), lease_id=lease_id
        )
        with pytest.raises(WrongLeaseError):
            registry.heartbeat(heartbeat)
    assert not a.load.is_draining and registry.max_num_seqs() == 16 + 8 + 4
    old_lease = a.lease_id
    assert registry.register(_registration("a", "http://a")) is a  # a restarted: a new lease
    assert a.lease_id != old_lease
    with pytest.raises(WrongLeaseError):
        registry.heartbeat(NodeHeartbeat(node_id="a", load=NodeLoad(), lease_id=old_lease))
    full = "2 live nodes (server.max_registered_nodes = 2)"
    with pytest.raises(RegistryFullError, match=re.escape(full)):
        registry.register(_registration("c", "http://c"))
    now[0] = 5.0
    registry.heartbeat(NodeHeartbeat(node_id="b", load=NodeLoad(), lease_id=b.lease_id))
    now[0] = 12.0  # a silent for 12 s, b for 7 s
    c = registry.register(_registration("c", "http://c"))  # replaces a, the expired one
    assert [n.node_id for n in registry.nodes] == ["static-0", "b", "c"]
    now[0] = 16.0  # b silent for 11 s: its id may move to another URL
    assert registry.register(_registration("b", "http://b2")).url == "http://b2"
    for bad, message in (
        (_registration("", "http://x"), "node_id must be 1 to 128 printable characters"),
        (_registration("x\n", "http://x"), "node_id must be 1 to 128 printable characters"),
        (_registration("x", "file:///etc"), "url must be an http:// or https:// URL"),
        (_registration("x", "http://x", max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            registry.register(bad)
    assert c.is_ready


# ---- SSE error events ------------------------------------------------------------------------


def test_sse_error_events_exact() -> None:
    err = ApiError(503, "busy", retry_after=1)
    assert sse_error_event(err, ErrorFlavor.OPENAI) == (
        b'data: {"error":{"message":"busy","type":"service_unavailable_error","param":null,'
        b'"code":null}}\n\n'
    )
    assert sse_error_event(err, ErrorFlavor.ANTHROPIC) == (
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
        b'"message":"busy"}}\n\n'
    )
    assert sse_error_event(err, ErrorFlavor.RESPONSES, sequence_number=7) == (
        b'event: error\ndata: {"type":"error","code":"service_unavailable_error",'
        b'"message":"busy","param":null,"sequence_number":7}\n\n'
    )


# ---- the CLI process --------------------------------------------------------------------------


def test_coordinator_process_exits_0_on_sigterm(tmp_path) -> None:
    port, internal_port = free_port(), free_port()
    args = ["--port", str(port), "--internal-port", str(internal_port),
            "--tokenizer", str(TOKENIZER_PATH), "--served-model-name", "m"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepinfer.cli", "coordinator", "--log-level", "INFO", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        statuses = asyncio.run(_wait_until_serving(port))
        assert statuses == (200, 503)  # alive; not ready without a node
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert "drain complete" in output


async def _wait_until_serving(port: int) -> tuple[int, int]:
    deadline = time.monotonic() + 20
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                base = f"http://127.0.0.1:{port}"
                async with (
                    session.get(f"{base}/health") as health,
                    session.get(f"{base}/ready") as ready,
                ):
                    return health.status, ready.status
            except aiohttp.ClientConnectionError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
