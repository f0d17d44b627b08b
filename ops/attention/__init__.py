"""Attention ops: sparse attention with sinks over listed keys, and the Lightning indexer's scores.

A backend object (``AttentionBackend``) provides ``sparse_attention``, ``indexer_scores``,
``indexer_topk`` and the two as one (``indexer_select``) with torch_ref's signatures, and the
cache writes ``store_rows`` / ``as_stored`` with ``kv_fp8.py``'s. Backends, fastest first:
``flashmla`` (DeepSeek's FlashMLA sparse decode over an FP8 cache where a call fits it, Triton
elsewhere: ``flashmla_backend.py``; built apart, SM90), ``triton`` (CUDA), ``torch_ref`` (the
oracle). A key source is dense rows or packed FP8 rows (``kv_fp8.py``, cache.kv_dtype = "fp8").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from deepinfer.ops.attention.flashmla import is_available
from deepinfer.ops.attention.kv_fp8 import KVSource
from deepinfer.ops.attention.torch_ref import indexer_scores, sparse_attention
from deepinfer.ops.registry import OpRegistry, triton_available


@runtime_checkable
class AttentionBackend(Protocol):
    """The attention ops of one backend object. Producer: ``BACKENDS.select`` (or
    ``ops.reference_kernels``). Consumer: the model, through ``Kernels.attention``. Shapes,
    dtypes and semantics: torch_ref's functions of the same names.

    ``window_from_ring(num_tokens)``: whether, over a packed ring, a step of that many tokens
    should give its window keys as one list of ring rows (the step's keys stored into the ring
    before attention, where ``StepMetadata.ring_first`` allows it) rather than the step's rows
    and the ring's as two sources (FlashMLA reads packed rows, and two sources at most: the
    window and the compressed entries)."""

    def window_from_ring(self, num_tokens: int) -> bool: ...

    def sparse_attention(
        self,
        q: torch.Tensor,
        sources: Sequence[tuple[KVSource, torch.Tensor]],
        sinks: torch.Tensor,
        scale: float,
        out_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor: ...

    def indexer_scores(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        entry_rows: torch.Tensor,
        token_req: torch.Tensor,
        num_visible: torch.Tensor,
        weight_scale: float = 1.0,
        q_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor: ...

    def indexer_topk(
        self, scores: torch.Tensor, entry_rows: torch.Tensor, token_req: torch.Tensor, k: int
    ) -> torch.Tensor: ...

    def indexer_select(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        entry_rows: torch.Tensor,
        token_req: torch.Tensor,
        num_visible: torch.Tensor,
        k: int,
        weight_scale: float = 1.0,
        q_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor: ...

    def store_rows(
        self,
        target: KVSource,
        index: torch.Tensor,
        values: torch.Tensor,
        rows: torch.Tensor | None = None,
    ) -> None: ...

    def as_stored(self, target: KVSource, values: torch.Tensor) -> torch.Tensor: ...


BACKENDS = OpRegistry("attention", AttentionBackend)
BACKENDS.register(
    "flashmla", "deepinfer.ops.attention.flashmla_backend:FlashMLAAttentionBackend", is_available
)
BACKENDS.register(
    "triton", "deepinfer.ops.attention.triton:TritonAttentionBackend", triton_available
)
BACKENDS.register("torch_ref", "deepinfer.ops.attention.torch_ref:TorchRefAttentionBackend")

__all__ = ["BACKENDS", "AttentionBackend", "indexer_scores", "sparse_attention"]
