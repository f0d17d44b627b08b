"""PinnedStaging: one step's host int64 values -> the CUDA device, through a reused pinned buffer.

    host plan (numpy int64 [n]) -> pinned buffer [capacity] -> device tensor [n]
        ModelRunner: a new device tensor, copied on a copy stream  (``upload``)
        DecodeGraphs: a graph's static input buffer, copied in place  (``copy_into``)

A copy from pinned memory does not wait for the device, so the host can fill the next step while
the previous ones run. The buffer is reused: an event recorded after each copy out of it is
waited on before refilling it, so a refill never overwrites values a queued copy has yet to read.
CUDA only: other devices copy from numpy directly (``torch.from_numpy(values).to(device)``).
"""

from __future__ import annotations

import numpy as np
import torch


class PinnedStaging:
    """A pinned host buffer of int64, grown (at least doubling) when a step needs more.
    Producer: the model runner or the decode graphs (host plans). Consumer: the device copy."""

    def __init__(self, device: torch.device, copy_stream: bool = False) -> None:
        """``copy_stream``: ``upload`` copies on a stream of its own (created here)."""
        self.device = device
        self._copy_stream = torch.cuda.Stream(device) if copy_stream else None
        self._buffer: torch.Tensor | None = None  # [capacity] int64, pinned
        # Recorded after each copy out of the buffer; waited on before refilling it.
        self._read = torch.cuda.Event()

    def upload(self, values: np.ndarray) -> torch.Tensor:
        """Host int64 [n] -> a new device tensor [n], copied on the copy stream; the compute
        (current) stream waits for the copy."""
        assert self._copy_stream is not None, "upload needs PinnedStaging(copy_stream=True)"
        host = self._fill(values)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            out = host.to(self.device, non_blocking=True)
            self._read.record()
        compute.wait_stream(self._copy_stream)
        out.record_stream(compute)  # allocated on the copy stream, used on the compute stream
        return out

    def copy_into(self, values: np.ndarray, out: torch.Tensor) -> None:
        """Host int64 [n] -> ``out`` (a device int64 [n], e.g. a graph's static input buffer),
        copied on the current stream."""
        assert values.shape[0] == out.numel(), f"plan of {values.shape[0]} != {out.numel()}"
        host = self._fill(values)
        out.copy_(host, non_blocking=True)
        self._read.record()

    def _fill(self, values: np.ndarray) -> torch.Tensor:
        """``values`` written into the buffer once the previous copy has read it: a pinned
        view [n]."""
        n = values.shape[0]
        self._read.synchronize()
        if self._buffer is None or self._buffer.numel() < n:
            capacity = max(n, 2 * (0 if self._buffer is None else self._buffer.numel()))
            self._buffer = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        host = self._buffer[:n]
        host.numpy()[:] = values
        return host
