"""Request: one generation request as the scheduler sees it (token ids only, torch-free).

Counts are stored, phases are derived:

    all_token_ids = prompt_token_ids + output_token_ids
    |<------------- num_tokens ------------->|
    |<-- num_computed_tokens -->|            |   tokens whose KV / state is on the device
                                |<- to run ->|   scheduled later (prefill chunks, or 1 decode token)

A running request in decode has ``num_computed_tokens == num_tokens - 1``: its newest sampled token
is fed in the next step. Preemption by recompute sets ``num_computed_tokens`` back to 0.

With asynchronous scheduling a step is scheduled before the previous one's tokens reach the host:
``num_pending_tokens`` counts the tokens sampled on the device and not yet appended, and the
next chunk may feed one as a placeholder (scheduler/output.py) that the executor fills in on the
device. Counting them, ``num_computed_tokens <= num_tokens + num_pending_tokens``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from deepinfer.images import PromptImage
from deepinfer.outputs import FinishReason
from deepinfer.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The finish reason of a finished status (None while unfinished)."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class TokenMatcher(Protocol):
    """What the scheduler needs of a grammar matcher (deepinfer.constraints.matcher.Matcher)."""

    def accept(self, token_id: int) -> bool: ...


@dataclass
class PrefixReuse:
    """One request's prefix-caching state (``Request.reuse``). Producer and consumer: the
    scheduler (scheduler/prefix_reuse.py's PrefixReuseManager, prefix_cache.py); each chunk
    carries its restore, block loads, window floor and protected tokens to the executor in its
    ScheduledRequest. Read elsewhere: ``cached_tokens_by_tier`` (the node's metrics)."""

    block_hashes: list[bytes] = field(default_factory=list)  # chain over full blocks so far
    num_inserted_blocks: int = 0  # leading blocks already offered to the prefix cache
    # A replay without a snapshot starts from an empty state at this position: keys before it
    # are not attended (they are not in the ring). 0 = no floor.
    window_floor: int = 0
    # Positions below this hold reused blocks: their entries are never written again.
    num_protected_tokens: int = 0
    num_replayed_tokens: int = 0  # tokens recomputed to rebuild the state slot on a hit
    restore_snapshot: int | None = None  # restored into the slot before the next chunk runs
    restore_snapshot_key: bytes | None = None  # ... or this snapshot staged from a lower tier
    # Blocks of the hit found in a lower tier: (device block id, hash), loaded before the step.
    block_loads: list[tuple[int, bytes]] = field(default_factory=list)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    pinned_snapshot: int | None = None  # kept from eviction until the restoring step ran
    # Snapshots written by the step in flight: (snapshot id, boundary hash, kept pending).
    snapshot_saves: list[tuple[int, bytes, bool]] = field(default_factory=list)
    pending_snapshot: tuple[int, bytes] | None = None  # newest decode-time boundary


@dataclass(eq=False)
class Request:
    """A request from admission to finish. Identity-hashed so it can live in sets."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Tokens sampled by scheduled steps whose results update() has not applied yet (0 or 1 with
    # synchronous scheduling, up to 2 with asynchronous).
    num_pending_tokens: int = 0
    # Prompt tokens served from a prefix cache at admission (0 until prefix caching exists).
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None
    # The stop token id (or stop string) that ended the request, when one did.
    stop_reason: int | str | None = None
    # One {token_id: logprob} per output token, when logprobs were asked for. Prompt logprobs are
    # only streamed in RequestOutputDelta (they can be large).
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # Prompt positions whose logprobs were asked of the executor. Advanced by schedule() together
    # with num_computed_tokens but never reset by preemption, so a recompute does not deliver them
    # twice.
    num_prompt_logprob_positions_scheduled: int = 0

    # Prefix caching: ``cache_salt`` isolates tenants; ``reuse`` is the scheduler's state.
    cache_salt: str | None = None
    reuse: PrefixReuse = field(default_factory=PrefixReuse)
    # Structured output: the grammar state after output_token_ids (None = unconstrained). Kept
    # across preemption: recompute replays the accepted tokens, it does not resample them.
    matcher: TokenMatcher | None = None
    # Speculative decoding: draft tokens the step in flight verifies after the request's last
    # token (0 when none is in flight). Set by schedule(), cleared by update().
    num_drafts_in_flight: int = 0
    # The drafter's own state for this request (the n-gram drafter's token array); it goes
    # with the request.
    drafter_state: Any = field(default=None, repr=False, compare=False)
    # The drafter's confidence in each of its last drafts (a drafter with a confidence head,
    # DSpark): what the confidence schedule reads.
    draft_confidence: list[float] | None = field(default=None, repr=False, compare=False)
    # Prefill/decode hand-off, prefill side: after its first output token the request leaves
    # the running queue with its blocks and slot held, until they are exported and released.
    hand_off: bool = False
    # The prompt's images, in prompt order (their positions hold placeholder ids; images.py).
    images: tuple[PromptImage, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt must not be empty")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without concatenating the whole sequence (decode: 1 id)."""
        num_prompt_tokens = len(self.prompt_token_ids)
        if start >= num_prompt_tokens:
            return self.output_token_ids[start - num_prompt_tokens : end - num_prompt_tokens]
        if end <= num_prompt_tokens:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason
