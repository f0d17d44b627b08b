"""The upcast of packed e2m1 codes to bf16 by bits, as inline PTX: one definition for the
grouped Triton kernels (triton.py, ``TileConfig.bits_upcast``) and the Gluon ones (gluon.py)."""

from __future__ import annotations

import triton.language as tl

__all__ = ["MXFP4_BITS_ASM"]

# Eight e2m1 codes of a 32-bit word (code j at bits 4j..4j+3: input 8w + j) and the factor of the
# word's scale byte s -> eight bf16 values. For codes j and j + 4 (16 bits apart) one shift puts
# both magnitudes (exponent and mantissa bits, 3) at bf16 bits 6..8 of their halves (exponent
# field e, the mantissa's top bit m) and another both signs at bit 15: the bf16 is the e2m1 value
# times 2 ** -126 exactly (code 1, 0.5, becomes the subnormal 2 ** -127). One bf16x2 multiply by
# 2 ** (s - 1), exponent field s + 126 in each half ($9 = (s + 126) * 0x00800080, computed once a
# scale group), makes it the weight e2m1 * 2 ** (s - 127). Exact for scale bytes 0 to 128
# (weights under 12 in magnitude): a byte over 128 needs a factor past bf16's largest power of
# two, so bits_upcast is for checkpoints whose scale bytes are checked to stay at or under 128
# (V4's experts: |w| << 1). It also needs the bf16 multiply to keep subnormal inputs (PTX:
# mul.bf16x2 has no flush-to-zero); tests/gpu/test_gpu_triton_moe.py's bits test would see a code
# 1 flushed to 0. Each register p_j holds codes j (low half) and j + 4 (high half): the kernels
# order the weights by those registers (triton.py's ``_in_pair_order``, gluon.py's ``mma_order``),
# so that the registers go to the MMA as they are, with no repacking of halves.
MXFP4_BITS_ASM = tl.constexpr("""
{
.reg .b32 m, s, p0, p1, p2, p3;
shl.b32 m, $8, 6; shl.b32 s, $8, 12; and.b32 m, m, 0x01C001C0; and.b32 s, s, 0x80008000;
or.b32 p0, m, s;
shl.b32 m, $8, 2; shl.b32 s, $8, 8; and.b32 m, m, 0x01C001C0; and.b32 s, s, 0x80008000;
or.b32 p1, m, s;
shr.b32 m, $8, 2; shl.b32 s, $8, 4; and.b32 m, m, 0x01C001C0; and.b32 s, s, 0x80008000;
or.b32 p2, m, s;
shr.b32 m, $8, 6; and.b32 m, m, 0x01C001C0; and.b32 s, $8, 0x80008000; or.b32 p3, m, s;
mul.rn.bf16x2 p0, p0, $9;
mul.rn.bf16x2 p1, p1, $9;
mul.rn.bf16x2 p2, p2, $9;
mul.rn.bf16x2 p3, p3, $9;
mov.b32 {$0, $4}, p0;
mov.b32 {$1, $5}, p1;
mov.b32 {$2, $6}, p2;
mov.b32 {$3, $7}, p3;
}
""")
