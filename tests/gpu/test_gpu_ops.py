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

from deepinfer.model.config import RopeArgs
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


@pytest.mark.parametrize("seed", SEEDS)
def test_sink_attention(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_q, num_heads, dim, num_keys = 48, 16, 512, 300
    q, kv = _bf16(num_q, num_heads, dim, gen=gen), _bf16(num_keys, dim, gen=gen)
    mask = torch.rand(num_q, num_keys, generator=gen) < 0.3
    mask[0] = False  # a query that sees nothing: the sink takes all the weight, output 0
    sinks = torch.randn(num_heads, generator=gen)
    scale = dim**-0.5
    ref = attention.sink_attention(q, kv, mask, sinks, scale)
    out = attention.sink_attention(_cuda_bf16(q), _cuda_bf16(kv), mask.cuda(), sinks.cuda(), scale)
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


# The indexer scores in fp32 (it upcasts its bf16 inputs), so the CUDA picks may differ from
# the CPU's only between entries whose fp32 scores are within reduction-order noise.
INDEXER_SCORE_TOL = 1e-4  # relative to the largest |score| of the row


@pytest.mark.parametrize("seed", SEEDS)
def test_indexer_topk(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_q, num_heads, dim, num_entries, ratio, topk = 64, 16, 128, 120, 4, 32
    q, keys = _bf16(num_q, num_heads, dim, gen=gen), _bf16(num_entries, dim, gen=gen)
    weights = _bf16(num_q, num_heads, gen=gen) * num_heads**-0.5
    # Queries from position 0 (no entry visible) to past the last entry.
    positions = torch.linspace(0, ratio * num_entries + 8, num_q).long()
    ref = attention.indexer_topk(q, keys, weights, positions, ratio, topk)
    out = attention.indexer_topk(
        _cuda_bf16(q), _cuda_bf16(keys), _cuda_bf16(weights), positions.cuda(), ratio, topk
    ).cpu()
    # Causality and the -1 fill are integer logic: exactly the CPU's.
    assert torch.equal(out < 0, ref < 0)
    scores = torch.einsum("chd,nd->chn", q, keys).relu() * dim**-0.5
    scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [C, N] fp32, as the op scores
    for row in range(num_q):
        picked, expected = out[row][out[row] >= 0], ref[row][ref[row] >= 0]
        if picked.numel() == 0:
            continue
        assert picked.unique().numel() == picked.numel()
        kth_best = scores[row, expected].min()
        worst_pick = scores[row, picked].min()
        slack = INDEXER_SCORE_TOL * scores[row, : (positions[row].item() + 1) // ratio].abs().max()
        assert worst_pick >= kth_best - slack, f"row {row}: picked {worst_pick} < {kth_best}"
