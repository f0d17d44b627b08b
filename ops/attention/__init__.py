from deepinfer.ops.attention.torch_ref import indexer_topk, sink_attention

__all__ = ["indexer_topk", "sink_attention"]
