"""NodeMetrics: a node's Prometheus metrics (``deepinfer_*``, labels ``component="node"``,
``model_name``, ``node``; the vocabulary is server/metrics.py's).

Producer: AsyncEngine's observer hooks (counters, histograms; event loop thread) and, at scrape
time, the engine's load and cache counters (collectors). Consumer: Prometheus, through
``GET /metrics`` of the node (or of `deepinfer serve`, merged with the coordinator's). Each app
owns its CollectorRegistry, so several nodes (and tests) can share a process.

    deepinfer_num_requests_running / _waiting          gauge       vllm:num_requests_*
    deepinfer_kv_blocks_used                           gauge
    deepinfer_kv_cache_usage_ratio                     gauge       vllm:kv_cache_usage_perc
    deepinfer_prompt_tokens_total                      counter     vllm:prompt_tokens_total
    deepinfer_generation_tokens_total                  counter     vllm:generation_tokens_total
    deepinfer_cached_prompt_tokens_total{tier}         counter: device | host | disk
    deepinfer_preemptions_total                        counter     vllm:num_preemptions_total
    deepinfer_aborted_requests_total                   counter
    deepinfer_finished_requests_total{finished_reason} counter     vllm:request_success_total
    deepinfer_iteration_tokens                         histogram   vllm:iteration_tokens_total
    deepinfer_request_prompt_tokens / _generation_tokens   histogram   vllm:request_*_tokens
    deepinfer_request_queue_time_seconds       histogram: arrival -> first admission    vllm:
    deepinfer_request_prefill_time_seconds     histogram: admission -> first token      vllm:
    deepinfer_request_decode_time_seconds      histogram: first token -> finish         vllm:
    deepinfer_request_inference_time_seconds   histogram: admission -> finish           vllm:
    deepinfer_step_time_seconds                histogram: one engine step
    deepinfer_prefix_cache_queries / _hits{tier}       counter     vllm:prefix_cache_*
    deepinfer_prefix_*, deepinfer_kv_snapshots, deepinfer_kv_tier_*   counters (cache_stats)
    deepinfer_lockstep_steps_total{rank,kind}         counter: forward | placeholder | idle
    deepinfer_expert_tokens_total{rank,expert}        counter: pairs each routed expert computed
    deepinfer_kv_transfer_bytes_total{direction,path}   counter: hand-offs' bytes (send | recv;
                                                      host | ipc)
    deepinfer_kv_transfer_seconds{direction}          histogram: one transfer, its wait included
    deepinfer_kv_transfer_failures_total{direction,reason}   counter: peer | timeout | checksum |
                                                      join | malformed
    deepinfer_kv_transfer_in_flight{direction}        gauge
    deepinfer_images_encoded_total / _image_cache_hits_total / _image_encode_seconds_total
                                                      counter: the vision tower (V4.1)
    deepinfer_spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens   counter  vllm:
    deepinfer_spec_decode_num_accepted_tokens_per_pos{position}   counter     vllm:
    deepinfer_spec_decode_acceptance_length    histogram: tokens a verified run gained (1..k+1)
    deepinfer_spec_decode_verify_step_seconds  histogram: a step that verified drafts
    (the kv_transfer series on prefill and decode nodes only: server/kv_transfer.py)

("vllm:" alone: the same name under vLLM's prefix.)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import ClassVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from deepinfer.outputs import FinishReason
from deepinfer.scheduler.drafts import VERIFY_TIME_BUCKETS
from deepinfer.scheduler.output import RequestOutputDelta
from deepinfer.scheduler.request import Request
from deepinfer.server.metrics import LATENCY_BUCKETS, render
from deepinfer.server.protocol import NodeLoad

_QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's buckets for request lengths)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class NodeMetrics:
    """Implements deepinfer.engine.async_engine.EngineObserver."""

    vllm_names: ClassVar[dict[str, tuple[str, ...]]] = {
        f"deepinfer_{name}": (f"vllm:{name}",)
        for name in (
            "num_requests_running",
            "num_requests_waiting",
            "prompt_tokens",
            "generation_tokens",
            "request_prompt_tokens",
            "request_generation_tokens",
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "request_inference_time_seconds",
            "prefix_cache_queries",
            "prefix_cache_hits",
        )
    } | {
        "deepinfer_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc",),  # a ratio there too
        "deepinfer_preemptions": ("vllm:num_preemptions",),
        "deepinfer_finished_requests": ("vllm:request_success",),
        "deepinfer_iteration_tokens": ("vllm:iteration_tokens_total",),
        "deepinfer_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
        "deepinfer_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
        "deepinfer_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
        "deepinfer_spec_decode_num_accepted_tokens_per_pos": (
            "vllm:spec_decode_num_accepted_tokens_per_pos",
        ),
    }

    def __init__(
        self,
        node_id: str,
        model_name: str,
        max_model_len: int,
        load: Callable[[], NodeLoad],
        *,
        export_vllm_names: bool = True,
    ) -> None:
        self.registry = CollectorRegistry()
        self.labels = ("node", model_name, node_id)
        self.export_vllm_names = export_vllm_names
        # Per request in flight: when it was first admitted, when its first token came.
        self._scheduled_at: dict[str, float] = {}
        self._first_token_at: dict[str, float] = {}
        self.registry.register(_LoadCollector(self.labels, load))
        self._init_counters()
        self._init_histograms(max_model_len)

    def watch_cache(self, stats: Callable[[], dict]) -> None:
        """Export prefix-cache and tier counters (LLMEngine.cache_stats) at every scrape."""
        self.registry.register(CacheStatsCollector(self.labels, stats))

    def watch_graphs(self, stats: Callable[[], dict[str, int]]) -> None:
        """Export the decode graphs captured at start-up and while serving
        (LLMEngine.graph_stats) at every scrape."""
        self.registry.register(_GraphCollector(self.labels, stats))

    def watch_drafts(self, stats: Callable[[], dict]) -> None:
        """Export the verification steps' counters (LLMEngine.spec_stats) at every scrape."""
        self.registry.register(_SpecDecodeCollector(self.labels, stats))

    def watch_images(self, stats: Callable[[], dict[str, float]]) -> None:
        """Export the vision tower's counters (LLMEngine.image_stats) at every scrape; nothing
        for a model without one."""
        self.registry.register(_ImageCollector(self.labels, stats))

    def watch_ranks(self, stats: Callable[[], dict]) -> None:
        """Export a lock-step rank's steps by kind and its experts' tokens
        (LLMEngine.rank_stats) at every scrape; nothing for an engine alone."""
        self.registry.register(_RankCollector(self.labels, stats))

    def watch_cache_events(self, last_seq: Callable[[], int]) -> None:
        """The number of the prefix cache's newest event for the router (server/cache_events.py);
        the coordinator's deepinfer_router_index_seq for this node catches up to it."""
        gauge = Gauge(
            "deepinfer_cache_event_seq",
            "The prefix cache's newest event published to the coordinator's router.",
            _LABELS,
            registry=self.registry,
        )
        gauge.labels(*self.labels).set_function(last_seq)

    def watch_transfers(self) -> TransferMetrics:
        """The hand-off transfer series (a prefill or decode node's KVTransfers observer)."""
        return TransferMetrics(self.registry, self.labels)

    def _init_counters(self) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=self.registry).labels(*self.labels)

        self.prompt_tokens = counter("deepinfer_prompt_tokens", "Node: prompt tokens admitted.")
        self.generation_tokens = counter("deepinfer_generation_tokens", "Node: tokens generated.")
        self.preemptions = counter("deepinfer_preemptions", "Preemptions of ended requests.")
        self.aborts = counter("deepinfer_aborted_requests", "Node: requests aborted.")
        self._cached_prompt_tokens = Counter(
            "deepinfer_cached_prompt_tokens",
            "Node: prompt tokens served from the prefix cache, by tier.",
            [*_LABELS, "tier"],
            registry=self.registry,
        )
        self._cached_prompt_tokens.labels(*self.labels, "device")  # shown (at 0) from the start
        self._finished = Counter(
            "deepinfer_finished_requests",
            "Node: finished requests by reason (stop, length, abort, error).",
            [*_LABELS, "finished_reason"],
            registry=self.registry,
        )

    def _init_histograms(self, max_model_len: int) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, doc, _LABELS, buckets=buckets, registry=self.registry)
            return family.labels(*self.labels)

        lengths = token_buckets(max_model_len)
        self.queue_time = histogram(
            "deepinfer_request_queue_time_seconds",
            "Node: time from arrival to first admission.",
            _QUEUE_TIME_BUCKETS,
        )
        self.prefill_time = histogram(
            "deepinfer_request_prefill_time_seconds",
            "Time from first admission to the first token.",
            LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "deepinfer_request_decode_time_seconds",
            "Time from the first token to the finish.",
            LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "deepinfer_request_inference_time_seconds",
            "Time from first admission to the finish.",
            LATENCY_BUCKETS,
        )
        self.step_time = histogram(
            "deepinfer_step_time_seconds",
            "Time of one engine step (schedule, execute, update).",
            _STEP_TIME_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "deepinfer_iteration_tokens",
            "Tokens one engine step ran (prefill chunks and decode tokens).",
            _ITERATION_TOKENS_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "deepinfer_request_prompt_tokens", "Prompt tokens of a finished request.", lengths
        )
        self.request_generation_tokens = histogram(
            "deepinfer_request_generation_tokens",
            "Generated tokens of a finished request.",
            lengths,
        )

    # -- EngineObserver ------------------------------------------------------------------------

    def on_scheduled(self, request: Request, queue_time_s: float) -> None:
        self._scheduled_at[request.request_id] = request.arrival_time + queue_time_s
        self.queue_time.observe(queue_time_s)
        self.prompt_tokens.inc(request.num_prompt_tokens)
        for tier, num_tokens in request.reuse.cached_tokens_by_tier.items():
            self._cached_prompt_tokens.labels(*self.labels, tier).inc(num_tokens)

    def on_step(
        self, step_time_s: float, deltas: list[RequestOutputDelta], num_scheduled_tokens: int
    ) -> None:
        now = time.monotonic()
        self.step_time.observe(step_time_s)
        if num_scheduled_tokens:
            self.iteration_tokens.observe(num_scheduled_tokens)
        num_generated = 0
        for delta in deltas:
            if delta.new_token_ids:
                num_generated += len(delta.new_token_ids)
                self._first_token_at.setdefault(delta.request_id, now)
        if num_generated:
            self.generation_tokens.inc(num_generated)

    def on_finished(self, request: Request, finish_reason: FinishReason) -> None:
        now = time.monotonic()
        self._finished.labels(*self.labels, finish_reason).inc()
        if finish_reason == FinishReason.ABORT:
            self.aborts.inc()
        if request.num_preemptions:
            self.preemptions.inc(request.num_preemptions)
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_generation_tokens.observe(request.num_output_tokens)
        scheduled_at = self._scheduled_at.pop(request.request_id, None)
        first_token_at = self._first_token_at.pop(request.request_id, None)
        if scheduled_at is not None:
            self.inference_time.observe(now - scheduled_at)
            if first_token_at is not None:
                self.prefill_time.observe(first_token_at - scheduled_at)
                self.decode_time.observe(now - first_token_at)

    # -- scrape --------------------------------------------------------------------------------

    def render(self) -> bytes:
        return render([self], export_vllm_names=self.export_vllm_names)


_LABELS = ("component", "model_name", "node")


class _LoadCollector:
    """The load gauges, from one ``load()`` (AsyncEngine.load) per scrape."""

    def __init__(self, labels: tuple[str, ...], load: Callable[[], NodeLoad]) -> None:
        self._labels = list(labels)
        self._load = load

    def collect(self) -> Iterator[GaugeMetricFamily]:
        load = self._load()
        num_used = load.num_total_blocks - load.num_free_blocks
        usage = num_used / load.num_total_blocks if load.num_total_blocks else 0.0
        for name, doc, value in (
            ("num_requests_running", "Node: requests running in the engine.", load.num_running),
            ("num_requests_waiting", "Node: requests waiting for admission.", load.num_waiting),
            ("kv_blocks_used", "KV cache blocks in use.", num_used),
            ("kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0 to 1).", usage),
            ("state_slots_used", "Request state slots in use.", load.num_used_slots),
        ):
            family = GaugeMetricFamily(f"deepinfer_{name}", doc, labels=_LABELS)
            family.add_metric(self._labels, value)
            yield family


class _GraphCollector:
    """Decode CUDA graphs captured, by phase: "startup", or "serving" (steps waited for those)."""

    def __init__(self, labels: tuple[str, ...], stats: Callable[[], dict[str, int]]) -> None:
        self._labels = list(labels)
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "deepinfer_decode_graph_captures",
            "Decode CUDA graphs captured, at start-up or while serving (requests wait for those).",
            labels=[*_LABELS, "phase"],
        )
        for phase, count in self._stats().items():
            family.add_metric([*self._labels, phase], count)
        yield family


class _ImageCollector:
    """Images the vision tower encoded, images found in its embeddings cache, and the seconds
    spent encoding (ImageEmbeddings' stats)."""

    _SERIES = (
        ("images_encoded_total", "num_encoded", "Images run through the vision tower."),
        ("image_cache_hits_total", "num_hits", "Images whose embeddings a step found cached."),
        ("images_received_total", "num_received", "Images whose embeddings an encode node sent."),
        ("image_host_tier_hits_total", "num_host_hits", "Of the hits, those from the host tier."),
        ("image_disk_tier_hits_total", "num_disk_hits", "Of the hits, those from the disk tier."),
        ("image_encode_seconds_total", "encode_seconds", "Seconds spent in the vision tower."),
    )

    def __init__(self, labels: tuple[str, ...], stats: Callable[[], dict[str, float]]) -> None:
        self._labels = list(labels)
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self._stats()
        if not stats:
            return
        for name, key, doc in self._SERIES:
            # CounterMetricFamily appends "_total" itself.
            family = CounterMetricFamily(f"deepinfer_{name[: -len('_total')]}", doc, labels=_LABELS)
            family.add_metric(self._labels, stats[key])
            yield family


class _SpecDecodeCollector:
    """Speculative decoding (scheduler/drafts.py SpecDecodeStats): drafts verified, their
    tokens, the accepted ones (in all and by position in the run), and the runs by tokens
    gained (accepted + 1) as a histogram. Nothing while no draft was verified."""

    def __init__(self, labels: tuple[str, ...], stats: Callable[[], dict]) -> None:
        self._labels = list(labels)
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        s, node = self._stats(), self._labels
        if not s.get("num_drafts"):
            return
        for key, doc in (
            ("num_drafts", "Runs of draft tokens verified."),
            ("num_draft_tokens", "Draft tokens verified."),
            ("num_accepted_tokens", "Draft tokens accepted."),
        ):
            family = CounterMetricFamily(f"deepinfer_spec_decode_{key}", doc, labels=_LABELS)
            family.add_metric(node, s[key])
            yield family
        per_pos = CounterMetricFamily(
            "deepinfer_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in their run (0: the first draft).",
            labels=[*_LABELS, "position"],
        )
        for position, count in enumerate(s["accepted_per_position"]):
            per_pos.add_metric([*node, str(position)], count)
        yield per_pos
        lengths = s["acceptance_lengths"]
        buckets, total = [], 0
        for length in range(1, max(lengths) + 1):
            total += lengths.get(length, 0)
            buckets.append((str(length), total))
        buckets.append(("+Inf", total))
        gained = HistogramMetricFamily(
            "deepinfer_spec_decode_acceptance_length",
            "Tokens one verified run gained: its accepted drafts + the token sampled after them.",
            labels=_LABELS,
        )
        gained.add_metric(node, buckets, sum_value=sum(n * c for n, c in lengths.items()))
        yield gained
        cumulative = list(itertools.accumulate(s["verify_time_counts"]))
        bounds = [str(b) for b in VERIFY_TIME_BUCKETS] + ["+Inf"]
        verify = HistogramMetricFamily(
            "deepinfer_spec_decode_verify_step_seconds",
            "Wall time of a step that verified drafts, launch to its kept tokens on the host "
            "(drafting on the device included).",
            labels=_LABELS,
        )
        verify.add_metric(
            node, list(zip(bounds, cumulative, strict=True)), sum_value=s["verify_time_sum"]
        )
        yield verify


class TransferMetrics:
    """Implements server/kv_transfer.py's TransferObserver (called from transfer threads;
    prometheus_client's metrics are thread-safe)."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, ...]) -> None:
        self.labels = labels
        by_direction = [*_LABELS, "direction"]
        self._bytes = Counter(
            "deepinfer_kv_transfer_bytes",
            "Node: bytes of hand-offs moved, by direction (send, recv) and path (host: through "
            "host memory and gloo; ipc: CUDA IPC on the GPU both nodes share).",
            [*by_direction, "path"],
            registry=registry,
        )
        self._seconds = Histogram(
            "deepinfer_kv_transfer_seconds",
            "Node: time of one hand-off transfer, its wait for the peer included.",
            by_direction,
            buckets=_TRANSFER_BUCKETS,
            registry=registry,
        )
        self._failures = Counter(
            "deepinfer_kv_transfer_failures",
            "Node: failed hand-off transfers by direction and reason (peer, timeout, checksum, "
            "join, malformed).",
            [*by_direction, "reason"],
            registry=registry,
        )
        self._in_flight = Gauge(
            "deepinfer_kv_transfer_in_flight",
            "Node: hand-off transfers in flight, by direction.",
            by_direction,
            registry=registry,
        )
        for direction in ("send", "recv"):  # shown (at 0) from the start
            self._bytes.labels(*labels, direction, "host")
            self._in_flight.labels(*labels, direction)

    def transfer_started(self, direction: str) -> None:
        self._in_flight.labels(*self.labels, direction).inc()

    def transfer_done(self, direction: str, path: str, num_bytes: int, seconds: float) -> None:
        self._in_flight.labels(*self.labels, direction).dec()
        self._bytes.labels(*self.labels, direction, path).inc(num_bytes)
        self._seconds.labels(*self.labels, direction).observe(seconds)

    def transfer_failed(self, direction: str, reason: str) -> None:
        self._in_flight.labels(*self.labels, direction).dec()
        self._failures.labels(*self.labels, direction, reason).inc()


class _RankCollector:
    """A lock-step rank: its steps (forward: its own tokens; placeholder: none, while others
    ran theirs; idle: the group had none), and the (token, slot) pairs each of its routed experts
    computed, summed over layers."""

    def __init__(self, labels: tuple[str, ...], stats: Callable[[], dict]) -> None:
        self._labels = list(labels)
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        s = self._stats()
        if not s:
            return
        labels = [*self._labels, str(s["rank"])]
        steps = CounterMetricFamily(
            "deepinfer_lockstep_steps",
            "Lock-step rank: steps by kind (forward, placeholder: none of its own, idle).",
            labels=[*_LABELS, "rank", "kind"],
        )
        idle = s["steps"] - s["forward_steps"] - s["placeholder_steps"]
        for kind, count in (
            ("forward", s["forward_steps"]),
            ("placeholder", s["placeholder_steps"]),
            ("idle", idle),
        ):
            steps.add_metric([*labels, kind], count)
        yield steps
        experts = CounterMetricFamily(
            "deepinfer_expert_tokens",
            "Lock-step rank: (token, slot) pairs its routed experts computed, summed over layers.",
            labels=[*_LABELS, "rank", "expert"],
        )
        for expert, count in s["expert_tokens"].items():
            experts.add_metric([*labels, str(expert)], count)
        yield experts


class CacheStatsCollector:
    """Prefix-cache and KV-tier counters, read from the engine at scrape time.

    ``stats`` returns LLMEngine.cache_stats(): flat counters plus ``cached_tokens_by_tier``
    and ``tiers`` ({tier: TierStats}). Plain reads of ints the engine thread increments.
    """

    def __init__(self, labels: tuple[str, ...], stats: Callable[[], dict]) -> None:
        self._labels = list(labels)
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        s, node = self._stats(), self._labels
        if not s:
            return

        def family(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=[*_LABELS, *labels])

        queries = family("deepinfer_prefix_cache_queries", "Prompt tokens looked up (tokens)", [])
        queries.add_metric(node, s["prefix_query_tokens"])
        hits = family("deepinfer_prefix_cache_hits", "Prompt tokens found, by tier", ["tier"])
        for tier, value in s["cached_tokens_by_tier"].items():
            hits.add_metric([*node, tier], value)
        evicted = family("deepinfer_prefix_cache_evicted_blocks", "Blocks evicted from device", [])
        evicted.add_metric(node, s["evicted_blocks"])
        replayed = family("deepinfer_prefix_replayed_tokens", "Tokens replayed on hits", [])
        replayed.add_metric(node, s["replayed_tokens"])
        snapshots = family("deepinfer_kv_snapshots", "State snapshots by event", ["event"])
        for event in ("stored", "restored", "evicted"):
            snapshots.add_metric([*node, event], s[f"snapshots_{event}"])
        tier_bytes = family("deepinfer_kv_tier_bytes", "Bytes moved by tier", ["tier", "direction"])
        tier_time = family(
            "deepinfer_kv_tier_seconds", "Seconds spent moving bytes", ["tier", "direction"]
        )
        tier_bad = family("deepinfer_kv_tier_corrupt_files", "Unreadable files ignored", ["tier"])
        tier_drop = family("deepinfer_kv_tier_dropped_writes", "Writes dropped", ["tier"])
        for tier, st in s["tiers"].items():
            tier_bytes.add_metric([*node, tier, "read"], st.bytes_read)
            tier_bytes.add_metric([*node, tier, "write"], st.bytes_written)
            tier_time.add_metric([*node, tier, "read"], st.read_seconds)
            tier_time.add_metric([*node, tier, "write"], st.write_seconds)
            tier_bad.add_metric([*node, tier], st.corrupt_files)
            tier_drop.add_metric([*node, tier], st.dropped_writes)
        yield from (queries, hits, evicted, replayed, snapshots, tier_bytes, tier_time)
        yield from (tier_bad, tier_drop)
