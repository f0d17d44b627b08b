"""The per-step agreement of lock-step ranks: one small collective before every step.

Every rank runs every MoE layer's collectives each step the group runs, so the ranks must agree
on whether the group runs one before anyone starts it::

    rank r:  schedule -> RankStep(tokens, decode_only, unfinished) --all_gather--> GroupStep
             GroupStep.runs:      its own tokens -> the forward; none -> a placeholder step
                                  (the MoE exchanges only, serving its experts to the others)
             not GroupStep.runs:  nothing (no rank has tokens; the loop goes on while any rank
                                  still has unfinished requests)

Everything that must agree comes out of the collective, never from one rank's own state: an
abort, a finish or a preemption on one rank changes only what it reports next. Served ranks
(AsyncEngine) also agree on when to stop: each reports that it is leaving, and they stop together
at the first step where every rank is leaving and none has requests left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankStep:
    """What one rank reports before a step."""

    num_tokens: int  # tokens it scheduled
    decode_only: bool  # every scheduled request decodes one token (graphs could run it)
    unfinished: bool  # it has requests left (scheduled, waiting or in flight)
    leaving: bool = False  # it is stopping (a served rank's drain): it takes no new requests


@dataclass(frozen=True)
class GroupStep:
    """What every rank learns: the same on all of them."""

    num_tokens: tuple[int, ...]  # per rank
    decode_only: bool  # every rank with tokens decodes only
    unfinished: bool  # some rank has requests left
    leaving: bool = False  # every rank is stopping

    @property
    def has_left(self) -> bool:
        """Every rank is stopping and none has requests left: they all stop after this step."""
        return self.leaving and not self.unfinished

    @property
    def runs(self) -> bool:
        """The group runs a step: every rank runs the forward or a placeholder."""
        return any(self.num_tokens)


@dataclass
class LockStepStats:
    steps: int = 0  # agreements
    forward_steps: int = 0  # steps this rank ran with its own tokens
    placeholder_steps: int = 0  # steps it ran with none, for the others
    # Steps the group ran with every rank decode-only (or idle): those a static-shape exchange
    # could run as decode graphs (expert parallelism over ranks runs them eager today).
    decode_only_steps: int = 0
    agree_seconds: float = 0.0  # host time in the agreement collective
    tokens_by_rank: list[int] = field(default_factory=list)  # summed over steps

    def as_dict(self) -> dict[str, float | int | list[int]]:
        return dict(self.__dict__)


class LockStep:
    """The agreement over the group's host-side (gloo) process group."""

    def __init__(self, group: dist.ProcessGroup, world_size: int) -> None:
        self.group = group
        self.world_size = world_size
        self.stats = LockStepStats(tokens_by_rank=[0] * world_size)
        self.last = GroupStep((0,) * world_size, True, False)

    def agree(self, mine: RankStep) -> GroupStep:
        start = time.perf_counter()
        local = torch.tensor([mine.num_tokens, mine.decode_only, mine.unfinished, mine.leaving])
        every = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(every, local, group=self.group)
        rows = torch.stack(every).tolist()
        step = GroupStep(
            num_tokens=tuple(r[0] for r in rows),
            decode_only=all(r[1] for r in rows if r[0]),
            unfinished=any(r[2] for r in rows),
            leaving=all(r[3] for r in rows),
        )
        stats = self.stats
        stats.agree_seconds += time.perf_counter() - start
        stats.steps += 1
        if step.runs:
            if mine.num_tokens:
                stats.forward_steps += 1
            else:
                stats.placeholder_steps += 1
            stats.decode_only_steps += step.decode_only
        stats.tokens_by_rank = [
            a + b for a, b in zip(stats.tokens_by_rank, step.num_tokens, strict=True)
        ]
        self.last = step
        return step
