"""One RoPE rotation for every Triton kernel that applies one.

A rotated channel is ``x * cos + partner * s`` (the pair (even, odd) by angle i: the even channel
takes partner odd and s = -sin, the odd one partner even and s = sin). Compiled, ptxas may fuse
either product of such a sum into an FMA, and which one it picks depends on the kernel around
it: the same rotation in two kernels could round differently (1 fp32 ulp, now and then a bf16
one). Written as one explicit FMA with the partner's product rounded first, it is one sum in
every kernel: apply_rope, the fused norm + RoPE, the compressor's pooled rows, the indexer's q,
the attention output's store. Under the interpreter ``tl.fma`` rounds twice, as torch_ref's
``x * cos - partner * sin`` does.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["rotate", "rotate_pair"]


@triton.jit
def rotate(x, partner, cos, s):
    """x * cos + partner * s (fp32): round(x * cos + round(partner * s)), in every kernel."""
    return tl.fma(x, cos, partner * s)


@triton.jit
def rotate_pair(even, odd, cos, sin):
    """The pair (even, odd) rotated by the angle of (cos, sin)."""
    return rotate(even, odd, cos, -sin), rotate(odd, even, cos, sin)
