"""NodeMetrics: a node's Prometheus metrics (``deepinfer_*``, every one labelled ``node``).

Producer: AsyncEngine's observer hooks (counters, histograms; event loop thread) and the /metrics
handler (gauges, read from AsyncEngine.load() at scrape time). Consumer: Prometheus, through
``GET /metrics``. Each app owns its CollectorRegistry, so several nodes (and tests) can share a
process without name clashes in the global registry.

    deepinfer_requests_running / _waiting            gauge
    deepinfer_kv_blocks_used, deepinfer_kv_cache_usage_ratio   gauge
    deepinfer_prompt_tokens_total                    counter (at first admission)
    deepinfer_generation_tokens_total                counter
    deepinfer_cached_prompt_tokens_total{tier}       counter: device | host | disk
    deepinfer_preemptions_total                      counter (counted when the request ends)
    deepinfer_aborted_requests_total                 counter
    deepinfer_finished_requests_total{finish_reason} counter: stop | length | abort | error
    deepinfer_request_queue_time_seconds             histogram: arrival -> first admission
    deepinfer_step_time_seconds                      histogram: one engine step
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from deepinfer.scheduler.output import RequestOutputDelta
from deepinfer.scheduler.request import Request
from deepinfer.server.protocol import NodeLoad

if TYPE_CHECKING:
    from deepinfer.engine.llm_engine import LLMEngine

_QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)


class NodeMetrics:
    """Implements deepinfer.engine.async_engine.EngineObserver."""

    def __init__(self, node_id: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._node_id = node_id
        self._init_gauges(node_id)
        self._init_counters(node_id)
        self._init_histograms(node_id)

    def watch_engine(self, engine: LLMEngine) -> None:
        """Export the engine's prefix-cache and tier counters (LLMEngine.cache_stats) and its
        decode-graph captures (LLMEngine.graph_stats) at every scrape."""
        self.registry.register(CacheStatsCollector(self._node_id, engine.cache_stats))
        self._graph_stats = engine.graph_stats

    def _init_gauges(self, node_id: str) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["node"], registry=self.registry).labels(node_id)

        self.num_running = gauge("deepinfer_requests_running", "Requests running on the node")
        self.num_waiting = gauge("deepinfer_requests_waiting", "Requests waiting for admission")
        self.kv_blocks_used = gauge("deepinfer_kv_blocks_used", "KV cache blocks in use")
        self.kv_usage = gauge("deepinfer_kv_cache_usage_ratio", "Fraction of KV blocks in use")
        self.state_slots_used = gauge("deepinfer_state_slots_used", "Request state slots in use")
        self._graph_captures = Gauge(
            "deepinfer_decode_graph_captures",
            "Decode CUDA graphs captured, at start-up or while serving (which requests wait for)",
            ["node", "phase"],
            registry=self.registry,
        )
        self._graph_stats: Callable[[], dict[str, int]] = dict

    def _init_counters(self, node_id: str) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["node"], registry=self.registry).labels(node_id)

        self.prompt_tokens = counter("deepinfer_prompt_tokens", "Prompt tokens admitted")
        self.generation_tokens = counter("deepinfer_generation_tokens", "Tokens generated")
        self.preemptions = counter("deepinfer_preemptions", "Preemptions of ended requests")
        self.aborts = counter("deepinfer_aborted_requests", "Requests aborted")
        self._cached_prompt_tokens = Counter(
            "deepinfer_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache, by tier",
            ["node", "tier"],
            registry=self.registry,
        )
        self._cached_prompt_tokens.labels(node_id, "device")  # shown (at 0) from the start
        self._finished = Counter(
            "deepinfer_finished_requests",
            "Requests finished, by finish reason (stop | length | abort | error)",
            ["node", "finish_reason"],
            registry=self.registry,
        )

    def _init_histograms(self, node_id: str) -> None:
        self.queue_time = Histogram(
            "deepinfer_request_queue_time_seconds",
            "Time from arrival to first admission",
            ["node"],
            buckets=_QUEUE_TIME_BUCKETS,
            registry=self.registry,
        ).labels(node_id)
        self.step_time = Histogram(
            "deepinfer_step_time_seconds",
            "Time of one engine step (schedule, execute, update)",
            ["node"],
            buckets=_STEP_TIME_BUCKETS,
            registry=self.registry,
        ).labels(node_id)

    # -- EngineObserver ------------------------------------------------------------------------

    def on_scheduled(self, request: Request, queue_time_s: float) -> None:
        self.queue_time.observe(queue_time_s)
        self.prompt_tokens.inc(request.num_prompt_tokens)
        for tier, num_tokens in request.cached_tokens_by_tier.items():
            self._cached_prompt_tokens.labels(self._node_id, tier).inc(num_tokens)

    def on_step(self, step_time_s: float, deltas: list[RequestOutputDelta]) -> None:
        self.step_time.observe(step_time_s)
        num_generated = sum(len(delta.new_token_ids) for delta in deltas)
        if num_generated:
            self.generation_tokens.inc(num_generated)

    def on_finished(self, request: Request, finish_reason: str) -> None:
        self._finished.labels(self._node_id, finish_reason).inc()
        if finish_reason == "abort":
            self.aborts.inc()
        if request.num_preemptions:
            self.preemptions.inc(request.num_preemptions)

    # -- scrape --------------------------------------------------------------------------------

    def render(self, load: NodeLoad) -> bytes:
        """The text exposition format, gauges refreshed from ``load``."""
        self.num_running.set(load.num_running)
        self.num_waiting.set(load.num_waiting)
        num_used = load.num_total_blocks - load.num_free_blocks
        self.kv_blocks_used.set(num_used)
        self.state_slots_used.set(load.num_used_slots)
        for phase, count in self._graph_stats().items():
            self._graph_captures.labels(self._node_id, phase).set(count)
        self.kv_usage.set(num_used / load.num_total_blocks if load.num_total_blocks else 0.0)
        return generate_latest(self.registry)


class CacheStatsCollector:
    """Prefix-cache and KV-tier counters, read from the engine at scrape time.

    ``stats`` returns LLMEngine.cache_stats(): flat counters plus ``cached_tokens_by_tier``
    and ``tiers`` ({tier: TierStats}). Plain reads of ints the engine thread increments.
    """

    def __init__(self, node_id: str, stats: Callable[[], dict]) -> None:
        self._node_id = node_id
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        s, node = self._stats(), self._node_id
        if not s:
            return

        def family(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=["node", *labels])

        queries = family("deepinfer_prefix_cache_queries", "Prompt tokens looked up (tokens)", [])
        queries.add_metric([node], s["prefix_query_tokens"])
        hits = family("deepinfer_prefix_cache_hits", "Prompt tokens found, by tier", ["tier"])
        for tier, value in s["cached_tokens_by_tier"].items():
            hits.add_metric([node, tier], value)
        evicted = family("deepinfer_prefix_cache_evicted_blocks", "Blocks evicted from device", [])
        evicted.add_metric([node], s["evicted_blocks"])
        replayed = family("deepinfer_prefix_replayed_tokens", "Tokens replayed on hits", [])
        replayed.add_metric([node], s["replayed_tokens"])
        snapshots = family("deepinfer_kv_snapshots", "State snapshots by event", ["event"])
        for event in ("stored", "restored", "evicted"):
            snapshots.add_metric([node, event], s[f"snapshots_{event}"])
        tier_bytes = family("deepinfer_kv_tier_bytes", "Bytes moved by tier", ["tier", "direction"])
        tier_time = family(
            "deepinfer_kv_tier_seconds", "Seconds spent moving bytes", ["tier", "direction"]
        )
        tier_bad = family("deepinfer_kv_tier_corrupt_files", "Unreadable files ignored", ["tier"])
        tier_drop = family("deepinfer_kv_tier_dropped_writes", "Writes dropped", ["tier"])
        for tier, st in s["tiers"].items():
            tier_bytes.add_metric([node, tier, "read"], st.bytes_read)
            tier_bytes.add_metric([node, tier, "write"], st.bytes_written)
            tier_time.add_metric([node, tier, "read"], st.read_seconds)
            tier_time.add_metric([node, tier, "write"], st.write_seconds)
            tier_bad.add_metric([node, tier], st.corrupt_files)
            tier_drop.add_metric([node, tier], st.dropped_writes)
        yield from (queries, hits, evicted, replayed, snapshots, tier_bytes, tier_time)
        yield from (tier_bad, tier_drop)
