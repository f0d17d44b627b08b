"""RMSNorm and rotary embedding, torch reference (the oracle; runs anywhere)."""

from __future__ import annotations

import math

import torch

from deepinfer.model.config import RopeArgs


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm with fp32 statistics; ``weight`` None is the unweighted variant.

    x: [..., N] any float dtype; weight: [N] fp32 (kept fp32, multiplied before the cast back).
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        xf = weight.float() * xf
    return xf.to(dtype)


def rope_inv_freq(rope: RopeArgs, rope_dim: int) -> torch.Tensor:
    """Inverse frequencies [rope_dim / 2] fp32: plain RoPE, or YaRN without mscale.

    YaRN: pairs below the low correction dim keep their frequency (extrapolation), pairs above
    the high one are divided by ``factor`` (interpolation), a linear ramp in between. V4 never
    scales cos/sin (attention factor 1).
    """
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    pos_freqs = rope.theta**exponents
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type != "yarn":
        return inv_freq

    def correction_dim(num_rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (rope_dim * math.log(orig / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated = 1.0 / (rope.factor * pos_freqs)
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rope_dim / 2] fp32 for int positions [T]."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing ``2 * cos.shape[-1]`` channels of x (fp32 math).

    x: [T, ..., D] laid out ``[nope | rope]``; pairs (2i, 2i+1) of the rope slice rotate by
    angle i. cos/sin: [T, rope_dim / 2]; pass ``-sin`` for the inverse rotation.
    """
    rope_dim = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]  # [T, ..., rope_dim / 2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
