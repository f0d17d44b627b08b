"""Programmatic dependent launch (PDL, sm_90 and up) for the Triton kernels.

A decode step is a chain of short kernels, so a kernel's launch and ramp-up, which otherwise
start only when its predecessor has finished, are a large share of the step. Launched with
``launch_pdl`` (CUDA's programmatic stream serialization), a kernel may start while its
predecessor's last programs still run. Every kernel launched so begins with ``enter``:

    griddepcontrol.wait               until the predecessor has completed and its writes are
                                      visible (nothing is read or written before: no hazard)
    griddepcontrol.launch_dependents  the successor may start now (it waits in its own enter)

so the only work that overlaps is the launch itself. A successor's programs start once every
program of this kernel has started, never taking an SM slot this kernel's own programs still
need. CUDA graphs capture the programmatic edges. Elsewhere (the CPU interpreter, GPUs before
Hopper) the keywords turn it off, and ``enter`` compiles to nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer.ops import triton_utils

try:  # Triton 3.3 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # an older Triton: launches as before
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


__all__ = ["enter", "pdl"]


@functools.cache
def _supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def pdl(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a kernel that begins with ``enter``: its ``PDL`` constexpr and
    Triton's ``launch_pdl``, on where ``device`` supports it and kernel.launch_pdl is true
    (``triton_utils.LAUNCH_PDL``; kernels compile a variant for each setting)."""
    if not _HAS_GDC:  # nor does this Triton know launch_pdl
        return {"PDL": False}
    on = triton_utils.LAUNCH_PDL and _supported(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def enter(PDL: tl.constexpr):
    """A kernel's first statement: wait for the predecessor, then let the successor launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
