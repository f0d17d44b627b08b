"""Triton's CPU interpreter (TRITON_INTERPRET=1), made to run our kernels as the GPU does: the
CPU tests (tests/triton_modules.py's ``interpreted``, test_triton_attention.py) and
benchmarks/decode_launches.py call ``patch_interpreter`` once TRITON_INTERPRET is set (triton,
imported before, would compile its own library's functions)."""

from __future__ import annotations

import numpy as np


def patch_interpreter() -> None:
    """Three fixes to Triton 3.6's interpreter, once a process:

    - a runtime loop bound becomes an int by int(array of shape [1]), which numpy >= 2.4
      refuses (triton-lang/triton#9171); squeeze first, as the upstream fix does. The attention
      kernels loop over runtime key counts (constexpr bounds would compile per count);
    - ``x.to(tl.bfloat16)`` from fp32 truncates the mantissa; CUDA rounds to nearest even, as
      torch does, so the cast goes through torch;
    - ``tl.dot`` of bf16 operands multiplies the integers that hold them (the interpreter keeps
      bf16 as uint16); they are widened to their fp32 values first, exactly."""
    import torch
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "patched", False):
        return

    def squeezed(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    squeezed.patched = True
    interpreter._patch_lang_tensor = squeezed

    builder = interpreter.InterpreterBuilder
    cast = builder.cast_impl

    def rounded(self, src, dst_type):
        tl = interpreter.tl
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            bits = data.view(torch.int16).numpy().view(np.uint16)  # as it holds bf16
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return cast(self, src, dst_type)

    builder.cast_impl = rounded  # create_fp_trunc and the other casts call it
    dot = builder.create_dot

    def widened(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (_bf16_as_fp32(interpreter, x) for x in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = widened


def _bf16_as_fp32(interpreter, x):
    """A bf16 handle as an fp32 one of the same values (other handles as they are)."""
    tl = interpreter.tl
    if x.dtype.scalar != tl.bfloat16:
        return x
    bits = (x.data.astype(np.uint32) << 16).view(np.float32)
    return interpreter.TensorHandle(bits, tl.float32)
