"""Routed experts with clamped SwiGLU, torch reference (the oracle), and the MXFP4 expert format.

Routed experts come dense (w1/w3 [E, I, D], w2 [E, D, I] tensors) or as the checkpoints ship
them: MXFP4, a ``Mxfp4Weight`` per projection. MXFP4 is e2m1 (1 sign, 2 exponent, 1 mantissa
bit) two values per byte, with one ue8m0 scale (a biased power of two) per 32 inputs of a row::

    packed [E, N, K/2] uint8   byte j of a row: [ high nibble: col 2j+1 | low nibble: col 2j ]
    scale  [E, N, K/32] uint8  w[e, n, k] = E2M1[code(e, n, k)] * 2**(scale[e, n, k // 32] - 127)

A dequantized value is exact in bf16 and fp32 (two significant bits times a power of two), so
a kernel that dequantizes in registers computes the function the dense kernel computes on
``dequantize_mxfp4``'s weights; only the order of its sums may differ.

The DeepGEMM backend takes a third form, converted at load: FP8 e4m3 with one fp32 scale per
128 x 128 block (``Fp8ExpertWeight``, ``to_fp8_experts``; exact from MXFP4, see there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.ops.linear.torch_ref import FP8_BLOCK, dequantize_fp8, quantize_fp8, scale_to_float
from deepinfer.ops.registry import Backend
from deepinfer.ops.streams import Pending, ready

MXFP4_BLOCK = 32  # inputs of a row that share one scale
# e2m1 code -> value: bit 3 sign, bits 2-1 exponent, bit 0 mantissa. Same table as DeepSeek-V4's
# inference/convert.py (FP4_TABLE) and transformers' integrations/finegrained_fp8.py.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES += tuple(-v for v in E2M1_VALUES)  # codes 8..15: the sign bit set (-0.0 first)
E2M1_MAX = 6.0
# Midpoints between the non-negative values: |x| <= a midpoint rounds down (ties toward zero).
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass(frozen=True)
class Mxfp4Weight:
    """One projection of a layer's routed experts in MXFP4 (module docstring): ``packed``
    [E, N, K/2] uint8, ``scale`` [E, N, K/32] uint8 biased exponents. Producer: the loader
    (``model.fp4_experts``) or ``quantize_mxfp4``. Consumers: the MoE backends, which read it
    where a dense weight [E, N, K] would go."""

    packed: torch.Tensor
    scale: torch.Tensor
    # The largest scale byte, where it was measured (``quantize_mxfp4``; the loader through
    # ``Experts.measure_scales``), else None. A kernel exact only up to some byte (the Triton
    # MoE's bits upcast: 128) takes that path only when this says it may.
    max_scale: int | None = None

    def __post_init__(self) -> None:
        e, n, half = self.packed.shape
        assert self.packed.dtype == self.scale.dtype == torch.uint8, (
            f"packed {self.packed.dtype}, scale {self.scale.dtype}: both must be uint8"
        )
        assert tuple(self.scale.shape) == (e, n, -(-2 * half // MXFP4_BLOCK)), (
            f"scale {tuple(self.scale.shape)} for packed {tuple(self.packed.shape)}"
        )

    @property
    def shape(self) -> tuple[int, int, int]:
        """The dense weight's shape [E, N, K]."""
        e, n, half = self.packed.shape
        return e, n, 2 * half

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def expert(self, index: int) -> torch.Tensor:
        """Expert ``index``'s matrix [N, K] in fp32."""
        return dequantize_mxfp4(self.packed[index], self.scale[index])

    def dequantize(self) -> torch.Tensor:
        """Every expert [E, N, K] in fp32."""
        return dequantize_mxfp4(self.packed, self.scale)


@dataclass(frozen=True)
class Fp8ExpertWeight:
    """One projection of a layer's routed experts in FP8 with 128 x 128 block scales (the
    DeepGEMM backend's operand): ``weight`` [E, N, K] float8_e4m3fn, ``scale`` [E, ceil(N/128),
    ceil(K/128)] fp32. Producer: ``to_fp8_experts`` at load, when the MoE backend asks for it
    (``fp8_experts``). Consumers: the deepgemm backend, and torch_ref (dequantized)."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        e, n, k = self.weight.shape
        bn, bk = FP8_BLOCK
        assert self.weight.dtype == torch.float8_e4m3fn, f"weight {self.weight.dtype}"
        assert self.scale.dtype == torch.float32, f"scale {self.scale.dtype}"
        assert tuple(self.scale.shape) == (e, -(-n // bn), -(-k // bk)), (
            f"scale {tuple(self.scale.shape)} for weight {tuple(self.weight.shape)}"
        )

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, k = self.weight.shape
        return e, n, k

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def expert(self, index: int) -> torch.Tensor:
        """Expert ``index``'s matrix [N, K] in fp32."""
        return dequantize_fp8(self.weight[index], self.scale[index])

    def dequantize(self) -> torch.Tensor:
        """Every expert [E, N, K] in fp32."""
        return dequantize_fp8(self.weight, self.scale)


ExpertWeight = torch.Tensor | Mxfp4Weight | Fp8ExpertWeight


def to_fp8_experts(w: ExpertWeight) -> Fp8ExpertWeight:
    """Routed experts (dense or MXFP4) as FP8 with 128 x 128 block scales, one expert at a time
    (fp32 temporaries of one matrix). Scales are powers of two (ue8m0, as DeepSeek's FP8
    checkpoints): an MXFP4 value c * 2**s (c in e2m1) divided by a power of two keeps its two
    significant bits, so the conversion is exact wherever a block's 32-input group scales span
    at most 14 binades (e4m3's range below its largest power); smaller values round to e4m3's
    subnormal step. Dense weights round to e4m3 like any FP8 quantization."""
    if isinstance(w, Fp8ExpertWeight):
        return w
    e, n, k = w.shape
    bn, bk = FP8_BLOCK
    weight = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(e, -(-n // bn), -(-k // bk), dtype=torch.float32, device=w.device)
    for index in range(e):
        dense = w.expert(index) if isinstance(w, Mxfp4Weight) else w[index]
        weight[index], scale[index] = quantize_fp8(dense, FP8_BLOCK, ue8m0=True)
    return Fp8ExpertWeight(weight, scale)


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, block: int = MXFP4_BLOCK
) -> torch.Tensor:
    """Packed e2m1 with ue8m0 scales -> fp32.

    ``packed`` [..., M, N/2] int8 / uint8 / float4_e2m1fn_x2, two values per byte, the LOW nibble
    first (column 2j = low, 2j+1 = high); ``scale`` [..., M, ceil(N/32)] (float8_e8m0fnu, raw
    uint8 exponents or fp32), one per 32 inputs of a row. Layout as in DeepSeek-V4's
    ``inference/convert.py`` (``cast_e2m1fn_to_e4m3fn``: int8 weight [out, in/2], ``low = x &
    0x0F`` then ``high = x >> 4`` stacked on the last dim, scale [out, in/32] float8_e8m0fnu);
    transformers' ``Fp8Dequantize._unpack_fp4`` agrees.
    """
    *lead, m, half = packed.shape
    n = 2 * half
    grid = (*lead, m, -(-n // block))
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match packed FP4 weight shape "
            f"{tuple(packed.shape)} (= {n} inputs, one scale per {block}; expected {grid})"
        )
    u8 = packed.view(torch.uint8)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = torch.stack((lut[(u8 & 0x0F).long()], lut[(u8 >> 4).long()]), dim=-1).flatten(-2)
    return values * scale_to_float(scale).repeat_interleave(block, -1)[..., :n]


def quantize_mxfp4(weight: torch.Tensor, block: int = MXFP4_BLOCK) -> Mxfp4Weight:
    """The inverse of ``dequantize_mxfp4`` up to e2m1 rounding: weight [E, N, K] (K a multiple
    of 32) -> packed experts. Each group's scale is the smallest power of two s with
    amax / s <= 6 (so nothing clips); values round to the nearest e2m1, ties toward zero. An
    all-zero group gets the smallest scale (byte 0).

    For the tiny quantized checkpoint and random-weight benchmarks: checkpoints ship their own.
    Exact arithmetic only (frexp, powers of two, comparisons), so the bytes are the same on
    every device.
    """
    e, n, k = weight.shape
    assert k % block == 0, f"{k} inputs are not a multiple of the {block}-input scale group"
    packed = torch.empty(e, n, k // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(e, n, k // block, dtype=torch.uint8, device=weight.device)
    midpoints = torch.tensor(_E2M1_MIDPOINTS, device=weight.device)
    step = max(1, 2**27 // max(1, n * k))  # experts per pass: ~0.5 GiB of fp32 temporaries
    for first in range(0, e, step):
        rows = slice(first, first + step)
        groups = weight[rows].float().unflatten(-1, (k // block, block))  # [e', N, K/32, 32]
        amax = groups.abs().amax(dim=-1)
        mantissa, exponent = torch.frexp(amax / E2M1_MAX)  # mantissa in [0.5, 1)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # powers of two fit
        exponent = torch.where(amax == 0, -127, exponent).clamp(-127, 127)
        scaled = groups / torch.exp2(exponent.float())[..., None]  # |scaled| <= 6, exact
        codes = torch.bucketize(scaled.abs(), midpoints, out_int32=True)  # magnitude 0..7
        codes = (codes | (scaled < 0).int() << 3).to(torch.uint8).flatten(-2)
        packed[rows] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        scale[rows] = (exponent + 127).to(torch.uint8)
    return Mxfp4Weight(packed, scale, int(scale.max()) if scale.numel() else 0)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    hash_ids: torch.Tensor | None,
    top_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's router after its GEMM: scores = sqrt(softplus(logits)) in fp32; the experts
    are the top_k of scores + bias (bias for the selection only), or ``hash_ids`` (a hash
    layer's, from the token id's table); weights = their scores / (sum + 1e-20) * scale.

    logits: [T, E] any float dtype; bias: [E] fp32 (None with hash_ids [T, k]). Returns
    (weights [T, k] fp32, expert ids [T, k] int64)."""
    scores = F.softplus(logits.float()).sqrt()  # [T, E]
    if hash_ids is None:
        assert bias is not None, "route: a bias to select by, or hash ids"
        ids = torch.topk(scores + bias, top_k, dim=-1, sorted=False).indices
    else:
        ids = hash_ids
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def _expert_matrix(w: ExpertWeight, expert: int, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(w, Mxfp4Weight | Fp8ExpertWeight):
        return w.expert(expert).to(dtype)
    return w[expert]


def fused_moe(
    x: torch.Tensor,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limit: float,
    residual: torch.Tensor | Pending | None = None,
) -> torch.Tensor:
    """Sum over each token's selected experts of weight * expert(x) (+ ``residual``).

    x: [T, D]; w1, w3: [E, I, D]; w2: [E, D, I], dense, ``Mxfp4Weight`` or ``Fp8ExpertWeight``
    (dequantized per expert to x's dtype; exactly in fp32); topk_ids: [T, k] int64;
    topk_weights: [T, k] fp32. Experts are visited in id order and accumulated with index_add
    (the order transformers uses), so results are reproducible for a given batch. Returns
    [T, D] in x's dtype; with ``residual`` ([T, D], x's dtype: the shared expert's output) the
    sum plus it, as two tensors in that dtype add (a ``Pending`` one joined first).
    """
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        h = x[token_idx]
        gate = F.linear(h, _expert_matrix(w1, expert, x.dtype))
        up = F.linear(h, _expert_matrix(w3, expert, x.dtype))
        h = F.linear(swiglu(gate, up, limit), _expert_matrix(w2, expert, x.dtype))
        h = h * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    residual = ready(residual)
    return out if residual is None else out + residual


class TorchRefMoEBackend(Backend):
    """The oracle as a backend object: this module's functions; it keeps no state."""

    fused_moe = staticmethod(fused_moe)
    swiglu = staticmethod(swiglu)
    route = staticmethod(route)
