"""StepPlanner: a model family's step plans for one model and its cache.

    SeqSpans + token ids (host) -> family.step_arrays -> host int64 arrays (one upload)
    uploaded flat array          -> family.batch_views -> ForwardBatch (views of it)

The model runner, the decode graphs and the memory profile plan their steps through it, so they
know a family only through ``deepinfer.model.family.ModelFamily``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch, SeqSpan
from deepinfer.model.families import load_family
from deepinfer.model.family import ModelFamily


@dataclass
class StepPlanner:
    family: ModelFamily
    geometry: Any  # the family's plan context for the cache
    num_history: int = 0  # token ids before a span its plans read (``SeqSpan.history``)

    @classmethod
    def of(cls, model: nn.Module, cache: KVCache) -> StepPlanner:
        """The planner of a family's model (its ``args.model_type``) over ``cache``."""
        args = model.args
        family = load_family(args.model_type)
        return cls(family, family.geometry(args, cache), family.history_tokens(args))

    def arrays(
        self,
        seqs: list[SeqSpan],
        token_ids: list[int],
        logits_indices: list[int],
        decode_context: int | None = None,
    ) -> dict[str, np.ndarray]:
        return self.family.step_arrays(
            seqs, token_ids, logits_indices, self.geometry, decode_context
        )

    def views(
        self, flat: torch.Tensor, host: dict[str, np.ndarray], seqs: list[SeqSpan]
    ) -> ForwardBatch:
        return self.family.batch_views(flat, host, seqs, self.geometry)
