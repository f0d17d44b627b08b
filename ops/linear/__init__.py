"""Linear layers with block-scaled FP8 weights. A backend provides ``fp8_linear(x, weight,
weight_scale, block)`` with torch_ref's signature: x [M, K] bf16/fp32, weight [N, K]
float8_e4m3fn, weight_scale [ceil(N/bn), ceil(K/bk)] fp32 -> y [M, N] in x's dtype.

Backends, fastest first: ``triton`` (CUDA: activations quantized to e4m3 per token per K block,
FP8 tensor-core GEMM with the block scales applied per K block; one launch at decode),
``torch_ref`` (the oracle: the dequantized weight, an fp32 matmul, x unquantized).
"""

from deepinfer.ops.linear.torch_ref import (
    FP8_BLOCK,
    dequantize_fp8,
    fp8_linear,
    quantize_activations,
    quantize_fp8,
)
from deepinfer.ops.registry import OpRegistry, triton_available

BACKENDS = OpRegistry("linear")
BACKENDS.register("triton", "deepinfer.ops.linear.triton", triton_available)
BACKENDS.register("torch_ref", "deepinfer.ops.linear.torch_ref")

__all__ = [
    "BACKENDS",
    "FP8_BLOCK",
    "dequantize_fp8",
    "fp8_linear",
    "quantize_activations",
    "quantize_fp8",
]
