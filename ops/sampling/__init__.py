"""Sampling ops: the torch reference sampler (the oracle) and, later, fast backends."""

from __future__ import annotations

from deepinfer.ops.sampling.torch_ref import (
    SamplerOutput,
    SamplingMetadata,
    apply_logits_processors,
    compute_logprobs,
    sample,
    seeded_key,
)

__all__ = [
    "SamplerOutput",
    "SamplingMetadata",
    "apply_logits_processors",
    "compute_logprobs",
    "sample",
    "seeded_key",
]
