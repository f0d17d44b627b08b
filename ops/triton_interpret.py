"""Triton's CPU interpreter (TRITON_INTERPRET=1), made to run our kernels: the CPU tests and
benchmarks/decode_launches.py call ``fix_loop_bounds`` after importing triton in that mode."""

from __future__ import annotations


def fix_loop_bounds() -> None:
    """Triton 3.6's interpreter makes a runtime loop bound an int with int(array of shape [1]),
    which numpy >= 2.4 refuses (triton-lang/triton#9171); squeeze first, as the upstream fix
    does. The attention kernels loop over runtime key counts (constexpr ones would compile per
    count)."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "squeezes_loop_bounds", False):
        return

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_loop_bounds = True
    interpreter._patch_lang_tensor = patched
