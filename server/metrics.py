"""Prometheus metrics of the coordinator (``GET /metrics``), one CollectorRegistry per app.

Names are ``deepinfer_*`` with vLLM's meanings (``vllm:time_to_first_token_seconds`` ->
``deepinfer_time_to_first_token_seconds``, ...), measured here, on the coordinator:

- TTFT: HTTP receipt -> first token delta from the node (includes parsing, encoding, queueing).
- inter-token latency: gap between successive token deltas (one per engine step), so ITL is per
  step as vLLM's benchmark counts it.
- e2e latency: HTTP receipt -> last delta. queue time: time waiting for an admission slot.
- running / waiting: requests in flight to nodes / waiting in the admission queue.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# vLLM's buckets for the same histograms.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST


class CoordinatorMetrics:
    """The coordinator's metrics; every series carries ``model_name``."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram(
            "deepinfer_time_to_first_token_seconds",
            "Time from HTTP receipt to the first token.",
            m, buckets=_TTFT_BUCKETS, registry=r,
        ).labels(model_name)  # fmt: skip
        self.itl = Histogram(
            "deepinfer_inter_token_latency_seconds",
            "Time between successive token deltas (one per engine step).",
            m, buckets=_ITL_BUCKETS, registry=r,
        ).labels(model_name)  # fmt: skip
        self.e2e = Histogram(
            "deepinfer_e2e_request_latency_seconds",
            "Time from HTTP receipt to the last token.",
            m, buckets=_LATENCY_BUCKETS, registry=r,
        ).labels(model_name)  # fmt: skip
        self.queue_time = Histogram(
            "deepinfer_request_queue_time_seconds",
            "Time spent waiting in the admission queue.",
            m, buckets=_LATENCY_BUCKETS, registry=r,
        ).labels(model_name)  # fmt: skip
        self._running = Gauge(
            "deepinfer_num_requests_running", "Requests in flight to nodes.", m, registry=r
        )
        self._waiting = Gauge(
            "deepinfer_num_requests_waiting", "Requests in the admission queue.", m, registry=r
        )
        self._nodes_ready = Gauge("deepinfer_num_nodes_ready", "Nodes in rotation.", m, registry=r)
        self.prompt_tokens = Counter(
            "deepinfer_prompt_tokens", "Prompt tokens of finished requests.", m, registry=r
        ).labels(model_name)
        self.cached_prompt_tokens = Counter(
            "deepinfer_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache.",
            m,
            registry=r,
        ).labels(model_name)
        self.generation_tokens = Counter(
            "deepinfer_generation_tokens", "Generated tokens.", m, registry=r
        ).labels(model_name)
        self.aborts = Counter(
            "deepinfer_num_aborted_requests",
            "Requests aborted on the node (client gone, timeout, drain).",
            m,
            registry=r,
        ).labels(model_name)
        self.retries = Counter(
            "deepinfer_num_request_retries",
            "Requests sent to another node after theirs failed before their first token.",
            m,
            registry=r,
        ).labels(model_name)
        self._rejections = Counter(
            "deepinfer_admission_rejections",
            "Requests refused by admission control.",
            ["model_name", "reason"],
            registry=r,
        )
        self._requests = Counter(
            "deepinfer_requests",
            "Finished requests by endpoint and finish reason (stop, length, abort, error).",
            ["model_name", "endpoint", "finished_reason"],
            registry=r,
        )

    def bind_gauges(
        self,
        num_running: Callable[[], float],
        num_waiting: Callable[[], float],
        num_nodes_ready: Callable[[], float],
    ) -> None:
        """Gauges read live state at scrape time instead of being kept in step by hand."""
        self._running.labels(self.model_name).set_function(num_running)
        self._waiting.labels(self.model_name).set_function(num_waiting)
        self._nodes_ready.labels(self.model_name).set_function(num_nodes_ready)

    def rejected(self, reason: str) -> None:
        self._rejections.labels(self.model_name, reason).inc()

    def finished(self, endpoint: str, finished_reason: str) -> None:
        self._requests.labels(self.model_name, endpoint, finished_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
