"""FlashMLA's sparse attention kernels (``flash_mla``) on DeepSeek-V4 shapes, and its FP8 KV layout.

The adapter the engine backend (``flashmla_backend.py``: FlashMLA's sparse decode where a call
fits it, over the engine's FP8 cache parts as they lie), the benchmark
(benchmarks/flashmla_vs_triton.py) and the GPU test (tests/gpu/test_gpu_flashmla.py) call. The
kernels are vendor code built apart (scripts/build_flashmla.sh): ``flash_mla`` is imported
only when a function here runs, so this module imports everywhere; ``is_available`` says why
it cannot run.

Mapping. Our op is shared-KV multi-query attention: one row of D = 512 is key and value for all
heads, laid out ``[nope 448 | rope 64]``. FlashMLA's V4 mode ("MODEL1": d_qk = d_v = 512) is the
same computation: logits q . k over all 512 channels, output sum p * k over all 512 channels (its
V is the whole K row, RoPE part included), a sink per head joining the softmax denominator
(out *= 1 / (1 + exp(sink - lse))), holes (-1) skipped, a token with no key giving zeros. So q is
passed as is, [B, s_q, H, 512]; only the KV rows change form: the 448 NoPE channels are stored in
FP8 with a power-of-two scale per 64 channels, the 64 RoPE channels stay bf16 (``pack_kv_cache``).
``unpack_kv_cache`` gives back exactly the values the kernel computes with (fp8 x 2^e is exact in
bf16), which is the input our kernels get when compared with it.

FP8 sparse KV cache, V4 layout (FlashMLA tests/quant.py ``MODEL1_FP8Sparse``; the kernel reads it
in csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh). Rows are grouped in page blocks of
``block_size`` tokens; row n lives in block n // block_size at slot n % block_size, and its
index in an index list is n itself (block * block_size + slot). One block of bs tokens::

    byte 0          576 * t          576 * bs          576 * bs + 8 * t          584 * bs
    | token 0 | ... | token t | ... | scales 0 | ... | scales t | ... | zero padding |

    token t, 576 bytes: 448 x e4m3 fp8 (NoPE channels 0..447), then 64 x bf16 little-endian
                        (RoPE channels 448..511)
    scales t, 8 bytes:  7 x ue8m0, scale of NoPE channels 64i..64i+63 = 2^(byte i - 127), then 0
    block stride:       584 * bs rounded up to a multiple of 576 bytes

The tensor handed to FlashMLA is a view [num_blocks, bs, 1, 584] of those blocks: stride 584 on
dim 1 (FlashMLA checks it) and the block stride on dim 0 (the kernel steps blocks by it and finds
a token's fields from the block base). Scale of a 64-channel tile:
2^ceil(log2(max(amax / 448, 1e-4))), so that the tile's largest value maps to at most 448,
e4m3's largest finite value.
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.ops.attention.kv_fp8 import Fp8Layout, Fp8Rows

HEAD_DIM = 512  # d_qk = d_v = 512: the whole row is key and value
ROPE_DIM = 64  # kept in bf16
LAYOUT = Fp8Layout(HEAD_DIM, ROPE_DIM)  # the engine's FP8 KV rows for V4: these bytes
BYTES_PER_TOKEN = LAYOUT.row_bytes  # 584 (576 data + 8 scales), the last dim FlashMLA checks
BLOCK_ALIGN = 576  # a block's stride is a multiple of this (as FlashMLA's tests lay it out)
DECODE_TOPK_BLOCK = 64  # decode index lists: a multiple of this many entries (padded with -1)
PREFILL_TOPK_BLOCK = 128  # sm90 sparse prefill: topk % (2 * 64) == 0
SUPPORTED_HEADS = (64, 128)


def is_available(device: torch.device) -> tuple[bool, str]:
    """FlashMLA's sparse kernels: a CUDA device of compute capability 9.0 (H100/H200; the build
    in scripts/build_flashmla.sh is SM90 only) and an importable ``flash_mla``."""
    if device.type != "cuda":
        return False, f"FlashMLA runs on CUDA devices, not {device.type}"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        name = torch.cuda.get_device_name(device)
        return (
            False,
            f"FlashMLA is built here for sm_90a; {name} is sm_{capability[0]}{capability[1]}",
        )
    try:
        import flash_mla
    except ImportError as error:
        return False, (
            f"flash_mla is not importable ({error}); bash scripts/build_flashmla.sh, then "
            "export PYTHONPATH=/tmp/flashmla-site:$PYTHONPATH"
        )
    return True, f"flash_mla from {flash_mla.__file__} on {torch.cuda.get_device_name(device)}"


# ---- the FP8 KV layout -----------------------------------------------------------------------


def block_stride_bytes(block_size: int) -> int:
    """Bytes from one page block to the next: 584 * block_size rounded up to 576."""
    return -(-block_size * BYTES_PER_TOKEN // BLOCK_ALIGN) * BLOCK_ALIGN


def pack_kv_cache(kv: torch.Tensor, block_size: int = 64) -> torch.Tensor:
    """KV rows [N, 512] (bf16 or fp32, ``[nope 448 | rope 64]``) in FlashMLA's V4 FP8 layout.

    Returns the view FlashMLA takes: [ceil(N / block_size), block_size, 1, 584] float8_e4m3fn
    with strides (block_stride_bytes(block_size), 584, 584, 1), on kv's device; rows past N are
    zeros. Row n's index in FlashMLA's index lists is n. The rows are packed by
    ``kv_fp8.Fp8Layout`` (the engine's FP8 KV rows: the same bytes), rounded to bf16 first.
    """
    assert kv.dim() == 2 and kv.shape[1] == HEAD_DIM, f"kv rows [N, {HEAD_DIM}], got {kv.shape}"
    assert block_size > 0, f"block_size {block_size}"
    num_rows = kv.shape[0]
    num_blocks = max(-(-num_rows // block_size), 1)
    padded = torch.zeros(
        (num_blocks * block_size, HEAD_DIM), dtype=torch.bfloat16, device=kv.device
    )
    padded[:num_rows] = kv
    data, scales = LAYOUT.pack(padded)  # [R, 576], [R, 8]
    blocks = torch.zeros(
        (num_blocks, block_stride_bytes(block_size)), dtype=torch.uint8, device=kv.device
    )
    rows = blocks[:, : block_size * BYTES_PER_TOKEN].view(num_blocks, block_size, -1)
    packed = Fp8Rows.of(rows, LAYOUT)
    packed.data.copy_(data.view(num_blocks, block_size, -1))
    packed.scales.copy_(scales.view(num_blocks, block_size, -1))
    return rows.unsqueeze(2).view(torch.float8_e4m3fn)


def unpack_kv_cache(cache: torch.Tensor, num_rows: int | None = None) -> torch.Tensor:
    """The rows a packed cache holds, as the kernel computes with them: [N, 512] bf16.

    cache: [num_blocks, block_size, 1, 584] as ``pack_kv_cache`` returns (fp8, int8 or uint8,
    any block stride). NoPE = fp8 value x 2^(byte - 127), exact in bf16; RoPE as stored.
    num_rows: the first rows to return (default: every slot of every block).
    """
    _, _, num_kv_heads, token_bytes = cache.shape
    assert num_kv_heads == 1 and token_bytes == BYTES_PER_TOKEN, f"cache {tuple(cache.shape)}"
    assert cache.stride(1) == BYTES_PER_TOKEN and cache.stride(3) == 1, (
        f"a block's tokens must be contiguous: strides {cache.stride()}"
    )
    packed = Fp8Rows.of(cache.view(torch.uint8).squeeze(2), LAYOUT)
    rows = LAYOUT.unpack(packed.data, packed.scales).flatten(0, 1)
    return rows if num_rows is None else rows[:num_rows]


# ---- calls into flash_mla (keyword arguments only) ------------------------------------------


def _pad_topk(idx: torch.Tensor, multiple: int) -> torch.Tensor:
    """int32 index lists, last dim contiguous and padded with -1 to a multiple of ``multiple``."""
    idx = idx.to(torch.int32)
    pad = -idx.shape[-1] % multiple
    if pad:
        idx = torch.nn.functional.pad(idx, (0, pad), value=-1)
    return idx if idx.stride(-1) == 1 else idx.contiguous()


def decode_metadata() -> Any:
    """A fresh FlashMLA scheduling plan (``FlashMLASchedMeta``), filled by the first
    ``sparse_decode`` that gets it. Reuse it only while the batch size, s_q, the caches' block
    sizes, the index lists' widths and the topk lengths stay the same: once per step, shared by
    every layer."""
    import flash_mla

    return flash_mla.get_mla_metadata()[0]


def sparse_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    *,
    extra_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    metadata: Any = None,
) -> torch.Tensor:
    """FlashMLA's sparse decode over one or two packed FP8 caches: out [B, s_q, H, 512] bf16.

    q: [B, s_q, H, 512] bf16, H in (64, 128). cache / extra_cache: ``pack_kv_cache`` views.
    indices / extra_indices: [B, s_q, K] / [B, s_q, K'] rows of cache / extra_cache, -1 = none
    (padded here with -1 to multiples of 64). sinks: [H] fp32. scale: the softmax scale.
    topk_length / extra_topk_length: [B] int32, only the first entries of each list count.
    metadata: ``decode_metadata()`` to share between calls of one step (default: a fresh one,
    which plans the split of the work on every call).
    """
    import flash_mla

    assert q.dim() == 4 and q.shape[-1] == HEAD_DIM, f"q [B, s_q, H, {HEAD_DIM}], got {q.shape}"
    assert q.shape[2] in SUPPORTED_HEADS, (
        f"FlashMLA takes {SUPPORTED_HEADS} heads, not {q.shape[2]}"
    )
    assert (extra_cache is None) == (extra_indices is None), "extra_cache needs extra_indices"
    if extra_indices is not None:
        extra_indices = _pad_topk(extra_indices, DECODE_TOPK_BLOCK)
    out, _lse = flash_mla.flash_mla_with_kvcache(
        q=q if q.stride(-1) == 1 else q.contiguous(),
        k_cache=cache,
        block_table=None,
        cache_seqlens=None,
        head_dim_v=HEAD_DIM,
        tile_scheduler_metadata=decode_metadata() if metadata is None else metadata,
        num_splits=None,
        softmax_scale=scale,
        causal=False,
        is_fp8_kvcache=True,
        indices=_pad_topk(indices, DECODE_TOPK_BLOCK),
        attn_sink=sinks.float().contiguous(),
        extra_k_cache=extra_cache,
        extra_indices_in_kvcache=extra_indices,
        topk_length=topk_length,
        extra_topk_length=extra_topk_length,
    )
    return out


def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    *,
    topk_length: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlashMLA's sparse prefill (bf16 KV, one source): out [T, H, 512] bf16.

    q: [T, H, 512] bf16, H in (64, 128). kv: [N, 512] bf16. indices: [T, K] rows of kv, -1 =
    none (padded here with -1 to a multiple of 128). sinks: [H] fp32. topk_length: [T] int32.
    Several of our sources go in as one: concatenate their rows and offset their index lists.
    """
    import flash_mla

    assert q.dim() == 3 and q.shape[-1] == HEAD_DIM, f"q [T, H, {HEAD_DIM}], got {q.shape}"
    assert kv.dim() == 2 and kv.shape[-1] == HEAD_DIM, f"kv [N, {HEAD_DIM}], got {kv.shape}"
    out, _max_logits, _lse = flash_mla.flash_mla_sparse_fwd(
        q=q if q.stride(-1) == 1 else q.contiguous(),
        kv=kv.unsqueeze(1),  # [N, 1, 512]: one KV head
        indices=_pad_topk(indices, PREFILL_TOPK_BLOCK).unsqueeze(1),  # [T, 1, K]
        sm_scale=scale,
        d_v=HEAD_DIM,
        attn_sink=sinks.float().contiguous(),
        topk_length=topk_length,
    )
    return out
