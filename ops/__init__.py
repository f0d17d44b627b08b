"""Kernels by op family; ``select_kernels`` picks one backend per family (see registry.py)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from deepinfer.config import KernelConfig


@dataclass(frozen=True)
class Kernels:
    """The backend module chosen for each op family."""

    attention: ModuleType
    linear: ModuleType
    moe: ModuleType
    norm: ModuleType
    sampling: ModuleType


def select_kernels(config: KernelConfig, device: torch.device) -> Kernels:
    from deepinfer.ops import attention, linear, moe, norm, sampling

    return Kernels(
        attention=attention.BACKENDS.select(config.attention, device),
        linear=linear.BACKENDS.select(config.linear, device),
        moe=moe.BACKENDS.select(config.moe, device),
        norm=norm.BACKENDS.select(config.norm, device),
        sampling=sampling.BACKENDS.select(config.sampling, device),
    )


def reference_kernels() -> Kernels:
    """The torch reference backends (the oracle), without logging."""
    from deepinfer.ops.attention import torch_ref as attention
    from deepinfer.ops.linear import torch_ref as linear
    from deepinfer.ops.moe import torch_ref as moe
    from deepinfer.ops.norm import torch_ref as norm
    from deepinfer.ops.sampling import torch_ref as sampling

    return Kernels(attention=attention, linear=linear, moe=moe, norm=norm, sampling=sampling)
