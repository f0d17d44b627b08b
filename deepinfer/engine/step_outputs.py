"""A step's outputs: its logits -> prompt logprobs and samples, the samples on their way to the
host (LaunchedStep) and on the device for the next launch (LastSamples).

    logits [N, V] fp32 ─┬─ prompt_logprobs() -> ModelRunnerOutput.prompt_logprobs (host, at once)
                        └─ sample() -> token ids [R] (device) ─┬─ copies to the host -> LaunchedStep
                                                               │   -> result() -> ModelRunnerOutput
                                                               └─ LastSamples -> the next launch's
                                                                   placeholders (never read back)

With async scheduling the scheduler schedules a request's next token before the host has its
previous one: that token is ``PLACEHOLDER_TOKEN_ID`` in the step (always a chunk's last token).
LastSamples keeps a launch's samples so that the next launch writes each one in for its
request's placeholder, gathered on the device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from deepinfer.constraints.matcher import Matcher, allowed_token_mask
from deepinfer.device import to_device
from deepinfer.ops.sampling import SamplerOutput, SamplingBackend
from deepinfer.scheduler.drafts import accepted
from deepinfer.scheduler.output import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)


def prompt_logprobs(
    sampling: SamplingBackend,
    scheduler_output: SchedulerOutput,
    logits: torch.Tensor,
    prompt_rows: list[tuple[int, int, int]],
    output: ModelRunnerOutput,
) -> None:
    """Into ``output``: the logprobs of each scored prompt token, from its rows of ``logits``
    (``sampling``: the kernels' sampling backend)."""
    for i, row, count in prompt_rows:
        sched = scheduler_output.scheduled[i]
        request = sched.request
        start = sched.start_pos + 1
        next_ids = request.prompt_token_ids[start : start + count]
        targets = torch.tensor(next_ids, dtype=torch.int64, device=logits.device)
        num_top = request.sampling_params.prompt_logprobs or 0
        output.prompt_logprobs[request.request_id] = sampling.compute_logprobs(
            logits[row : row + count], targets, num_top
        )


def sample(
    sampling: SamplingBackend,
    scheduler_output: SchedulerOutput,
    logits: torch.Tensor,
    sample_rows: list[tuple[int, int]],
    *,
    eos_token_id: int | None,
    generator: torch.Generator,
    last_samples: LastSamples,
) -> SamplerOutput | None:
    """The step's samples, on the device (None when no request samples). ``last_samples``:
    the previous launch's, for the requests whose newest token is still a placeholder."""
    if not sample_rows:
        return None
    scheduled = [scheduler_output.scheduled[i] for i, _ in sample_rows]
    requests = [s.request for s in scheduled]
    # A request's j-th sampled position (j > 0 with drafts) samples as if its first j drafts
    # were accepted: after them in the output history, one position further.
    draft_index = [0] * len(sample_rows)
    for n in range(1, len(sample_rows)):
        if sample_rows[n][0] == sample_rows[n - 1][0]:
            draft_index[n] = draft_index[n - 1] + 1
    outputs = [
        r.output_token_ids + s.token_ids[s.num_tokens - s.num_draft_tokens :][:j] if j else
        r.output_token_ids
        for r, s, j in zip(requests, scheduled, draft_index, strict=True)
    ]  # fmt: skip
    metadata = sampling.SamplingMetadata.build(
        [r.sampling_params for r in requests],
        prompt_token_ids=[r.prompt_token_ids for r in requests],
        output_token_ids=outputs,
        # The sampled token's position (the request's tokens still on the device included).
        positions=[
            s.start_pos + s.num_tokens - s.num_draft_tokens + j
            for s, j in zip(scheduled, draft_index, strict=True)
        ],
        eos_token_id=eos_token_id,
        device=logits.device,
        allowed_token_mask=allowed_token_mask(
            [
                r.matcher if r.matcher is None or not j else DraftedMatcher(r.matcher, out[-j:])
                for r, out, j in zip(requests, outputs, draft_index, strict=True)
            ],
            logits.shape[-1],
            logits.device,
        ),
        pending=last_samples.pending(scheduled),
    )
    rows = to_device(torch.tensor([row for _, row in sample_rows]), logits.device)
    return sampling.sample(logits[rows], metadata, generator)


class DraftedMatcher:
    """A request's grammar state after ``drafts`` (a drafted position's mask): the matcher is
    advanced through them and rolled back again around each read. A draft the grammar rejects
    ends the walk there: that draft cannot be accepted (the sample before it was masked), so the
    masks after it are never used."""

    def __init__(self, matcher: Matcher, drafts: list[int]) -> None:
        self.matcher, self.drafts = matcher, drafts

    @property
    def is_active(self) -> bool:
        with self._advanced():
            return self.matcher.is_active

    def fill_mask(self, bitmask_row: torch.Tensor) -> None:
        with self._advanced():
            self.matcher.fill_mask(bitmask_row)

    @contextlib.contextmanager
    def _advanced(self) -> Iterator[None]:
        num_accepted = 0
        for token_id in self.drafts:
            if not self.matcher.accept(token_id):
                break
            num_accepted += 1
        try:
            yield
        finally:
            self.matcher.rollback(num_accepted)


@dataclass
class LaunchedStep:
    """A step queued on the device. Producer: ModelRunner.launch. Consumer: the engine, which
    calls ``result()`` (once) when it needs the samples on the host.

    ``samples`` (host tensors, filled by copies queued after the sampler) belong to
    ``request_ids`` in order (a request with drafts once per sampled position); ``ready``
    (CUDA) is recorded after those copies. ``drafted``: the requests that verified drafts,
    whose rejected drafts ``roll_back`` undoes in the cache once the samples are known;
    ``after`` then completes the step with them.
    """

    output: ModelRunnerOutput  # prompt logprobs already in it
    request_ids: list[str] = field(default_factory=list)
    samples: SamplerOutput | None = None
    ready: torch.cuda.Event | None = None
    drafted: dict[str, ScheduledRequest] = field(default_factory=dict)
    roll_back: Callable[[ScheduledRequest, int], None] | None = None
    # Runs on the output once the kept tokens are in it (the MTP layer's drafts).
    after: Callable[[ModelRunnerOutput], None] | None = None
    launched_at: float = 0.0  # time.perf_counter() at the launch (a verify step's time)

    def result(self) -> ModelRunnerOutput:
        if self.samples is None:
            return self.output
        if self.ready is not None:
            self.ready.synchronize()
        output = self.output
        for rid, token_id, entry in zip(
            self.request_ids, self.samples.token_ids.tolist(), self.samples.logprobs, strict=True
        ):
            output.sampled_token_ids.setdefault(rid, []).append(token_id)
            if entry is not None:
                output.logprobs.setdefault(rid, []).append(entry)
        for rid, sched in self.drafted.items():
            drafts = sched.token_ids[sched.num_tokens - sched.num_draft_tokens :]
            kept = accepted(drafts, output.sampled_token_ids[rid])
            output.sampled_token_ids[rid] = kept
            if rid in output.logprobs:
                output.logprobs[rid] = output.logprobs[rid][: len(kept)]
            num_rejected = len(drafts) + 1 - len(kept)
            if num_rejected and self.roll_back is not None:
                self.roll_back(sched, num_rejected)
        if self.after is not None:
            self.after(output)
        if self.drafted:
            output.verify_time_s = time.perf_counter() - self.launched_at
        self.samples = None
        return output


class LastSamples:
    """The last launch's sampled ids [R] on the device, and each request's row in them: what the
    next launch's placeholders stand for. Producer: ModelRunner.launch (``record``). Consumers:
    the next launch's input ids (``fill_placeholders``) and sampler (``pending``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._samples: tuple[torch.Tensor, dict[str, int]] | None = None

    def record(self, token_ids: torch.Tensor, request_ids: list[str]) -> None:
        """``token_ids`` [R] int64 on the device: the samples of ``request_ids``, in order."""
        self._samples = (token_ids, {rid: j for j, rid in enumerate(request_ids)})

    def clear(self) -> None:
        """The last launch sampled nothing."""
        self._samples = None

    def fill_placeholders(
        self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor, stride: int = 0
    ) -> None:
        """Write into ``input_ids`` (the flat batch of ``scheduled``) the tokens that stand in for
        the previous launch's samples (``PLACEHOLDER_TOKEN_ID``, always a chunk's last token).
        ``stride``: request i's tokens start at row i * stride (a graphed step); 0: packed."""
        dst, request_ids, offset = [], [], 0
        for i, sched in enumerate(scheduled):
            first = i * stride if stride else offset
            offset += sched.num_tokens
            if sched.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                dst.append(first + sched.num_tokens - 1)
                request_ids.append(sched.request_id)
        if dst:
            input_ids[to_device(torch.tensor(dst), self.device)] = self._gather(request_ids)

    def pending(self, scheduled: list[ScheduledRequest]) -> tuple[list[int], torch.Tensor] | None:
        """The sampling rows whose newest output token is still on the device (fed in this step
        as a placeholder), and those tokens."""
        rows = [
            j
            for j, sched in enumerate(scheduled)
            if sched.start_pos + sched.num_tokens - sched.num_draft_tokens
            != sched.request.num_tokens
        ]
        if not rows:
            return None
        return rows, self._gather([scheduled[j].request_id for j in rows])

    def _gather(self, request_ids: list[str]) -> torch.Tensor:
        """[len(request_ids)] int64 on the device: each request's token sampled by the previous
        launch, gathered there (never read back)."""
        assert self._samples is not None, (
            f"requests {request_ids[:3]} wait for a token but no step sampled before"
        )
        tokens, row_of = self._samples
        rows = torch.tensor([row_of[rid] for rid in request_ids], dtype=torch.int64)
        return tokens[to_device(rows, self.device)]
