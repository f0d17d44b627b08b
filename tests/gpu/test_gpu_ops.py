"""Each torch reference op in bf16 on CUDA against its fp32 result on the CPU.

Inputs are drawn in fp32 on the CPU (fresh per seed) and rounded to bf16 once; the reference
computes in fp32 from those same values, so the error measured is the op's bf16 arithmetic and
output rounding, not the input rounding. Error: ||out - ref|| / ||ref||. One bf16 rounding is at
most 2^-8 = 3.9e-3 relative (~1.7e-3 RMS over many elements); each tolerance below says what
it allows for, and the errors bf16 on the CPU gives are noted next to it.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.deepseek_v4.args import RopeArgs
from deepinfer.ops.attention import torch_ref as attention
from deepinfer.ops.moe import torch_ref as moe
from deepinfer.ops.norm import torch_ref as norm

pytestmark = pytest.mark.gpu

SEEDS = [0, 1, 2]


def _bf16(*shape: int, gen: torch.Generator, std: float = 1.0) -> torch.Tensor:
    """fp32 CPU values that bf16 represents exactly."""
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16).float()


def _cuda_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to("cuda", torch.bfloat16)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.float().cpu()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm()).item()


# Output rounding only: the statistics and the rotation run in fp32 from the bf16 inputs
# (CPU bf16: 1.7e-3; rope 5.9e-4, as it rotates 64 of the 512 channels and passes the rest).
RMS_NORM_TOL = 3e-3
ROPE_TOL = 3e-3


@pytest.mark.parametrize("seed", SEEDS)
def test_rms_norm(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, weight = _bf16(64, 8, 512, gen=gen, std=3.0), 1 + 0.1 * torch.randn(512, generator=gen)
    ref = norm.rms_norm(x, weight, 1e-6)
    out = norm.rms_norm(_cuda_bf16(x), weight.cuda(), 1e-6)
    assert out.dtype == torch.bfloat16
    assert _rel_err(out, ref) < RMS_NORM_TOL


@pytest.mark.parametrize("seed", SEEDS)
def test_apply_rope(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = _bf16(64, 8, 512, gen=gen)
    positions = torch.randint(0, 65536, (64,), generator=gen)
    rope = RopeArgs(theta=10000.0, rope_type="yarn", factor=16.0)
    inv_freq = norm.rope_inv_freq(rope, 64)
    ref = norm.apply_rope(x, *norm.rope_cos_sin(positions, inv_freq))
    out = norm.apply_rope(_cuda_bf16(x), *norm.rope_cos_sin(positions.cuda(), inv_freq.cuda()))
    assert torch.equal(out[..., :-64].float().cpu(), ref[..., :-64])  # nope channels untouched
    assert _rel_err(out, ref) < ROPE_TOL


# bf16 logits (q.k rounded before the fp32 softmax) and bf16 probabilities times bf16 values:
# a few roundings per output (CPU bf16: 3.9e-3).
SINK_ATTENTION_TOL = 1.5e-2


def _index_lists(num_q: int, width: int, num_rows: int, gen: torch.Generator) -> torch.Tensor:
    """[num_q, width] rows of a key source, about a third of them -1 (holes anywhere)."""
    idx = torch.randint(0, num_rows, (num_q, width), generator=gen)
    return torch.where(torch.rand(num_q, width, generator=gen) < 0.3, -1, idx)


@pytest.mark.parametrize("seed", SEEDS)
def test_sparse_attention(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_q, num_heads, dim = 48, 16, 512
    q = _bf16(num_q, num_heads, dim, gen=gen)
    kvs = [_bf16(rows, dim, gen=gen) for rows in (48, 200, 300)]
    idx = [_index_lists(num_q, w, kv.shape[0], gen) for w, kv in zip((8, 64, 96), kvs, strict=True)]
    for i in idx:
        i[0] = -1  # a query that sees nothing: the sink takes all the weight, output 0
    sinks = torch.randn(num_heads, generator=gen)
    scale = dim**-0.5
    ref = attention.sparse_attention(q, list(zip(kvs, idx, strict=True)), sinks, scale)
    sources = [(_cuda_bf16(kv), i.cuda()) for kv, i in zip(kvs, idx, strict=True)]
    out = attention.sparse_attention(_cuda_bf16(q), sources, sinks.cuda(), scale)
    assert out.dtype == torch.bfloat16 and not out[0].any()
    assert _rel_err(out, ref) < SINK_ATTENTION_TOL


# Two bf16 GEMMs with a bf16 SwiGLU between them, the routing weight, and a bf16 index_add of
# k = 2 experts per token (CPU bf16: 4.6e-3).
FUSED_MOE_TOL = 2e-2


@pytest.mark.parametrize("seed", SEEDS)
def test_fused_moe(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_tokens, dim, inter, num_experts, k = 96, 256, 128, 8, 2
    x = _bf16(num_tokens, dim, gen=gen)
    w1 = _bf16(num_experts, inter, dim, gen=gen, std=dim**-0.5)
    w3 = _bf16(num_experts, inter, dim, gen=gen, std=dim**-0.5)
    w2 = _bf16(num_experts, dim, inter, gen=gen, std=inter**-0.5)
    ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(-1)[:, :k]
    weights = torch.rand(num_tokens, k, generator=gen)
    ref = moe.fused_moe(x, w1, w2, w3, ids, weights, 10.0)
    args = [_cuda_bf16(t) for t in (x, w1, w2, w3)]
    out = moe.fused_moe(*args, ids.cuda(), weights.cuda(), 10.0)
    assert out.dtype == torch.bfloat16
    assert _rel_err(out, ref) < FUSED_MOE_TOL


# The indexer scores in fp32 (it upcasts its bf16 inputs): only the reduction order differs.
INDEXER_SCORE_TOL = 1e-5


@pytest.mark.parametrize("seed", SEEDS)
def test_indexer_scores(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_q, num_heads, dim, num_reqs, num_entries, num_rows = 64, 16, 128, 3, 120, 400
    q, keys = _bf16(num_q, num_heads, dim, gen=gen), _bf16(num_rows, dim, gen=gen)
    weights = _bf16(num_q, num_heads, gen=gen) * num_heads**-0.5
    entry_rows = torch.randint(0, num_rows, (num_reqs, num_entries), generator=gen)
    token_req = torch.randint(0, num_reqs, (num_q,), generator=gen)
    num_visible = torch.randint(0, num_entries + 1, (num_q,), generator=gen)
    args = (q, weights, keys, entry_rows, token_req, num_visible)
    ref = attention.indexer_scores(*args)
    out = attention.indexer_scores(
        *[_cuda_bf16(t) if t.is_floating_point() else t.cuda() for t in args]
    ).cpu()
    assert torch.equal(torch.isinf(out), torch.isinf(ref))  # visibility is integer logic
    finite = torch.isfinite(ref)
    assert _rel_err(out[finite], ref[finite]) < INDEXER_SCORE_TOL
