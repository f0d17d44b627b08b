"""Tickets: the programs that split one output tile's sum meet in one launch.

Each of a tile's programs stores its partial result, then takes a ticket from the tile's
counter; the last to arrive reads the others' partials and adds them in a fixed order (so the
sum is deterministic: the ticket decides only which program adds, never the order), writes the
tile and resets the counter for the next launch. No second launch adds the partials.

    partial stores --debug_barrier--> atomic_add(counter, 1, acq_rel, gpu) == arrivals - 1 ?
        yes: read the partials through L2 (.cg), add them in order, store, reset the counter

Users: the FP8 GEMM's split K (ops/linear/triton.py), the decode MoE's slot split
(ops/moe/triton_gemv.py), hc_pre's row norm over D programs (ops/norm/triton.py). The counters
are zero between launches and shared by those kernels, so two kernels that take tickets must
not run at once on one set: a device has one set for its compute stream and one for its side
stream (ops/streams.py), whose kernels may run beside the compute stream's.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer.ops.streams import is_side

__all__ = ["MAX_TICKET_TILES", "arrive", "depart", "ticket_counters"]

MAX_TICKET_TILES = 1 << 14


def ticket_counters(device: torch.device) -> torch.Tensor:
    """The ticket counters (``MAX_TICKET_TILES`` int32 zeros) of launches on ``device``'s
    current stream: its side stream's own set, or the compute stream's."""
    return _counters(device)[int(is_side(device))]


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    """[2, MAX_TICKET_TILES] int32 zeros: the compute stream's set, then the side stream's."""
    return torch.zeros(2, MAX_TICKET_TILES, dtype=torch.int32, device=device)


@triton.jit
def arrive(counter_ptr, ARRIVALS):
    """After this program's partial stores: its ticket from the tile's counter (the barrier
    orders every thread's stores before it; one thread takes it, release and acquire at GPU
    scope). True for the last of ARRIVALS, which then reads the partials with .cg loads and
    calls ``depart``. ARRIVALS: a constexpr, or a runtime count (a grid axis' size)."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == ARRIVALS - 1


@triton.jit
def depart(counter_ptr):
    """The last program, done: the counter back to zero for the next launch."""
    tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
