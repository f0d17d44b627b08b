"""Kernels by op family: ``select_kernels`` makes one backend object a family (registry.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.config import KernelConfig
from deepinfer.ops.registry import ParallelContext

logger = logging.getLogger(__name__)

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
    # Work the next launches do not read runs on the device's side stream (ops/streams.py).
    side_stream: bool = False


def select_kernels(
    config: KernelConfig, device: torch.device, experts: ParallelContext | None = None
) -> Kernels:
    """One backend per family for ``device``. ``experts``: the expert-parallel ranks (None:
    none); the MoE backend then exchanges tokens over them (``moe/expert_parallel.py``) around
    the device's own. Attention, linears, norms and sampling run on each rank alone.
    ``config.launch_pdl`` sets the process's Triton launches (``triton_utils.LAUNCH_PDL``);
    ``config.side_stream`` the model's forks (CUDA only)."""
    from deepinfer.ops import attention, linear, moe, norm, sampling, triton_utils

    triton_utils.LAUNCH_PDL = config.launch_pdl
    routed = moe.BACKENDS.select(config.moe, device)
    if experts is not None:
        from deepinfer.ops.moe.expert_parallel import ExpertParallelMoEBackend

        logger.info(
            "moe: expert parallel, rank %d of %d, around %s",
            experts.rank,
            experts.world_size,
            type(routed).__name__,
        )
        routed = ExpertParallelMoEBackend(device, experts, routed)
    return Kernels(
        attention=attention.BACKENDS.select(config.attention, device),
        linear=linear.BACKENDS.select(config.linear, device),
        moe=routed,
        norm=norm.BACKENDS.select(config.norm, device),
        sampling=sampling.BACKENDS.select(config.sampling, device),
        side_stream=config.side_stream and device.type == "cuda",
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
