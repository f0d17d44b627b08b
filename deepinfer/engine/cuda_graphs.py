"""Decode and verification steps replayed from CUDA graphs.

    SchedulerOutput (decode / verify) -> padded plan (host) -> static input buffer -> replay
                                                         -> logits [B * rows, V] (+ hidden)

A decode step's launches depend only on the number of requests, the rows each has and the
widest entry list, so one graph per (batch bucket, context bucket, rows) serves every such
step: the requests are padded to the bucket with requests on the cache's scratch slot and block,
the entry lists to the context bucket (MIN_CONTEXT x 4^k, up to the model's context: 7 buckets
for a 1M context), and each request's tokens to the rows (1, and with drafts the powers of two
up to 1 + num_speculative_tokens: a verify step's last token and its drafts, ``SeqSpan.num_pad``
pads after a request with fewer). Inputs (token ids, positions and every index plan) live in
one static int64 buffer per graph, refilled with one copy before each replay. Every graph is
captured at start-up (``capture_all``, before the node reports ready), on scratch-only inputs
(so capture and its warm-up touch no request's cache), and they share one memory pool. A shape
missed there is captured when first seen, counted in ``num_captures_while_serving`` and logged
as a warning: capture takes 0.1-4 s, which every request in the step waits for.

Memory: a graph keeps only its input buffer of its own. Its intermediates are freed at the end
of its capture and reused by the next capture into the shared pool (graphs never run at the same
time), and every graph writes its logits into one buffer of [max_batch * max rows, V] fp32 (and,
for a model whose drafter reads the last layer's output, that output into one buffer too). Each
graph also keeps buffers of its own (about 25 MiB on V4-Flash shapes), so ``profile_memory``
captures them all on the scratch cache at start and keeps what they take out of the KV cache.
"""

from __future__ import annotations

import dataclasses
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


def context_bucket(num_positions: int, block_size: int, max_positions: int | None = None) -> int:
    """The context bound of a step whose longest request spans ``num_positions``:
    MIN_CONTEXT x CONTEXT_GROWTH^k, at least a block (the padded requests sit at the scratch
    block's last position), and no more than ``max_positions`` rounded up to a block (steps
    never span more; None: unbounded)."""
    longest = max(num_positions, block_size)
    bucket = MIN_CONTEXT
    while bucket < longest:
        bucket *= CONTEXT_GROWTH
    if max_positions is not None:
        bucket = min(bucket, max(MIN_CONTEXT, -(-max_positions // block_size) * block_size))
    return max(bucket, longest)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [n] int64: the flattened plan, refilled before each replay
    logits: torch.Tensor  # [bucket * rows, V] fp32, written by each replay (shared by all graphs)
    # Every tensor the graph reads must outlive it: were one made before capture and freed, its
    # memory would be reused and the replays would read garbage. The batch holds them all.
    batch: ForwardBatch
    hidden: torch.Tensor | None  # [bucket * rows, ...] the last layer's output (shared), or None


@dataclass
class GraphStep:
    """What one graphed step leaves: request i's token j is row i * rows + j (its pads follow
    its tokens; the padded requests' rows come last and are cut off)."""

    logits: torch.Tensor  # [num_reqs * rows, V] fp32
    rows: int
    hidden: torch.Tensor | None = None  # [num_reqs * rows, ...] when the model keeps it


def _layout(host: dict[str, np.ndarray]) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, array.shape) for name, array in host.items()]


def row_buckets(max_tokens: int) -> list[int]:
    """Rows per request of the graphs for steps of up to ``max_tokens`` tokens a request: the
    powers of two below it, and it (a step replays the smallest that holds its longest request:
    a verify step of fewer drafts, n-gram's or the confidence schedule's, pads less)."""
    return sorted(
        {1 << i for i in range(max_tokens.bit_length()) if 1 << i < max_tokens} | {max_tokens}
    )


def pad_spans(seqs: list[SeqSpan], rows: int, bucket: int, cache: KVCache) -> list[SeqSpan]:
    """A graphed step's spans: request i's tokens at rows i * rows on, then pads (``num_pad``);
    requests past ``seqs`` decode token 0 on the cache's scratch slot and block, at the block's
    last position (so their windows close, as a real request's may), then pads."""
    spans = [
        dataclasses.replace(s, offset=i * rows, num_tokens=rows, num_pad=rows - s.num_tokens)
        for i, s in enumerate(seqs)
    ]
    scratch = cache.scratch_slot, [cache.scratch_block]
    last = cache.block_size - 1
    spans += [
        SeqSpan(i * rows, rows, last, *scratch, num_pad=rows - 1) for i in range(len(seqs), bucket)
    ]
    return spans


class DecodeGraphs:
    """Producer of decode and verify logits for the model runner; device: the model's CUDA
    device."""

    def __init__(
        self,
        model: nn.Module,
        cache: KVCache,
        max_batch: int,
        capture: bool = True,
        max_positions: int | None = None,
        max_tokens: int = 1,
    ) -> None:
        """``capture`` False runs the same padded steps eagerly (on any device: the tests check
        the padded plans on the CPU this way). ``max_positions``: the longest request (the
        context limit); None leaves the context buckets unbounded. ``max_tokens``: the most
        tokens of a request in a step (1 + num_speculative_tokens with drafts): steps with
        drafts replay graphs of that many rows per request, the others graphs of one."""
        self.model, self.cache, self.capture = model, cache, capture
        self.device = cache.device
        self.buckets = [b for b in (1, 2, 4, 8) if b < max_batch]
        self.buckets += [*range(16, max_batch, 16), max_batch]
        self.row_buckets = row_buckets(max_tokens)
        self.max_positions = max_positions
        self.num_captures_while_serving = 0  # captures after capture_all(): should stay 0
        self.num_replays = 0
        self.num_verify_replays = 0  # replays of graphs with drafts (more than one row each)
        self._planner: StepPlanner | None = None  # built on the first plan
        self._is_warm = False  # capture_all() ran
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        if capture:
            self._pool = torch.cuda.graph_pool_handle()
            self._staging = PinnedStaging(self.device)
            # Every graph's logits, [max_batch * max rows, V] fp32: one buffer, not one per graph.
            vocab_size = model.args.vocab_size
            self._logits = torch.empty(self.max_rows, vocab_size, device=self.device)
            self._hidden: torch.Tensor | None = None  # made on the first capture that keeps it

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def max_rows(self) -> int:
        """Rows of the largest graph: max_batch requests of the most tokens."""
        return self.max_batch * self.row_buckets[-1]

    def can_run(self, scheduler_output: SchedulerOutput) -> bool:
        """Decode and verify steps: one token per request and its drafts (few enough), every
        position sampled, no prompt logprobs, few enough requests."""
        scheduled = scheduler_output.scheduled
        return 0 < len(scheduled) <= self.max_batch and all(
            s.num_tokens - s.num_draft_tokens == 1
            and s.num_tokens <= self.row_buckets[-1]
            and s.do_sample
            and not s.num_prompt_logprob_positions
            for s in scheduled
        )

    def run(
        self,
        scheduler_output: SchedulerOutput,
        fill_placeholders: Callable[[torch.Tensor, int], None] | None = None,
    ) -> GraphStep:
        """The step's logits (and the last layer's output), rows laid out as ``GraphStep``
        says, requests in scheduling order.

        ``fill_placeholders(input_ids, rows)`` writes the tokens still on the device into the
        step's input ids (a view of the static buffer; request i's tokens at rows i * rows
        on), after the plan is copied in and before the replay."""
        scheduled = scheduler_output.scheduled
        num_reqs = len(scheduled)
        bucket = next(b for b in self.buckets if b >= num_reqs)
        rows = next(r for r in self.row_buckets if r >= max(s.num_tokens for s in scheduled))
        context = self.context_bucket(max(s.start_pos + s.num_tokens for s in scheduled))
        seqs, token_ids = [], []
        for sched in scheduled:
            seqs.append(SeqSpan.of(0, sched, self.planner.num_history))
            token_ids += [*sched.token_ids, *[0] * (rows - sched.num_tokens)]
        host = self._plan(seqs, token_ids, bucket, context, rows)
        num = num_reqs * rows
        if not self.capture:
            # What a replay relies on: the plan's layout is the captured (scratch) plan's.
            scratch = self._plan([], [], bucket, context, rows)
            assert _layout(host) == _layout(scratch), "plan layout"
            inputs = torch.from_numpy(flatten(host)).to(self.device)
            batch = self._batch(inputs, host)
            if fill_placeholders is not None:
                fill_placeholders(batch.input_ids, rows)
            logits = self.model(batch, self.cache)[:num]
            hidden = None if batch.hidden is None else batch.hidden[:num]
            return GraphStep(logits, rows, hidden)
        graph = self._graphs.get((bucket, context, rows))
        if graph is None:
            if self._is_warm:
                self.num_captures_while_serving += 1
                logger.warning(
                    "capturing the decode graph for %d requests of %d tokens, context <= %d "
                    "while serving (missed at start-up)",
                    bucket,
                    rows,
                    context,
                )
            graph = self._capture(bucket, context, rows)
        self._staging.copy_into(flatten(host), graph.inputs)
        if fill_placeholders is not None:
            fill_placeholders(graph.batch.input_ids, rows)
        graph.graph.replay()
        self.num_replays += 1
        self.num_verify_replays += rows > 1
        hidden = None if graph.hidden is None else graph.hidden[:num]
        return GraphStep(graph.logits[:num], rows, hidden)

    def context_bucket(self, num_positions: int) -> int:
        """``context_bucket`` of this cache and model (module function)."""
        return context_bucket(num_positions, self.cache.block_size, self.max_positions)

    @property
    def context_buckets(self) -> list[int]:
        """Every context bucket a step can fall in (needs ``max_positions``)."""
        assert self.max_positions is not None, "context_buckets needs max_positions"
        buckets = [self.context_bucket(1)]
        while buckets[-1] < self.context_bucket(self.max_positions):
            buckets.append(self.context_bucket(buckets[-1] + 1))
        return buckets

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """(batch bucket, context bucket, rows) of every graph, smallest first."""
        return [
            (b, c, r) for r in self.row_buckets for c in self.context_buckets for b in self.buckets
        ]

    def capture_all(self, purpose: str = "captured") -> None:
        """Capture every graph now (start-up, or the memory profile on a scratch cache), with a
        progress bar; logs the time and memory."""
        from tqdm import tqdm

        started = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        shapes = [shape for shape in self.shapes if shape not in self._graphs]
        desc = "capturing decode graphs" if purpose == "captured" else f"{purpose} decode graphs"
        for bucket, context, rows in tqdm(shapes, desc=desc, unit="graph"):
            self._capture(bucket, context, rows, quiet=True)
        self._is_warm = True
        logger.info(
            "%s %d decode graphs (batch buckets %s x context buckets %s x tokens per request "
            "%s) in %.1f s, %+.1f MiB reserved",
            purpose,
            len(shapes),
            self.buckets,
            self.context_buckets,
            self.row_buckets,
            time.perf_counter() - started,
            (torch.cuda.memory_reserved(self.device) - reserved) / 2**20,
        )

    def _plan(
        self, seqs: list[SeqSpan], token_ids: list[int], bucket: int, context: int, rows: int
    ) -> dict[str, np.ndarray]:
        """The step of ``seqs`` (their tokens, ``rows`` per request) padded to the bucket
        (``pad_spans``). Every row gets logits."""
        token_ids = token_ids + [0] * ((bucket - len(seqs)) * rows)
        padded = pad_spans(seqs, rows, bucket, self.cache)
        return self.planner.arrays(padded, token_ids, list(range(bucket * rows)), context)

    @property
    def planner(self) -> StepPlanner:
        if self._planner is None:
            self._planner = StepPlanner.of(self.model, self.cache)
        return self._planner

    def _capture(self, bucket: int, context: int, rows: int, quiet: bool = False) -> _Graph:
        started = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        host = self._plan([], [], bucket, context, rows)
        inputs = torch.from_numpy(flatten(host)).to(self.device)
        batch = self._batch(inputs, host)
        # Warm up on a side stream (kernel compilation, library handles), then capture.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(batch, self.cache)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        num = bucket * rows
        hidden = None
        if batch.hidden is not None:  # the model keeps its last layer's output for a drafter
            if self._hidden is None:
                shape = (self.max_rows, *batch.hidden.shape[1:])
                self._hidden = batch.hidden.new_empty(shape)
            hidden = self._hidden[:num]
        graph = torch.cuda.CUDAGraph()
        logits = self._logits[:num]
        with torch.cuda.graph(graph, pool=self._pool):
            logits.copy_(self.model(batch, self.cache))
            if hidden is not None:
                hidden.copy_(batch.hidden)
        batch.hidden = None  # the capture's own, in the pool: the next capture reuses it
        torch.cuda.synchronize(self.device)
        captured = _Graph(graph, inputs, logits, batch, hidden)
        self._graphs[bucket, context, rows] = captured
        (logger.debug if quiet else logger.info)(
            "captured the decode graph for %d requests of %d tokens, context <= %d: %.0f ms, "
            "%+.1f MiB reserved (%d graphs)",
            bucket,
            rows,
            context,
            (time.perf_counter() - started) * 1e3,
            (torch.cuda.memory_reserved(self.device) - reserved) / 2**20,
            len(self._graphs),
        )
        return captured

    def _batch(self, inputs: torch.Tensor, host: dict[str, np.ndarray]) -> ForwardBatch:
        return self.planner.views(inputs, host, [])
