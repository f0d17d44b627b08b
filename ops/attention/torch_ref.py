"""Sparse attention with sinks and the Lightning indexer's scores, torch reference (the oracle).

Both ops are batched over the flat step (T query tokens of any number of requests) and read keys
through index lists, so one call serves the whole batch and a fast kernel has the same contract:

- ``sparse_attention``: every query token lists, per key source, the rows it attends to. The
  model passes three sources: this step's new keys, the sliding-window ring (earlier positions)
  and the paged compressed entries (HCA: every visible entry; CSA: the indexer's picks).
- ``indexer_scores``: every query token scores the compressed indexer keys of its request.
- ``indexer_topk``: the rows of each query token's best-scored entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.ops.attention.kv_fp8 import KVSource, as_stored, gather_rows, store_rows
from deepinfer.ops.norm.torch_ref import apply_rope
from deepinfer.ops.registry import Backend

# Query tokens per chunk of the reference loops: bounds the gathered keys' memory.
_CHUNK = 256


def sparse_attention(
    q: torch.Tensor,
    sources: Sequence[tuple[KVSource, torch.Tensor]],
    sinks: torch.Tensor,
    scale: float,
    out_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Shared-KV multi-query attention over listed keys, with a per-head sink logit.

    q: [T, H, D]. sources: (kv [N, D] one head used as key and value, or packed FP8 rows
    (``kv_fp8.Fp8Rows``, read as their exact values in q's dtype), idx [T, L] integer rows of
    kv, -1 = no key) per source; a query attends to the union of its listed rows. sinks: [H]
    fp32; exp(sink) joins the softmax denominator and contributes no value. The softmax runs in
    fp32. A query with no keys outputs zeros. Returns [T, H, D] in q's dtype. out_rope: (cos,
    sin) [T, rope_dim / 2]: the output roped last (the norm family's apply_rope; V4 passes
    (cos, -sin) to rotate V's RoPE back; the kernels rotate in the output's store).
    """
    num_q, num_heads = q.shape[0], q.shape[1]
    out = torch.empty_like(q)
    sink = sinks.float().view(1, num_heads, 1)
    for lo in range(0, num_q, _CHUNK):
        hi = min(num_q, lo + _CHUNK)
        keys, valid = [], []
        for kv, idx in sources:
            rows = idx[lo:hi].long()
            keys.append(gather_rows(kv, rows.clamp(min=0), q.dtype))  # [C, L, D]
            valid.append(rows >= 0)
        kv_rows, mask = torch.cat(keys, dim=1), torch.cat(valid, dim=1)  # [C, L, D], [C, L]
        logits = torch.einsum("chd,cld->chl", q[lo:hi], kv_rows).float() * scale
        logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
        combined = torch.cat([logits, sink.expand(hi - lo, -1, -1)], dim=-1)  # [C, H, L + 1]
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        out[lo:hi] = torch.einsum("chl,cld->chd", probs.to(kv_rows.dtype), kv_rows)
    return out if out_rope is None else apply_rope(out, *out_rope)


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_req: torch.Tensor,
    num_visible: torch.Tensor,
    weight_scale: float = 1.0,
    q_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Lightning indexer scores of every query token over its request's compressed entries.

    q: [T, Hi, Di]; weights: [T, Hi], any float dtype, taken as weights.float() *
    weight_scale (V4: Hi^-0.5; the product is the kernels' too); keys: [P, Di] the flat
    indexer-key pool; entry_rows: [B, N] integer row of keys holding entry n of request b (any
    value at or past a request's entry count); token_req: [T] request (row of entry_rows) of each
    token; num_visible: [T] entries 0..num_visible-1 a token may see. q_rope: (cos, sin) [T,
    rope_dim / 2]: q is roped first, as the norm family's apply_rope does (the kernels' in
    their own launch). Returns [T, N] fp32: sum_h weights[t, h] * relu(q[t, h] .
    keys[entry]) * Di^-0.5, -inf where n >= num_visible.
    """
    if q_rope is not None:
        q = apply_rope(q, *q_rope)
    num_q, num_entries = q.shape[0], entry_rows.shape[1]
    out = torch.full((num_q, num_entries), float("-inf"), dtype=torch.float32, device=q.device)
    entry_ids = torch.arange(num_entries, device=q.device)
    weights = weights.float() * weight_scale
    for lo in range(0, num_q, _CHUNK):
        hi = min(num_q, lo + _CHUNK)
        visible = entry_ids.unsqueeze(0) < num_visible[lo:hi].unsqueeze(1)  # [C, N]
        rows = torch.where(visible, entry_rows[token_req[lo:hi]], 0).long()
        k = keys[rows].float()  # [C, N, Di]
        scores = torch.einsum("chd,cnd->chn", q[lo:hi].float(), k)
        scores = torch.relu(scores) * q.shape[-1] ** -0.5
        scores = (scores * weights[lo:hi].unsqueeze(-1)).sum(dim=1)  # [C, N]
        out[lo:hi] = scores.masked_fill(~visible, float("-inf"))
    return out


def indexer_topk(
    scores: torch.Tensor, entry_rows: torch.Tensor, token_req: torch.Tensor, k: int
) -> torch.Tensor:
    """Each query token's k best-scored entries, as rows of the indexer-key pool.

    scores: [T, N] fp32 (indexer_scores', -inf where not visible); entry_rows: [B, N];
    token_req: [T]. Returns [T, min(k, N)] in entry_rows' dtype: entry_rows[token_req[t], n]
    for the min(k, N) columns n of the highest scores, ties to the lower column (a score is
    exactly 0 wherever every head's ReLU is, so ties are common, and which one is chosen must not
    depend on N or on the batch), -1 where the chosen score is -inf. Attention takes a row's
    entries as a set; their order is the backend's (here by score, descending).
    """
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, indices = values[:, :k], indices[:, :k]
    rows = entry_rows[token_req.unsqueeze(1), indices]
    return torch.where(values == float("-inf"), -1, rows)


def indexer_select(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    entry_rows: torch.Tensor,
    token_req: torch.Tensor,
    num_visible: torch.Tensor,
    k: int,
    weight_scale: float = 1.0,
    q_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The indexer's pick: ``indexer_topk(indexer_scores(...), entry_rows, token_req, k)``,
    [T, min(k, N)] rows of the indexer-key pool (one launch on Triton for a few thousand
    entries)."""
    scores = indexer_scores(
        q, weights, keys, entry_rows, token_req, num_visible, weight_scale, q_rope
    )
    return indexer_topk(scores, entry_rows, token_req, k)


class TorchRefAttentionBackend(Backend):
    """The oracle as a backend object: this module's functions; it keeps no state."""

    @staticmethod
    def window_from_ring(num_tokens: int) -> bool:
        return False

    sparse_attention = staticmethod(sparse_attention)
    indexer_scores = staticmethod(indexer_scores)
    indexer_topk = staticmethod(indexer_topk)
    indexer_select = staticmethod(indexer_select)
    store_rows = staticmethod(store_rows)
    as_stored = staticmethod(as_stored)
