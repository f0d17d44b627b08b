"""Attention ops: sparse attention with sinks over listed keys, and the Lightning indexer's scores.

A backend module provides ``sparse_attention`` and ``indexer_scores`` with torch_ref's signatures.
"""

from deepinfer.ops.attention.torch_ref import indexer_scores, sparse_attention
from deepinfer.ops.registry import OpRegistry, triton_available

BACKENDS = OpRegistry("attention")
BACKENDS.register("triton", "deepinfer.ops.attention.triton", triton_available)
BACKENDS.register("torch_ref", "deepinfer.ops.attention.torch_ref")

__all__ = ["BACKENDS", "indexer_scores", "sparse_attention"]
