from deepinfer.ops.moe.torch_ref import fused_moe, swiglu

__all__ = ["fused_moe", "swiglu"]
