"""Small building blocks shared by the model's modules."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``norm``: the norm backend (deepinfer.ops.norm) whose ``rms_norm`` runs it."""

    def __init__(self, dim: int, eps: float, norm: ModuleType) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self._rms_norm = norm.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(x, self.weight, self.eps)


def linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)
