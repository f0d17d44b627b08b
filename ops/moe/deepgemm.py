"""Routed experts on DeepSeek's DeepGEMM: FP8 experts with 128 x 128 block scales and the grouped
FP8 GEMM in its contiguous layout (``m_grouped_fp8_gemm_nt_contiguous``; on SM90 1 x 128
activation scales, fp32 accumulation promoted per K block).

The experts are converted at load (``fp8_experts``: the engine runs ``torch_ref.to_fp8_experts``
on what it loaded; exact from the checkpoint's MXFP4). They then hold about twice the packed
bytes (1 byte a value against 17/32), so ``auto`` keeps the packed Triton kernels and this
backend is chosen by name: ``kernel.moe = "deepgemm"``. Availability is the linear family's
(``ops/linear/deepgemm.py``: SM90+, ``deep_gemm`` importable, the C++ runtime preloaded, one
GEMM right in a child process).

Data flow of ``fused_moe`` (T tokens, k experts a token, P = T * k pairs, R rows of the layout):

    topk_ids [T, k] --triton.align_by_expert(E, 128)--> sorted_pair_ids [R] (P in padding),
                                                         block_expert [R / 128] (-1: none)
    m_indices [R] = each block's expert, repeated per row (DeepGEMM skips a block whose first
                    row is -1; padding rows of a real block are computed and never read)
    x [T, D] --quantize 1 x 128--> (q, s) --each row's token--> (qa [R, D], sa [R, D/128])
    (qa, sa) . w1, w3 [E, I, D] --grouped GEMM--> gate, up [R, I] bf16
    swiglu --> h [R, I] --quantize--> (qh, sh) . w2 [E, D, I] --grouped GEMM--> y [R, D] bf16
    out[t] = sum over j of topk_weights[t, j] * y[row of pair (t, j)]   (fp32 sum, x's dtype)

R is align_by_expert's bound from shapes alone and nothing here reads the device from the host,
so a decode step with this backend captures in a CUDA graph. Shapes off DeepGEMM's tiles (D or
I not a multiple of 128: toy models) run torch_ref on the same FP8 experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.ops.linear import torch_ref as linear_ref
from deepinfer.ops.linear import triton as linear_triton
from deepinfer.ops.linear.deepgemm import is_available
from deepinfer.ops.moe import torch_ref
from deepinfer.ops.moe.torch_ref import ExpertWeight, Fp8ExpertWeight, swiglu
from deepinfer.ops.moe.triton import align_by_expert
from deepinfer.ops.moe.triton_router import route
from deepinfer.ops.registry import Backend, ParallelContext
from deepinfer.ops.streams import Pending, ready

BLOCK_M = 128  # DeepGEMM's M alignment of the contiguous layout on SM90
Operand = tuple[torch.Tensor, torch.Tensor]  # (e4m3 values, fp32 scales)
# (a, b, d, m_indices): d[r] = a[r] . b[m_indices[r]]^T per 128-row block, as DeepGEMM's.
GroupedGemm = Callable[[Operand, Operand, torch.Tensor, torch.Tensor], None]

__all__ = ["DeepGEMMMoEBackend", "fused_moe", "is_available"]


def fused_moe(
    x: torch.Tensor,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float,
    grouped_gemm: GroupedGemm,
) -> torch.Tensor:
    """As torch_ref.fused_moe on FP8 experts, with the activations quantized per token per 128
    (W8A8; module docstring). x: [T, D]; w1, w3: [E, I, D], w2: [E, D, I] ``Fp8ExpertWeight``;
    topk_ids [T, k] int64; topk_weights [T, k] fp32. Returns [T, D] in x's dtype.
    ``grouped_gemm``: DeepGEMM's (the backend's), or another implementation of its contract."""
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        if not isinstance(w, Fp8ExpertWeight):
            raise TypeError(
                f"the deepgemm MoE backend takes FP8 experts, {name} is a {type(w).__name__}: "
                "the engine converts them at load for this backend (fp8_experts)"
            )
    num_tokens, dim = x.shape
    num_experts, inter, _ = w1.shape
    if dim % BLOCK_M or inter % BLOCK_M:
        return torch_ref.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, limit)
    quantize = linear_triton.quantize_activations if x.is_cuda else linear_ref.quantize_activations
    if num_tokens == 0:
        return x.new_zeros(0, dim)

    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    sorted_pair_ids, block_expert = align_by_expert(topk_ids, num_experts, BLOCK_M)
    num_rows = sorted_pair_ids.numel()
    m_indices = block_expert.repeat_interleave(BLOCK_M)  # [R] int32
    # Padding rows take token T - 1's values: real numbers, computed, never read.
    tokens = (sorted_pair_ids // top_k).clamp(max=num_tokens - 1).long()  # [R]
    q, scale = quantize(x)  # [T, D] e4m3, [T, D/128] with strides (1, T)
    # Scales stay MN-major ([D/128, R] in memory), the layout DeepGEMM's SM90 kernels read.
    rows = (q[tokens], scale.t()[:, tokens].t())

    gate = torch.empty(num_rows, inter, dtype=torch.bfloat16, device=x.device)
    up = torch.empty_like(gate)
    grouped_gemm(rows, (w1.weight, w1.scale), gate, m_indices)
    grouped_gemm(rows, (w3.weight, w3.scale), up, m_indices)
    h = swiglu(gate, up, limit)  # [R, I] bf16
    y = torch.empty(num_rows, dim, dtype=torch.bfloat16, device=x.device)
    grouped_gemm(quantize(h), (w2.weight, w2.scale), y, m_indices)

    # Row of each pair: the inverse of sorted_pair_ids. Padding rows write past P, each to its
    # own index, so the scatter has no duplicates (deterministic on every device).
    positions = torch.arange(num_rows, device=x.device)
    real = sorted_pair_ids < num_pairs
    targets = torch.where(real, sorted_pair_ids.long(), num_pairs + positions)
    row_of_pair = torch.empty(num_pairs + num_rows, dtype=torch.long, device=x.device)
    row_of_pair.scatter_(0, targets, positions)
    pair_out = y[row_of_pair[:num_pairs]].view(num_tokens, top_k, dim)
    return (pair_out.float() * topk_weights[..., None]).sum(1).to(x.dtype)


class DeepGEMMMoEBackend(Backend):
    """DeepGEMM's grouped FP8 GEMMs on one CUDA device; the engine converts the routed experts
    to ``Fp8ExpertWeight`` at load for it (``fp8_experts``)."""

    fp8_experts = True
    swiglu = staticmethod(swiglu)
    route = staticmethod(route)

    def __init__(self, device: torch.device, parallel: ParallelContext | None = None) -> None:
        super().__init__(device, parallel)
        import deep_gemm

        def grouped_gemm(a: Operand, b: Operand, d: torch.Tensor, m_indices: torch.Tensor) -> None:
            deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a=a, b=b, d=d, grouped_layout=m_indices)

        self.grouped_gemm: GroupedGemm = grouped_gemm

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
    ) -> torch.Tensor:
        out = fused_moe(x, w1, w2, w3, topk_ids, topk_weights, limit, self.grouped_gemm)
        residual = ready(residual)
        return out if residual is None else out + residual
