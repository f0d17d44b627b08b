"""Scheduler: decides each step which requests run and how many tokens each feeds (torch-free).

    add_request() ─▶ waiting ─▶ schedule() ─▶ SchedulerOutput ─▶ executor ─▶ ModelRunnerOutput
                                   ▲                                              │
                                   └──── running ◀── update() ─▶ deltas ◀─────────┘

Queues. An unfinished request sits in exactly one of them:

    waiting (deque, FCFS)                     running (list, admission order)
    front                          back       oldest                     newest
    [B', C', W1, W2, ...]                     [A, ...]
     ^ preempted requests go back to the       ^ scheduled first          ^ preempted first
       front; preempting C then B leaves                                    when blocks run out
       B' before C' (admission order kept)

One step spends one token budget (``max_num_batched_tokens``) on decode tokens and prefill chunks
alike: first every running request in admission order, each taking
``min(tokens not yet computed, budget left, long_prefill_token_threshold if > 0)``, so a request in
the middle of a chunked prefill just continues; then waiting requests, first come first served,
while a state slot and the blocks for their first chunk are free. ``schedule()`` advances
``num_computed_tokens`` at once (vLLM v1 style), so an asynchronous engine can schedule step N+1
before step N's tokens are known: a request whose step-N token is still on the device
(``num_pending_tokens``) decodes it as a placeholder, and blocks are reserved for that chunk
whether or not step N turns out to finish the request. ``update(N)`` then runs after step N+1
was scheduled: a request that step N finished is freed at once (its N+1 token is dropped; the
device runs steps in order, so whatever reuses its blocks runs after N+1 wrote them). A request
whose pending token ends it by length is not scheduled again. ``needs_sampled_tokens()`` says
when the next schedule needs the tokens on the host first (a block boundary whose hash names
the token).

Preemption is by recompute: the victim drops its blocks and state slot and later runs again from
position 0. A request never holds more than the whole KV pool, so a request finishes with
"length" at ``min(max_model_len, num_blocks * block_size)`` tokens; beyond that a lone request
would preempt itself forever.

One file of ~640 lines: ``schedule()`` and ``update()`` keep the queue invariants drawn above
together; prefix reuse, integrity checks and state slots are rooms of their own beside it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from deepinfer.config import SchedulerConfig
from deepinfer.scheduler.block_manager import BlockManager
from deepinfer.scheduler.drafts import (
    ConfidenceSchedule,
    Drafter,
    SpecDecodeStats,
    num_draft_slots,
)
from deepinfer.scheduler.integrity import check_integrity
from deepinfer.scheduler.output import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    RequestOutputDelta,
    ScheduledRequest,
    SchedulerOutput,
)
from deepinfer.scheduler.prefix_reuse import LowerTiers, PrefixCachingOptions, PrefixReuseManager
from deepinfer.scheduler.request import Request, RequestStatus
from deepinfer.scheduler.state_slots import StateSlotManager

logger = logging.getLogger(__name__)


class NoRoomError(ValueError):
    """A hand-off cannot be reserved now (requests, blocks or slots are all taken)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Iteration-level scheduler with chunked prefill and preemption by recompute."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        block_size: int,
        num_blocks: int,
        num_state_slots: int,
        max_model_len: int,
        prefix_caching: PrefixCachingOptions | None = None,
        tiers: LowerTiers | None = None,
        max_draft_tokens: int = 0,
    ) -> None:
        self._init_limits(config, block_size, num_blocks, max_model_len)
        # Speculative decoding (scheduler/drafts.py): the drafter, and the most drafts a step
        # verifies per request (what the cache can roll back).
        self.drafter: Drafter | None = None
        self.spec_stats = SpecDecodeStats()
        self.max_draft_tokens = max_draft_tokens
        # None: every request verifies all the drafts it may (fixed length); else how many the
        # drafter's confidence earns each, decided once per step.
        self.verify_schedule: ConfidenceSchedule | None = None
        self._verify_counts: dict[str, int] = {}
        self._init_managers(num_blocks, num_state_slots, prefix_caching, tiers)
        self._init_queues()

    def _init_limits(
        self, config: SchedulerConfig, block_size: int, num_blocks: int, max_model_len: int
    ) -> None:
        assert block_size >= 1, f"block_size must be >= 1, got {block_size}"
        assert max_model_len >= 2, f"max_model_len must be >= 2, got {max_model_len}"
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self._num_pool_tokens = num_blocks * block_size
        # A request finishes with "length" at this many tokens (see the module docstring).
        self._max_num_tokens = min(max_model_len, self._num_pool_tokens)

    def _init_managers(
        self,
        num_blocks: int,
        num_state_slots: int,
        prefix_caching: PrefixCachingOptions | None,
        tiers: LowerTiers | None,
    ) -> None:
        self.block_manager = BlockManager(num_blocks)
        self.state_slots = StateSlotManager(num_state_slots)
        self.prefix: PrefixReuseManager | None = None
        if prefix_caching is not None:
            self.prefix = PrefixReuseManager(
                prefix_caching, self.block_manager, self.block_size, tiers
            )

    def _init_queues(self) -> None:
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting: deque[Request] = deque()  # WAITING and PREEMPTED
        self._running: list[Request] = []  # RUNNING, in admission order
        # Hand-offs (prefill side): first token sampled, blocks and slot kept for export.
        self._held: dict[str, Request] = {}
        # Hand-offs (decode side): blocks and a slot kept for a request whose cache is on its way.
        self._reserved: dict[str, tuple[list[int], int]] = {}
        # Ids freed since the previous schedule(), reported to the executor by the next one.
        self._freed_ids: set[str] = set()
        self._preempted_ids: set[str] = set()

    # -- queries ----------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: the waiting requests' and the running ones' rest."""
        waiting = sum(r.num_prompt_tokens for r in self._waiting)
        running = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self._running)
        return waiting + running

    def needs_sampled_tokens(self) -> bool:
        """True when scheduling the next step needs a running request's pending token on the host
        first: with prefix caching, its next chunk ends a block whose hash (for a snapshot)
        covers it. (Penalties and min_tokens count it on the device; a grammar needs it before
        sampling only, see llm_engine.py.)"""
        if self.drafter is not None:  # drafts follow tokens the host has
            if getattr(self.drafter, "waits_for_every_step", False):
                return True
            return any(r.num_pending_tokens for r in self._running)
        if self.prefix is None:
            return False
        return any(
            r.num_pending_tokens and (r.num_computed_tokens + 1) % self.block_size == 0
            for r in self._running
        )

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id; None once it finished (or was never added)."""
        return self._requests.get(request_id)

    # -- requests in and out ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Validate a new request and queue it WAITING; ValueError names the limit it breaks."""
        request_id = request.request_id
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0, (
            f"request {request_id!r} is not new: {request.status.name}, "
            f"{request.num_computed_tokens} computed tokens"
        )
        num_prompt_tokens = request.num_prompt_tokens
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {num_prompt_tokens} tokens but "
                f"max_model_len is {self.max_model_len}; it must be shorter, to leave room for "
                "one output token"
            )
        if num_prompt_tokens + 1 > self._num_pool_tokens:
            raise ValueError(
                f"request {request_id!r}: the prompt has {num_prompt_tokens} tokens; with one "
                f"output token it needs {num_prompt_tokens + 1} KV positions but the KV pool "
                f"holds {self.block_manager.num_blocks} blocks x {self.block_size} tokens "
                f"= {self._num_pool_tokens}"
            )
        self._requests[request_id] = request
        self._waiting.append(request)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus, stop_reason: str | None = None
    ) -> list[str]:
        """End requests wherever they are (waiting, running, preempted) and free all they hold.

        For stops found on detokenized text (a stop string) and for aborts. Unknown or already
        finished ids are ignored; returns the ids actually finished.
        """
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        assert not isinstance(request_ids, str), f"pass a list of ids, not the str {request_ids!r}"
        finished = []
        for request_id in request_ids:
            if request_id in self._held:  # a hand-off not collected: its blocks go back
                self.release_held(request_id, status)
                finished.append(request_id)
                continue
            if self.unreserve(request_id):  # a hand-off that will not arrive
                finished.append(request_id)
                continue
            request = self._requests.get(request_id)
            if request is None:
                continue
            request.stop_reason = stop_reason
            self._finish(request, status)
            finished.append(request_id)
        return finished

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Abort requests in any state (FINISHED_ABORTED); returns the ids actually aborted."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # -- one step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and chunks, allocating blocks and slots (may preempt).

        ``freed_request_ids`` holds every id finished, aborted or preempted since the previous
        call (this call's preemptions included); ``preempted_request_ids`` the preempted subset.
        """
        scheduled: list[ScheduledRequest] = []
        if self.verify_schedule is not None:
            rates = {r.request_id: r.draft_confidence for r in self._running if r.draft_confidence}
            self._verify_counts = self.verify_schedule.counts(rates)
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled)
        # Admitting right after a preemption would hand the freed blocks to a newcomer (or back
        # to the victim) and preempt again next step. _preempted_ids is emptied below, so it is
        # non-empty here only if this call preempted.
        if not self._preempted_ids:
            self._schedule_waiting(budget, scheduled)
        output = SchedulerOutput(
            scheduled=scheduled,
            freed_request_ids=self._freed_ids,
            preempted_request_ids=self._preempted_ids,
        )
        if self.prefix is not None:
            output.block_offloads, self.prefix.cache.evicted = self.prefix.cache.evicted, []
            output.snapshot_offloads, self.prefix.snapshots.evicted = (
                self.prefix.snapshots.evicted,
                [],
            )
        self._freed_ids, self._preempted_ids = set(), set()
        return output

    def _schedule_running(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            num_new_tokens = self._num_new_tokens(request, budget)
            if num_new_tokens == 0:
                index += 1
                continue
            drafts = self._drafts(request, num_new_tokens, budget)
            end = request.num_computed_tokens + num_new_tokens + len(drafts)
            while not self._allocate_blocks(request, end):
                # Victims come from the tail, so requests already scheduled this step (ahead of
                # index) are never preempted; the tail may be this request itself.
                victim = self._running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                break  # it preempted itself, so it was the newest: nothing runs after it
            scheduled.append(self._schedule_chunk(request, num_new_tokens, drafts))
            budget -= num_new_tokens + len(drafts)
            index += 1
        return budget

    def _drafts(self, request: Request, num_new_tokens: int, budget: int) -> list[int]:
        """The drafter's guesses to verify after this chunk (none where drafts.py says so)."""
        if self.drafter is None:
            return []
        num_slots = num_draft_slots(
            request,
            end=request.num_computed_tokens + num_new_tokens,
            max_draft_tokens=self.max_draft_tokens,
            budget=budget - num_new_tokens,
            max_num_tokens=self._max_num_tokens,
            block_size=self.block_size if self.prefix is not None else None,
        )
        num_slots = min(num_slots, self._verify_counts.get(request.request_id, num_slots))
        return list(self.drafter.propose(request, num_slots))[:num_slots] if num_slots else []

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> None:
        # Strict FCFS: stop at the first request that does not fit, so a large request at the
        # front is not starved by smaller ones behind it.
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting[0]
            if not self.state_slots.can_allocate():
                break
            is_fresh = request.num_computed_tokens == 0 and not request.block_table
            if self.prefix is not None and is_fresh:
                self.prefix.admit(request)
            num_new_tokens = self._num_new_tokens(request, budget)
            assert num_new_tokens > 0, (
                f"waiting request {request.request_id!r} has {request.num_tokens} tokens, "
                f"{request.num_computed_tokens} computed"
            )
            if not self._allocate_blocks(request, request.num_computed_tokens + num_new_tokens):
                if self.prefix is not None:
                    self.prefix.undo_admit(request)
                break
            if self.prefix is not None:
                self.prefix.on_admitted(request)
            self._waiting.popleft()
            request.state_slot = self.state_slots.allocate()
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            scheduled.append(self._schedule_chunk(request, num_new_tokens))
            budget -= num_new_tokens

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        if request.num_pending_tokens and self._is_ended_by_pending(request):
            return 0
        num_to_compute = (
            request.num_tokens + request.num_pending_tokens - request.num_computed_tokens
        )
        num_new_tokens = min(num_to_compute, budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_new_tokens = min(num_new_tokens, threshold)
        # A recompute stops its chunk where prompt logprobs were already delivered, so that the
        # positions still wanted are always a prefix of a chunk (see _schedule_chunk).
        num_logprobs_scheduled = request.num_prompt_logprob_positions_scheduled
        if request.num_computed_tokens < num_logprobs_scheduled:
            num_new_tokens = min(
                num_new_tokens, num_logprobs_scheduled - request.num_computed_tokens
            )
        if self.prefix is not None:
            start = request.num_computed_tokens
            num_new_tokens = self.prefix.clip_chunk(request, start, start + num_new_tokens) - start
        return max(num_new_tokens, 0)

    def _is_ended_by_pending(self, request: Request) -> bool:
        """The tokens still on the device bring the request to a length limit: it finishes when
        they arrive, so computing past them would be wasted (and could need a block too many)."""
        num_tokens = request.num_tokens + request.num_pending_tokens
        max_tokens = request.sampling_params.max_tokens
        num_outputs = request.num_output_tokens + request.num_pending_tokens
        return (
            num_tokens >= self._max_num_tokens
            or (max_tokens is not None and num_outputs >= max_tokens)
            or (request.hand_off and num_outputs >= 1)
        )

    def _allocate_blocks(self, request: Request, end: int) -> bool:
        """Grow the block table to cover positions ``0 .. end - 1``; False if too few are free."""
        num_needed = _cdiv(end, self.block_size) - len(request.block_table)
        if num_needed <= 0:
            return True
        if not self.block_manager.can_allocate(num_needed):
            return False
        request.block_table.extend(self.block_manager.allocate(num_needed))
        return True

    def _schedule_chunk(
        self, request: Request, num_new_tokens: int, drafts: list[int] | None = None
    ) -> ScheduledRequest:
        """Build the chunk ``[start, start + num_new_tokens)`` and advance the counters.

        Prompt logprobs exist for positions ``p <= num_prompt_tokens - 2`` (position p scores
        token p + 1). Those not yet asked for are always a prefix of the chunk:

            chunk     [start .............................. end)
            wanted    [start ...... num_prompt_tokens - 1)            (or none)

        because a chunk starting before the delivered count ends at or before it (_num_new_tokens),
        and a chunk starting at or after it wants every prompt position it covers.
        """
        start = request.num_computed_tokens
        end = start + num_new_tokens
        num_logprob_positions = 0
        if request.sampling_params.prompt_logprobs is not None:
            num_scheduled = request.num_prompt_logprob_positions_scheduled
            if start >= num_scheduled:
                num_logprob_positions = max(0, min(end, request.num_prompt_tokens - 1) - start)
            assert num_logprob_positions == 0 or start == num_scheduled, (
                f"request {request.request_id!r}: chunk [{start}, {end}) would skip or repeat "
                f"prompt logprobs, {num_scheduled} already scheduled"
            )
            request.num_prompt_logprob_positions_scheduled += num_logprob_positions
        save_snapshot = None
        if self.prefix is not None:
            save_snapshot = self.prefix.snapshot_after(request, start, end)
        reuse = request.reuse
        restore_snapshot, reuse.restore_snapshot = reuse.restore_snapshot, None
        restore_key, reuse.restore_snapshot_key = reuse.restore_snapshot_key, None
        block_loads, reuse.block_loads = reuse.block_loads, []
        request.num_computed_tokens = end
        assert request.state_slot is not None, f"request {request.request_id!r} has no state slot"
        # Positions from num_tokens on hold tokens still on the device (asynchronous scheduling).
        known_end = min(end, request.num_tokens)
        token_ids = request.get_token_ids(start, known_end)
        token_ids += [PLACEHOLDER_TOKEN_ID] * (end - max(start, known_end))
        do_sample = end == request.num_tokens + request.num_pending_tokens
        request.num_pending_tokens += do_sample
        if drafts:
            assert do_sample, f"request {request.request_id!r}: drafts after a prefill chunk"
            token_ids += drafts
            request.num_computed_tokens += len(drafts)
            request.num_drafts_in_flight = len(drafts)
        return ScheduledRequest(
            request=request,
            token_ids=token_ids,
            start_pos=start,
            # A copy: the executor of an in-flight step must not see next step's blocks appear.
            block_table=list(request.block_table),
            state_slot=request.state_slot,
            do_sample=do_sample,
            num_prompt_logprob_positions=num_logprob_positions,
            num_draft_tokens=len(drafts or ()),
            restore_snapshot=restore_snapshot,
            restore_snapshot_key=restore_key,
            block_loads=block_loads,
            save_snapshot=save_snapshot,
            window_floor=reuse.window_floor,
            num_protected_tokens=reuse.num_protected_tokens,
        )

    def _preempt(self, request: Request) -> None:
        assert self._running[-1] is request, (
            f"preempting {request.request_id!r}, which is not the newest of {self.num_running} "
            "running requests"
        )
        self._running.pop()
        self._free_resources(request, RequestStatus.PREEMPTED)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0  # the steps in flight resample them after the recompute
        request.num_drafts_in_flight = 0
        request.num_preemptions += 1
        self._waiting.appendleft(request)
        self._preempted_ids.add(request.request_id)
        self._freed_ids.add(request.request_id)

    # -- results ----------------------------------------------------------------------------------

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutputDelta]:
        """Apply one executed step: append sampled tokens, apply token-level stops, free finished.

        Returns one delta per request that got a token or prompt logprobs this step, in schedule
        order. Requests finished (aborted, stopped on text) since the schedule() are skipped.
        """
        deltas = []
        if runner_output.verify_time_s is not None:
            self.spec_stats.record_verify_step(runner_output.verify_time_s)
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            if request.is_finished:
                continue
            # A request preempted after this step was scheduled recomputes (and resamples) later.
            sampled = scheduled.do_sample and request.status == RequestStatus.RUNNING
            token_ids = runner_output.sampled_token_ids.get(request.request_id) if sampled else None
            if sampled:
                assert token_ids, (
                    f"request {request.request_id!r} had do_sample but no sampled token came back"
                )
                self._roll_back_drafts(request, scheduled, len(token_ids))
            if self.prefix is not None and request.status == RequestStatus.RUNNING:
                self.prefix.on_step_done(request)
            new_prompt_logprobs = self._take_prompt_logprobs(scheduled, runner_output)
            new_token_ids: list[int] = []
            new_logprobs = None
            if sampled and runner_output.draft_token_ids is not None:
                request.drafter_state = runner_output.draft_token_ids.get(request.request_id)
                confidence = runner_output.draft_confidence or {}
                request.draft_confidence = confidence.get(request.request_id)
            if token_ids:
                request.num_pending_tokens -= 1
                logprobs = runner_output.logprobs.get(request.request_id)
                for n, token_id in enumerate(token_ids):
                    new_token_ids.append(token_id)
                    entry = None if logprobs is None else logprobs[n]
                    if self._append_token(request, token_id, entry):
                        break
                if logprobs is not None:
                    new_logprobs = logprobs[: len(new_token_ids)]
            if new_token_ids or new_prompt_logprobs is not None:
                deltas.append(
                    RequestOutputDelta(
                        request_id=request.request_id,
                        new_token_ids=new_token_ids,
                        new_logprobs=new_logprobs,
                        new_prompt_logprobs=new_prompt_logprobs,
                        finish_reason=request.finish_reason,
                        stop_reason=request.stop_reason,
                        num_cached_tokens=request.num_cached_tokens,
                    )
                )
        return deltas

    def _roll_back_drafts(
        self, request: Request, scheduled: ScheduledRequest, num_kept: int
    ) -> None:
        """The drafts the executor rejected were computed but are not tokens: uncount them."""
        num_rejected = scheduled.num_draft_tokens - (num_kept - 1)
        assert 0 <= num_rejected <= scheduled.num_draft_tokens, (
            f"request {request.request_id!r}: {num_kept} tokens for "
            f"{scheduled.num_draft_tokens} drafts"
        )
        request.num_computed_tokens -= num_rejected
        request.num_drafts_in_flight = 0
        if scheduled.num_draft_tokens:
            self.spec_stats.record(scheduled.num_draft_tokens, num_kept - 1)

    def _append_token(
        self, request: Request, token_id: int, logprobs: dict[int, float] | None
    ) -> bool:
        """Append one output token and apply its stops; True when it finished the request."""
        request.output_token_ids.append(token_id)
        is_rejected = request.matcher is not None and not request.matcher.accept(token_id)
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        status = self._check_stop(request, token_id)
        if is_rejected:
            # The sampler only draws allowed tokens: a rejection is a masking bug.
            logger.error(
                "request %r: token %d broke its output constraint; aborting it",
                request.request_id,
                token_id,
            )
            status = RequestStatus.FINISHED_ABORTED
        if status is not None:
            self._finish(request, status)
            return True
        if request.hand_off:
            self._hold(request)
            return True
        return False

    # -- prefill/decode hand-off ------------------------------------------------------------------

    def _hold(self, request: Request) -> None:
        """Prefill side: the first token is sampled; the request leaves the running queue with
        its blocks and slot held (its KV and state, for the decode side) until released."""
        self._running.remove(request)
        del self._requests[request.request_id]
        self._held[request.request_id] = request
        self._freed_ids.add(request.request_id)  # the executor forgets its per-request state

    def held_request(self, request_id: str) -> Request | None:
        """A hand-off whose first token is sampled and whose blocks are still held."""
        return self._held.get(request_id)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def release_held(
        self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_LENGTH
    ) -> None:
        """Free a held hand-off's blocks and slot (the full blocks stay in the prefix cache);
        ``status``: how it ended here (exported: FINISHED_LENGTH; not collected: ABORTED)."""
        request = self._held.pop(request_id)
        self._free_resources(request, status)
        request.status = status

    def reserve_hand_off(self, request_id: str, num_tokens: int) -> tuple[list[int], int]:
        """Decode side: keep blocks for positions 0 .. num_tokens - 1 and a state slot for a
        request computed elsewhere: (block ids, slot). ValueError when the id is in use,
        NoRoomError when there is no room now.
        ``add_handed_off`` takes them over; ``unreserve`` (or an abort) gives them back."""
        if request_id in self._requests or request_id in self._reserved:
            raise ValueError(f"request id {request_id!r} is already in use")
        num_blocks = _cdiv(num_tokens, self.block_size)
        num_seqs = len(self._running) + len(self._reserved)
        if num_seqs >= self.config.max_num_seqs:
            raise NoRoomError(f"{num_seqs} requests run or are on their way (max_num_seqs)")
        if not self.block_manager.can_allocate(num_blocks + 1):  # + the next token's
            raise NoRoomError(f"{num_blocks + 1} free KV blocks needed")
        if not self.state_slots.can_allocate():
            raise NoRoomError("no free state slot")
        reservation = (self.block_manager.allocate(num_blocks), self.state_slots.allocate())
        self._reserved[request_id] = reservation
        return reservation

    def reservation(self, request_id: str) -> tuple[list[int], int] | None:
        """(block ids, state slot) kept for a hand-off on its way, None if there is none."""
        return self._reserved.get(request_id)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def unreserve(self, request_id: str) -> bool:
        """Give a reservation back; False if there was none."""
        reserved = self._reserved.pop(request_id, None)
        if reserved is None:
            return False
        block_ids, slot = reserved
        self.block_manager.free(block_ids)
        self.state_slots.free(slot)
        return True

    def add_handed_off(self, request: Request) -> None:
        """Decode side: continue ``request`` (its prompt and first output token set, its cache
        written into its reservation's blocks and slot) as a running request."""
        assert request.output_token_ids, "a handed-off request has its first token"
        block_ids, slot = self._reserved.pop(request.request_id)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = request.num_prompt_tokens
        request.block_table, request.state_slot = list(block_ids), slot
        self._requests[request.request_id] = request
        self._running.append(request)

    def _take_prompt_logprobs(
        self, scheduled: ScheduledRequest, runner_output: ModelRunnerOutput
    ) -> list[dict[int, float]] | None:
        if scheduled.num_prompt_logprob_positions == 0:
            return None
        prompt_logprobs = runner_output.prompt_logprobs.get(scheduled.request_id)
        num_returned = -1 if prompt_logprobs is None else len(prompt_logprobs)
        assert num_returned == scheduled.num_prompt_logprob_positions, (
            f"request {scheduled.request_id!r}: {scheduled.num_prompt_logprob_positions} prompt "
            f"logprob positions scheduled, {num_returned} returned (-1: none)"
        )
        return prompt_logprobs

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        """Token-level stops, in order: EOS, stop token ids (both after min_tokens), lengths.

        EOS is checked first (as in vLLM), so an EOS id also listed in stop_token_ids reports
        stop_reason None.
        """
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id == request.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self._max_num_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self._running.remove(request)
            self._free_resources(request, status)
        else:
            self._waiting.remove(request)
        request.status = status
        request.num_pending_tokens = 0  # tokens of steps in flight are dropped
        request.num_drafts_in_flight = 0
        del self._requests[request.request_id]
        self._freed_ids.add(request.request_id)

    def _free_resources(self, request: Request, status: RequestStatus) -> None:
        if self.prefix is not None:
            self.prefix.on_release(request, status)
        request.reuse.num_protected_tokens = 0
        self.block_manager.free(request.block_table)
        request.block_table = []
        if request.state_slot is not None:
            self.state_slots.free(request.state_slot)
            request.state_slot = None

    # -- invariants -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError unless every block and slot in use is held by a running request
        (or a held hand-off, or a reservation)."""
        check_integrity(
            self,
            self._running,
            self._waiting,
            self._requests.keys(),
            list(self._held.values()),
            list(self._reserved.values()),
        )
