"""Expert parallelism behind the MoE backend interface: dispatch, the local experts, combine.

Each of N ranks holds a contiguous E/N of the routed experts (rank r: experts r*E/N ..). A
token's k (token, slot) pairs travel to the ranks holding their experts and their outputs come
back, through all-to-all collectives of the rank group::

    rank r: x [T, D], topk_ids [T, k] (global ids), topk_weights [T, k]
      pairs sorted by expert id (stable)   -> dest rank = id // (E/N), counts per dest [N]
      all_to_all(counts)                   -> counts from each source (the only host sync)
      all_to_all(payload rows)             -> received pairs: x row | local id | weight, as bytes
      inner backend, k = 1 per pair        -> each pair's weight * expert(x) [R, D]
      all_to_all(outputs) back             -> the rank's own pairs' outputs, in sent order
      combine: per token, its k outputs in ascending expert id, summed in fp32 from zero

The combine's order is the torch reference's (it visits experts in id order), and a token's
output depends only on its own pairs, not on which other tokens share the step. A rank with no
tokens of its own (a placeholder step) still runs every exchange with T = 0: it serves its
experts to the others. One rank (a group of one) exchanges nothing: it holds every expert.

Every rank calls ``fused_moe`` the same number of times per step (lockstep.py makes sure), so
the collectives of all ranks line up layer by layer. A DeepEP backend would replace this module.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from deepinfer.ops.moe import MoEBackend
from deepinfer.ops.registry import Backend, ParallelContext
from deepinfer.ops.streams import Pending, ready

__all__ = ["ExpertParallelMoEBackend", "combine", "pack_pairs", "route_pairs", "unpack_pairs"]


def route_pairs(topk_ids: torch.Tensor, experts_per_rank: int, world_size: int) -> tuple:
    """(order [P]: pair numbers sorted by expert id, send counts per rank [N] int64)."""
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    dest = flat[order] // experts_per_rank
    counts = torch.bincount(dest, minlength=world_size)
    return order, counts


def pack_pairs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    order: torch.Tensor,
    experts_per_rank: int,
) -> torch.Tensor:
    """The sorted pairs as rows of bytes: x row | local expert id (int64) | weight (fp32)."""
    k = topk_ids.shape[1]
    rows = x[order // k]  # [P, D]
    local = (topk_ids.flatten()[order] % experts_per_rank).to(torch.int64)
    weights = topk_weights.flatten()[order].to(torch.float32)
    parts = (rows.contiguous(), local[:, None], weights[:, None])
    return torch.cat([p.view(torch.uint8) for p in parts], dim=1)  # [P, bytes per row]


def unpack_pairs(
    payload: torch.Tensor, hidden: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Received byte rows -> (x rows [R, D] dtype, local ids [R, 1] int64, weights [R, 1] fp32)."""
    width = hidden * torch.empty((), dtype=dtype).element_size()

    def column(lo: int, hi: int, as_dtype: torch.dtype) -> torch.Tensor:
        dense = payload[:, lo:hi].clone(memory_format=torch.contiguous_format)
        return dense.view(as_dtype)

    x = column(0, width, dtype)
    ids = column(width, width + 8, torch.int64)
    weights = column(width + 8, payload.shape[1], torch.float32)
    return x, ids, weights


def combine(
    pair_out: torch.Tensor, order: torch.Tensor, topk_ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Outputs of the sorted pairs [P, D] -> [T, D]: each token's k outputs in ascending expert
    id (its pairs' sorted order), added in fp32 from zero, then cast to ``dtype``."""
    (t, k), hidden = topk_ids.shape, pair_out.shape[1]
    by_pair = torch.empty_like(pair_out)
    by_pair[order] = pair_out
    by_pair = by_pair.view(t, k, hidden)
    slots = torch.argsort(topk_ids, dim=1, stable=True)  # each token's slots by expert id
    ordered = by_pair.gather(1, slots[..., None].expand(-1, -1, hidden)).float()
    out = torch.zeros(t, hidden, dtype=torch.float32, device=pair_out.device)
    for j in range(k):
        out += ordered[:, j]
    return out.to(dtype)


class ExpertParallelMoEBackend(Backend):
    """Routed experts over the ranks of ``parallel``: ``fused_moe`` takes this rank's experts
    (w1/w3 [E/N, I, D], w2 [E/N, D, I]) and global expert ids, and runs ``inner`` (the device's
    MoE backend) on the pairs that reach this rank. ``exchange_seconds`` adds up host time in
    the collectives (exact on gloo, where they block)."""

    def __init__(
        self,
        device: torch.device | None,
        parallel: ParallelContext,
        inner: MoEBackend,
    ) -> None:
        super().__init__(device, parallel)
        assert parallel.world_size == 1 or parallel.group is not None, "ranks need a group"
        self.inner = inner
        self.exchange_seconds = 0.0
        # Pairs that reached each of this rank's experts, summed over layers (on the device:
        # adding them costs no sync; ``expert_tokens`` reads them).
        self._expert_tokens: torch.Tensor | None = None
        self._first_expert = 0

    def expert_tokens(self) -> dict[int, int]:
        """Global expert id -> (token, slot) pairs its rank computed for it so far (metrics:
        tokens dispatched per expert, for expert load balancing)."""
        if self._expert_tokens is None:
            return {}
        counts = self._expert_tokens.tolist()
        return {self._first_expert + i: n for i, n in enumerate(counts)}

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        """The inner backend's (the shared expert runs on every rank's own tokens)."""
        return self.inner.swiglu(gate, up, limit)

    def route(
        self,
        logits: torch.Tensor,
        bias: torch.Tensor | None,
        hash_ids: torch.Tensor | None,
        top_k: int,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The inner backend's router: every rank routes its own tokens over all experts."""
        return self.inner.route(logits, bias, hash_ids, top_k, scale)

    @property
    def fp8_experts(self) -> bool:
        """The inner backend's expert format (the loader converts this rank's share)."""
        return getattr(self.inner, "fp8_experts", False)

    def fused_moe(
        self,
        x: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        limit: float,
        residual: torch.Tensor | Pending | None = None,
    ) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return self.inner.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, limit, residual)
        out = self.exchange_moe(x, w1, w2, w3, topk_ids, topk_weights, limit)
        residual = ready(residual)
        return out if residual is None else out + residual  # once, after the ranks' sums

    def exchange_moe(
        self,
        x: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        limit: float,
    ) -> torch.Tensor:
        """Dispatch, the local experts, combine: what ``fused_moe`` runs over several ranks
        (over one, every pair stays: a check of the path on one device)."""
        world, per_rank = self.parallel.world_size, w1.shape[0]
        order, send_counts = route_pairs(topk_ids, per_rank, world)
        payload = pack_pairs(x, topk_ids, topk_weights, order, per_rank)
        start = time.perf_counter()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.parallel.group)
        sent, received = send_counts.tolist(), recv_counts.tolist()
        incoming = payload.new_empty(sum(received), payload.shape[1])
        self._all_to_all(incoming, payload, received, sent)
        self.exchange_seconds += time.perf_counter() - start
        rx, local_ids, weights = unpack_pairs(incoming, x.shape[-1], x.dtype)
        counts = torch.bincount(local_ids.flatten(), minlength=per_rank)
        if self._expert_tokens is None:
            self._expert_tokens = torch.zeros_like(counts)
            self._first_expert = self.parallel.rank * per_rank
        self._expert_tokens += counts
        out = self.inner.fused_moe(rx, w1, w2, w3, local_ids, weights, limit)  # [R, D]
        start = time.perf_counter()
        back = out.new_empty(sum(sent), out.shape[1])
        self._all_to_all(back, out.contiguous(), sent, received)
        self.exchange_seconds += time.perf_counter() - start
        return combine(back, order, topk_ids, x.dtype)

    def _all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> None:
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.parallel.group)
