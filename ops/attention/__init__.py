"""Attention ops: sink attention over window + compressed entries, and the Lightning indexer.

A backend module provides ``sink_attention`` and ``indexer_topk`` with torch_ref's signatures.
"""

from deepinfer.ops.attention.torch_ref import indexer_topk, sink_attention
from deepinfer.ops.registry import OpRegistry

BACKENDS = OpRegistry("attention")
BACKENDS.register("torch_ref", "deepinfer.ops.attention.torch_ref")

__all__ = ["BACKENDS", "indexer_topk", "sink_attention"]
