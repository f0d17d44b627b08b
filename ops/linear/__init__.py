"""Linear layers with block-scaled FP8 weights. A backend object (``LinearBackend``) provides
``fp8_linear(x, weight, weight_scale, block)`` with torch_ref's signature: x [M, K] bf16/fp32,
weight [N, K] float8_e4m3fn, weight_scale [ceil(N/bn), ceil(K/bk)] fp32 -> y [M, N] in x's dtype
(``swiglu=(up, limit)``: of the shared expert's activation of the gate x, which a backend may
compute where it quantizes x); and ``fp8_grouped_linear``, its block-diagonal form (x [M, G, K],
weight [G*N, K] -> [M, G, N]); and ``dense_linear(x, weight)``, F.linear on a weight in x's
dtype (the fused projections of ``model.layers.FusedLinears``; Triton's own GEMM at decode).

Backends, fastest first: ``deepgemm`` (DeepSeek's DeepGEMM, SM90+; chosen by auto only when it
is installed and a probe GEMM runs right in a child process: ``deepgemm.py``), ``triton`` (CUDA:
activations quantized to e4m3 per token per K block, FP8 tensor-core GEMM with the block
scales applied per K block; one launch at decode; cuBLAS's blockwise FP8 GEMM at prefill),
``torch_ref`` (the oracle: the dequantized weight, an fp32 matmul, x unquantized).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from deepinfer.ops.linear.deepgemm import is_available as deepgemm_available
from deepinfer.ops.linear.torch_ref import (
    FP8_BLOCK,
    dequantize_fp8,
    fp8_grouped_linear,
    fp8_linear,
    quantize_activations,
    quantize_fp8,
)
from deepinfer.ops.registry import OpRegistry, triton_available


@runtime_checkable
class LinearBackend(Protocol):
    """The FP8 (and dense) linears of one backend object. Producer: ``BACKENDS.select`` (or
    ``ops.reference_kernels``). Consumer: ``model.layers.Fp8Linear``, through
    ``Kernels.linear``. Semantics: torch_ref.fp8_linear and torch_ref.fp8_grouped_linear."""

    def fp8_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        block: tuple[int, int] = FP8_BLOCK,
        *,
        swiglu: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor: ...

    def fp8_grouped_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        block: tuple[int, int] = FP8_BLOCK,
    ) -> torch.Tensor: ...

    def dense_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...


BACKENDS = OpRegistry("linear", LinearBackend)
BACKENDS.register(
    "deepgemm", "deepinfer.ops.linear.deepgemm:DeepGEMMLinearBackend", deepgemm_available
)
BACKENDS.register("triton", "deepinfer.ops.linear.triton:TritonLinearBackend", triton_available)
BACKENDS.register("torch_ref", "deepinfer.ops.linear.torch_ref:TorchRefLinearBackend")

__all__ = [
    "BACKENDS",
    "FP8_BLOCK",
    "LinearBackend",
    "dequantize_fp8",
    "fp8_grouped_linear",
    "fp8_linear",
    "quantize_activations",
    "quantize_fp8",
]
