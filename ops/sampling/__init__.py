"""Sampling ops: the torch reference sampler (the oracle) and, later, fast backends.

A backend module provides ``SamplingMetadata``, ``sample`` and ``compute_logprobs``.
"""

from __future__ import annotations

from deepinfer.ops.registry import OpRegistry
from deepinfer.ops.sampling.torch_ref import (
    SamplerOutput,
    SamplingMetadata,
    apply_logits_processors,
    compute_logprobs,
    sample,
    seeded_key,
)

BACKENDS = OpRegistry("sampling")
BACKENDS.register("torch_ref", "deepinfer.ops.sampling.torch_ref")

__all__ = [
    "BACKENDS",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_logits_processors",
    "compute_logprobs",
    "sample",
    "seeded_key",
]
