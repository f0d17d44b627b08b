"""ForwardBatch: one step's inputs as the model sees them.

    Request -> ScheduledRequest (scheduler, CPU) -> ForwardBatch (executor -> model, device)

The batch is flat: every request's tokens of this step are concatenated, in scheduling order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deepinfer.engine.attention_metadata import StepMetadata
    from deepinfer.scheduler.output import ScheduledRequest


@dataclass
class SeqSpan:
    """One request's slice of the flat batch.

    ``offset``: index of its first token in the flat batch; positions ``start_pos ..
    start_pos + num_tokens - 1``; ``block_ids``: the request's block table (host ints).
    """

    offset: int
    num_tokens: int
    start_pos: int
    slot: int
    block_ids: list[int]
    # Prefix reuse: keys before ``window_floor`` are not attended (a replay from an empty slot);
    # compressed entries of positions below ``num_protected`` (shared blocks) are not written.
    window_floor: int = 0
    num_protected: int = 0

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens

    @classmethod
    def of(cls, offset: int, sched: ScheduledRequest) -> SeqSpan:
        """A scheduled request's span, its first token at row ``offset`` of the batch."""
        return cls(
            offset,
            sched.num_tokens,
            sched.start_pos,
            sched.state_slot,
            list(sched.block_table),
            window_floor=sched.window_floor,
            num_protected=sched.num_protected_tokens,
        )


@dataclass
class ForwardBatch:
    """Producer: the executor. Consumer: the model. Device: the model's device.

    input_ids, positions: [T] int64. logits_indices: [N] int64 rows whose logits are computed.
    ``rope``: cos/sin [T, rope_dim / 2] fp32 per rope kind ("main", "compress"), set by the model.
    ``metadata``: the step's index plans (attention_metadata.py); the model builds them when the
    executor has not.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    seqs: list[SeqSpan]
    logits_indices: torch.Tensor
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    metadata: StepMetadata | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]
