"""Spies on an engine's scheduler, for tests that must show a situation really happened."""

from __future__ import annotations

from deepinfer import LLM
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
