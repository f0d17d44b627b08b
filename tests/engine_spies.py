"""Spies on an engine's scheduler and executor, for tests that must show a situation really
happened."""

from __future__ import annotations

from typing import Any

from deepinfer import LLM
from deepinfer.engine.cuda_graphs import DecodeGraphs, GraphStep
from deepinfer.scheduler.output import SchedulerOutput


def record_preemptions(llm: LLM) -> list[str]:
    """The list that every later ``schedule()`` of ``llm``'s engine appends its preempted
    request ids to."""
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    preempted: list[str] = []

    def spy() -> SchedulerOutput:
        out = schedule()
        preempted.extend(out.preempted_request_ids)
        return out

    scheduler.schedule = spy
    return preempted


def graph_shaped(runner: Any, max_tokens: int = 1) -> list[tuple[int, int]]:
    """Make the model runner ``runner`` run its decode and verify steps as CUDA graphs run them
    (requests padded onto the scratch slot, entry lists to the context bucket, ``max_tokens``
    rows per request: its token and drafts, pads after fewer), eagerly, on the CPU. Returns the
    list every such step appends its (requests, rows per request) to."""
    runner.graphs = DecodeGraphs(
        runner.model, runner.kv_cache, max_batch=4, capture=False, max_tokens=max_tokens
    )
    run, steps = runner.graphs.run, []

    def spy(scheduler_output: SchedulerOutput, *args: Any) -> GraphStep:
        step = run(scheduler_output, *args)
        steps.append((len(scheduler_output.scheduled), step.rows))
        return step

    runner.graphs.run = spy
    return steps


class TruthDrafts:
    """Wraps a model runner's drafter layers (``runner.step_drafts.run``): records what they
    proposed after which tokens, and hands the scheduler the plain run's continuation instead
    (``outputs[i]``: the tokens ``prompts[i]`` got without drafts), every third guess wrong, so
    that verification accepts some drafts and rolls back the rest."""

    def __init__(self, run: Any, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.run = run
        self.truth = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}
        self.records: list[tuple[list[int], list[int]]] = []  # (tokens up to the last, drafts)

    def __call__(self, scheduled: list, hidden: Any, kept: dict[str, list[int]]) -> dict:
        drafts = self.run(scheduled, hidden, kept)
        for sched in scheduled:
            request, rid = sched.request, sched.request_id
            if rid not in drafts:
                continue
            tokens = request.get_token_ids(0, request.num_tokens) + kept[rid]
            self.records.append((tokens, drafts[rid]))
            truth = self.truth[tuple(request.prompt_token_ids)]
            done = len(tokens) - request.num_prompt_tokens
            guesses = list(truth[done : done + len(drafts[rid])])
            drafts[rid] = [t if (done + i) % 3 != 2 else t % 900 + 5 for i, t in enumerate(guesses)]
        return drafts
