"""Boundary objects between the scheduler and the executor (CPU, torch-free).

Scheduler.schedule() -> SchedulerOutput -> executor (builds ForwardBatch) -> ModelRunnerOutput
-> Scheduler.update() -> list[RequestOutputDelta] -> engine / API
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.outputs import FinishReason
from deepinfer.scheduler.request import Request

# Stands in for a token sampled by the step in flight (asynchronous scheduling): the executor
# feeds that step's sampled id, still on the device, in its place.
PLACEHOLDER_TOKEN_ID = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Producer: Scheduler.schedule(). Consumer: the executor. Device: none (CPU lists).
    ``token_ids`` are fed at absolute positions ``start_pos .. start_pos + len(token_ids) - 1``.
    ``block_table`` covers every block those positions need (entries of a block are written when
    its compression windows close). ``state_slot`` holds the sliding-window rings and compressor
    buffers; ``start_pos == 0`` means the slot must be treated as empty. ``do_sample`` is set when
    the chunk reaches the end of the request's tokens, so the last position's logits are sampled.
    ``num_prompt_logprob_positions`` counts the positions of this chunk (from its first) whose
    prompt logprobs are wanted. A decode chunk scheduled while its request's previous token is
    still on the device is ``[PLACEHOLDER_TOKEN_ID]``.

    ``num_draft_tokens`` (speculative decoding, with ``do_sample``): the last that many of
    ``token_ids`` are drafted guesses of the tokens after the request's last one. The executor
    samples at each of the last ``num_draft_tokens + 1`` positions and keeps the samples while
    each draft equals the token sampled before it (``ModelRunnerOutput``), then rolls the
    request's cache state back over the rejected drafts.
    """

    request: Request
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    state_slot: int
    do_sample: bool
    num_prompt_logprob_positions: int = 0
    num_draft_tokens: int = 0
    # Prefix reuse (scheduler/prefix_reuse.py): copy snapshot -> slot before the chunk runs,
    # slot -> snapshot after it; keys before ``window_floor`` are not attended; entries of
    # positions below ``num_protected_tokens`` (reused blocks) are not written.
    restore_snapshot: int | None = None
    save_snapshot: int | None = None
    window_floor: int = 0
    num_protected_tokens: int = 0
    # Lower-tier hits: a snapshot staged under this key is restored instead of a device one;
    # these (block id, hash) get their content from the tiers before the forward.
    restore_snapshot_key: bytes | None = None
    block_loads: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def history_token_ids(self, num: int) -> list[int]:
        """The ``num`` token ids before ``start_pos`` (fewer near position 0). They are known
        on the host: only a chunk's last token can still be on the device."""
        start = self.start_pos
        assert start <= self.request.num_tokens, (
            f"request {self.request_id!r}: tokens before position {start} are not all known "
            f"({self.request.num_tokens})"
        )
        return self.request.get_token_ids(max(0, start - num), start)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_sampled_positions(self) -> int:
        """Positions whose logits are sampled: the last one and each draft's (0: none)."""
        return self.num_draft_tokens + 1 if self.do_sample else 0


@dataclass
class SchedulerOutput:
    """Everything the executor needs for one step.

    Producer: Scheduler.schedule(). Consumer: the executor. Device: none.
    ``freed_request_ids`` lists requests that gave up their blocks and slot since the previous
    step (finished, aborted or preempted) so the executor can drop per-request state it keeps;
    ``preempted_request_ids`` is the preempted subset (they run again later).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    freed_request_ids: set[str] = field(default_factory=set)
    preempted_request_ids: set[str] = field(default_factory=set)
    # Cached blocks / snapshots evicted from the device by this schedule: their content must be
    # copied to the lower tiers before the step overwrites it. (id, hash) pairs.
    block_offloads: list[tuple[int, bytes]] = field(default_factory=list)
    snapshot_offloads: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """What one executed step produced.

    Producer: the executor. Consumer: Scheduler.update(). Device: none (host values).
    ``sampled_token_ids`` has the tokens of each request that had ``do_sample``: one, or with
    drafts the accepted ones (1 to num_draft_tokens + 1, in order: each accepted draft, then the
    token sampled after the last of them). ``logprobs`` maps a request to one
    ``{token_id: logprob}`` per sampled token (that token plus the top-k asked for);
    ``prompt_logprobs`` maps a request to one such dict per prompt position of the chunk
    (position p holds the logprob of token p+1 given tokens <= p). ``draft_token_ids`` (an
    executor that drafts on the device, DeepSeek-V4's MTP layer; None otherwise): each sampled
    request's guesses of the tokens after its new last one, for the next step to verify.
    ``verify_time_s`` (a step that verified drafts, where the executor times it): wall time
    from its launch to its kept tokens on the host.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] | None = None
    draft_confidence: dict[str, list[float]] | None = None  # the drafter's, per draft (DSpark)
    verify_time_s: float | None = None


@dataclass
class RequestOutputDelta:
    """What changed for one request in one step.

    Producer: Scheduler.update(). Consumer: the engine (offline API, node server stream).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    new_prompt_logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Prompt tokens served from the prefix cache (fixed at the first admission).
    num_cached_tokens: int = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None
