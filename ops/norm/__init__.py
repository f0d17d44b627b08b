"""Norm ops: RMSNorm, RoPE and the hyper-connection mixing.

A backend module provides ``rms_norm``, ``hc_pre`` and ``hc_post`` with torch_ref's signatures;
RoPE tables and rotation stay torch (they are elementwise and fused by nothing yet).
"""

from deepinfer.ops.norm.torch_ref import (
    apply_rope,
    hc_post,
    hc_pre,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from deepinfer.ops.registry import OpRegistry

BACKENDS = OpRegistry("norm")
BACKENDS.register("torch_ref", "deepinfer.ops.norm.torch_ref")

__all__ = [
    "BACKENDS",
    "apply_rope",
    "hc_post",
    "hc_pre",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
]
