"""Norm ops: RMSNorm, RoPE, the hyper-connection mixing and the compressors' gated pooling.

A backend module provides ``rms_norm``, ``apply_rope``, ``hc_pre``, ``hc_post`` and
``gated_pool`` with torch_ref's signatures; the RoPE tables (``rope_inv_freq``,
``rope_cos_sin``: built once per step, not per layer) stay torch, so every backend re-exports
them from torch_ref. Backends, fastest first: ``triton`` (CUDA: RMSNorm and RoPE one launch
each, hc_pre two launches with Sinkhorn in registers, hc_post one, gated_pool one: the softmax,
weighted sum and norm of a window per program), ``torch_ref`` (the oracle).
"""

from deepinfer.ops.norm.torch_ref import (
    apply_rope,
    gated_pool,
    hc_post,
    hc_pre,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from deepinfer.ops.registry import OpRegistry, triton_available

BACKENDS = OpRegistry("norm")
BACKENDS.register("triton", "deepinfer.ops.norm.triton", triton_available)
BACKENDS.register("torch_ref", "deepinfer.ops.norm.torch_ref")

__all__ = [
    "BACKENDS",
    "apply_rope",
    "gated_pool",
    "hc_post",
    "hc_pre",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
]
