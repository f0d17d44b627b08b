"""Sampling ops: the torch reference sampler (the oracle) and, later, fast backends.

A backend object (``SamplingBackend``) provides ``SamplingMetadata`` (the metadata type its
``sample`` reads), ``sample`` and ``compute_logprobs``. ``keyed.py`` and ``nucleus.py`` are
torch_ref's steps (seeded draws, top-k/top-p), not backends.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from deepinfer.ops.registry import OpRegistry
from deepinfer.ops.sampling.torch_ref import (
    SamplerOutput,
    SamplingMetadata,
    apply_logits_processors,
    compute_logprobs,
    sample,
    seeded_key,
)


@runtime_checkable
class SamplingBackend(Protocol):
    """The sampler of one backend object. Producer: ``BACKENDS.select`` (or
    ``ops.reference_kernels``). Consumer: the model runner's step outputs, through
    ``Kernels.sampling``, which build ``SamplingMetadata`` and call ``sample``. Semantics:
    torch_ref's of the same names."""

    SamplingMetadata: type[SamplingMetadata]

    def sample(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        generator: torch.Generator | None = None,
    ) -> SamplerOutput: ...

    def compute_logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
    ) -> list[dict[int, float]]: ...


BACKENDS = OpRegistry("sampling", SamplingBackend)
BACKENDS.register("torch_ref", "deepinfer.ops.sampling.torch_ref:TorchRefSamplingBackend")

__all__ = [
    "BACKENDS",
    "SamplerOutput",
    "SamplingBackend",
    "SamplingMetadata",
    "apply_logits_processors",
    "compute_logprobs",
    "sample",
    "seeded_key",
]
