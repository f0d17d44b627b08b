"""Prometheus metrics of the coordinator, and the exposition every `/metrics` uses.

One vocabulary for the coordinator and the node (server/node_metrics.py): names are
``deepinfer_*`` with vLLM's meanings and spelling (``num_requests_running``, ``finished_reason``),
every series carries ``component`` ("coordinator" | "node") and ``model_name``, a node's also
``node``. A family both components have (``deepinfer_num_requests_running``: requests in flight to
the nodes on the coordinator, running in the engine on a node) is one family with two
``component`` values; `deepinfer serve` exposes both components in one scrape.

vLLM's names (``vllm:*``) are exported too (``metrics.export_vllm_names``, on by default) for the
series that mean what vLLM's do, taken from the component vLLM measures them in: the latency
histograms from the coordinator (``VLLM_NAMES`` below), the engine's series from the node. No
``_created`` series (as vLLM).

Measured on the coordinator:

- TTFT: HTTP receipt -> first token delta from the node (includes parsing, encoding, queueing).
- inter-token latency: gap between successive token deltas (one per engine step), so ITL is per
  step as vLLM's benchmark counts it.
- e2e latency: HTTP receipt -> last delta. queue time: time waiting for an admission slot.
- running / waiting: requests in flight to nodes / waiting in the admission queue.
- a prefill/decode pair's request (server/pairing.py): its TTFT split into the prefill node's
  part (sent -> first token), the transfer (first token -> the decode node has the cache) and the
  decode node's first step (-> the second token), and its requests per pair.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar, Protocol

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from deepinfer.kv_cache.events import TIERS
from deepinfer.server.cache_index import CacheIndex, PrefixHit

prometheus_client.disable_created_metrics()

# vLLM's buckets for the same histograms.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ComponentMetrics(Protocol):
    """What ``render`` needs of CoordinatorMetrics and NodeMetrics."""

    registry: CollectorRegistry
    # deepinfer family -> the vLLM names it is exported under too.
    vllm_names: dict[str, tuple[str, ...]]


def render(parts: Sequence[ComponentMetrics], *, export_vllm_names: bool) -> bytes:
    """One scrape of ``parts``: same-named families merged, vLLM's names added."""
    families: dict[str, Metric] = {}
    mirrored: list[Metric] = []
    for part in parts:
        for family in part.registry.collect():
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            assert merged.type == family.type, f"{family.name}: {merged.type} vs {family.type}"
            if family.documentation not in merged.documentation:
                merged.documentation += f" | {family.documentation}"
            merged.samples += family.samples
            names = part.vllm_names.get(family.name, ()) if export_vllm_names else ()
            mirrored += [_renamed(family, name) for name in names]
    return generate_latest(_Families([*families.values(), *mirrored]))


def _renamed(family: Metric, name: str) -> Metric:
    out = Metric(name, family.documentation, family.type, family.unit)
    # Sample names are the family's plus a suffix (_total, _bucket, _sum, _count).
    out.samples = [s._replace(name=name + s.name[len(family.name) :]) for s in family.samples]
    return out


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class CoordinatorMetrics:
    """The coordinator's metrics; ``parts`` are what its `/metrics` shows (itself, and in
    `deepinfer serve` the in-process node's)."""

    vllm_names: ClassVar[dict[str, tuple[str, ...]]] = {
        "deepinfer_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
        "deepinfer_inter_token_latency_seconds": (
            "vllm:inter_token_latency_seconds",
            "vllm:time_per_output_token_seconds",  # vLLM's older name of the same
        ),
        "deepinfer_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    }

    def __init__(self, model_name: str, *, export_vllm_names: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.export_vllm_names = export_vllm_names
        self.parts: list[ComponentMetrics] = [self]
        r, m, labels = self.registry, ["component", "model_name"], ("coordinator", model_name)
        self.ttft = Histogram(
            "deepinfer_time_to_first_token_seconds",
            "Time from HTTP receipt to the first token.",
            m, buckets=_TTFT_BUCKETS, registry=r,
        ).labels(*labels)  # fmt: skip
        self.itl = Histogram(
            "deepinfer_inter_token_latency_seconds",
            "Time between successive token deltas (one per engine step).",
            m, buckets=_ITL_BUCKETS, registry=r,
        ).labels(*labels)  # fmt: skip
        self.e2e = Histogram(
            "deepinfer_e2e_request_latency_seconds",
            "Time from HTTP receipt to the last token.",
            m, buckets=LATENCY_BUCKETS, registry=r,
        ).labels(*labels)  # fmt: skip
        self.queue_time = Histogram(
            "deepinfer_request_queue_time_seconds",
            "Coordinator: time waiting in the admission queue.",
            m, buckets=LATENCY_BUCKETS, registry=r,
        ).labels(*labels)  # fmt: skip
        self._running = Gauge(
            "deepinfer_num_requests_running", "Coordinator: requests in flight to nodes.", m,
            registry=r,
        )  # fmt: skip
        self._waiting = Gauge(
            "deepinfer_num_requests_waiting", "Coordinator: requests in the admission queue.", m,
            registry=r,
        )  # fmt: skip
        self._nodes_ready = Gauge("deepinfer_num_nodes_ready", "Nodes in rotation.", m, registry=r)
        self.prompt_tokens = Counter(
            "deepinfer_prompt_tokens", "Coordinator: prompt tokens of finished requests.", m,
            registry=r,
        ).labels(*labels)  # fmt: skip
        self.cached_prompt_tokens = Counter(
            "deepinfer_cached_prompt_tokens",
            "Coordinator: prompt tokens of finished requests served from the prefix cache.",
            m,
            registry=r,
        ).labels(*labels)
        self.generation_tokens = Counter(
            "deepinfer_generation_tokens", "Coordinator: tokens streamed to clients.", m,
            registry=r,
        ).labels(*labels)  # fmt: skip
        self.aborts = Counter(
            "deepinfer_aborted_requests",
            "Coordinator: requests aborted on the node (client gone, timeout, drain).",
            m,
            registry=r,
        ).labels(*labels)
        self.retries = Counter(
            "deepinfer_request_retries",
            "Requests sent to another node after theirs failed before their first token.",
            m,
            registry=r,
        ).labels(*labels)
        self._rejections = Counter(
            "deepinfer_admission_rejections",
            "Requests refused by admission control.",
            [*m, "reason"],
            registry=r,
        )
        self._finished = Counter(
            "deepinfer_finished_requests",
            "Coordinator: finished requests by endpoint and reason (stop, length, abort, error).",
            [*m, "endpoint", "finished_reason"],
            registry=r,
        )
        self._handoff_phase = Histogram(
            "deepinfer_handoff_phase_seconds",
            "A prefill/decode pair's request: time of each phase (prefill: sent to the first "
            "token; transfer: to the decode node having the cache; first_decode: to the second "
            "token).",
            [*m, "phase"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self._predicted_cached = Counter(
            "deepinfer_router_predicted_cached_tokens",
            "Prompt tokens the router's cache index expected a request to find cached on its "
            "node (a prefill/decode pair: the prefill node), by source: index (published by "
            "the node), in_flight (in prompts of requests running there).",
            [*m, "node", "source"],
            registry=r,
        )
        self._reported_cached = Counter(
            "deepinfer_router_reported_cached_tokens",
            "Prompt tokens the node reported cached for the requests routed there.",
            [*m, "node"],
            registry=r,
        )
        self._mispredicted = Counter(
            "deepinfer_router_mispredicted_requests",
            "Requests whose cached tokens on the node differed from the router's prediction.",
            [*m, "node"],
            registry=r,
        )
        self._pair_requests = Counter(
            "deepinfer_pair_requests",
            "Requests sent to a prefill/decode pair, by pair and outcome (handed_off: the decode "
            "node took over; prefill_only: it ended with its first token; failed; aborted).",
            [*m, "prefill", "decode", "outcome"],
            registry=r,
        )

    def bind_gauges(
        self,
        num_running: Callable[[], float],
        num_waiting: Callable[[], float],
        num_nodes_ready: Callable[[], float],
    ) -> None:
        """Gauges read live state at scrape time instead of being kept in step by hand."""
        labels = ("coordinator", self.model_name)
        self._running.labels(*labels).set_function(num_running)
        self._waiting.labels(*labels).set_function(num_waiting)
        self._nodes_ready.labels(*labels).set_function(num_nodes_ready)

    def rejected(self, reason: str) -> None:
        self._rejections.labels("coordinator", self.model_name, reason).inc()

    def finished(self, endpoint: str, finished_reason: str) -> None:
        self._finished.labels("coordinator", self.model_name, endpoint, finished_reason).inc()

    def pair_request(
        self, prefill: str, decode: str, outcome: str, phases: dict[str, float]
    ) -> None:
        """A pair's request ended (server/pairing.py PairObserver)."""
        labels = ("coordinator", self.model_name)
        self._pair_requests.labels(*labels, prefill, decode, outcome).inc()
        for phase, seconds in phases.items():
            self._handoff_phase.labels(*labels, phase).observe(seconds)

    def cache_prediction(self, node_id: str, predicted: PrefixHit, reported: int) -> None:
        """A request finished on ``node_id``: the cached prompt tokens the router predicted
        there (published, and in blocks of requests in flight there), and those the node
        reported."""
        labels = ("coordinator", self.model_name, node_id)
        in_flight = predicted.in_flight
        self._predicted_cached.labels(*labels, "index").inc(predicted.num_tokens - in_flight)
        self._predicted_cached.labels(*labels, "in_flight").inc(in_flight)
        self._reported_cached.labels(*labels).inc(reported)
        if predicted.num_tokens != reported:
            self._mispredicted.labels(*labels).inc()

    def bind_router(self, index: CacheIndex, policy: object) -> None:
        """The cache index's size, events and resyncs per node, and the load guard's count,
        read at scrape time."""
        self.registry.register(_RouterCollector(self.model_name, index, policy))

    def render(self) -> bytes:
        return render(self.parts, export_vllm_names=self.export_vllm_names)


class _RouterCollector(Collector):
    def __init__(self, model_name: str, index: CacheIndex, policy: object) -> None:
        self.model_name = model_name
        self.index = index
        self.policy = policy

    def collect(self) -> Iterator[Metric]:
        base = ["coordinator", self.model_name]
        labels = ["component", "model_name"]
        blocks = GaugeMetricFamily(
            "deepinfer_router_index_blocks",
            "Blocks the coordinator's cache index holds per node and tier (a shared disk tier: "
            "on each node mounting it).",
            labels=[*labels, "node", "tier"],
        )
        events = CounterMetricFamily(
            "deepinfer_router_cache_events",
            "Cache events applied to the coordinator's index, per node.",
            labels=[*labels, "node"],
        )
        resyncs = CounterMetricFamily(
            "deepinfer_router_resyncs",
            "Snapshots asked of a node (it had none applied, or its events had a gap).",
            labels=[*labels, "node"],
        )
        seqs = GaugeMetricFamily(
            "deepinfer_router_index_seq",
            "The node's last cache event applied to the index (-1: waiting for a snapshot).",
            labels=[*labels, "node"],
        )
        for node_id, cache in self.index.nodes():
            for tier in TIERS:
                keys = cache.tier(tier)
                if keys is not None:
                    blocks.add_metric([*base, node_id, tier], len(keys))
            events.add_metric([*base, node_id], cache.num_events)
            resyncs.add_metric([*base, node_id], cache.num_resyncs)
            applied = cache.applied_seq
            seqs.add_metric([*base, node_id], -1 if applied is None else applied)
        yield from (blocks, events, resyncs, seqs)
        guarded = getattr(self.policy, "num_guarded", None)
        if guarded is not None:
            family = CounterMetricFamily(
                "deepinfer_router_guarded_choices",
                "Requests whose cheapest nodes the load guard all left out (too loaded).",
                labels=labels,
            )
            family.add_metric(base, guarded)
            yield family
