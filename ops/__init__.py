"""Kernels by op family: ``select_kernels`` makes one backend object a family (registry.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.config import KernelConfig
from deepinfer.ops.registry import ParallelContext

if TYPE_CHECKING:
    from deepinfer.ops.attention import AttentionBackend
    from deepinfer.ops.linear import LinearBackend
    from deepinfer.ops.moe import MoEBackend
    from deepinfer.ops.norm import NormBackend
    from deepinfer.ops.sampling import SamplingBackend


@dataclass(frozen=True)
class Kernels:
    """The backend object chosen for each op family. Producer: ``select_kernels`` (the model
    runner, once, for its device) or ``reference_kernels``. Consumer: the model's modules
    (``kernels.norm.rms_norm(...)``) and the sampling step (``kernels.sampling``)."""

    attention: AttentionBackend
    linear: LinearBackend
    moe: MoEBackend
    norm: NormBackend
    sampling: SamplingBackend


def select_kernels(
    config: KernelConfig, device: torch.device, parallel: ParallelContext | None = None
) -> Kernels:
    from deepinfer.ops import attention, linear, moe, norm, sampling

    return Kernels(
        attention=attention.BACKENDS.select(config.attention, device, parallel),
        linear=linear.BACKENDS.select(config.linear, device, parallel),
        moe=moe.BACKENDS.select(config.moe, device, parallel),
        norm=norm.BACKENDS.select(config.norm, device, parallel),
        sampling=sampling.BACKENDS.select(config.sampling, device, parallel),
    )


def reference_kernels() -> Kernels:
    """The torch reference backends (the oracle), without logging; they run on any device."""
    from deepinfer.ops.attention.torch_ref import TorchRefAttentionBackend
    from deepinfer.ops.linear.torch_ref import TorchRefLinearBackend
    from deepinfer.ops.moe.torch_ref import TorchRefMoEBackend
    from deepinfer.ops.norm.torch_ref import TorchRefNormBackend
    from deepinfer.ops.sampling.torch_ref import TorchRefSamplingBackend

    return Kernels(
        attention=TorchRefAttentionBackend(),
        linear=TorchRefLinearBackend(),
        moe=TorchRefMoEBackend(),
        norm=TorchRefNormBackend(),
        sampling=TorchRefSamplingBackend(),
    )
