"""FP8 block-scaled linear layers, torch reference (the oracle), and the block (de)quantizers.

``fp8_linear`` dequantizes the weight and multiplies in fp32: the exact value of the FP8 weight,
with the activations unquantized. The fast backends also quantize the activations to e4m3 (one
scale per token per K block); ``quantize_activations`` is that step in torch, the oracle of their
quantizer and what the ``cublas`` backend runs.

Weight blocks, ``block = (bn, bk)``: block (r, c) of weight [N, K] covers rows r*bn.. and
columns c*bk..; the last block row/column is short when N or K is not a multiple::

    cols:   0 ........ bk-1 | bk ...... 2bk-1 | .. K-1
    rows 0..bn-1:  s[0,0]   |      s[0,1]     | s[0,2] (ragged)
    rows bn..N-1:  s[1,0]   |      s[1,1]     | s[1,2]

Activation groups: x [M, K] -> q [M, K] e4m3 and one fp32 scale per row and K block,
x_scale [M, ceil(K/bk)], so that x[m, k] ~ q[m, k] * x_scale[m, k // bk].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.ops.registry import Backend

FP8_BLOCK = (128, 128)
FP8_MAX = 448.0  # the largest finite e4m3 value
# Scales are max(amax, AMAX_EPS) / 448: an all-zero group gets a tiny positive scale, not 0/0.
AMAX_EPS = 1e-10


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    *,
    swiglu: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """y = x @ dequantize_fp8(weight, weight_scale)^T in fp32, cast to x's dtype.

    x: [M, K] bf16 / fp16 / fp32; weight: [N, K] float8_e4m3fn; weight_scale: [ceil(N/bn),
    ceil(K/bk)] fp32 (the dequantization multiplier). Returns [M, N] in x's dtype. ``swiglu``
    (up, limit): the input is the shared expert's activation ``moe.torch_ref.swiglu(x, up,
    limit)`` of the gate x (a backend may compute it with the quantization of its input).
    """
    if swiglu is not None:
        from deepinfer.ops.moe.torch_ref import swiglu as activation  # it imports this module

        x = activation(x, *swiglu)
    w = dequantize_fp8(weight, weight_scale, block)  # [N, K] fp32
    return (x.float() @ w.T).to(x.dtype)


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
) -> torch.Tensor:
    """A block-diagonal linear (V4's grouped output projection ``wo_a``): x [M, G, K] ->
    y [M, G, N], y[:, g] = x[:, g] @ W[g*N:(g+1)*N]^T in fp32, cast to x's dtype.

    weight: [G*N, K] float8_e4m3fn, the groups' row blocks stacked, with weight_scale
    [ceil(G*N/bn), ceil(K/bk)] over the whole of it (a group need not start on a block row).
    """
    _, groups, k = x.shape
    w = dequantize_fp8(weight, weight_scale, block).view(groups, -1, k)  # [G, N, K] fp32
    return torch.einsum("mgk,gnk->mgn", x.float(), w).to(x.dtype)


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """Block-scaled FP8 -> fp32.

    ``weight`` [..., N, K] float8_e4m3fn, ``scale`` [..., ceil(N/bn), ceil(K/bk)] (fp32, or
    ue8m0 as float8_e8m0fnu / raw uint8 exponents); blocks as pictured at the top of the module.
    """
    *lead, n, k = weight.shape
    bn, bk = block
    grid = (*lead, -(-n // bn), -(-k // bk))
    if tuple(scale.shape) != grid:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match weight shape {tuple(weight.shape)} "
            f"with {bn}x{bk} blocks (expected {grid})"
        )
    s = scale_to_float(scale).repeat_interleave(bn, -2)[..., :n, :]
    return weight.float() * s.repeat_interleave(bk, -1)[..., :k]


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as fp32; ue8m0 scales stored as raw bytes are biased exponents:
    2 ** (byte - 127)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK, *, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``dequantize_fp8`` up to e4m3 rounding: weight [N, K] (any float dtype) ->
    (q [N, K] float8_e4m3fn, scale [ceil(N/bn), ceil(K/bk)] fp32), scale = block amax / 448;
    ``ue8m0``: that scale rounded up to a power of two (DeepSeek's ``scale_fmt`` "ue8m0").

    For random-weight benchmarks and tests: checkpoints ship their own FP8 weights.
    """
    n, k = weight.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = weight.new_zeros(nb * bn, kb * bk, dtype=torch.float32)
    padded[:n, :k] = weight
    blocks = padded.view(nb, bn, kb, bk)
    scale = _div_by_fp8_max(blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_EPS))  # [nb, kb]
    if ue8m0:
        mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, [0.5, 1)
        scale = torch.exp2((exponent - (mantissa == 0.5).to(exponent.dtype)).float())
    q = _to_e4m3(blocks / scale[:, None, :, None]).view(nb * bn, kb * bk)[:n, :k]
    return q.contiguous(), scale


def quantize_activations(
    x: torch.Tensor, group: int = FP8_BLOCK[1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-group e4m3 quantization: x [M, K] -> (q [M, K] float8_e4m3fn,
    x_scale [M, ceil(K/group)] fp32 with strides (1, M)), x_scale = group amax / 448.

    The scales are stored K-block-major (column-major, "outer-dim-major"): one K block's M
    scales are contiguous, the layout the GEMMs (and cuBLAS's 1x128 blockwise recipe) read.
    Division is IEEE fp32 and the cast rounds to nearest even, as the Triton quantizer.
    """
    m, k = x.shape
    kb = -(-k // group)
    padded = x.new_zeros(m, kb * group, dtype=torch.float32)
    padded[:, :k] = x
    groups = padded.view(m, kb, group)
    scale = _div_by_fp8_max(groups.abs().amax(dim=-1).clamp(min=AMAX_EPS))  # [M, Kb]
    q = _to_e4m3(groups / scale[..., None]).view(m, kb * group)[:, :k]
    return q.contiguous(), scale.t().contiguous().t()


def _div_by_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, IEEE-rounded on every device. A tensor divisor on purpose: for a scalar one
    torch's CUDA kernel multiplies by the reciprocal, which is off by an ulp at times (and then
    so is every quantized value of the group)."""
    return amax / torch.full_like(amax, FP8_MAX)


def _to_e4m3(values: torch.Tensor) -> torch.Tensor:
    # Clamped first: a quotient one ulp above 448 must saturate, not become NaN.
    return values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A linear on a weight in x's dtype: F.linear(x, weight); x [M, K], weight [N, K]."""
    return F.linear(x, weight)


class TorchRefLinearBackend(Backend):
    """The oracle as a backend object: this module's functions; it keeps no state."""

    fp8_linear = staticmethod(fp8_linear)
    fp8_grouped_linear = staticmethod(fp8_grouped_linear)
    dense_linear = staticmethod(dense_linear)
