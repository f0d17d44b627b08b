"""FlashMLA's SM90 sparse decode (ops/attention/flashmla.py) against torch_ref, V4-Flash shapes.

Shapes: 64 query heads of 512, shared-KV rows [nope 448 | rope 64], a sink per head; a "window"
cache (128 ring slots per request, FlashMLA's main cache) and a "compressed" cache (a pool of
2048 entries per request, FlashMLA's extra cache) from which every query token lists 512; batch
1, 32 and 128 requests of 1 or 2 query tokens. Index lists have -1 holes, the last 64 compressed
picks of every token are -1 (entries not visible yet) and the last token of a batch sees no key.
One more case passes topk_length / extra_topk_length and other page block sizes (256 and 2).

FlashMLA reads the caches packed in its V4 FP8 layout; the oracle reads the same rows unpacked
(``unpack_kv_cache``: exactly the values the kernel dequantizes to) in fp32 on CUDA with TF32
off, with the same index lists, so what is measured is the kernel's arithmetic (bf16 q . k on
tensor cores with fp32 accumulation, probabilities rounded to bf16 for the value product, bf16
output), not the FP8 quantization. The oracle's output is rounded to bf16, and the two are held to
FlashMLA's own decode tolerances (tests/test_flash_mla_sparse_decoding.py), the absolute one
scaled to our values: every element within 1e-2 absolute or 2.01/128 relative, and a cosine
difference under 5e-6. (FlashMLA draws KV rows at std 0.1 and allows 1e-3; ours are at std 1, as
the model's normed kv, and a value's rounding errors scale with it.) A CPU model of that
arithmetic on these inputs (online softmax over tiles of 64 keys, probabilities rounded to bf16)
gives a cosine difference ~2.3e-6, a relative error ~2.2e-3, and at most 1.5e-3 absolute where
the relative error exceeds 2.01/128 (few keys, outputs near 0).

test_sparse_prefill holds FlashMLA's sparse prefill (bf16 KV, one source) to the fp32 oracle the
same way, with the tolerances of FlashMLA's prefill test (the model above: cosine difference
~2.1e-6).

Skipped with the reason where flash_mla is not importable (bash scripts/build_flashmla.sh, then
PYTHONPATH=/tmp/flashmla-site) or the GPU is not SM90.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from deepinfer.ops.attention import flashmla, torch_ref

pytestmark = pytest.mark.gpu

NUM_HEADS, DIM = 64, 512
WINDOW, POOL_PER_REQUEST, TOPK = 128, 2048, 512
NOT_VISIBLE = 64  # the last picks of every compressed list: -1
HOLE_FRACTION = 0.1

# FlashMLA's sparse decode test: |out - ref| < abs or |out - ref| / |ref| < rel, element-wise,
# and 1 - 2<out, ref> / (|out|^2 + |ref|^2) < cos. Its abs is 1e-3 for values 10x smaller.
OUT_ABS_TOL = 1e-2
OUT_REL_TOL = 2.01 / 128
COS_DIFF_TOL = 5e-6
# Its sparse prefill test, against the fp32 reference not rounded: 8e-4 (x 10 here), 3.01/128, 7e-6.
PREFILL_ABS_TOL = 8e-3
PREFILL_REL_TOL = 3.01 / 128
PREFILL_COS_DIFF_TOL = 7e-6
PREFILL_TOKENS, PREFILL_POOL = 512, 2048


@dataclass(frozen=True)
class Case:
    batch: int
    s_q: int
    block_size: int = 64
    extra_block_size: int = 64
    with_lengths: bool = False

    def __str__(self) -> str:
        lengths = "-lengths" if self.with_lengths else ""
        blocks = f"-blocks{self.block_size},{self.extra_block_size}"
        return f"B{self.batch}-sq{self.s_q}{blocks}{lengths}"


CASES = [Case(batch, s_q) for batch in (1, 32, 128) for s_q in (1, 2)] + [
    Case(32, 2, block_size=256, extra_block_size=2, with_lengths=True)
]


@pytest.fixture(scope="module")
def flash_mla() -> Iterator[ModuleType]:
    """flash_mla, or a skip that says why; TF32 off meanwhile (the oracle runs IEEE fp32)."""
    ok, why = flashmla.is_available(torch.device("cuda"))
    if not ok:
        pytest.skip(why)
    import flash_mla as module

    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield module
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32


@dataclass
class Inputs:
    q: torch.Tensor  # [B, s_q, H, D] bf16
    window: torch.Tensor  # [B * 128, D] bf16 rows before packing
    window_idx: torch.Tensor  # [B, s_q, 128] int32
    pool: torch.Tensor  # [B * 2048, D]
    pool_idx: torch.Tensor  # [B, s_q, 512] int32
    sinks: torch.Tensor  # [H] fp32
    topk_length: torch.Tensor | None  # [B] int32
    extra_topk_length: torch.Tensor | None


def _holes(idx: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return idx.masked_fill(torch.rand(idx.shape, generator=gen) < HOLE_FRACTION, -1)


def _inputs(case: Case, gen: torch.Generator) -> Inputs:
    """CPU tensors: q, rows ~ N(0, 1) as the model's normed q and kv are (logits ~ N(0, 1))."""
    b, s_q = case.batch, case.s_q
    q = torch.randn(b, s_q, NUM_HEADS, DIM, generator=gen).bfloat16()
    window = torch.randn(b * WINDOW, DIM, generator=gen).bfloat16()
    pool = torch.randn(b * POOL_PER_REQUEST, DIM, generator=gen).bfloat16()
    requests = torch.arange(b).view(b, 1, 1)
    window_idx = requests * WINDOW + torch.arange(WINDOW).expand(b, s_q, WINDOW)
    window_idx = _holes(window_idx, gen)
    picks = torch.rand(b, s_q, POOL_PER_REQUEST, generator=gen).argsort(dim=-1)[..., :TOPK]
    pool_idx = _holes(requests * POOL_PER_REQUEST + picks, gen)
    pool_idx[..., TOPK - NOT_VISIBLE :] = -1
    if b * s_q > 1:
        window_idx[-1, -1], pool_idx[-1, -1] = -1, -1
    sinks = torch.randn(NUM_HEADS, generator=gen)
    topk_length = extra_topk_length = None
    if case.with_lengths:
        topk_length = torch.randint(0, WINDOW + 1, (b,), generator=gen, dtype=torch.int32)
        extra_topk_length = torch.randint(0, TOPK + 1, (b,), generator=gen, dtype=torch.int32)
    return Inputs(
        q, window, window_idx.int(), pool, pool_idx.int(), sinks, topk_length, extra_topk_length
    )


def _cut(idx: torch.Tensor, length: torch.Tensor | None) -> torch.Tensor:
    """The index lists as the oracle sees them: entries at or past a request's length are -1."""
    if length is None:
        return idx
    past = torch.arange(idx.shape[-1], device=idx.device) >= length.view(-1, 1, 1)
    return idx.masked_fill(past, -1)


def _compare(
    out: torch.Tensor, ref: torch.Tensor, abs_tol: float, rel_tol: float
) -> tuple[float, float, float]:
    """(fraction of elements within tolerance, cosine difference, max abs error), as FlashMLA's
    kernelkit check_is_allclose computes them."""
    out, ref = out.double(), ref.double()
    abs_err = (out - ref).abs()
    rel_err = abs_err / (ref.abs() + 1e-6)
    passed = (abs_err < abs_tol) | (rel_err < rel_tol)
    cos_diff = 1 - 2 * (out * ref).sum() / (out * out + ref * ref).sum()
    return passed.double().mean().item(), cos_diff.item(), abs_err.max().item()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sparse_decode(
    flash_mla: ModuleType, record_figure: Callable[[str], None], case: Case
) -> None:
    from triton.testing import do_bench

    gen = torch.Generator().manual_seed(case.batch * 10 + case.s_q)
    x = _inputs(case, gen)
    cuda = torch.device("cuda")
    window_cache = flashmla.pack_kv_cache(x.window.to(cuda), case.block_size)
    pool_cache = flashmla.pack_kv_cache(x.pool.to(cuda), case.extra_block_size)
    q, sinks = x.q.to(cuda), x.sinks.to(cuda)
    window_idx, pool_idx = x.window_idx.to(cuda), x.pool_idx.to(cuda)
    lengths = {
        "topk_length": None if x.topk_length is None else x.topk_length.to(cuda),
        "extra_topk_length": None if x.extra_topk_length is None else x.extra_topk_length.to(cuda),
    }
    scale = DIM**-0.5

    def run() -> torch.Tensor:
        return flashmla.sparse_decode(
            q,
            window_cache,
            window_idx,
            sinks,
            scale,
            extra_cache=pool_cache,
            extra_indices=pool_idx,
            **lengths,
        )

    out = run()
    torch.cuda.synchronize()
    assert out.shape == (case.batch, case.s_q, NUM_HEADS, DIM) and out.dtype == torch.bfloat16

    num_q = case.batch * case.s_q
    sources = [
        (flashmla.unpack_kv_cache(window_cache).float(), window_idx, lengths["topk_length"]),
        (flashmla.unpack_kv_cache(pool_cache).float(), pool_idx, lengths["extra_topk_length"]),
    ]
    ref = torch_ref.sparse_attention(
        q.float().view(num_q, NUM_HEADS, DIM),
        [(rows, _cut(idx, length).view(num_q, -1)) for rows, idx, length in sources],
        sinks,
        scale,
    )
    ref = ref.view_as(out).bfloat16()
    assert torch.isfinite(out).all(), "non-finite output"
    if num_q > 1 and not case.with_lengths:
        assert not out[-1, -1].any(), "a token without keys must give zeros"
    tolerances = (OUT_ABS_TOL, OUT_REL_TOL, COS_DIFF_TOL)
    _check(f"sparse_decode {case}", out, ref, tolerances, do_bench(run), record_figure)


def _check(
    name: str,
    out: torch.Tensor,
    ref: torch.Tensor,
    tolerances: tuple[float, float, float],
    ms: float,
    record_figure: Callable[[str], None],
) -> None:
    """Record the comparison and its time; every element within (abs, rel), cos diff under."""
    abs_tol, rel_tol, cos_tol = tolerances
    passed, cos_diff, max_abs = _compare(out, ref, abs_tol, rel_tol)
    record_figure(
        f"flashmla {name} H={NUM_HEADS} D={DIM} keys={WINDOW}+{TOPK}: "
        f"{passed:.2%} within tol, cos diff {cos_diff:.2e}, max abs err {max_abs:.2e}, "
        f"{ms * 1e3:.1f} us"
    )
    assert passed == 1.0, f"{1 - passed:.3%} of elements out of tolerance (max abs {max_abs:.2e})"
    assert cos_diff < cos_tol, f"cos diff {cos_diff:.2e}"


def test_sparse_prefill(flash_mla: ModuleType, record_figure: Callable[[str], None]) -> None:
    """One chunk of 512 tokens: each sees its window (this chunk's keys t-127..t) and 512 picks
    of a 2048-entry compressed pool, one bf16 KV tensor for both (FlashMLA takes one source)."""
    from triton.testing import do_bench

    gen = torch.Generator().manual_seed(7)
    num_q = PREFILL_TOKENS
    q = torch.randn(num_q, NUM_HEADS, DIM, generator=gen).bfloat16()
    kv = torch.randn(num_q + PREFILL_POOL, DIM, generator=gen).bfloat16()  # [new keys | pool]
    t = torch.arange(num_q).unsqueeze(1)
    window_idx = t - WINDOW + 1 + torch.arange(WINDOW)
    window_idx = window_idx.masked_fill(window_idx < 0, -1)
    picks = torch.rand(num_q, PREFILL_POOL, generator=gen).argsort(dim=-1)[:, :TOPK] + num_q
    picks = _holes(picks, gen)
    picks[:, TOPK - NOT_VISIBLE :] = -1
    idx = torch.cat([window_idx, picks], dim=1).int()  # [T, 640], padded to 768 by the adapter
    sinks = torch.randn(NUM_HEADS, generator=gen)
    q, kv, idx, sinks = q.cuda(), kv.cuda(), idx.cuda(), sinks.cuda()
    scale = DIM**-0.5

    def run() -> torch.Tensor:
        return flashmla.sparse_prefill(q, kv, idx, sinks, scale)

    out = run()
    assert out.shape == (num_q, NUM_HEADS, DIM) and out.dtype == torch.bfloat16
    ref = torch_ref.sparse_attention(q.float(), [(kv.float(), idx)], sinks, scale)
    assert torch.isfinite(out).all(), "non-finite output"
    tolerances = (PREFILL_ABS_TOL, PREFILL_REL_TOL, PREFILL_COS_DIFF_TOL)
    _check(f"sparse_prefill T={num_q}", out.float(), ref, tolerances, do_bench(run), record_figure)
