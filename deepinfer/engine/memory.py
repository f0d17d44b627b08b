"""Device memory sizing: a profile step measures peak activations; the KV cache gets the rest.

    ModelRunner (start, cache.num_blocks unset, CUDA) -> profile_memory() -> MemoryProfile
    -> fit_num_blocks() -> KVCache(num_blocks)

    total x gpu_memory_utilization
    +---------+--------------------+--------------+--------+------------------------------------+
    | weights | peak activations   | decode graph | margin | KV cache: state slots + snapshots  |
    |         | (the profile step) | pool         |        | + blocks (what the others leave)   |
    +---------+--------------------+--------------+--------+------------------------------------+

The decode graphs are measured by capturing all of them on the scratch cache and freeing them
again: they share one pool for their intermediates, but each keeps buffers of its own (about
25 MiB a graph on V4-Flash shapes), so the largest alone undercounts them.

The budget is per engine (two engines at 0.45 can share a device); it is also capped by what is
free on the device after the profile, less the activations the steps will need again.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.engine.cuda_graphs import DecodeGraphs
from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch, SeqSpan
from deepinfer.ops import Kernels

logger = logging.getLogger(__name__)

# Device memory kept out of the KV cache beyond the profiled peak: the caching allocator's
# fragmentation and what libraries allocate outside it after start (cuBLAS/cuDNN handles). The
# CUDA context itself sits in the (1 - utilization) rest, or under the free-memory cap.
MEMORY_MARGIN_BYTES = 512 * 2**20
GIB = 2**30


@dataclass(frozen=True)
class MemoryProfile:
    """How the KV cache was sized on CUDA, in bytes. Producer: ``profile_memory`` at start.
    Consumers: the model runner (``kv_budget``), the start-up log and tests.

    kv_budget = min(total * utilization - weights - activations - graphs - margin,
                    free - activations - graphs - margin)   (free: after the profile)
    """

    total: int
    utilization: float
    weights: int
    activations: int  # peak of the profile step above what was allocated before it
    graphs: int  # reserved by capturing every decode graph (0: no graphs)
    margin: int
    free: int
    kv_budget: int
    num_tokens: int  # the profile step: one request of num_tokens tokens ending at context
    context: int


def fit_num_blocks(budget: int, *, bytes_per_block: int, fixed_bytes: int, max_useful: int) -> int:
    """Blocks that ``budget`` holds after ``fixed_bytes`` (state slots + snapshots), at most
    ``max_useful``; 0 when not even one fits."""
    fit = (budget - fixed_bytes) // max(bytes_per_block, 1)
    return max(0, min(fit, max_useful))


def profile_memory(
    model: nn.Module,
    kernels: Kernels,
    scratch: KVCache,
    *,
    utilization: float,
    num_tokens: int,
    context: int,
    graph_batch: int = 0,
    graph_tokens: int = 1,
) -> MemoryProfile:
    """Run the worst step on ``scratch`` (a cache of one block and one slot), measure its peak
    allocation, and return the KV budget that ``utilization`` x total memory leaves.

    The worst step for the torch reference backends is one request that holds the whole token
    budget (``num_tokens``) at the end of the longest context (``context``), with logits for
    every token (prompt logprobs): the attention and indexer intermediates grow as chunk x context
    per request, and the requests of a step run one after another inside each layer.

    ``graph_batch`` > 0: decode steps of up to that many requests replay CUDA graphs; the pool
    of all of them (``graph_tokens``: the most tokens of a request in one) is measured and kept
    out of the budget.
    """
    device = scratch.device
    total = torch.cuda.get_device_properties(device).total_memory
    tensors = itertools.chain(model.parameters(), model.buffers())
    weights = sum(t.numel() * t.element_size() for t in tensors)
    start_pos = context - num_tokens
    logger.info(
        "memory: profiling a step of %d tokens at positions %d..%d (logits for every token)",
        num_tokens,
        start_pos,
        context - 1,
    )
    began = time.perf_counter()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        _run_profile_step(model, kernels, scratch, start_pos, num_tokens)
        torch.cuda.synchronize(device)
    except torch.OutOfMemoryError as e:
        raise RuntimeError(
            f"the profile step ({num_tokens} tokens at context {context}) does not fit in device "
            "memory; lower model.max_model_len or scheduler.max_num_batched_tokens"
        ) from e
    activations = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    graphs = 0
    if graph_batch:
        graphs = _graph_pool_bytes(model, scratch, graph_batch, context, graph_tokens)
    free, _ = torch.cuda.mem_get_info(device)
    margin = MEMORY_MARGIN_BYTES
    kept = activations + graphs + margin
    budget = int(utilization * total) - weights - kept
    # Other processes (or other engines of this one) may hold memory: what is free now must
    # also hold the activations and the graphs at run time.
    if free - kept < budget:
        logger.warning(
            "memory: only %.2f GiB free on %s; the KV cache gets %.3f GiB instead of %.3f GiB",
            free / GIB,
            device,
            (free - kept) / GIB,
            budget / GIB,
        )
        budget = free - kept
    logger.info(
        "memory: %.2f GiB total x %.2f - %.3f GiB weights - %.3f GiB peak activations "
        "(profile step %.1f s) - %.3f GiB decode graphs - %.2f GiB margin -> %.3f GiB for the "
        "KV cache",
        total / GIB,
        utilization,
        weights / GIB,
        activations / GIB,
        time.perf_counter() - began,
        graphs / GIB,
        margin / GIB,
        budget / GIB,
    )
    return MemoryProfile(
        total=total,
        utilization=utilization,
        weights=weights,
        activations=activations,
        graphs=graphs,
        margin=margin,
        free=free,
        kv_budget=budget,
        num_tokens=num_tokens,
        context=context,
    )


def _run_profile_step(
    model: nn.Module, kernels: Kernels, scratch: KVCache, start_pos: int, num_tokens: int
) -> None:
    """One request of ``num_tokens`` tokens at ``start_pos``: logits and logprobs for all."""
    device = scratch.device
    end_pos = start_pos + num_tokens
    # Every logical block maps to scratch block 0: the compressed entries are gathered and written
    # at full length; their values do not matter.
    block_ids = [0] * -(-end_pos // scratch.block_size)
    token_ids = torch.arange(num_tokens, device=device) % model.args.vocab_size
    batch = ForwardBatch(
        input_ids=token_ids,
        positions=torch.arange(start_pos, end_pos, device=device),
        seqs=[SeqSpan(0, num_tokens, start_pos, 0, block_ids)],
        logits_indices=torch.arange(num_tokens, device=device),
    )
    logits = model(batch, scratch)  # [num_tokens, V] fp32
    kernels.sampling.compute_logprobs(logits, token_ids, 0)


def _graph_pool_bytes(
    model: nn.Module, scratch: KVCache, graph_batch: int, context: int, graph_tokens: int
) -> int:
    """Device memory the decode graphs reserve: all of their captures (pool + the shared
    logits buffer), measured on ``scratch`` and freed again."""
    device = scratch.device
    torch.cuda.synchronize(device)
    reserved = torch.cuda.memory_reserved(device)
    # Every graph keeps buffers of its own besides the shared pool, so all of them are measured.
    graphs = DecodeGraphs(
        model, scratch, graph_batch, max_positions=context, max_tokens=graph_tokens
    )
    graphs.capture_all(purpose="measuring")
    pool = torch.cuda.memory_reserved(device) - reserved
    del graphs
    gc.collect()
    torch.cuda.empty_cache()
    return pool
