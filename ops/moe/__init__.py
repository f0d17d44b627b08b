"""MoE ops: routed experts with clamped SwiGLU. A backend provides ``fused_moe`` and ``swiglu``."""

from deepinfer.ops.moe.torch_ref import fused_moe, swiglu
from deepinfer.ops.registry import OpRegistry, triton_available

BACKENDS = OpRegistry("moe")
BACKENDS.register("triton", "deepinfer.ops.moe.triton", triton_available)
BACKENDS.register("torch_ref", "deepinfer.ops.moe.torch_ref")

__all__ = ["BACKENDS", "fused_moe", "swiglu"]
