"""`deepinfer sim`: a discrete-event simulator of a fleet of nodes behind the coordinator's router.

    trace (Mooncake JSONL: timestamp ms, input_length, output_length, hash_ids of blocks)
      └─ replicate R times (disjoint hash ids, seeded time offsets) ─▶ arrivals
    arrival ──RoutingPolicy.select (server/routing.py, the coordinator's objects)──▶ SimNode
    SimNode: prefill queue (FCFS, one prompt at a time) ─▶ decode batch (continuous) ─▶ done
             its blocks: scheduler/block_manager.py's BlockManager (the node's LRU eviction),
             evicted blocks to a host LRU of host_capacity_blocks (as the host tier keeps them)

What is the real code: the policies (with the same ``RouteRequest`` the coordinator builds,
its hit per node from the simulated caches, the blocks of requests in flight counted as the
coordinator counts them) and the block manager's free list, whose order is the prefix cache's
LRU eviction. What is modelled (``SpeedModel``): a prompt's prefill takes
``prefill_fixed_ms + uncached tokens x prefill_ms_per_token`` and runs alone on its node (no
chunking with decodes); decode steps take ``step_ms(batch)``, linear between measured points,
and every running request gains one token a step (a fluid model: no event per step). A
request reserves blocks for its prompt and output when its prefill starts and waits (FIFO)
while too few are free or ``max_num_seqs`` run. Only full prompt blocks are cached, as the
nodes do (the last prompt token is always computed).

Per policy: hit rate (cached prompt tokens / prompt tokens), TTFT and TPOT p50/p99, load
imbalance (most requests on one node / the mean), output throughput.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import heapq
import itertools
import json
import multiprocessing
import random
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from deepinfer.bench.datasets import TraceRecord, read_trace
from deepinfer.config import ROUTING_POLICIES, RoutingConfig
from deepinfer.scheduler.block_manager import BlockManager
from deepinfer.server.cache_index import PrefixHit, walk_prefix
from deepinfer.server.protocol import NodeLoad
from deepinfer.server.routing import (
    CacheAwarePolicy,
    LeastLoadedPolicy,
    NodeEntry,
    RoundRobinPolicy,
    RouteRequest,
    RoutingPolicy,
    make_policy,
    pending_prefill_tokens,
    ring_distance,
    ring_points,
)


@dataclass(frozen=True)
class SpeedModel:
    """A node's speed. Defaults: one H200 running DeepSeek-V4-Flash's shapes at full depth
    (benchmarks/RESULTS.md, 2026-11-30 "V4-Flash prefill and decode after the changes": prefill
    of 8,192 tokens in 643 ms; decode steps of 18.18 / 78.14 / 129 ms at batch 1 / 32 / 128,
    CUDA graphs, context 4,096)."""

    prefill_ms_per_token: float = 643.0 / 8192
    prefill_fixed_ms: float = 0.0
    decode_points: tuple[tuple[int, float], ...] = ((1, 18.18), (32, 78.14), (128, 129.0))

    def prefill_ms(self, num_tokens: int) -> float:
        return self.prefill_fixed_ms + num_tokens * self.prefill_ms_per_token

    def step_ms(self, batch: int) -> float:
        """Linear between the measured points, and beyond the last along its last segment."""
        points = self.decode_points
        if batch <= points[0][0] or len(points) == 1:
            return points[0][1]
        for (b0, t0), (b1, t1) in itertools.pairwise(points):
            if batch <= b1:
                return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = points[-2], points[-1]
        return t1 + (t1 - t0) * (batch - b1) / (b1 - b0)


@dataclass(frozen=True)
class FleetSpec:
    num_nodes: int
    capacity_blocks: int = 4096  # device KV blocks per node (of node_block_tokens each)
    host_capacity_blocks: int = 0  # blocks the host tier keeps after eviction (0: none)
    block_tokens: int = 512  # the trace's block size (Mooncake's: 512)
    # The nodes' KV block (cache.block_size), dividing block_tokens; None: block_tokens. A
    # trace block of id h is then its r = block_tokens / node_block_tokens node blocks
    # h*r .. h*r + r - 1: allocation, hits and eviction at the nodes' granularity.
    node_block_tokens: int | None = None
    max_num_seqs: int = 256
    speed: SpeedModel = field(default_factory=SpeedModel)


@dataclass(eq=False, slots=True)
class SimRequest:
    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]  # of its blocks of block_tokens
    block_tokens: int = 512
    cached_tokens: int = 0
    first_token_ms: float = 0.0
    done_ms: float = 0.0
    block_ids: list[int] = field(default_factory=list)
    release: Callable[[], None] = lambda: None
    node_id: str = ""  # where it was routed

    @property
    def num_full_blocks(self) -> int:
        return (self.input_length - 1) // self.block_tokens


class _PromptTokens(Sequence[int]):
    """A prompt as the policies see it: its length, and for its first tokens the ids of the
    blocks they are in (the affinity key of prompts that begin alike)."""

    def __init__(self, request: SimRequest) -> None:
        self.request = request

    def __len__(self) -> int:
        return self.request.input_length

    def __getitem__(self, index):  # type: ignore[override]
        if not isinstance(index, slice):
            return self._token(range(len(self))[index])
        positions = range(len(self))[index]
        if positions.step != 1:
            return [self._token(p) for p in positions]
        bt, out = self.request.block_tokens, []
        p = positions.start
        while p < positions.stop:  # a block's tokens at a time
            end = min(positions.stop, (p // bt + 1) * bt)
            out += [self._token(p)] * (end - p)
            p = end
        return out

    def _token(self, position: int) -> int:
        block, ids = position // self.request.block_tokens, self.request.hash_ids
        return ids[block] % 2**32 if block < len(ids) else 0


class SimNode:
    def __init__(self, node_id: str, spec: FleetSpec, sim: Simulation) -> None:
        self.spec, self.sim = spec, sim
        self.entry = NodeEntry(node_id, backend=None, max_model_len=1 << 30)  # type: ignore[arg-type]
        self.entry.max_num_seqs = spec.max_num_seqs
        self.entry.load = NodeLoad(num_total_blocks=spec.capacity_blocks)
        self.blocks = BlockManager(spec.capacity_blocks)
        self.blocks.on_evict = self._evicted
        self.cached: dict[int, int] = {}  # hash id -> device block
        self.host: OrderedDict[int, None] = OrderedDict()
        self.in_flight: Counter[int] = Counter()
        self.queue: deque[SimRequest] = deque()
        self.prefilling: SimRequest | None = None
        self.num_queued_tokens = 0
        # Decoding, as a fluid: every running request gains one token per step.
        self.steps = 0.0  # steps run since the start
        self.steps_at_ms = 0.0
        self.decoding: list[tuple[float, int, SimRequest]] = []  # (finish step, seq, request)
        self._decode_version = 0
        self.num_routed = 0

    # -- the cache ----------------------------------------------------------------------------

    def _evicted(self, block_id: int, block_hash: bytes) -> None:
        h = int.from_bytes(block_hash, "big", signed=True)
        del self.cached[h]
        if self.spec.host_capacity_blocks:
            self.host[h] = None
            self.host.move_to_end(h)
            while len(self.host) > self.spec.host_capacity_blocks:
                self.sim.index.dropped(self, self.host.popitem(last=False)[0])
        self.sim.index.dropped(self, h)

    def holds(self, h: int) -> bool:
        return h in self.cached or h in self.in_flight or h in self.host

    def hit(self, request: SimRequest) -> PrefixHit:
        """What the router predicts: device blocks, blocks in flight, then the host tier's."""
        ids = request.hash_ids[: request.num_full_blocks]
        return walk_prefix(ids, self.cached, self.in_flight, self.host, (), self.spec.block_tokens)

    def hold(self, request: SimRequest) -> Callable[[], None]:
        keys = request.hash_ids[: request.num_full_blocks]
        self.in_flight.update(keys)
        if keys:
            self.sim.index.added(self, keys[0])

        def release() -> None:
            self.in_flight.subtract(keys)
            for key in keys:
                if self.in_flight[key] <= 0:
                    del self.in_flight[key]
            if keys:
                self.sim.index.dropped(self, keys[0])

        return release

    def _admit(self, request: SimRequest) -> bool:
        """The node's lookup at admission (device prefix, then host), and the blocks for the
        prompt and its output; False (nothing taken) while too few are free."""
        ids, bt = request.hash_ids[: request.num_full_blocks], self.spec.block_tokens
        hit = []
        for h in ids:
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        from_host = []
        for h in ids[len(hit) :]:
            if h not in self.host:
                break
            from_host.append(h)
        needed = -(-(request.input_length + request.output_length) // bt)
        new = needed - len(hit)
        # Blocks reused from the free list do not count against it, but they are on it.
        free_after_reuse = self.blocks.num_free_blocks - sum(
            1 for b in hit if self.blocks.ref_count(b) == 0
        )
        if new > free_after_reuse:
            return False
        for h in from_host:  # read: the most recent (before this allocation evicts any)
            self.host.move_to_end(h)
        self.blocks.reuse(hit)
        fresh = self.blocks.allocate(new)
        for h, block in zip(from_host, fresh, strict=False):
            self._cache(h, block)
        request.block_ids = hit + fresh
        request.cached_tokens = (len(hit) + len(from_host)) * bt
        return True

    def _cache(self, h: int, block: int) -> None:
        self.cached[h] = block
        self.blocks.set_hash(block, h.to_bytes(8, "big", signed=True))
        self.sim.index.added(self, h)

    def _insert(self, request: SimRequest) -> None:
        """The prompt is computed: its full blocks enter the cache."""
        for h, block in zip(
            request.hash_ids[: request.num_full_blocks], request.block_ids, strict=False
        ):
            if h not in self.cached and self.blocks.block_hash(block) is None:
                self._cache(h, block)

    # -- requests -----------------------------------------------------------------------------

    def arrive(self, request: SimRequest, now: float) -> None:
        self.num_routed += 1
        self.queue.append(request)
        self.num_queued_tokens += request.input_length
        self._start_prefill(now)
        self._update_load()

    def _start_prefill(self, now: float) -> None:
        if self.prefilling is not None or not self.queue:
            return
        if len(self.decoding) >= self.spec.max_num_seqs:
            return
        request = self.queue[0]
        if not self._admit(request):
            return
        self.queue.popleft()
        self.num_queued_tokens -= request.input_length
        self.prefilling = request
        uncached = request.input_length - request.cached_tokens
        self.sim.schedule(now + self.spec.speed.prefill_ms(uncached), self._prefill_done, request)

    def _prefill_done(self, now: float, request: SimRequest) -> None:
        self.prefilling = None
        self._insert(request)
        request.first_token_ms = now
        if request.output_length <= 1:
            self._finish(request, now)
        else:
            self._advance(now)
            finish = self.steps + request.output_length - 1
            heapq.heappush(self.decoding, (finish, self.sim.next_seq(), request))
            self._schedule_decode(now)
        self._start_prefill(now)
        self._update_load()

    def _advance(self, now: float) -> None:
        if self.decoding:
            self.steps += (now - self.steps_at_ms) / self.spec.speed.step_ms(len(self.decoding))
        self.steps_at_ms = now

    def _schedule_decode(self, now: float) -> None:
        self._decode_version += 1
        if self.decoding:
            step = self.spec.speed.step_ms(len(self.decoding))
            at = now + max(0.0, self.decoding[0][0] - self.steps) * step
            self.sim.schedule(at, self._decode_check, self._decode_version)

    def _decode_check(self, now: float, version: int) -> None:
        if version != self._decode_version:
            return  # the batch changed since: a newer check is scheduled
        self._advance(now)
        while self.decoding and self.decoding[0][0] <= self.steps + 1e-9:
            _, _, request = heapq.heappop(self.decoding)
            self._finish(request, now)
        self._schedule_decode(now)
        self._start_prefill(now)
        self._update_load()

    def _finish(self, request: SimRequest, now: float) -> None:
        request.done_ms = now
        self.blocks.free(request.block_ids)
        request.release()
        self.entry.num_inflight -= 1
        self.sim.finished.append(request)

    def _update_load(self) -> None:
        """After every event that changed the node (its callers run it once, at their end)."""
        load = self.entry.load
        load.num_running = len(self.decoding) + (self.prefilling is not None)
        load.num_waiting = len(self.queue)
        load.num_prefill_tokens = self.num_queued_tokens
        load.num_free_blocks = self.blocks.num_free_blocks
        self.sim.index.moved(self)


class Simulation:
    """``shortlist``: hand each policy only the nodes that can win (FleetIndex); False: every
    node, as the coordinator does. Both choose the same nodes (tests/test_sim.py)."""

    def __init__(self, spec: FleetSpec, policy: RoutingPolicy, shortlist: bool = True) -> None:
        self.spec, self.policy = spec, policy
        self.index = FleetIndex(policy, shortlist)
        self.nodes = [SimNode(f"node{i}", spec, self) for i in range(spec.num_nodes)]
        for node in self.nodes:
            self.index.join(node)
        self._by_id = {n.entry.node_id: n for n in self.nodes}
        self._events: list[tuple[float, int, Callable, object]] = []
        self._seq = 0
        self.finished: list[SimRequest] = []

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def schedule(self, at_ms: float, action: Callable, arg: object) -> None:
        heapq.heappush(self._events, (at_ms, self.next_seq(), action, arg))

    def run(self, requests: Sequence[SimRequest]) -> None:
        if self.index.kind == "cache_aware":
            self.index.first_blocks = {r.hash_ids[0] for r in requests if r.num_full_blocks}
        for request in requests:
            self.schedule(request.arrival_ms, self._route, request)
        while self._events:
            now, _, action, arg = heapq.heappop(self._events)
            action(now, arg)

    def _route(self, now: float, request: SimRequest) -> None:
        hits: dict[str, PrefixHit] = {}

        def hit(entry: NodeEntry) -> PrefixHit:
            if entry.node_id not in hits:
                hits[entry.node_id] = self._by_id[entry.node_id].hit(request)
            return hits[entry.node_id]

        candidates = self.index.candidates(request)
        route = RouteRequest(
            _PromptTokens(request), request.input_length + request.output_length, hit
        )
        entry = self.policy.select(candidates, route)
        request.node_id = entry.node_id
        entry.num_inflight += 1
        node = self._by_id[entry.node_id]
        request.release = node.hold(request)
        node.arrive(request, now)


class FleetIndex:
    """The nodes a policy must weigh for a request so that its choice is the one it would make
    over the whole fleet, found without visiting every node:

    - round_robin: every node (its turn counts requests, not nodes);
    - least_loaded: the node of least (load, -free blocks, id): the policy's own order;
    - cache_aware: every node holding the prompt's first block (only they have a hit), the
      least loaded node (the guard's reference), a node of the least load cost among those
      without a hit, and, among the nodes within the guard without a hit, of the least load
      cost there, the one nearest the prompt on the tie-break's ring (the policy's choice
      among them if they tie): a ring walk from the prompt's point (``ring_distance``).

    Load cost = pending prefill tokens + request_cost_tokens x requests, as the policy's cost
    without the prompt's own tokens. Kept up to date by ``moved`` (a node's load changed),
    ``added``/``dropped`` (a block entered or left a node's device, host or in-flight set)."""

    def __init__(self, policy: RoutingPolicy, enabled: bool = True) -> None:
        # What the policy needs kept: nothing (round_robin, or every node handed over), the
        # least-loaded order, or the cache-aware buckets.
        self.kind = "all"
        if enabled and isinstance(policy, LeastLoadedPolicy):
            self.kind = "least_loaded"
        elif enabled and isinstance(policy, CacheAwarePolicy):
            self.kind = "cache_aware"
        elif enabled and not isinstance(policy, RoundRobinPolicy):
            raise ValueError(f"no shortlist for {type(policy).__name__}")
        self.policy = policy
        # Only cache_aware asks who holds a block, and only of a prompt's first block: only
        # those are tracked (``first_blocks``, set before the run).
        self.first_blocks: set[int] = set()
        self.nodes: list[SimNode] = []
        self.holders: dict[int, set[SimNode]] = {}
        self._cost_of: dict[SimNode, tuple[float, int]] = {}  # node -> (load cost, load)
        self._by_cost: dict[float, set[SimNode]] = {}
        self._cost_heap: list[float] = []
        self._by_load: dict[int, set[SimNode]] = {}
        self._load_heap: list[int] = []
        self._least_loaded: list[tuple] = []  # (load, -free blocks, id, version, node)
        self._version: dict[SimNode, int] = {}
        self._ring: list[tuple[int, SimNode]] = []
        self._request_cost = policy.config.request_cost_tokens if self.kind == "cache_aware" else 0

    def join(self, node: SimNode) -> None:
        self.nodes.append(node)
        self.nodes.sort(key=lambda n: n.entry.node_id)
        for point in ring_points(node.entry.node_id):
            bisect.insort(self._ring, (point, node), key=lambda item: item[0])
        self._version[node] = 0
        self.moved(node)

    # -- upkeep -------------------------------------------------------------------------------

    def added(self, node: SimNode, h: int) -> None:
        if h in self.first_blocks:
            self.holders.setdefault(h, set()).add(node)

    def dropped(self, node: SimNode, h: int) -> None:
        if h in self.first_blocks and not node.holds(h):
            holders = self.holders.get(h)
            if holders is not None:
                holders.discard(node)
                if not holders:
                    del self.holders[h]

    def moved(self, node: SimNode) -> None:
        entry = node.entry
        if self.kind == "least_loaded":
            version = self._version[node] + 1
            self._version[node] = version
            free = entry.load.num_free_blocks
            heapq.heappush(
                self._least_loaded, (entry.load_score, -free, entry.node_id, version, node)
            )
        if self.kind != "cache_aware":
            return
        load = entry.load_score
        cost = pending_prefill_tokens(entry) + self._request_cost * load
        old = self._cost_of.get(node)
        if old is not None:
            for buckets, key in ((self._by_cost, old[0]), (self._by_load, old[1])):
                buckets[key].discard(node)
                if not buckets[key]:
                    del buckets[key]
        self._cost_of[node] = (cost, load)
        if cost not in self._by_cost or not self._by_cost[cost]:
            heapq.heappush(self._cost_heap, cost)
        self._by_cost.setdefault(cost, set()).add(node)
        if load not in self._by_load or not self._by_load[load]:
            heapq.heappush(self._load_heap, load)
        self._by_load.setdefault(load, set()).add(node)

    @staticmethod
    def _min_key(heap: list, buckets: dict) -> object:
        """The least key of ``buckets`` (none empty), from a heap of keys pushed as buckets
        appeared (lazily popped, rebuilt when mostly stale)."""
        if len(heap) > 4 * len(buckets) + 64:
            heap[:] = list(buckets)
            heapq.heapify(heap)
        while heap[0] not in buckets:
            heapq.heappop(heap)
        return heap[0]

    # -- queries ------------------------------------------------------------------------------

    def candidates(self, request: SimRequest) -> list[NodeEntry]:
        if self.kind == "least_loaded":
            return [self._least_loaded_node().entry]
        if self.kind == "cache_aware":
            return [n.entry for n in self._cache_aware(self.policy, request)]
        return [n.entry for n in self.nodes]

    def _least_loaded_node(self) -> SimNode:
        heap = self._least_loaded
        while heap[0][3] != self._version[heap[0][4]]:
            heapq.heappop(heap)
        if len(heap) > 8 * len(self.nodes):  # drop the stale entries now and then
            heap[:] = [e for e in heap if e[3] == self._version[e[4]]]
            heapq.heapify(heap)
        return heap[0][4]

    def _cache_aware(self, policy: CacheAwarePolicy, request: SimRequest) -> set[SimNode]:
        full = request.hash_ids[: request.num_full_blocks]
        hit = self.holders.get(full[0], set()) if full else set()
        least = self._min_key(self._load_heap, self._by_load)
        out = set(hit)
        out.add(next(iter(self._by_load[least])))
        c = policy.config
        bound = max(least + c.balance_abs_requests, c.balance_ratio * least)
        point = policy.affinity_point(RouteRequest(_PromptTokens(request), 0))
        found_any = False
        for cost in self._costs_in_order():
            bucket = self._by_cost[cost]
            without_hit = next((n for n in bucket if n not in hit), None)
            if without_hit is None:
                continue
            if not found_any:
                out.add(without_hit)  # of the least cost of all: what the guard's count needs
                found_any = True
            nearest = self._nearest(point, bucket, hit, bound)
            if nearest is not None:
                out.add(nearest)
                break
        return out

    def _costs_in_order(self) -> Iterator[float]:
        first = self._min_key(self._cost_heap, self._by_cost)
        yield first
        yield from sorted(k for k in self._by_cost if k != first)

    def _nearest(
        self, point: int, bucket: set[SimNode], hit: set[SimNode], bound: float
    ) -> SimNode | None:
        """The node of ``bucket`` without a hit and within the guard nearest ``point`` on the
        ring: the policy's pick among them when they tie."""

        def qualifies(n: SimNode) -> bool:
            return n not in hit and n.entry.load_score <= bound

        if len(bucket) <= 64:
            eligible = [n for n in bucket if qualifies(n)]
            if not eligible:
                return None
            return min(
                eligible, key=lambda n: (ring_distance(point, n.entry.node_id), n.entry.node_id)
            )
        ring = self._ring
        start = bisect.bisect_left(ring, point, key=lambda item: item[0])
        for i in range(len(ring)):
            node = ring[(start + i) % len(ring)][1]
            if node in bucket and qualifies(node):
                return node
        return None


# ---- traces -------------------------------------------------------------------------------------


def replicate(records: Sequence[TraceRecord], copies: int, seed: int) -> list[TraceRecord]:
    """``copies`` independent copies of a trace: each copy's hash ids in a namespace of its own
    (copy c's id h is ``c * (max id + 1) + h``), its timestamps shifted by a seeded offset within
    the trace's duration; merged in time order."""
    if copies <= 1:
        return list(records)
    span = max((max(r.hash_ids, default=0) for r in records), default=0) + 1
    duration = max(r.timestamp_ms for r in records) if records else 0.0
    rng = random.Random(seed)
    out = []
    for c in range(copies):
        offset = rng.uniform(0, duration) if c else 0.0
        out += [
            dataclasses.replace(
                r,
                timestamp_ms=r.timestamp_ms + offset,
                hash_ids=tuple(c * span + h for h in r.hash_ids),
            )
            for r in records
        ]
    out.sort(key=lambda r: r.timestamp_ms)
    return out


# ---- results ------------------------------------------------------------------------------------


def summarize(requests: Sequence[SimRequest], nodes: Sequence[SimNode], seconds: float) -> dict:
    prompt = sum(r.input_length for r in requests)
    cached = sum(r.cached_tokens for r in requests)
    ttft = np.array([r.first_token_ms - r.arrival_ms for r in requests])
    tpot = np.array(
        [
            (r.done_ms - r.first_token_ms) / (r.output_length - 1)
            for r in requests
            if r.output_length > 1
        ]
    )
    routed = np.array([n.num_routed for n in nodes])
    start = min((r.arrival_ms for r in requests), default=0.0)
    end = max((r.done_ms for r in requests), default=0.0)
    output = sum(r.output_length for r in requests)

    def pct(values: np.ndarray, q: float) -> float | None:
        return float(np.percentile(values, q)) if len(values) else None

    return {
        "num_requests": len(requests),
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "tpot_p50_ms": pct(tpot, 50),
        "tpot_p99_ms": pct(tpot, 99),
        "load_imbalance": float(routed.max() / routed.mean()) if routed.sum() else 0.0,
        "output_throughput": output / ((end - start) / 1000.0) if end > start else 0.0,
        "run_seconds": seconds,
    }


def simulate(
    records: Sequence[TraceRecord],
    spec: FleetSpec,
    policy: str,
    routing: RoutingConfig | None = None,
    *,
    shortlist: bool = True,
    routed: list[tuple[str, int]] | None = None,
) -> dict:
    """One policy on one fleet: its summary."""
    node_tokens = spec.node_block_tokens or spec.block_tokens
    if spec.block_tokens % node_tokens:
        raise ValueError(
            f"the nodes' block ({node_tokens} tokens) must divide the trace's ({spec.block_tokens})"
        )
    per = spec.block_tokens // node_tokens
    spec = dataclasses.replace(spec, block_tokens=node_tokens, node_block_tokens=None)
    config = dataclasses.replace(routing or RoutingConfig(), policy=policy)
    sim = Simulation(spec, make_policy(config), shortlist)
    requests = [
        SimRequest(
            r.timestamp_ms, r.input_length, max(1, r.output_length),
            r.hash_ids if per == 1 else tuple(h * per + j for h in r.hash_ids for j in range(per)),
            node_tokens,
        )
        for r in records
    ]  # fmt: skip
    too_long = [
        r
        for r in requests
        if -(-(r.input_length + r.output_length) // spec.block_tokens) > spec.capacity_blocks
    ]
    if too_long:
        r = too_long[0]
        raise ValueError(
            f"{len(too_long)} requests need more than --capacity-blocks {spec.capacity_blocks} "
            f"blocks of {spec.block_tokens} tokens (e.g. {r.input_length} in + "
            f"{r.output_length} out)"
        )
    start = time.perf_counter()
    sim.run(requests)
    assert len(sim.finished) == len(requests), "a simulated request never finished"
    summary = summarize(requests, sim.nodes, time.perf_counter() - start)
    summary["guarded"] = getattr(sim.policy, "num_guarded", 0)
    if routed is not None:  # each request's node and cached tokens, in trace order
        routed += [(r.node_id, r.cached_tokens) for r in requests]
    return summary


# ---- `deepinfer sim` ----------------------------------------------------------------------------

_COLUMNS = (
    ("hit_rate", "hit rate", "{:.3f}"), ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"), ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
    ("tpot_p99_ms", "TPOT p99 ms", "{:.1f}"), ("load_imbalance", "imbalance", "{:.2f}"),
    ("output_throughput", "output tok/s", "{:.0f}"), ("run_seconds", "run s", "{:.1f}"),
)  # fmt: skip


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL (timestamp ms, ...)")
    p.add_argument("--nodes", type=int, required=True, help="nodes in the fleet")
    p.add_argument("--policies", default=",".join(ROUTING_POLICIES), help="comma-separated")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    p.add_argument("--block-tokens", type=int, default=512, help="the trace's block size")
    p.add_argument("--node-block-tokens", type=int, default=None,
                   help="the nodes' KV block size (default: the trace's)")  # fmt: skip
    p.add_argument("--capacity-blocks", type=int, default=FleetSpec.capacity_blocks,
                   help="device KV blocks per node")  # fmt: skip
    p.add_argument("--host-capacity-blocks", type=int, default=0,
                   help="blocks a node's host tier keeps after eviction")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=FleetSpec.max_num_seqs)
    p.add_argument("--replicate", type=int, default=1, help="independent copies of the trace")
    p.add_argument("--num-requests", type=int, default=None, help="the trace's first N only")
    p.add_argument("--seed", type=int, default=0, help="the copies' time offsets")
    speed = SpeedModel()
    p.add_argument("--prefill-ms-per-token", type=float, default=speed.prefill_ms_per_token)
    p.add_argument("--prefill-fixed-ms", type=float, default=speed.prefill_fixed_ms)
    p.add_argument("--decode-step-ms", default=",".join(f"{b}:{t}" for b, t in speed.decode_points),
                   help="decode step time by batch, BATCH:MS,... (linear between)")  # fmt: skip
    p.add_argument("--request-cost-tokens", type=int, default=RoutingConfig.request_cost_tokens)
    p.add_argument("--plot-dir", default=None, help="write a PNG of the policies' figures here")
    p.add_argument("--jobs", type=int, default=1, help="policies simulated at once (processes)")


def main(ns: argparse.Namespace) -> int:
    if ns.plot_dir:
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise ValueError(
                f"--plot-dir needs matplotlib ({e}): pip install 'deepinfer[test]' or matplotlib"
            ) from e
    policies = [p.strip() for p in ns.policies.split(",") if p.strip()]
    for policy in policies:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"--policies: {policy!r} is not one of {list(ROUTING_POLICIES)}")
    points = tuple(
        (int(b), float(t)) for b, t in (item.split(":") for item in ns.decode_step_ms.split(","))
    )
    spec = FleetSpec(
        num_nodes=ns.nodes, capacity_blocks=ns.capacity_blocks,
        host_capacity_blocks=ns.host_capacity_blocks, block_tokens=ns.block_tokens,
        node_block_tokens=ns.node_block_tokens,
        max_num_seqs=ns.max_num_seqs,
        speed=SpeedModel(ns.prefill_ms_per_token, ns.prefill_fixed_ms, points),
    )  # fmt: skip
    records = replicate(read_trace(ns.trace, ns.num_requests), ns.replicate, ns.seed)
    routing = RoutingConfig(request_cost_tokens=ns.request_cost_tokens)
    if ns.jobs > 1 and len(policies) > 1:
        # fork: the workers share the trace read here.
        context = multiprocessing.get_context("fork")
        with context.Pool(min(ns.jobs, len(policies))) as pool:
            runs = pool.starmap(simulate, [(records, spec, p, routing) for p in policies])
        results = dict(zip(policies, runs, strict=True))
    else:
        results = {policy: simulate(records, spec, policy, routing) for policy in policies}
    print(f"{len(records)} requests, {ns.nodes} nodes ({ns.trace}, x{ns.replicate})")
    print("| policy | " + " | ".join(title for _, title, _ in _COLUMNS) + " |")
    print("|---" * (len(_COLUMNS) + 1) + "|")
    for policy, r in results.items():
        cells = ["-" if r[key] is None else fmt.format(r[key]) for key, _, fmt in _COLUMNS]
        print(f"| {policy} | " + " | ".join(cells) + " |")
    out = {
        "trace": str(ns.trace), "num_requests": len(records), "replicate": ns.replicate,
        "fleet": dataclasses.asdict(spec), "policies": results,
    }  # fmt: skip
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    if ns.plot_dir:
        print(f"wrote {_plot(results, Path(ns.plot_dir), ns.nodes)}")
    return 0


def _plot(results: dict[str, dict], folder: Path, num_nodes: int) -> Path:
    from matplotlib.figure import Figure

    folder.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(12, 3.5))
    names = list(results)
    for ax, (key, title) in zip(
        figure.subplots(1, 3),
        (
            ("hit_rate", "hit rate"),
            ("ttft_p99_ms", "TTFT p99 (ms)"),
            ("load_imbalance", "max / mean requests"),
        ),
        strict=True,
    ):
        ax.bar(names, [results[n][key] or 0 for n in names])
        ax.set_title(title)
    figure.suptitle(f"deepinfer sim: {num_nodes} nodes")
    figure.tight_layout()
    path = folder / f"sim_{num_nodes}_nodes.png"
    figure.savefig(path)
    return path
