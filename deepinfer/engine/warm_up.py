"""Eager warm-up: the prefill and mixed step shapes run once at start-up, before the node reports
ready.

    token counts (each kernel tile class, aligned to 16 and not) x decodes beside them
    -> ForwardBatch on the cache's scratch slot and block -> model (outputs dropped)

The kernels' first compilations (Triton JIT, a second or more each, per tile class and
alignment) happen here rather than inside the first requests' steps. CUDA only; the batches
touch no request's cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch, SeqSpan

logger = logging.getLogger(__name__)


def warm_up_eager(
    model: Callable[[ForwardBatch, KVCache], torch.Tensor],
    cache: KVCache,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    device: torch.device,
) -> None:
    """CUDA: run the eager (prefill and mixed) step shapes once, on the cache's scratch slot and
    block (scheduler.max_num_batched_tokens and max_num_seqs bound the shapes); a no-op on other
    devices."""
    if device.type != "cuda":
        return
    budget = max_num_batched_tokens
    started = time.perf_counter()
    # Each tile class of the kernels (by token count), aligned to 16 and not.
    sizes = sorted({n for n in (1, 3, 4, 7, 16, 24, 32, 48, 64, 100, 128, 200, 256, 512,
                                1000, 1024, 2000, 2048) if n <= budget} | {budget})  # fmt: skip
    max_decodes = min(max_num_seqs - 1, 63)
    shapes = [(n, 0) for n in sizes] + [
        (n, d) for n in sizes for d in (1, max_decodes) if d > 0 and n + d <= budget
    ]
    for num_tokens, num_decodes in tqdm(shapes, desc="warming up prefill steps", unit="step"):
        _warm_up_step(model, cache, num_tokens, num_decodes, device)
    torch.cuda.synchronize(device)
    logger.info(
        "warmed up %d eager step shapes (a prefill chunk of %s tokens, alone and beside "
        "decodes) in %.1f s",
        len(shapes),
        sizes,
        time.perf_counter() - started,
    )


def _warm_up_step(
    model: Callable[[ForwardBatch, KVCache], torch.Tensor],
    cache: KVCache,
    num_tokens: int,
    num_decodes: int,
    device: torch.device,
) -> None:
    """A fresh prompt chunk of ``num_tokens`` and ``num_decodes`` one-token decodes at the
    end of a block, all on the scratch slot and block (their values do not matter)."""
    block = cache.block_size
    chunk = SeqSpan(0, num_tokens, 0, cache.scratch_slot, [cache.scratch_block] * -(
        -num_tokens // block))  # fmt: skip
    decodes = [
        SeqSpan(num_tokens + i, 1, block - 1, cache.scratch_slot, [cache.scratch_block])
        for i in range(num_decodes)
    ]
    positions = list(range(num_tokens)) + [block - 1] * num_decodes
    total = num_tokens + num_decodes
    batch = ForwardBatch(
        input_ids=torch.zeros(total, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        seqs=[chunk, *decodes],
        logits_indices=torch.tensor([num_tokens - 1, *range(num_tokens, total)], device=device),
    )
    with torch.inference_mode():
        model(batch, cache)
