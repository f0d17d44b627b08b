"""Cache-aware routing, in parts: the node's cache event log and the tiers' hooks, the
coordinator's index (ordering, repeats, a gap and the resync, a shared disk tier), its predicted
hit against what the engine itself finds, the publisher against the coordinator's internal
listener, and each routing policy's choice on crafted fleets. The same on real processes is in
test_cache_routing_processes.py."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import msgspec
import pytest
import torch
from coordinator_fakes import TOKENIZER_PATH, FakeBackend
from oracle import oracle_prompts
from test_prefix_cache import BLOCK, _llm

from deepinfer import SamplingParams
from deepinfer.config import RoutingConfig, ServerConfig
from deepinfer.kv_cache.disk_tier import DiskTier
from deepinfer.kv_cache.events import CacheEvent, CacheEventLog, CacheLayout, block_key
from deepinfer.kv_cache.tiers import HostTier
from deepinfer.server.cache_events import CachePublisher
from deepinfer.server.cache_index import CacheIndex, PrefixHit, prompt_keys
from deepinfer.server.coordinator import INTERNAL_APP, REGISTRY, create_coordinator_app
from deepinfer.server.protocol import (
    CacheEventBatch,
    NodeLease,
    NodeLoad,
    NodeRegistration,
)
from deepinfer.server.registry import NodeRegistry
from deepinfer.server.routing import (
    CacheAwarePolicy,
    LeastLoadedPolicy,
    NodeEntry,
    RoundRobinPolicy,
    RouteRequest,
    make_pairing,
)


def _hashes(*names: int) -> list[bytes]:
    return [n.to_bytes(1, "big") * 32 for n in names]


def _key(name: int) -> int:
    return block_key(_hashes(name)[0])


# ---- the node's event log and the tiers' hooks ------------------------------------------------


def test_event_log_numbers_events_mirrors_tiers_and_snapshots_after_losing_some() -> None:
    log = CacheEventLog(max_pending_events=3)
    log.stored("device", _hashes(1, 2))
    log.removed("device", _hashes(1))
    log.stored("host", _hashes(1))
    log.stored("device", [])  # nothing changed: no event
    first, events = log.pending(10)
    assert first == 1 and log.last_seq == 3
    assert events == [
        CacheEvent("device", True, (_key(1), _key(2))),
        CacheEvent("device", False, (_key(1),)),
        CacheEvent("host", True, (_key(1),)),
    ]
    assert log.pending(2) == (1, events[:2])
    log.acknowledge(2)
    assert log.pending(10) == (3, events[2:])
    log.acknowledge(2)  # an old acknowledgement changes nothing
    assert log.pending(10) == (3, events[2:])
    # A fourth pending event is more than the log keeps: they are dropped, a snapshot follows.
    log.stored("disk", _hashes(3, 4))
    log.stored("disk", _hashes(5))
    assert log.pending(10) == (
        3,
        [events[2], *_log_events(("disk", True, [3, 4]), ("disk", True, [5]))],
    )
    log.removed("disk", _hashes(4))
    assert log.pending(10) is None
    seq, held = log.snapshot()
    assert seq == 6 == log.last_seq
    assert held == {"device": [_key(2)], "host": [_key(1)], "disk": sorted([_key(3), _key(5)])}
    assert log.pending(10) == (7, [])
    log.removed("disk", _hashes(3))
    assert log.pending(10) == (7, [CacheEvent("disk", False, (_key(3),))])


def test_host_and_disk_tiers_record_what_they_hold(tmp_path: Path) -> None:
    payload = [torch.zeros(16, dtype=torch.uint8)]
    host = HostTier(2 * 16, pin_memory=False)
    log = CacheEventLog()
    host.events = log
    a, b, c = _hashes(1, 2, 3)
    host.put("block", a, payload)
    host.put("snapshot", b, payload)  # not a block: no event, but it takes room
    host.put("block", c, payload)  # evicts a
    host.pop("block", c)
    assert log.num_held["host"] == 0
    assert [(e.is_stored, e.keys) for e in log.pending(10)[1]] == [
        (True, (_key(1),)), (True, (_key(3),)), (False, (_key(1),)), (False, (_key(3),)),
    ]  # fmt: skip

    first = DiskTier(tmp_path, 1 << 20, b"salt")
    other = DiskTier(tmp_path, 1 << 20, b"salt")  # another node on the same mount
    disk_log, other_log = CacheEventLog(), CacheEventLog()
    first.publish_to(disk_log)
    other.publish_to(other_log)
    assert first.tier_id() == other.tier_id() and len(first.tier_id()) == 32
    first.put("block", a, payload)
    assert disk_log.num_held["disk"] == 1  # pending writes are served already: they count
    first.flush()
    assert other.get("block", a) is not None  # read where the first node wrote it
    assert other_log.num_held["disk"] == 1
    (tmp_path / "block" / a.hex()[:2] / f"{a.hex()}.kv").unlink()  # gone behind our back
    assert first.get("block", a) is None
    assert disk_log.num_held["disk"] == 0
    first.close()
    other.close()
    # A restarted node publishes the files it finds.
    with DiskTier(tmp_path, 1 << 20, b"salt") as restarted:
        restarted.put("block", b, payload)
        restarted.flush()
    with DiskTier(tmp_path, 1 << 20, b"salt") as restarted:
        found = CacheEventLog()
        restarted.publish_to(found)
        assert found.snapshot()[1] == {"disk": [_key(2)]}


# ---- the coordinator's index ------------------------------------------------------------------

LAYOUT = CacheLayout(b"model-salt", 4)


def _log_events(*items: tuple[str, bool, list[int]]) -> list[CacheEvent]:
    return [
        CacheEvent(tier, stored, tuple(_key(n) for n in names)) for tier, stored, names in items
    ]


def test_index_applies_in_order_skips_repeats_and_asks_for_a_snapshot_after_a_gap() -> None:
    index = CacheIndex()
    index.add("n1", LAYOUT)
    keys = [_key(n) for n in (1, 2, 3, 4)]
    # Nothing is applied before the node's snapshot.
    assert index.apply("n1", 1, _log_events(("device", True, [1]))) is None
    assert index.load("n1", 0, {"device": [_key(1)]})
    assert index.hit("n1", keys) == PrefixHit(device=4)
    batch = _log_events(("device", True, [2]), ("host", True, [3]), ("device", False, [2]))
    assert index.apply("n1", 1, batch) == 3
    assert index.hit("n1", keys) == PrefixHit(device=4)  # block 2 left: the chain stops
    assert index.apply("n1", 2, batch[1:] + _log_events(("device", True, [2]))) == 4  # repeats
    assert index.hit("n1", keys) == PrefixHit(device=8, host=4)
    assert index.node("n1").num_events == 4
    # A gap: events 5 and 6 never arrived. The index waits for a snapshot, predicting nothing.
    assert index.apply("n1", 7, _log_events(("device", False, [1]))) is None
    assert index.hit("n1", keys) == PrefixHit()
    assert index.apply("n1", 8, []) is None
    assert index.node("n1").num_resyncs == 3
    assert index.load("n1", 8, {"host": [_key(1), _key(2)]})
    assert index.hit("n1", keys) == PrefixHit(host=8)
    assert index.apply("n1", 9, _log_events(("device", True, [1]))) == 9
    assert index.hit("n1", keys) == PrefixHit(device=4, host=4)


def test_blocks_of_requests_in_flight_count_until_they_end() -> None:
    index = CacheIndex()
    index.add("n1", LAYOUT)
    index.load("n1", 0, {"device": [_key(1)]})
    keys = [_key(n) for n in (1, 2, 3)]
    release = index.hold("n1", keys[:2])
    again = index.hold("n1", keys)
    assert index.hit("n1", keys) == PrefixHit(device=4, in_flight=8)
    release()
    assert index.hit("n1", keys) == PrefixHit(device=4, in_flight=8)  # the other still runs
    index.apply("n1", 1, _log_events(("device", True, [2])))  # computed and published
    assert index.hit("n1", keys) == PrefixHit(device=8, in_flight=4)
    again()
    assert index.hit("n1", keys) == PrefixHit(device=8)
    assert not index.node("n1").in_flight


def test_a_shared_disk_tier_is_a_hit_on_every_node_mounting_it() -> None:
    index = CacheIndex()
    shared = CacheLayout(b"model-salt", 4, disk_tier_id="mount-1")
    for node_id in ("n1", "n2"):
        index.add(node_id, shared)
        index.load(node_id, 0, {})
    index.add("n3", CacheLayout(b"model-salt", 4, disk_tier_id="mount-2"))
    index.load("n3", 0, {})
    index.apply("n1", 1, _log_events(("disk", True, [1, 2])))
    keys = [_key(1), _key(2)]
    assert index.hit("n2", keys) == PrefixHit(disk=8)
    assert index.hit("n3", keys) == PrefixHit()
    index.apply("n2", 1, _log_events(("disk", False, [2])))  # n2 evicted a file n1 wrote
    assert index.hit("n1", keys) == PrefixHit(disk=4)
    index.drop("n1")
    assert index.hit("n1", keys) == PrefixHit()
    assert index.hit("n2", keys) == PrefixHit(disk=4)  # the mount is still n2's
    index.drop("n2")
    index.add("n2", shared)
    index.load("n2", 0, {})
    assert index.hit("n2", keys) == PrefixHit()  # the last node left: the set went with it


def test_prompt_keys_are_the_engine_s_chain_and_skip_the_last_token() -> None:
    layout = CacheLayout(b"salt", 4)
    assert len(prompt_keys(list(range(9)), layout, None)) == 2
    assert len(prompt_keys(list(range(8)), layout, None)) == 1  # token 8 is always computed
    tenant = prompt_keys(list(range(9)), layout, "tenant-a")
    assert tenant != prompt_keys(list(range(9)), layout, None)
    assert (
        prompt_keys(list(range(9)), layout, None)[0]
        == prompt_keys([0, 1, 2, 3, 9], layout, None)[0]
    )


def test_predicted_hits_equal_what_the_engine_finds(oracle_hf_dir: Path, tmp_path: Path) -> None:
    """The index fed by a real engine's events (device blocks evicted to a small host tier and
    written through to disk) predicts every request's cached tokens exactly."""
    llm = _llm(oracle_hf_dir, num_blocks=22, host_tier_gib=4e-5, disk_tier_dir=str(tmp_path))
    log = CacheEventLog()
    layout = llm.engine.publish_cache_events(log)
    assert layout is not None and layout.block_size == BLOCK and layout.disk_tier_id
    index = CacheIndex()
    index.add("n", layout)
    index.load("n", *log.snapshot())
    a, b = oracle_prompts()[2], oracle_prompts()[1]
    c, d = random.Random(0).sample(a, len(a)), random.Random(1).sample(a, len(a))
    # Shared prefixes, and unrelated prompts that push the earlier ones' blocks to the host
    # tier and on out of it (the disk tier keeps them all).
    prompts = [a[:100], a[:170] + b[:9], c, a[:100] + b[:20], d, a, c[:200], a[:161], b, a[:40]]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    by_tier: dict[str, int] = {}
    for prompt in prompts:
        first, events = log.pending(1 << 20)
        index.apply("n", first, events)
        predicted = index.hit("n", prompt_keys(prompt, layout, None))
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.num_cached_tokens == predicted.num_tokens, prompt
        for tier in ("device", "host", "disk"):
            by_tier[tier] = by_tier.get(tier, 0) + getattr(predicted, tier)
    assert all(by_tier.values()), by_tier  # each tier served some hit
    llm.engine.tiers.flush()
    first, events = log.pending(1 << 20)
    index.apply("n", first, events)
    node = index.node("n")
    prefix = llm.engine.scheduler.prefix.cache
    assert node.device == {block_key(h) for h in prefix._blocks}
    assert node.host == {
        block_key(k)
        for kind, k in llm.engine.tiers.host.keys()  # noqa: SIM118
        if kind == "block"
    }
    on_disk = {block_key(bytes.fromhex(f.stem)) for f in (tmp_path / "block").rglob("*.kv")}
    assert node.disk.keys == on_disk and on_disk


# ---- the publisher and the coordinator's internal listener -----------------------------------


@pytest.mark.asyncio
async def test_publisher_syncs_resyncs_and_is_refused_without_the_lease(aiohttp_server) -> None:
    app = create_coordinator_app(
        ServerConfig(), tokenizer_path=TOKENIZER_PATH, served_model_name="m",
        backend_factory=lambda url: FakeBackend(),
    )  # fmt: skip
    server = await aiohttp_server(app[INTERNAL_APP])
    base = str(server.make_url("")).rstrip("/")
    registry: NodeRegistry = app[REGISTRY]
    wire = CacheLayout(b"s", 4)
    entry = registry.register(NodeRegistration(
        node_id="n1", url="http://n1", role="mixed", model="m", max_model_len=64, cache=wire,
    ))  # fmt: skip
    log = CacheEventLog()
    log.stored("device", _hashes(1))
    publisher = CachePublisher(log, interval_s=0.01)
    async with aiohttp.ClientSession() as session:
        # A batch without the node's lease is refused; the publisher waits for a lease.
        stranger = CacheEventBatch(node_id="n1", lease_id="x", first_seq=1, events=[])
        url = f"{base}/internal/cache_events"
        async with session.post(url, data=msgspec.msgpack.encode(stranger)) as r:
            assert r.status == 403
        task = asyncio.create_task(publisher.run(session, base))
        try:
            publisher.new_lease(
                NodeLease(node_id="n1", lease_id=entry.lease_id, heartbeat_timeout_s=9)
            )
            index = registry.cache_index
            await _until(lambda: index.node("n1").applied_seq == 1)
            assert index.node("n1").device == {_key(1)}
            log.stored("device", _hashes(2))
            log.removed("device", _hashes(1))
            await _until(lambda: index.node("n1").applied_seq == 3)
            assert index.node("n1").device == {_key(2)} and log.pending(10) == (4, [])
            # The node missed heartbeats: the coordinator forgets its entries; the next batch
            # gets "needs snapshot", and the snapshot brings the index back in step.
            registry.cache_index.forget("n1")
            log.stored("host", _hashes(1))
            await _until(lambda: index.node("n1").applied_seq == 4)
            assert (index.node("n1").device, index.node("n1").host) == ({_key(2)}, {_key(1)})
            assert index.node("n1").num_resyncs == 1
        finally:
            task.cancel()


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


# ---- the policies on crafted fleets -----------------------------------------------------------


def _fleet(**loads: int) -> list[NodeEntry]:
    nodes = []
    for node_id, load in loads.items():
        node = NodeEntry(node_id, FakeBackend(), max_model_len=1 << 20)
        node.load = NodeLoad(num_running=load)
        nodes.append(node)
    return nodes


def _request(num_prompt_tokens: int, hits: dict[str, PrefixHit], head: int = 0) -> RouteRequest:
    prompt = [head, *range(1, num_prompt_tokens)]
    return RouteRequest(
        prompt, num_prompt_tokens + 16, lambda node: hits.get(node.node_id, PrefixHit())
    )


def test_round_robin_and_least_loaded_ignore_the_caches() -> None:
    fleet = _fleet(b=0, a=5, c=1)
    hits = {"a": PrefixHit(device=1000)}
    policy = RoundRobinPolicy()
    assert [policy.select(fleet, _request(1000, hits)).node_id for _ in range(4)] == [
        "a",
        "b",
        "c",
        "a",
    ]
    assert LeastLoadedPolicy().select(fleet, _request(1000, hits)).node_id == "b"


def test_cache_aware_cost_weighs_hits_tiers_and_load() -> None:
    policy = CacheAwarePolicy(RoutingConfig(request_cost_tokens=100))
    fleet = _fleet(a=3, b=0, c=1)
    # a: 1000 - 800 + 3 x 100 = 500; b: 1000; c: 1000 - 400 + 100 = 700.
    hits = {"a": PrefixHit(device=800), "c": PrefixHit(device=400)}
    assert [policy.cost(n, _request(1000, hits)) for n in fleet] == [500, 1000, 700]
    assert policy.select(fleet, _request(1000, hits)).node_id == "a"
    # Lower tiers' hits cost a share of the tokens: a: 200 + 0.25 x 800 + 300 = 700;
    # c: 600 + 0.05 x 400 + 100 = 720.
    hits = {"a": PrefixHit(disk=800), "c": PrefixHit(host=400)}
    assert policy.select(fleet, _request(1000, hits)).node_id == "a"
    fleet[0].load = NodeLoad(num_running=4)  # a: 800 > c: 720
    assert policy.select(fleet, _request(1000, hits)).node_id == "c"
    # Pending prefill work counts as tokens too.
    fleet[2].num_prefill_tokens_inflight = 500
    assert policy.select(fleet, _request(1000, hits)).node_id == "a"


def test_ranks_of_lock_step_instances_are_chosen_by_their_own_cache() -> None:
    fleet = _fleet(a0=0, a1=0, b0=1, b1=1)
    for node in fleet:
        node.instance_id, node.rank, node.num_ranks = node.node_id[0], int(node.node_id[1]), 2
    hits = {"b1": PrefixHit(device=1024)}  # each rank keeps its own requests' blocks
    assert CacheAwarePolicy().select(fleet, _request(1100, hits)).node_id == "b1"
    assert LeastLoadedPolicy().select(fleet, _request(1100, hits)).node_id == "a0"


def test_a_snapshot_too_large_for_one_message_keeps_the_device_s_blocks_first(
    monkeypatch,
) -> None:
    from deepinfer.server import cache_events

    monkeypatch.setattr(cache_events, "MAX_SNAPSHOT_KEYS", 3)
    held = {"device": [1, 2], "host": [3, 4], "disk": [5]}
    assert cache_events._bounded(9, held) == (9, {"device": [1, 2], "host": [3]})


def test_the_load_guard_keeps_overloaded_nodes_out() -> None:
    config = RoutingConfig(request_cost_tokens=1, balance_abs_requests=4, balance_ratio=2.0)
    policy = CacheAwarePolicy(config)
    hits = {"hot": PrefixHit(device=4000)}
    # hot is 6 requests above the least loaded (> 4) and 7 x its load (> 2): left out.
    fleet = _fleet(hot=7, cold=1, warm=3)
    assert policy.select(fleet, _request(4096, hits)).node_id == "cold"
    assert policy.num_guarded == 1
    # Within either bound it is chosen: 6 above the least loaded, but not twice its load...
    fleet = _fleet(hot=12, cold=6)
    assert policy.select(fleet, _request(4096, hits)).node_id == "hot"
    fleet = _fleet(hot=5, cold=1)  # ...or 5 times its load, but only 4 above
    assert policy.select(fleet, _request(4096, hits)).node_id == "hot"
    assert policy.num_guarded == 1


def test_equal_costs_keep_a_conversation_together_and_spread_others() -> None:
    policy = CacheAwarePolicy(RoutingConfig(affinity_tokens=8))
    fleet = _fleet(a=0, b=0, c=0, d=0)
    chosen = {}
    for conversation in range(40):
        turns = [_request(n, {}, head=conversation) for n in (20, 200, 900)]
        homes = {policy.select(fleet, turn).node_id for turn in turns}
        assert len(homes) == 1  # every turn (same first 8 tokens) lands on the same node
        chosen[conversation] = homes.pop()
    assert set(chosen.values()) == {"a", "b", "c", "d"}  # different conversations spread
    # A node leaving moves only its own conversations.
    without_b = [n for n in fleet if n.node_id != "b"]
    for conversation, home in chosen.items():
        now = policy.select(without_b, _request(200, {}, head=conversation)).node_id
        assert now == home or home == "b"


def test_a_pair_s_prefill_node_is_chosen_by_its_cache() -> None:
    policy = CacheAwarePolicy(RoutingConfig())
    pairing = make_pairing(policy)
    prefill = _fleet(p0=0, p1=0)
    decode = _fleet(d0=0)
    hits = {"p1": PrefixHit(device=2000)}
    assert pairing.pair(prefill, decode, _request(2048, hits))[0].node_id == "p1"
    assert (
        make_pairing(LeastLoadedPolicy()).pair(prefill, decode, _request(2048, hits))[0].node_id
        == "p0"
    )


def test_route_requests_look_up_the_registry_s_index() -> None:
    registry = NodeRegistry(10.0, lambda url: FakeBackend(), CacheAwarePolicy())
    layout = CacheLayout(b"s", 4)
    for node_id in ("n1", "n2"):
        registry.register(NodeRegistration(
            node_id=node_id, url=f"http://{node_id}", role="mixed", model="m",
            max_model_len=64, cache=layout,
        ))  # fmt: skip
        registry.cache_index.load(node_id, 0, {})
    prompt = list(range(13))
    keys = prompt_keys(prompt, CacheLayout(b"s", 4), None)
    registry.cache_index.apply("n2", 1, [CacheEvent("device", True, tuple(keys[:2]))])
    with registry.select(registry.route_request(prompt, 20)) as chosen:
        assert chosen.node_id == "n2"
        # While it runs, a request with the same prompt counts its third block there too.
        assert registry.route_request(prompt, 20).hit(chosen) == PrefixHit(device=8, in_flight=4)
    route = registry.route_request(prompt, 20)
    assert [route.hit(n) for n in registry.nodes] == [PrefixHit(), PrefixHit(device=8)]
    # A least-loaded choice predicts what the node finds without the request's own blocks.
    registry.policy = LeastLoadedPolicy()
    route = registry.route_request(prompt, 20)
    with registry.select(route) as chosen:
        assert chosen.node_id == "n1" and route.hit(chosen) == PrefixHit()
    # Prompt logprobs: the node computes every token, so no node has a hit.
    no_lookup = registry.route_request(prompt, 20, looks_up=False)
    assert [no_lookup.hit(n).device for n in registry.nodes] == [0, 0]
    # Another tenant's salt: another chain.
    tenant = registry.route_request(prompt, 20, "tenant")
    assert [tenant.hit(n).device for n in registry.nodes] == [0, 0]


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "cache_aware"])
def test_policy_names(policy: str) -> None:
    from deepinfer.server.routing import make_policy

    assert (
        type(make_policy(RoutingConfig(policy=policy)))
        .__name__.lower()
        .startswith(policy.replace("_", ""))
    )
