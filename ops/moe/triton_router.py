"""DeepSeek-V4's router in one Triton launch: after its GEMM (``route``), or at decode with it
(``gate_route``); ``torch_ref``'s contracts.

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

At decode the GEMM is a GEMV of the [E, D] weight that cuBLAS spreads over the SMs; ``gate_route``
does it in the routing's launch: a program a few experts' logits for every token, stored, then
a ticket (``triton_tickets``); the last program routes every token from the stored logits:

    programs [E / GATE_E]:  logits[:, e0 : e0 + GATE_E] = x @ w[e0 : e0 + GATE_E].T  (bf16 out)
    last to arrive:         for each token t: route(logits[t])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deepinfer.ops.triton_pdl import enter, pdl
from deepinfer.ops.triton_tickets import MAX_TICKET_TILES, arrive, depart, ticket_counters

MAX_EXPERTS = 4096  # a program's block of scores
# gate_route: the most tokens its one launch takes (the GEMM's tile of tokens, padded to it at
# any T so that a token's sums do not depend on the batch), the experts and the channels of a
# program's tile. V4-Flash: 64 programs, each 32 KB of the [256, 4096] bf16 weight.
GATE_MAX_TOKENS = 8
GATE_E = 4
GATE_D = 256
GATE_WARPS = 8


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
def _route_row(
    x, t, bias_ptr, hash_ptr, weights_ptr, ids_ptr, num_experts, stride_hash, scale,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, HASHED: tl.constexpr,
):  # fmt: skip
    """Token t's weights [TOP_K] fp32 and ids [TOP_K] int64 from its logits x [BLOCK_E] fp32
    (module docstring)."""
    experts = tl.arange(0, BLOCK_E)
    real = experts < num_experts
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


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, hash_ptr, weights_ptr, ids_ptr, num_experts, stride_logits,
    stride_hash, scale, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    HASHED: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program t: token t's routing (``_route_row``)."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_logits + experts, mask=experts < num_experts, other=0.0)
    _route_row(
        x.to(tl.float32), t, bias_ptr, hash_ptr, weights_ptr, ids_ptr, num_experts, stride_hash,
        scale, TOP_K, BLOCK_E, BLOCK_K, HASHED,
    )  # fmt: skip


@triton.jit
def _gate_route_kernel(
    x_ptr, w_ptr, logits_ptr, bias_ptr, hash_ptr, weights_ptr, ids_ptr, counter_ptr,
    num_tokens, num_experts, channels, stride_x, stride_hash, scale, TOKENS: tl.constexpr,
    GATE_E: tl.constexpr, GATE_D: tl.constexpr, PROGRAMS: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, HASHED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program p: logits[:, GATE_E experts from p * GATE_E] = x @ w.T for up to TOKENS tokens
    (fp32 products accumulated in a [TOKENS, GATE_E, GATE_D] tile over D, summed once at the
    end: the same order for any T; rounded to x's dtype, as F.linear's output), stored; the
    last program to arrive routes every token from them."""
    enter(PDL)
    tokens = tl.arange(0, TOKENS)
    experts = tl.program_id(0) * GATE_E + tl.arange(0, GATE_E)
    token_mask, expert_mask = tokens < num_tokens, experts < num_experts
    acc = tl.zeros([TOKENS, GATE_E, GATE_D], dtype=tl.float32)
    for d0 in range(0, channels, GATE_D):
        d = d0 + tl.arange(0, GATE_D)
        x = tl.load(
            x_ptr + tokens[:, None] * stride_x + d[None, :],
            mask=token_mask[:, None] & (d < channels)[None, :],
            other=0.0,
        ).to(tl.float32)  # [TOKENS, GATE_D]
        w = tl.load(
            w_ptr + experts[:, None].to(tl.int64) * channels + d[None, :],
            mask=expert_mask[:, None] & (d < channels)[None, :],
            other=0.0,
        ).to(tl.float32)  # [GATE_E, GATE_D]
        acc += x[:, None, :] * w[None, :, :]  # products summed once, after the loop
    logits = tl.sum(acc, axis=2).to(x_ptr.dtype.element_ty)
    at = tokens[:, None] * num_experts + experts[None, :]
    tl.store(logits_ptr + at, logits, mask=token_mask[:, None] & expert_mask[None, :])
    if arrive(counter_ptr, PROGRAMS):
        every = tl.arange(0, BLOCK_E)
        for t in range(num_tokens):
            row = tl.load(
                logits_ptr + t * num_experts + every,
                mask=every < num_experts,
                other=0.0,
                cache_modifier=".cg",
            )
            _route_row(
                row.to(tl.float32), t, bias_ptr, hash_ptr, weights_ptr, ids_ptr, num_experts,
                stride_hash, scale, TOP_K, BLOCK_E, BLOCK_K, HASHED,
            )  # fmt: skip
        depart(counter_ptr)


def _route_outputs(
    num_tokens: int,
    num_experts: int,
    bias: torch.Tensor | None,
    hash_ids: torch.Tensor | None,
    top_k: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """route's checks; (weights, ids) to fill, and bias (fp32) and hash_ids with unit column
    stride."""
    assert 0 < top_k <= num_experts <= MAX_EXPERTS, f"route: top {top_k} of {num_experts}"
    assert (bias is None) != (hash_ids is None), "route: a bias to select by, or hash ids"
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if hash_ids is not None:
        assert hash_ids.shape == (num_tokens, top_k), f"route: hash ids {tuple(hash_ids.shape)}"
        hash_ids = hash_ids if hash_ids.stride(1) == 1 else hash_ids.contiguous()
    else:
        bias = bias.float().contiguous()
    return weights, ids, bias, hash_ids


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
    weights, ids, bias, hash_ids = _route_outputs(
        num_tokens, num_experts, bias, hash_ids, top_k, logits.device
    )
    if num_tokens == 0:
        return weights, ids
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    hashed = hash_ids is not None
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(num_tokens,)](
        logits, bias if not hashed else logits, hash_ids if hashed else logits, weights, ids,
        num_experts, logits.stride(0), hash_ids.stride(0) if hashed else 0, scale,
        TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), HASHED=hashed,
        num_warps=4 if block_e >= 512 else 2,
        **pdl(logits.device),
    )  # fmt: skip
    return weights, ids


def gate_route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    hash_ids: torch.Tensor | None,
    top_k: int,
    scale: float,
    *,
    tiles: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route(F.linear(x, weight), ...)``: x [T, D], weight [E, D] of x's dtype. Up to
    ``GATE_MAX_TOKENS`` tokens (decode) in one launch: ``GATE_E`` experts' logits a program,
    the last to arrive routing every token; more, cuBLAS's GEMM then ``route``. ``tiles``
    (GATE_E, GATE_D, warps) instead of the module's (for tuning)."""
    num_tokens, dim = x.shape
    num_experts = weight.shape[0]
    if num_tokens > GATE_MAX_TOKENS:
        return route(F.linear(x, weight), bias, hash_ids, top_k, scale)
    assert weight.shape == (num_experts, dim) and weight.dtype == x.dtype, (
        f"gate_route: weight {tuple(weight.shape)} {weight.dtype}, x {tuple(x.shape)} {x.dtype}"
    )
    weights, ids, bias, hash_ids = _route_outputs(
        num_tokens, num_experts, bias, hash_ids, top_k, x.device
    )
    if num_tokens == 0:
        return weights, ids
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    logits = torch.empty(num_tokens, num_experts, dtype=x.dtype, device=x.device)
    hashed = hash_ids is not None
    gate_e, gate_d, num_warps = tiles or (GATE_E, GATE_D, GATE_WARPS)
    programs = triton.cdiv(num_experts, gate_e)
    assert programs <= MAX_TICKET_TILES, f"gate_route: {programs} programs"
    block_e = triton.next_power_of_2(num_experts)
    _gate_route_kernel[(programs,)](
        x, weight, logits, bias if not hashed else x, hash_ids if hashed else x, weights, ids,
        ticket_counters(x.device), num_tokens, num_experts, dim, x.stride(0),
        hash_ids.stride(0) if hashed else 0, scale, TOKENS=GATE_MAX_TOKENS, GATE_E=gate_e,
        GATE_D=gate_d, PROGRAMS=programs, TOP_K=top_k, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), HASHED=hashed, num_warps=num_warps,
        **pdl(x.device),
    )  # fmt: skip
    return weights, ids
