"""FlashMLA's sparse kernels as the engine's attention where a call fits them; Triton elsewhere.

FlashMLA's SM90 sparse decode (``flashmla.sparse_decode``) reads packed FP8 rows
(cache.kv_dtype = "fp8": the engine's ring and entry parts hold exactly its V4 layout,
``flashmla.py``) from at most two sources, a main cache and an "extra" one. The model gives it
two: it asks for the window as one list of ring rows (``window_from_ring``: a decode step's keys
go into the ring before attention, ``StepMetadata.ring_window``, in steps of MIN_TOKENS tokens
or more), and the compressed entries are the second. A call goes to FlashMLA when:

    q              [T, H, 512] bf16 on CUDA, H in (64, 128)
    sources        1 or 2, each packed rows of the V4 layout (448 e4m3 + 64 bf16) whose
                   groups (blocks, ring slots) start 16-byte aligned: an even number of rows a
                   group (FlashMLA loads a row's codes 16 bytes at a time from the group's base)

and the step has MIN_TOKENS tokens or more (below, FlashMLA's extra launches cost more than
its kernel saves); to the Triton kernels (``TritonAttentionBackend``) otherwise: a dense (bf16)
cache, a prefill step's three sources, the tiny models' heads, few tokens. A source's rows are
FlashMLA's paged cache as they lie (row n: group n // r, slot n % r; a group's r rows of 576
bytes, then their r x 8 scale bytes), so no copy is made; its index lists go in as int32 padded
with -1 to a multiple of 64 (a no-op for ``ring_window``'s). Each token is a batch row of one query
(B = T, s_q = 1): every token has its own lists. The output's RoPE channels are rotated back
(``out_rope``) by the norm family's ``apply_rope``, one launch.

A prefill chunk over an FP8 cache (UNPACK_MIN_TOKENS tokens or more, not under CUDA-graph
capture) goes to FlashMLA's sparse prefill instead (``prefill_sources``): it takes one bf16
source, so the rows the lists name are unpacked once each (as the Triton path does from that
size), put one after another and the lists renumbered onto them; any block size.

FlashMLA's arithmetic: bf16 q . k on tensor cores with fp32 accumulation, probabilities rounded
to bf16 for the value product, over the same dequantized values our kernels read
(tests/gpu/test_gpu_flashmla.py holds it to torch_ref within FlashMLA's own tolerances).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.ops.attention import flashmla
from deepinfer.ops.attention.kv_fp8 import Fp8Rows, KVSource
from deepinfer.ops.attention.triton import TritonAttentionBackend, unpacked, unpacks
from deepinfer.ops.norm.triton import apply_rope

ALIGN = 16  # bytes: a group's base, for FlashMLA's 16-byte loads

# Steps of fewer tokens stay on Triton. A CSA layer's decode step (H100, FP8 cache, 4K context,
# graphed; benchmarks/RESULTS.md) took 0.329 ms with FlashMLA against Triton's 0.286 at batch
# 1, the same 1.34 at 32, and 1.95 against 2.08 at 128: its call is five launches (the index
# cast, its scheduling plan, the split kernel and their combine, the RoPE) against two.
MIN_TOKENS = 64


def paged_view(kv: KVSource) -> torch.Tensor | None:
    """A source as FlashMLA's paged FP8 cache [groups, r, 1, 584] (the same bytes), or None
    where FlashMLA cannot read it (dense rows, another layout, unaligned groups)."""
    if not isinstance(kv, Fp8Rows) or kv.layout != flashmla.LAYOUT:
        return None
    data, scales = kv.data, kv.scales
    groups, rows, data_bytes = data.shape
    stride = data.stride(0)
    contiguous = data.stride(1) == data_bytes and data.stride(2) == 1
    scales_follow = (
        scales.stride(0) == stride and scales.data_ptr() == data.data_ptr() + rows * data_bytes
    )
    if not contiguous or not scales_follow or stride % ALIGN or data.data_ptr() % ALIGN:
        return None
    row = flashmla.BYTES_PER_TOKEN
    view = data.as_strided((groups, rows, 1, row), (stride, row, row, 1))
    return view.view(torch.float8_e4m3fn)


def takes_queries(q: torch.Tensor) -> bool:
    """Whether q is what FlashMLA's sparse kernels take: [T, H, 512] bf16 on CUDA, H 64 or 128."""
    return (
        q.is_cuda
        and q.dtype == torch.bfloat16
        and q.dim() == 3
        and q.shape[1] in flashmla.SUPPORTED_HEADS
        and q.shape[2] == flashmla.HEAD_DIM
    )


def fits(q: torch.Tensor, caches: Sequence[torch.Tensor | None]) -> bool:
    """Whether FlashMLA's sparse decode takes q over these sources (``paged_view``'s)."""
    return takes_queries(q) and 1 <= len(caches) <= 2 and all(c is not None for c in caches)


def prefill_sources(
    q: torch.Tensor, sources: Sequence[tuple[KVSource, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A prefill chunk's sources as FlashMLA's sparse prefill takes them, one bf16 source: the
    rows its lists name, each once (``unpacked``), one after another, and the lists renumbered
    onto them. Only for a call the Triton path unpacks too (``unpacks``: a packed source, enough
    tokens, no graph capture) and whose dense sources are the chunk's own keys (a bf16 cache
    part is not copied whole); None otherwise, or for q of other shapes."""
    dense = [kv for kv, _ in sources if not isinstance(kv, Fp8Rows)]
    if (
        not takes_queries(q)
        or not unpacks(q, sources)
        or any(kv.shape[0] > q.shape[0] for kv in dense)
    ):
        return None
    rows, lists, first = [], [], 0
    for kv, idx in sources:
        dense, local = unpacked(kv, idx, q.dtype)
        rows.append(dense)
        lists.append(torch.where(local >= 0, local + first, -1))
        first += dense.shape[0]
    return torch.cat(rows), torch.cat(lists, dim=1)


class FlashMLAAttentionBackend(TritonAttentionBackend):
    """FlashMLA's sparse decode and prefill for the calls that fit them (module docstring),
    this device's Triton kernels for the rest and for every other op."""

    @staticmethod
    def window_from_ring(num_tokens: int) -> bool:
        return num_tokens >= MIN_TOKENS

    def sparse_attention(
        self,
        q: torch.Tensor,
        sources: Sequence[tuple[KVSource, torch.Tensor]],
        sinks: torch.Tensor,
        scale: float,
        out_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        # A list of no columns (no entry closed yet in any request) names no key: left out,
        # rather than handed to FlashMLA as a cache of no index blocks.
        listed = [(kv, idx) for kv, idx in sources if idx.shape[1]] or sources
        caches = [paged_view(kv) for kv, _ in listed]
        if fits(q, caches) and q.shape[0] >= MIN_TOKENS:
            lists = [idx.unsqueeze(1) for _, idx in listed]  # [T, 1, L]: a query a batch row
            extra = {}
            if len(listed) == 2:
                extra = {"extra_cache": caches[1], "extra_indices": lists[1]}
            out = flashmla.sparse_decode(q.unsqueeze(1), caches[0], lists[0], sinks, scale, **extra)
            out = out.squeeze(1)  # [T, H, 512]
        elif (prefill := prefill_sources(q, sources)) is not None:
            out = flashmla.sparse_prefill(q, *prefill, sinks, scale)  # [T, H, 512]
        else:
            return super().sparse_attention(q, sources, sinks, scale, out_rope)
        return out if out_rope is None else apply_rope(out, *out_rope, num_sms=self.num_sms)
