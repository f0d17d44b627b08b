"""Draft tokens for speculative decoding: who proposes them, and how many a step may verify.

    schedule(): a decoding request's chunk [its last token] -> [its last token, d1 .. dk]
    executor:   samples s0 .. sk at those k + 1 positions; keeps s0, then s(j) while d(j) == s(j-1)
    update():   appends the kept tokens (stops apply to each), rolls num_computed_tokens back
                over the rejected drafts (the executor rolls the cache state back)

Drafts are proposed only where a verification step gives exactly the tokens a plain run would:
a request decoding with every token on the host (no token in flight), not deterministic (those
run one token per forward), and, with prefix caching, drafts that stay inside the current block
(a block boundary is where a snapshot of the state is saved, and it must not include rejected
drafts). A grammar masks each drafted position with its state after the drafts before it
(``step_outputs.DraftedMatcher``).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from deepinfer.scheduler.request import Request


class Drafter(Protocol):
    """Proposes up to ``max_tokens`` guesses of the tokens after ``request``'s last one (from
    its prompt and output tokens); fewer, or none, is fine. A drafter whose drafts come with
    each step's results sets ``waits_for_every_step`` (the engine then completes every step
    before it schedules the next)."""

    def propose(self, request: Request, max_tokens: int) -> list[int]: ...


class ExecutorDrafter:
    """Drafts the executor proposed with the step that sampled the request's last token
    (``ModelRunnerOutput.draft_token_ids``, which ``Scheduler.update`` keeps in
    ``Request.drafter_state``): DeepSeek-V4's MTP layer runs after every step on the device."""

    waits_for_every_step = True

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        drafts = request.drafter_state
        return list(drafts[:max_tokens]) if isinstance(drafts, list) and max_tokens > 0 else []


def num_draft_slots(
    request: Request,
    *,
    end: int,
    max_draft_tokens: int,
    budget: int,
    max_num_tokens: int,
    block_size: int | None,
) -> int:
    """How many drafts a chunk ending at ``end`` (the request's known tokens) may verify:
    bounded by the cache's rollback margin, the step's token budget left, the length limits
    (the drafts and the token after them must fit) and, with prefix caching (``block_size``),
    the current block."""
    params = request.sampling_params
    if (
        max_draft_tokens <= 0
        or request.num_pending_tokens
        or end != request.num_tokens
        or params.deterministic
    ):
        return 0
    room = min(max_draft_tokens, budget, max_num_tokens - request.num_tokens - 1)
    if params.max_tokens is not None:
        room = min(room, params.max_tokens - request.num_output_tokens - 1)
    if block_size is not None:
        room = min(room, 0 if end % block_size == 0 else block_size - end % block_size - 1)
    return max(room, 0)


def accepted(drafts: list[int], samples: list[int]) -> list[int]:
    """The tokens a verification step keeps: ``samples[0]``, then each next sample while the
    draft fed at its position equals the sample before it (len(samples) == len(drafts) + 1)."""
    assert len(samples) == len(drafts) + 1, f"{len(samples)} samples for {len(drafts)} drafts"
    kept = samples[:1]
    for draft, sample in zip(drafts, samples[1:], strict=True):
        if draft != kept[-1]:
            break
        kept.append(sample)
    return kept


class NgramDrafter:
    """Prompt lookup (vLLM's ``ngram`` method): find the longest suffix of the request's tokens,
    ``min_n`` to ``max_n`` long, that occurred before in its prompt or output, and propose the
    tokens that followed its most recent earlier occurrence (the most recent with a full run of
    drafts after it, if any). No weights, no device work; it pays off where the output copies
    its context (code edits, quotes, retrieval answers).

    Per request it keeps the token ids as a growing numpy array (``Request.drafter_state``,
    dropped with the request): a proposal appends the tokens since the last one and scans the
    array once (O(tokens) vectorised), so a long prompt costs no per-step Python loop.
    """

    waits_for_every_step = False

    def __init__(self, min_n: int, max_n: int, vocab_size: int | None = None) -> None:
        assert 1 <= min_n <= max_n, f"n-gram sizes {min_n}..{max_n}"
        self.min_n, self.max_n = min_n, max_n
        # Ids from vocab_size on are an image's placeholders (deepinfer/images.py): never
        # proposed, a proposal stops before the first.
        self.vocab_size = vocab_size

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        tokens = _TokenArray.of(request)
        drafts = lookup(tokens.view(), self.min_n, self.max_n, max_tokens)
        if request.images and self.vocab_size is not None:
            drafts = list(itertools.takewhile(lambda t: t < self.vocab_size, drafts))
        return drafts


def lookup(tokens: np.ndarray, min_n: int, max_n: int, max_tokens: int) -> list[int]:
    """The prompt-lookup proposal for ``tokens`` (1-D int array): up to ``max_tokens`` ids that
    followed an earlier occurrence of the longest suffix of ``min_n``..``max_n`` tokens (the
    most recent one with ``max_tokens`` ids after it, else the most recent); [] when no suffix
    of ``min_n`` tokens occurred before."""
    length = len(tokens)
    if length < min_n + 1:
        return []
    # Candidate occurrences end at j (j < length - 1) where tokens[j] is the last token.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # suffix tokens matched backwards from j
    alive = np.ones(ends.size, dtype=bool)
    for back in range(1, min(max_n, length - 1)):
        earlier = ends - back
        alive &= earlier >= 0
        alive[alive] = tokens[earlier[alive]] == tokens[length - 1 - back]
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    starts = ends[matched == best] + 1
    # The most recent occurrence with max_tokens tokens after it, else the most recent one.
    full = starts[starts + max_tokens <= length]
    start = int(full[-1] if full.size else starts[-1])
    return tokens[start : start + max_tokens].tolist()


@dataclass
class _TokenArray:
    """A request's token ids as an int64 array that grows by doubling."""

    data: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    length: int = 0

    @classmethod
    def of(cls, request: Request) -> _TokenArray:
        state = request.drafter_state
        if not isinstance(state, cls):
            state = request.drafter_state = cls()
        state.extend(request.get_token_ids(state.length, request.num_tokens))
        return state

    def extend(self, ids: list[int]) -> None:
        end = self.length + len(ids)
        if end > len(self.data):
            grown = np.empty(max(end, 2 * len(self.data), 64), dtype=np.int64)
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[self.length : end] = ids
        self.length = end

    def view(self) -> np.ndarray:
        return self.data[: self.length]


# Upper bounds (s) of the verify-step time histogram's buckets (the last bucket is +Inf).
VERIFY_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_NUM_VERIFY_BUCKETS = len(VERIFY_TIME_BUCKETS) + 1


@dataclass(frozen=True)
class ConfidenceSchedule:
    """How many of its drafts each decoding request verifies in a step, from the drafter's
    confidence (``speculative.verify_schedule = "confidence"``; DeepSeek's engine's MTP varlen
    schedule: a step's cost from its token count).

    ``rates[r][j]`` estimates P(draft j + 1 accepted | the drafts before it accepted), so the
    cumulative product c[r][j] is the expected number of tokens that verifying draft j + 1 adds
    (given the ones before it verified). A step of T tokens costs ``cost(T)``: the measured
    ``curve`` of (tokens, ms) points, interpolated linearly (its last segment extended, its
    first value below it), or without one ``cost_tokens`` + T token-units (``cost_tokens``: a
    step's fixed cost in tokens' worth). N requests verifying k drafts yield N + sum(c) tokens
    in expectation: the schedule takes the k drafts of highest c (at most ``max_tokens``; 0: no
    bound) for the k that maximises (N + sum(c)) / cost(N + k). The c of a request never grow
    with j, so each request verifies a prefix of its drafts.

    Graphed steps (``batch_buckets`` and ``row_buckets``: the decode graphs' shapes) cost their
    graph's rows, not their tokens: N requests in the smallest batch bucket B >= N, each padded
    to the smallest row bucket that holds the longest request. There a step picks a row bucket
    r and every request verifies up to r - 1 drafts (a draft costs what its pad would), for the
    r that maximises (N + sum(c)) / cost(B r); one that verifies fewer in the same graph would
    pay the pads and gain less."""

    cost_tokens: float
    max_tokens: int = 0
    batch_buckets: tuple[int, ...] = ()
    row_buckets: tuple[int, ...] = ()
    curve: tuple[tuple[int, float], ...] = ()

    def cost(self, tokens: np.ndarray | int) -> np.ndarray:
        """A step's cost at ``tokens`` tokens (ms with a curve, else token-units)."""
        t = np.asarray(tokens, dtype=np.float64)
        if not self.curve:
            return self.cost_tokens + t
        x, y = (np.asarray(v, dtype=np.float64) for v in zip(*self.curve, strict=True))
        high = y[-1] + (t - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2])
        return np.where(t > x[-1], high, np.interp(t, x, y))  # below x[0]: y[0]

    def counts(self, rates: dict[str, list[float]]) -> dict[str, int]:
        """Drafts to verify per request id (every id of ``rates``)."""
        if not rates:
            return {}
        ids = list(rates)
        gains = [np.cumprod(np.asarray(rates[r], dtype=np.float64)) for r in ids]
        graphed = self.row_buckets and len(ids) <= max(self.batch_buckets, default=0)
        picked = self._graphed(gains) if graphed else self._free(gains)
        return dict(zip(ids, picked, strict=True))

    def _free(self, gains: list[np.ndarray]) -> list[int]:
        owner = np.concatenate([np.full(len(g), i) for i, g in enumerate(gains)])
        value = np.concatenate(gains)
        order = np.argsort(-value, kind="stable")  # ties: earlier requests, earlier drafts
        limit = len(order) if self.max_tokens <= 0 else min(self.max_tokens, len(order))
        n = len(gains)
        k = np.arange(limit + 1)
        gained = np.concatenate([[0.0], np.cumsum(value[order[:limit]])])
        best = int(np.argmax((n + gained) / self.cost(n + k)))
        return np.bincount(owner[order[:best]], minlength=n).tolist()

    def _graphed(self, gains: list[np.ndarray]) -> list[int]:
        n = len(gains)
        batch = min(b for b in self.batch_buckets if b >= n)
        best, best_value = [0] * n, -1.0
        for rows in self.row_buckets:
            counts = [min(rows - 1, len(g)) for g in gains]
            if rows > 1 and 0 < self.max_tokens < sum(counts):
                continue
            gained = sum(float(g[:c].sum()) for g, c in zip(gains, counts, strict=True))
            value = (n + gained) / float(self.cost(batch * rows))
            if value > best_value:
                best, best_value = counts, value
        return best


@dataclass
class SpecDecodeStats:
    """What verification steps did, for metrics (vLLM's spec_decode_* counters): one ``draft``
    is one verified run of draft tokens after a request's last token."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Drafts accepted at position 0, 1, ... of their run (grows to the longest run seen).
    accepted_per_position: list[int] = field(default_factory=list)
    # Runs by tokens they gained: accepted drafts + the token sampled after them (1 .. k + 1).
    acceptance_lengths: dict[int, int] = field(default_factory=dict)
    # Steps that verified drafts, by wall time from launch to their kept tokens (and drafts) on
    # the host: counts per VERIFY_TIME_BUCKETS bucket (+ one for +Inf), and their sum.
    verify_time_counts: list[int] = field(
        default_factory=lambda: [0] * (len(VERIFY_TIME_BUCKETS) + 1)
    )
    verify_time_sum: float = 0.0

    def record_verify_step(self, seconds: float) -> None:
        bucket = next((i for i, b in enumerate(VERIFY_TIME_BUCKETS) if seconds <= b), -1)
        self.verify_time_counts[bucket] += 1
        self.verify_time_sum += seconds

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            grow = num_draft_tokens - len(self.accepted_per_position)
            self.accepted_per_position += [0] * grow
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        length = num_accepted + 1
        self.acceptance_lengths[length] = self.acceptance_lengths.get(length, 0) + 1

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
