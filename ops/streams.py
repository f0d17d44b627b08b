"""A second stream a device: work that the current stream's next launches do not read runs
beside them, at the same time.

At decode a layer's kernels are short and most leave the GPU's bandwidth idle. ``beside``
forks the side stream from the current one, queues the work there and returns a ``Pending``;
``Pending.wait`` joins it back just before the launch that reads the value. It forks only while
a CUDA graph is captured (the decode steps): the graph holds the fork and the join as edges and
replays both branches at once. Elsewhere (eager steps, the CPU, NPUs, kernel.side_stream =
false) the work runs in place and ``wait`` returns at once. The kernels and their inputs are
the same either way, so are the results, bit for bit. A V4 layer forks twice:

    attention  ─► x projections ─┬─► q norm ─► wq_b ─► q/kv RoPE ──┬─► indexer ─► attention ─►
                                 └─side─► compressors' pools ─────┘
    MoE        ─────────────────┬─► router ─► route ─► routed gate/up ──┬─► routed down (+ shared)
                                └─side─► shared w1/w3 ─► SwiGLU, w2 ────┘

Memory: the side stream's tensors come from its own pool of the caching allocator (under
capture, the graph's pool). A value made on the side stream is freed on the current one only
after the join, and every later use of its memory by the side stream follows a later fork, so
no block is reused while the other stream may still read it. Kernels that meet through the
device's ticket counters take the side stream's own (``ops/triton_tickets.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")

__all__ = ["Pending", "beside", "is_side", "ready", "side_stream"]


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # by CUDA device index


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The CUDA device's side stream (one a process: the engine computes on one stream, forking
    to this one and joining back within a layer)."""
    index = _index(device)
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return _SIDE_STREAMS[index]


def is_side(device: torch.device) -> bool:
    """Whether launches on ``device`` now go to its side stream (never before one is made)."""
    if device.type != "cuda" or not _SIDE_STREAMS:
        return False
    stream = _SIDE_STREAMS.get(_index(device))
    return stream is not None and torch.cuda.current_stream(device) == stream


@dataclass(frozen=True)
class Pending(Generic[T]):
    """What work queued on the side stream returns (a tensor, or None for work that writes in
    place). Producer: ``beside``; consumer: the launch that reads it, after ``wait`` (or
    ``ready``). ``stream`` None: already in order on the current stream."""

    value: T
    stream: torch.cuda.Stream | None = None

    def wait(self) -> T:
        """The value, the current stream now ordered after the side stream's work so far."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        return self.value


def beside(enabled: bool, device: torch.device, fn: Callable[..., T], *args: object) -> Pending[T]:
    """``fn(*args)`` on ``device``'s side stream, after everything queued on the current one so
    far, while a CUDA graph is being captured; in place elsewhere: where ``enabled`` is false,
    ``device`` is not CUDA, the current stream is already the side stream, or launches run
    eagerly (H100, V4-Flash layers at batch 1: the forks and joins took the host's eager step
    from 2.4 to 4.6 ms a layer, while a graph's layer went from 0.27 to 0.25 ms)."""
    captured = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not enabled or not captured or is_side(device):
        return Pending(fn(*args))
    stream = side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        value = fn(*args)
    return Pending(value, stream)


def ready(value: torch.Tensor | Pending[torch.Tensor] | None) -> torch.Tensor | None:
    """A tensor argument that may still be on the side stream, joined: call it right before the
    launch that reads it."""
    return value.wait() if isinstance(value, Pending) else value
