"""Deterministic steps: requests whose tokens run one per forward, beside a batched forward.

    SchedulerOutput -> deterministic_rows() -> forward_split(): the batched part in one forward
                                                                + each token of the others alone
                                                           -> logits rows in the step's layout

A matmul's or reduction's result depends on its shapes (split-K, tile choice, reduction order),
so a request that must give bit-identical logits alone, batched, chunked or recomputed runs
every token as a batch of one. Producer: the model runner (host); the forwards run on its device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from deepinfer.scheduler.output import SchedulerOutput

# One eager forward of a step: (logits [N, V] fp32, sample rows, prompt rows), the rows as
# ModelRunner._prepare lays them out.
Forward = Callable[
    [SchedulerOutput], tuple[torch.Tensor, list[tuple[int, int]], list[tuple[int, int, int]]]
]


def deterministic_rows(scheduler_output: SchedulerOutput, all_deterministic: bool) -> set[int]:
    """Scheduled requests whose tokens run one per forward: all when ``all_deterministic``
    (kernel.deterministic), else those that asked (SamplingParams.deterministic)."""
    scheduled = scheduler_output.scheduled
    if all_deterministic:
        return set(range(len(scheduled)))
    return {i for i, s in enumerate(scheduled) if s.request.sampling_params.deterministic}


def forward_split(
    scheduler_output: SchedulerOutput,
    sample_rows: list[tuple[int, int]],
    prompt_rows: list[tuple[int, int, int]],
    one_by_one: set[int],
    *,
    forward: Forward,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """The requests in ``one_by_one`` run one token per forward, so every matmul and
    reduction has the same shapes whatever else is batched and wherever chunks start: their
    results are bit-identical alone, batched, chunked or recomputed. The others run batched
    in one forward. ``sample_rows`` and ``prompt_rows`` lay out the whole step's logits; returns
    those rows, [N, V] fp32."""
    scheduled = scheduler_output.scheduled
    row_of: dict[tuple[int, int], int] = {}  # (scheduled index, token index) -> logits row
    for i, row, count in prompt_rows:
        for j in range(count):
            row_of[i, j] = row + j
    for i, row in sample_rows:
        row_of[i, scheduled[i].num_tokens - 1] = row
    rows: list[torch.Tensor | None] = [None] * len(row_of)
    batched = [i for i in range(len(scheduled)) if i not in one_by_one]
    if batched:
        part = SchedulerOutput(scheduled=[scheduled[i] for i in batched])
        logits, part_samples, part_prompts = forward(part)
        for k, row in part_samples:
            i = batched[k]
            rows[row_of[i, scheduled[i].num_tokens - 1]] = logits[row]
        for k, row, count in part_prompts:
            for j in range(count):
                rows[row_of[batched[k], j]] = logits[row + j]
    for i in sorted(one_by_one):
        sched = scheduled[i]
        for j, token_id in enumerate(sched.token_ids):
            one = dataclasses.replace(
                sched,
                token_ids=[token_id],
                start_pos=sched.start_pos + j,
                do_sample=(i, j) in row_of,  # asks the forward for this token's logits
                num_prompt_logprob_positions=0,
            )
            logits, _, _ = forward(SchedulerOutput(scheduled=[one]))
            if (i, j) in row_of:
                rows[row_of[i, j]] = logits[0]
    assert all(r is not None for r in rows), "a logits row was not computed"
    if not rows:  # a prefill chunk that neither samples nor scores prompt tokens
        return torch.empty(0, vocab_size, device=device)
    return torch.stack(rows)
