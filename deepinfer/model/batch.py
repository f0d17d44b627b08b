"""ForwardBatch: one step's inputs as every model family sees them.

    Request -> ScheduledRequest (scheduler, CPU) -> ForwardBatch (engine -> model, device)

The batch is flat: every request's tokens of this step are concatenated, in scheduling order.
A step's host arrays travel to the device in one int64 copy (``flatten``) and come back as
views of it (``split_flat``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch


class Scheduled(Protocol):
    """What a span needs of one scheduled request (the scheduler's ScheduledRequest)."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def start_pos(self) -> int: ...
    @property
    def state_slot(self) -> int: ...
    @property
    def block_table(self) -> Sequence[int]: ...
    @property
    def window_floor(self) -> int: ...
    @property
    def num_protected_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    def history_token_ids(self, num: int) -> list[int]: ...


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
    # The token ids just before ``start_pos`` (as many as the family's ``history_tokens``, fewer
    # near position 0): what a model reading n-grams of the input needs.
    history: list[int] = field(default_factory=list)
    # The request's prompt length (0: unknown, a padded or profiling span): what a family that
    # truncates prefills (DeepSeek-V4.1's YoCo) keeps is decided by it.
    num_prompt_tokens: int = 0
    # Graphed steps (every request gets the same number of rows): the span's last ``num_pad``
    # rows stand in for no token. They are computed, never sampled, and leave nothing in the
    # cache (their writes go to its scratch rows): the span's real tokens end at
    # ``end_pos - num_pad``.
    num_pad: int = 0

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens

    @classmethod
    def of(cls, offset: int, sched: Scheduled, num_history: int = 0) -> SeqSpan:
        """A scheduled request's span, its first token at row ``offset`` of the batch, with
        the ``num_history`` token ids before it."""
        return cls(
            offset,
            sched.num_tokens,
            sched.start_pos,
            sched.state_slot,
            list(sched.block_table),
            window_floor=sched.window_floor,
            num_protected=sched.num_protected_tokens,
            history=sched.history_token_ids(num_history) if num_history else [],
            num_prompt_tokens=sched.num_prompt_tokens,
        )


@dataclass
class ForwardBatch:
    """Producer: the executor. Consumer: the model. Device: the model's device.

    input_ids, positions: [T] int64. logits_indices: [N] int64 rows whose logits are computed.
    ``rope``: cos/sin [T, rope_dim / 2] fp32 per rope kind ("main", "compress"), set by the model.
    ``metadata``: the step's index plans, in the model family's own type (DeepSeek-V4:
    ``deepseek_v4/step_plan.py``); the model builds them when the engine has not.
    ``hidden``: set by the model's forward when a drafter reads it (see the field).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    seqs: list[SeqSpan]
    logits_indices: torch.Tensor
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    metadata: Any = None
    # The last layer's output [T, ...], kept by a model whose drafter reads it after the step
    # (DeepSeek-V4's MTP layer).
    hidden: torch.Tensor | None = None
    # Rows of the step holding image positions [K] int64, and their embeddings [K, D] (the
    # vision tower's, in the model's dtype); None when the step has none.
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


# Each array of the flat copy starts 16 bytes in (two int64s): Triton specialises a kernel on
# whether each pointer it gets is 16-byte aligned, and a plan's arrays at odd offsets would
# compile another variant for every new pattern of sizes (seconds, while a step waits).
_ALIGN = 2


def _padded(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def flatten(host: dict[str, np.ndarray]) -> np.ndarray:
    """A step's host arrays as one int64 array, in the dict's order, each starting at a
    multiple of 16 bytes (zeros in between; one copy to the device)."""
    flat = np.zeros(sum(_padded(a.size) for a in host.values()), dtype=np.int64)
    at = 0
    for array in host.values():
        flat[at : at + array.size] = array.ravel()
        at += _padded(array.size)
    return flat


def split_flat(flat: torch.Tensor, host: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Views of ``flat`` (as ``flatten`` laid it out) shaped like the host arrays."""
    out, at = {}, 0
    for name, array in host.items():
        out[name] = flat[at : at + array.size].view(array.shape)
        at += _padded(array.size)
    return out
