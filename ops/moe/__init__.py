"""MoE ops: routed experts with clamped SwiGLU. A backend object (``MoEBackend``) provides
``fused_moe``, ``swiglu`` and the router after its GEMM (``route``) with torch_ref's
signatures; expert weights are dense tensors, packed MXFP4 (``Mxfp4Weight``, as the
checkpoints ship them) or FP8 128 x 128 blocks (``Fp8ExpertWeight``, converted at load for a
backend whose ``fp8_experts`` is set). Backends, in auto's order: ``triton`` (CUDA: grouped
GEMMs or a program a pair, MXFP4 dequantized in registers), ``deepgemm`` (DeepSeek's grouped
FP8 GEMMs on FP8 experts: twice the packed bytes, so auto reaches it only where Triton is
absent; ``deepgemm.py``), ``torch_ref`` (the oracle)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from deepinfer.ops.linear.deepgemm import is_available as deepgemm_available
from deepinfer.ops.moe.torch_ref import (
    MXFP4_BLOCK,
    ExpertWeight,
    Fp8ExpertWeight,
    Mxfp4Weight,
    dequantize_mxfp4,
    fused_moe,
    quantize_mxfp4,
    swiglu,
    to_fp8_experts,
)
from deepinfer.ops.registry import OpRegistry, triton_available
from deepinfer.ops.streams import Pending


@runtime_checkable
class MoEBackend(Protocol):
    """The routed experts of one backend object. Producer: ``BACKENDS.select`` (or
    ``ops.reference_kernels``). Consumer: the model's MoE, through ``Kernels.moe``. Semantics:
    torch_ref's functions of the same names; ``fused_moe``'s residual may be ``Pending`` (made
    on the side stream: ops/streams.py), joined just before the launch that adds it. A backend
    whose class sets ``fp8_experts = True`` gets the routed experts as ``Fp8ExpertWeight``
    (the loader converts them)."""

    def fused_moe(
        self,
        x: torch.Tensor,
        w1: ExpertWeight,
        w2: ExpertWeight,
        w3: ExpertWeight,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        limit: float,
        residual: torch.Tensor | Pending | None = None,
    ) -> torch.Tensor: ...

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor: ...

    def route(
        self,
        logits: torch.Tensor,
        bias: torch.Tensor | None,
        hash_ids: torch.Tensor | None,
        top_k: int,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


BACKENDS = OpRegistry("moe", MoEBackend)
BACKENDS.register("triton", "deepinfer.ops.moe.triton:TritonMoEBackend", triton_available)
BACKENDS.register("deepgemm", "deepinfer.ops.moe.deepgemm:DeepGEMMMoEBackend", deepgemm_available)
BACKENDS.register("torch_ref", "deepinfer.ops.moe.torch_ref:TorchRefMoEBackend")

__all__ = [
    "BACKENDS",
    "MXFP4_BLOCK",
    "ExpertWeight",
    "Fp8ExpertWeight",
    "MoEBackend",
    "Mxfp4Weight",
    "dequantize_mxfp4",
    "fused_moe",
    "quantize_mxfp4",
    "swiglu",
    "to_fp8_experts",
]
