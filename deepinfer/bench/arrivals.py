"""When each session is sent: arrival processes as offsets in seconds from the benchmark start.

Producer: these pure functions. Consumer: the runner, which sleeps until ``start + offset``.

vLLM ``bench serve`` semantics: inter-arrival gaps ~ Gamma(shape=burstiness,
scale=1/(rate·burstiness)) (burstiness 1 = Poisson), accumulated, then rescaled so that the last
of N arrivals lands exactly at N/rate. The rescaling removes the 1-2 % run-to-run drift of the
sum of random gaps without changing the gaps' coefficient of variation (1/sqrt(burstiness)).
A rate of ``inf`` sends everything at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Send offsets (s) for ``num_requests`` arrivals at ``request_rate`` req/s.

    The first arrival is one random gap after the start, as in vLLM.
    """
    if num_requests <= 0:
        return []
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        gaps = rng.gamma(
            shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests
        )
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (num_requests / request_rate) / offsets[-1]
    return offsets.tolist()


def trace_offsets(timestamps_s: Sequence[float], request_rate: float) -> list[float]:
    """Send offsets (s) that replay a trace's timestamps, relative to its first record.

    A finite ``request_rate`` rescales time so that the mean gap between consecutive records is
    ``1/request_rate``; ``inf`` replays the trace at its own pace.
    """
    if not timestamps_s:
        return []
    first = min(timestamps_s)
    offsets = [t - first for t in timestamps_s]
    span = max(offsets)
    if math.isinf(request_rate) or span <= 0 or len(offsets) < 2:
        return offsets
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    factor = (len(offsets) - 1) / (request_rate * span)
    return [t * factor for t in offsets]
