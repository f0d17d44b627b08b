"""Routed experts with clamped SwiGLU, torch reference (the oracle)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.ops.registry import Backend


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def fused_moe(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Sum over each token's selected experts of weight * expert(x).

    x: [T, D]; w1, w3: [E, I, D]; w2: [E, D, I]; topk_ids: [T, k] int64; topk_weights: [T, k]
    fp32. Experts are visited in id order and accumulated with index_add (the order transformers
    uses), so results are reproducible for a given batch. Returns [T, D] in x's dtype.
    """
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        h = x[token_idx]
        h = swiglu(F.linear(h, w1[expert]), F.linear(h, w3[expert]), limit)
        h = F.linear(h, w2[expert]) * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


class TorchRefMoEBackend(Backend):
    """The oracle as a backend object: this module's functions; it keeps no state."""

    fused_moe = staticmethod(fused_moe)
    swiglu = staticmethod(swiglu)
