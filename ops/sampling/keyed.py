"""Keyed (counter-based) randomness of seeded rows: a row's key from (seed, position), and
uniforms from (key, token id) by integer hashing, identical on every device.

Producer of the draws ``torch_ref.sample`` uses for seeded rows; a seeded request's tokens then
depend only on its seed and positions, not on the batch, the chunking, preemption or the device.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def seeded_key(seed: int, position: int) -> int:
    """The 63-bit key of a seeded row: splitmix64 of ``seed ^ position * gamma``.

    The mixing makes keys of nearby (seed, position) pairs unrelated; 63 bits keep the key a
    non-negative int64.
    """
    z = (seed ^ (position * _GOLDEN_GAMMA)) & _MASK64
    z = (z + _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & ((1 << 63) - 1)


def _as_int64(value: int) -> int:
    """A 64-bit pattern as the int64 value with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


# splitmix64's constants as int64 values; torch's int64 products wrap like uint64 ones.
_GAMMA_I64 = _as_int64(_GOLDEN_GAMMA)
_MIX1_I64 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2_I64 = _as_int64(0x94D049BB133111EB)
# Columns per pass on the CPU: the int64 temporaries stay in cache (5x faster than one pass).
_CPU_COLUMNS = 16384


def keyed_uniforms(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] fp32 uniforms in [0, 1): token t of the row with key k draws the top 24 bits of
    splitmix64's finaliser of ``k ^ (t + 1) * gamma``, over 2^24.

    Integer arithmetic (wrapping int64 products, masked shifts) is exact on every device, so a
    seeded request draws the same uniforms on the CPU and on a GPU, where they are made in
    place instead of being drawn on the host and copied (V floats per row per step).
    """
    num_rows, device = keys.shape[0], keys.device
    out = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
    step = _CPU_COLUMNS if device.type == "cpu" else vocab_size
    for lo in range(0, vocab_size, step):
        hi = min(vocab_size, lo + step)
        z = torch.arange(lo + 1, hi + 1, dtype=torch.int64, device=device).mul_(_GAMMA_I64)
        z = z.unsqueeze(0).repeat(num_rows, 1).bitwise_xor_(keys.unsqueeze(1))  # [R, cols]
        z ^= _shift_right(z, 30)
        z *= _MIX1_I64
        z ^= _shift_right(z, 27)
        z *= _MIX2_I64
        z ^= _shift_right(z, 31)
        out[:, lo:hi] = _shift_right(z, 40)
    return out.mul_(2.0**-24)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (z >> bits).bitwise_and_((1 << (64 - bits)) - 1)
