"""The shared expert's and the routed experts' activation for every Triton kernel that applies
it: ``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in fp32 (torch_ref.swiglu's clamps;
torch_ref rounds SiLU's output to the dtype first, these kernels round once, at their store).
One definition, so that the MoE kernels, the SwiGLU launch and the FP8 GEMM that applies it to
its input (``fp8_linear(gate, ..., swiglu=(up, limit))``) compute the same values.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["swiglu"]


@triton.jit
def swiglu(gate, up, limit):
    """silu(min(gate, limit)) * clamp(up, -limit, limit) of fp32 gate and up."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(gate) * up
