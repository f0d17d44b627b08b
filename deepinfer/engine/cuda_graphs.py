"""Decode steps replayed from CUDA graphs.

    SchedulerOutput (decode only) -> padded plan (host) -> static input buffer -> graph replay
                                                                               -> logits [B, V]

A decode step's launches depend only on the number of requests and the widest entry list, so
one graph per (batch bucket, context bucket) serves every such step: the requests are padded to
the bucket with requests on the cache's scratch slot and block, and the entry lists to the
context bucket (MIN_CONTEXT x 4^k, up to the model's context: 7 buckets for a 1M context).
Inputs (token ids, positions and every index plan) live in one static int64 buffer per graph,
refilled with one copy before each replay. Every (batch, context) graph is captured at start-up
(``capture_all``, before the node reports ready), on scratch-only inputs (so capture and its
warm-up touch no request's cache), and they share one memory pool. A shape missed there is
captured when first seen, counted in ``num_captures_while_serving`` and logged as a warning:
capture takes 0.1-4 s, which every request in the step waits for.

Memory: a graph keeps only its input buffer of its own. Its intermediates are freed at the end
of its capture and reused by the next capture into the shared pool (graphs never run at the same
time), and every graph writes its logits into one buffer of [max_batch, V] fp32. Each graph
also keeps buffers of its own (about 25 MiB on V4-Flash shapes), so ``profile_memory`` captures
them all on the scratch cache at start and keeps what they take out of the KV cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from deepinfer.engine.planner import StepPlanner
from deepinfer.engine.staging import PinnedStaging
from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch, SeqSpan, flatten
from deepinfer.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)

MIN_CONTEXT = 256  # smallest context bucket, tokens
CONTEXT_GROWTH = 4  # each context bucket is this many times the previous one


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [n] int64: the flattened plan, refilled before each replay
    logits: torch.Tensor  # [bucket, V] fp32, written by each replay (shared by all graphs)
    # Every tensor the graph reads must outlive it: were one made before capture and freed, its
    # memory would be reused and the replays would read garbage. The batch holds them all.
    batch: ForwardBatch


def _layout(host: dict[str, np.ndarray]) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, array.shape) for name, array in host.items()]


class DecodeGraphs:
    """Producer of decode logits for the model runner; device: the model's CUDA device."""

    def __init__(
        self,
        model: nn.Module,
        cache: KVCache,
        max_batch: int,
        capture: bool = True,
        max_positions: int | None = None,
    ) -> None:
        """``capture`` False runs the same padded steps eagerly (on any device: the tests check
        the padded plans on the CPU this way). ``max_positions``: the longest request (the
        context limit); None leaves the context buckets unbounded."""
        self.model, self.cache, self.capture = model, cache, capture
        self.device = cache.device
        self.buckets = [b for b in (1, 2, 4, 8) if b < max_batch]
        self.buckets += [*range(16, max_batch, 16), max_batch]
        self.max_positions = max_positions
        self.num_captures_while_serving = 0  # captures after capture_all(): should stay 0
        self.num_replays = 0
        self._planner: StepPlanner | None = None  # built on the first plan
        self._is_warm = False  # capture_all() ran
        self._graphs: dict[tuple[int, int], _Graph] = {}
        if capture:
            self._pool = torch.cuda.graph_pool_handle()
            self._staging = PinnedStaging(self.device)
            # Every graph's logits, [max_batch, V] fp32: one buffer instead of one per graph.
            vocab_size = model.args.vocab_size
            self._logits = torch.empty(self.max_batch, vocab_size, device=self.device)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def can_run(self, scheduler_output: SchedulerOutput) -> bool:
        """Decode only: one sampled token per request, no prompt logprobs, few enough requests."""
        scheduled = scheduler_output.scheduled
        return 0 < len(scheduled) <= self.max_batch and all(
            s.num_tokens == 1 and s.do_sample and not s.num_prompt_logprob_positions
            for s in scheduled
        )

    def run(
        self,
        scheduler_output: SchedulerOutput,
        fill_placeholders: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Logits [B, V] fp32 of the step's requests, in scheduling order.

        ``fill_placeholders`` writes the tokens still on the device into the step's input ids
        (a view of the static buffer), after the plan is copied in and before the replay."""
        scheduled = scheduler_output.scheduled
        num_reqs = len(scheduled)
        bucket = next(b for b in self.buckets if b >= num_reqs)
        context = self.context_bucket(max(s.start_pos + 1 for s in scheduled))
        seqs = [SeqSpan.of(i, s, self.planner.num_history) for i, s in enumerate(scheduled)]
        token_ids = [s.token_ids[0] for s in scheduled]
        host = self._plan(seqs, token_ids, bucket, context)
        if not self.capture:
            # What a replay relies on: the plan's layout is the captured (scratch) plan's.
            assert _layout(host) == _layout(self._plan([], [], bucket, context)), "plan layout"
            inputs = torch.from_numpy(flatten(host)).to(self.device)
            batch = self._batch(inputs, host)
            if fill_placeholders is not None:
                fill_placeholders(batch.input_ids)
            return self.model(batch, self.cache)[:num_reqs]
        graph = self._graphs.get((bucket, context))
        if graph is None:
            if self._is_warm:
                self.num_captures_while_serving += 1
                logger.warning(
                    "capturing the decode graph for %d requests, context <= %d while serving "
                    "(missed at start-up)",
                    bucket,
                    context,
                )
            graph = self._capture(bucket, context)
        self._staging.copy_into(flatten(host), graph.inputs)
        if fill_placeholders is not None:
            fill_placeholders(graph.batch.input_ids)
        graph.graph.replay()
        self.num_replays += 1
        return graph.logits[:num_reqs]

    def context_bucket(self, num_positions: int) -> int:
        """The context bound of a step whose longest request spans ``num_positions``:
        MIN_CONTEXT x CONTEXT_GROWTH^k, at least a block (the padded requests sit at the scratch
        block's last position), and no more than ``max_positions`` rounded up to a block
        (steps never span more)."""
        longest = max(num_positions, self.cache.block_size)
        bucket = MIN_CONTEXT
        while bucket < longest:
            bucket *= CONTEXT_GROWTH
        if self.max_positions is not None:
            block = self.cache.block_size
            bucket = min(bucket, max(MIN_CONTEXT, -(-self.max_positions // block) * block))
        return max(bucket, longest)

    @property
    def context_buckets(self) -> list[int]:
        """Every context bucket a step can fall in (needs ``max_positions``)."""
        assert self.max_positions is not None, "context_buckets needs max_positions"
        buckets = [self.context_bucket(1)]
        while buckets[-1] < self.context_bucket(self.max_positions):
            buckets.append(self.context_bucket(buckets[-1] + 1))
        return buckets

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """(batch bucket, context bucket) of every graph, smallest first."""
        return [(b, c) for c in self.context_buckets for b in self.buckets]

    def capture_all(self, purpose: str = "captured") -> None:
        """Capture every graph now (start-up, or the memory profile on a scratch cache), with a
        progress bar; logs the time and memory."""
        from tqdm import tqdm

        started = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        shapes = [shape for shape in self.shapes if shape not in self._graphs]
        desc = "capturing decode graphs" if purpose == "captured" else f"{purpose} decode graphs"
        for bucket, context in tqdm(shapes, desc=desc, unit="graph"):
            self._capture(bucket, context, quiet=True)
        self._is_warm = True
        logger.info(
            "%s %d decode graphs (batch buckets %s x context buckets %s) in %.1f s, "
            "%+.1f MiB reserved",
            purpose,
            len(shapes),
            self.buckets,
            self.context_buckets,
            time.perf_counter() - started,
            (torch.cuda.memory_reserved(self.device) - reserved) / 2**20,
        )

    def _plan(
        self, seqs: list[SeqSpan], token_ids: list[int], bucket: int, context: int
    ) -> dict[str, np.ndarray]:
        """The padded step: requests past ``seqs`` decode token 0 on the scratch slot and block,
        at the block's last position (so their windows close, as a real request's may)."""
        cache = self.cache
        last = cache.block_size - 1
        pad = [
            SeqSpan(i, 1, last, cache.scratch_slot, [cache.scratch_block])
            for i in range(len(seqs), bucket)
        ]
        token_ids = token_ids + [0] * len(pad)
        return self.planner.arrays(seqs + pad, token_ids, list(range(bucket)), context)

    @property
    def planner(self) -> StepPlanner:
        if self._planner is None:
            self._planner = StepPlanner.of(self.model, self.cache)
        return self._planner

    def _capture(self, bucket: int, context: int, quiet: bool = False) -> _Graph:
        started = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        host = self._plan([], [], bucket, context)
        inputs = torch.from_numpy(flatten(host)).to(self.device)
        batch = self._batch(inputs, host)
        # Warm up on a side stream (kernel compilation, library handles), then capture.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(batch, self.cache)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        logits = self._logits[:bucket]
        with torch.cuda.graph(graph, pool=self._pool):
            logits.copy_(self.model(batch, self.cache))
        torch.cuda.synchronize(self.device)
        captured = _Graph(graph, inputs, logits, batch)
        self._graphs[bucket, context] = captured
        (logger.debug if quiet else logger.info)(
            "captured the decode graph for %d requests, context <= %d: %.0f ms, %+.1f MiB "
            "reserved (%d graphs)",
            bucket,
            context,
            (time.perf_counter() - started) * 1e3,
            (torch.cuda.memory_reserved(self.device) - reserved) / 2**20,
            len(self._graphs),
        )
        return captured

    def _batch(self, inputs: torch.Tensor, host: dict[str, np.ndarray]) -> ForwardBatch:
        return self.planner.views(inputs, host, [])
