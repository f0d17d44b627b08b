"""MoE ops: routed experts with clamped SwiGLU. A backend object (``MoEBackend``) provides
``fused_moe`` and ``swiglu`` with torch_ref's signatures; expert weights are dense tensors or
packed MXFP4 (``Mxfp4Weight``, as the checkpoints ship them). Backends, fastest first:
``triton`` (CUDA: two grouped GEMMs, MXFP4 dequantized in registers), ``torch_ref`` (the
oracle)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from deepinfer.ops.moe.torch_ref import (
    MXFP4_BLOCK,
    ExpertWeight,
    Mxfp4Weight,
    dequantize_mxfp4,
    fused_moe,
    quantize_mxfp4,
    swiglu,
)
from deepinfer.ops.registry import OpRegistry, triton_available


@runtime_checkable
class MoEBackend(Protocol):
    """The routed experts of one backend object. Producer: ``BACKENDS.select`` (or
    ``ops.reference_kernels``). Consumer: the model's MoE, through ``Kernels.moe``. Semantics:
    torch_ref's functions of the same names."""

    def fused_moe(
        self,
        x: torch.Tensor,
        w1: ExpertWeight,
        w2: ExpertWeight,
        w3: ExpertWeight,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        limit: float,
    ) -> torch.Tensor: ...

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor: ...


BACKENDS = OpRegistry("moe", MoEBackend)
BACKENDS.register("triton", "deepinfer.ops.moe.triton:TritonMoEBackend", triton_available)
BACKENDS.register("torch_ref", "deepinfer.ops.moe.torch_ref:TorchRefMoEBackend")

__all__ = [
    "BACKENDS",
    "MXFP4_BLOCK",
    "ExpertWeight",
    "MoEBackend",
    "Mxfp4Weight",
    "dequantize_mxfp4",
    "fused_moe",
    "quantize_mxfp4",
    "swiglu",
]
