"""Norm ops: RMSNorm, RoPE, the hyper-connection mixing and the compressors' gated pooling.

A backend object (``NormBackend``) provides ``rms_norm``, ``apply_rope``, ``rms_norm_rope``
(and its ``_pair``), ``hc_pre``, ``hc_post``, ``hc_head`` and ``compress_windows`` (a
compressor's step: its windows' entries, pooled as torch_ref's ``gated_pool`` says, and its
rings kept, from ``CompressRows``) with torch_ref's signatures; the RoPE tables
(``rope_inv_freq``, ``rope_cos_sin``: built once per step, not per layer) stay torch, so every
backend re-exports them from torch_ref. Backends, fastest first: ``triton`` (CUDA: RMSNorm
and RoPE one launch each, a layer's queries' and keys' norm and RoPE one together, hc_pre two
launches with Sinkhorn in registers, hc_head the same two without it, hc_post one;
compress_windows as ``triton_pool.py`` says), ``torch_ref`` (the oracle).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from deepinfer.ops.norm.torch_ref import (
    CompressRows,
    RopeParams,
    apply_rope,
    compress_windows,
    hc_head,
    hc_post,
    hc_pre,
    hc_pre_shifted,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from deepinfer.ops.registry import OpRegistry, triton_available


@runtime_checkable
class NormBackend(Protocol):
    """The norm ops of one backend object. Producer: ``BACKENDS.select`` (or
    ``ops.reference_kernels``). Consumer: the model's modules, through ``Kernels.norm``. Shapes,
    dtypes and semantics: torch_ref's functions of the same names."""

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor: ...

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...

    def rms_norm_rope(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        store: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor: ...

    def rms_norm_rope_pair(
        self,
        x: torch.Tensor,
        k: torch.Tensor,
        weights: tuple[torch.Tensor | None, torch.Tensor | None],
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        store: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def hc_pre(
        self,
        x: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        sinkhorn_iters: int,
        hc_eps: float,
        norm_eps: float,
        *,
        block_norm: tuple[torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def hc_pre_shifted(
        self,
        x: torch.Tensor,
        prev_pre: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        sinkhorn_iters: int,
        hc_eps: float,
        norm_eps: float,
        *,
        block_norm: tuple[torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def hc_post(
        self, out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor: ...

    def hc_post_pre(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        post: torch.Tensor,
        comb: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        sinkhorn_iters: int,
        hc_eps: float,
        norm_eps: float,
        *,
        block_norm: tuple[torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def hc_head(
        self,
        x: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        hc_eps: float,
        norm_eps: float,
        *,
        block_norm: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor: ...

    def compress_windows(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        rows: CompressRows,
        ape: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def rope_inv_freq(self, rope: RopeParams, rope_dim: int) -> torch.Tensor: ...

    def rope_cos_sin(
        self, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


BACKENDS = OpRegistry("norm", NormBackend)
BACKENDS.register("triton", "deepinfer.ops.norm.triton:TritonNormBackend", triton_available)
BACKENDS.register("torch_ref", "deepinfer.ops.norm.torch_ref:TorchRefNormBackend")

__all__ = [
    "BACKENDS",
    "CompressRows",
    "NormBackend",
    "apply_rope",
    "compress_windows",
    "hc_head",
    "hc_post",
    "hc_pre",
    "hc_pre_shifted",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
]
