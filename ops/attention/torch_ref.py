"""Sparse attention with sinks and the Lightning indexer, torch reference (the oracle).

One request at a time: the caller gathers the keys a request's queries may see (sliding window
rows from the state slot, then compressed entries from the paged pool) and a boolean mask.
"""

from __future__ import annotations

import torch


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Shared-KV multi-query attention with a per-head sink logit in the softmax denominator.

    q: [C, H, D]; kv: [L, D] (one head, used as key and value); mask: [C, L] bool (True = may
    attend); sinks: [H] fp32. Returns [C, H, D] in q's dtype. The sink adds exp(sink) to the
    denominator and contributes no value. The softmax runs in fp32 (the sinks are fp32).
    """
    num_q, num_heads = q.shape[0], q.shape[1]
    logits = torch.einsum("chd,ld->hcl", q, kv).float() * scale  # [H, C, L]
    logits = logits.masked_fill(~mask.unsqueeze(0), float("-inf"))
    sink = sinks.float().view(num_heads, 1, 1).expand(num_heads, num_q, 1)
    combined = torch.cat([logits, sink], dim=-1)  # [H, C, L + 1]
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("hcl,ld->chd", probs.to(kv.dtype), kv)


def indexer_topk(
    q: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    topk: int,
) -> torch.Tensor:
    """Lightning indexer: pick up to ``topk`` causal compressed entries per query.

    q: [C, Hi, Di] (roped); keys: [N, Di] compressed indexer keys; weights: [C, Hi] per-head
    weights (already scaled by Hi^-0.5); positions: [C] query positions. score[t, s] =
    sum_h weights[t, h] * relu(q[t, h] . keys[s]) * Di^-0.5, future entries (s >= (t+1)//ratio)
    excluded. Returns [C, min(topk, N)] int64 indices, -1 where a query has fewer visible entries.
    """
    num_entries = keys.shape[0]
    scores = torch.einsum("chd,nd->chn", q.float(), keys.float())  # [C, Hi, N]
    scores = torch.relu(scores) * q.shape[-1] ** -0.5
    scores = (scores * weights.float().unsqueeze(-1)).sum(dim=1)  # [C, N]
    threshold = ((positions + 1) // ratio).unsqueeze(-1)  # [C, 1]
    entries = torch.arange(num_entries, device=keys.device)
    scores = scores.masked_fill(entries.unsqueeze(0) >= threshold, float("-inf"))
    picked = scores.topk(min(topk, num_entries), dim=-1).indices
    return torch.where(picked >= threshold, torch.full_like(picked, -1), picked)
