"""Top-k / top-p filtering of logits rows (the sampler's nucleus step).

``apply_top_k_top_p`` finds each row's cut from its best tokens; ``sorted_top_k_top_p`` is the
full stable sort that defines the result (and serves rows the candidates cannot decide).
"""

from __future__ import annotations

import torch

# Top-k / top-p read each row's best tokens only: a full sort of the vocabulary per row costs far
# more than the forward on the CPU (and a sizeable share of a decode step on a GPU).
NUM_CANDIDATES = 1024


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    may_need_sort: bool | None = None,
) -> torch.Tensor:
    """Mask all but each row's top_k (0 = all) then its smallest nucleus with mass >= top_p.

    The order is a stable descending sort: among equal logits the lower id ranks first, so the
    top token (rank 0, exclusive cumulative mass 0 < top_p) always survives. Each row keeps
    its first ``c`` tokens in that order, ``c`` found from its best ``NUM_CANDIDATES`` tokens; rows
    whose nucleus may reach past them (or whose top_k and top_p both need ranks past them, or
    whose top_k alone goes past them) are done by ``sorted_top_k_top_p``. Either way a row's
    result depends on that row only.

    ``may_need_sort``: None finds those rows on the host (a device sync); False says the caller
    knows there are none (no top_p, no top_k past the candidates); True sorts every row and keeps
    the sorted result where needed, with no sync (an asynchronous GPU step must not wait).
    """
    vocab_size = logits.shape[-1]
    num_candidates = min(vocab_size, NUM_CANDIDATES)
    if num_candidates == vocab_size:
        return sorted_top_k_top_p(logits, top_k, top_p)
    values, _ = logits.topk(num_candidates, dim=-1)  # [B, K] descending (values only: exact)
    k = torch.where(top_k > 0, top_k, vocab_size)  # [B]
    uses_p = top_p < 1.0
    # The nucleus' normaliser: the mass of the top_k tokens (all tokens when top_k is off).
    ranks = torch.arange(num_candidates, device=logits.device).unsqueeze(0)
    top = values[:, :1]
    in_k = ranks < k.unsqueeze(1)
    local = torch.where(in_k, (values - top).exp(), 0.0)  # [B, K]
    normaliser = torch.where(
        k >= vocab_size, (logits - top).exp().sum(dim=-1), local.sum(dim=-1)
    ).unsqueeze(1)
    probs = local / normaliser
    mass_before = probs.cumsum(dim=-1) - probs
    inside = in_k & ((mass_before < top_p.unsqueeze(1)) | ~uses_p.unsqueeze(1))
    num_keep = torch.where(uses_p, inside.sum(dim=-1), k)  # [B] tokens kept in sorted order
    # Undecided: a nucleus that fills every candidate (it may go on), or top_k past the
    # candidates with top_p on (its normaliser needs ranks past them).
    undecided = uses_p & ((num_keep == num_candidates) | ((k > num_candidates) & (k < vocab_size)))
    if may_need_sort:
        far = (num_keep > num_candidates) & (num_keep < vocab_size)
        fast = _keep_first(logits, values, num_keep.clamp(max=vocab_size), find_far=False)
        exact = sorted_top_k_top_p(logits, top_k, top_p)
        return torch.where((undecided | far).unsqueeze(1), exact, fast)
    out = _keep_first(logits, values, num_keep.clamp(max=vocab_size))
    if may_need_sort is None and bool(undecided.any()):
        rows = undecided.nonzero().squeeze(1)
        out[rows] = sorted_top_k_top_p(logits[rows], top_k[rows], top_p[rows])
    return out


def _keep_first(
    logits: torch.Tensor, values: torch.Tensor, num_keep: torch.Tensor, find_far: bool = True
) -> torch.Tensor:
    """Each row's first ``num_keep`` tokens in stable descending order kept, the rest -inf.

    values: [B, K] the rows' best logits, descending. The cutoff logit v is the num_keep-th best
    (kthvalue when past the candidates, if ``find_far``): every token above v stays, and of the
    tokens equal to v the lowest ids fill what is left.
    """
    vocab_size = logits.shape[-1]
    num_candidates = values.shape[1]
    keep_all = num_keep >= vocab_size
    index = (num_keep - 1).clamp(min=0, max=num_candidates - 1).unsqueeze(1)
    cutoff = values.gather(1, index)  # [B, 1]
    far = (num_keep > num_candidates) & ~keep_all
    if find_far and bool(
        far.any()
    ):  # pure top_k past the candidates: its value by selection, not sort
        for row in far.nonzero().squeeze(1).tolist():
            rank = vocab_size - int(num_keep[row]) + 1  # the num_keep-th largest
            cutoff[row, 0] = logits[row].kthvalue(rank).values
    above = logits > cutoff
    tied = logits == cutoff
    needed = (num_keep - above.sum(dim=-1)).unsqueeze(1)
    keep = above | (tied & (tied.cumsum(dim=-1) <= needed)) | keep_all.unsqueeze(1)
    return logits.masked_fill(~keep, float("-inf"))


def sorted_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """``apply_top_k_top_p`` by a full stable sort of each row (exact for any row)."""
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # [B, V]
    ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, V]
    k = torch.where(top_k > 0, top_k, vocab_size).unsqueeze(1)  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p == 1 are left alone: rounding can push the tail's cumulative mass to 1.0.
    outside = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
