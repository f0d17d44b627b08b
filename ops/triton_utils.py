"""What the Triton backends (``ops/*/triton.py``) share: how many SMs a launch should fill, and
the precision ``tl.dot`` runs in. Each backend passes its own choices; nothing here imports
Triton, so the helpers are the same under the interpreter (CPU tests) and compiled (CUDA).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: torch.device, cpu_stand_in: int) -> int:
    """Streaming multiprocessors of ``device``; ``cpu_stand_in`` where torch cannot ask the
    device (Triton's CPU interpreter), the count the caller's launch heuristics assume there."""
    if device.type != "cuda":
        return cpu_stand_in
    return torch.cuda.get_device_properties(device).multi_processor_count


def dot_precision(dtype: torch.dtype, *, for_16bit: str) -> str:
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``: fp32 operands run exact IEEE
    products (the fp32 parity mode matches the CPU to ~1e-5); others take ``for_16bit``, the
    caller's choice ("tf32", Triton's default, which 16-bit operands ignore; or "tf32x3")."""
    return "ieee" if dtype == torch.float32 else for_16bit


# kernel.launch_pdl for the process (ops.select_kernels sets it): whether the Triton kernels
# launch with programmatic dependent launch where the device supports it (triton_pdl.py).
LAUNCH_PDL = True
