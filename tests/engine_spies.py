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
