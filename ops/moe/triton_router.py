"""DeepSeek-V4's router after its GEMM in one Triton launch (``torch_ref.route``'s contract).

The reference takes about ten launches a MoE layer (softplus, sqrt, the bias add, a top-k sort,
the gather, the sum, the division, the scale), each a few µs at decode. Here one program a
token holds the token's E scores in registers:

    logits [T, E] --softplus, sqrt (fp32)--> scores [E]
    selection:  top_k rounds of (max of scores + bias, its lowest index, masked out), or the
                hash layer's ids
    weights [k] = scores[ids] / (sum + 1e-20) * scale      ids [k] in selection order

E is at most a few hundred (V4-Flash: 256), so a program's scores fit one block. The ids come
out highest first; torch's unsorted top-k gives the same set in another order (the experts'
combine adds a token's k outputs in slot order, so the order changes rounding, not routing).
Softplus is log(1 + e^x) computed as log1p (the ratio form, exact to a few ulps where 1 + e^x
rounds), e^x below -16 and x above 20, as torch's threshold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.triton_pdl import enter, pdl

MAX_EXPERTS = 4096  # a program's block of scores


@triton.jit
def _softplus(x):
    """log(1 + e^x) in fp32: x above 20 (torch's threshold), e^x below -16, else log1p(e^x)
    by the ratio form log(w) * u / (w - 1), w = 1 + u (exact where w rounds to 1)."""
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    rounds = w == 1.0
    log1p = tl.where(rounds, u, tl.math.div_rn(tl.log(w) * u, tl.where(rounds, 1.0, w - 1.0)))
    return tl.where(x > 20.0, x, tl.where(x < -16.0, u, log1p))


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, hash_ptr, weights_ptr, ids_ptr, num_experts, stride_logits,
    stride_hash, scale, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    HASHED: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program t: token t's weights [TOP_K] fp32 and ids [TOP_K] int64 (module docstring)."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    real = experts < num_experts
    x = tl.load(logits_ptr + t * stride_logits + experts, mask=real, other=0.0).to(tl.float32)
    scores = tl.sqrt_rn(_softplus(x))
    slots = tl.arange(0, BLOCK_K)
    if HASHED:
        ids = tl.load(hash_ptr + t * stride_hash + slots, mask=slots < TOP_K, other=-1)
        hit = ids[:, None] == experts[None, :]  # [BLOCK_K, BLOCK_E]
        picked = tl.sum(tl.where(hit, scores[None, :], 0.0), axis=1)
    else:
        bias = tl.load(bias_ptr + experts, mask=real, other=0.0)
        biased = tl.where(real, scores + bias, float("-inf"))
        ids = tl.full([BLOCK_K], -1, dtype=tl.int64)
        picked = tl.zeros([BLOCK_K], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(biased, axis=0)
            chosen = tl.min(tl.where(biased == best, experts, BLOCK_E), axis=0)
            here = experts == chosen
            ids = tl.where(slots == j, chosen.to(tl.int64), ids)
            picked = tl.where(slots == j, tl.sum(tl.where(here, scores, 0.0), axis=0), picked)
            biased = tl.where(here, float("-inf"), biased)
    total = tl.sum(tl.where(slots < TOP_K, picked, 0.0), axis=0)
    weights = tl.math.div_rn(picked, total + 1e-20) * scale
    out = t * TOP_K + slots
    tl.store(weights_ptr + out, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=slots < TOP_K)


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    hash_ids: torch.Tensor | None,
    top_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_ref.route`` in one launch (module docstring): logits [T, E]; bias [E] fp32, or
    hash_ids [T, top_k]. Returns (weights [T, top_k] fp32, ids [T, top_k] int64)."""
    num_tokens, num_experts = logits.shape
    assert 0 < top_k <= num_experts <= MAX_EXPERTS, f"route: top {top_k} of {num_experts}"
    assert (bias is None) != (hash_ids is None), "route: a bias to select by, or hash ids"
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    hashed = hash_ids is not None
    if hashed:
        assert hash_ids.shape == (num_tokens, top_k), f"route: hash ids {tuple(hash_ids.shape)}"
        hash_ids = hash_ids if hash_ids.stride(1) == 1 else hash_ids.contiguous()
    else:
        bias = bias.float().contiguous()
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(num_tokens,)](
        logits, bias if not hashed else logits, hash_ids if hashed else logits, weights, ids,
        num_experts, logits.stride(0), hash_ids.stride(0) if hashed else 0, scale,
        TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), HASHED=hashed,
        num_warps=4 if block_e >= 512 else 2,
        **pdl(logits.device),
    )  # fmt: skip
    return weights, ids
