"""What the measured throughput means in accelerator-hours and dollars.

Producer: `compute_economics` (from `BenchMetrics` and the ``--accelerators``/price flags).
Consumer: ``report.py``.

Method (also written into the JSON as ``economics.method``):

- Token rates are the run's measured rates. The input rate is split into cached and uncached
  with the measured hit rate h: cached tok/s = h · input tok/s, uncached = (1 − h) · input tok/s.
- *Sole-attribution cost* of a token kind = cluster $/s ÷ that kind's tok/s × 1e6: all the
  accelerator time is charged to that one kind. It is an upper bound for each kind (the same
  hours also served the others) and needs no prices.
- With prices, *revenue-weighted cost* splits the cluster cost over the kinds in proportion to
  the revenue each brings (price × measured rate), so every kind carries the same margin:
  cost per M of kind k = price_k × cost / revenue. Blended input cost per M =
  (1 − h) · uncached + h · cached.
- Implied margin = (revenue − cost) / revenue at the measured throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.bench.metrics import BenchMetrics

METHOD = (
    "token rates measured; cached input tok/s = hit_rate * input tok/s; sole-attribution "
    "cost/M = cluster $/s / tok/s * 1e6 (all cost charged to one token kind, an upper bound); "
    "revenue-weighted cost/M = price * cost / revenue (cost split by revenue share, equal "
    "margin per kind); margin = (revenue - cost) / revenue"
)
TOKEN_KINDS = ("input", "uncached_input", "cached_input", "output", "total")


@dataclass(frozen=True)
class Prices:
    """USD per million tokens; None = not given."""

    input_per_m: float | None = None
    cached_input_per_m: float | None = None
    output_per_m: float | None = None

    @property
    def is_complete(self) -> bool:
        return None not in (self.input_per_m, self.output_per_m)


@dataclass(frozen=True)
class Economics:
    num_accelerators: int
    accelerator_hour_cost: float | None
    cost_per_hour: float | None
    tokens_per_s: dict[str, float]
    tokens_per_accelerator_hour: dict[str, float]
    sole_cost_per_m: dict[str, float | None]
    revenue_per_hour: float | None
    revenue_per_accelerator_hour: float | None
    revenue_weighted_cost_per_m: dict[str, float | None]
    margin: float | None
    method: str = METHOD


def _per_m(cost_per_s: float | None, tok_s: float) -> float | None:
    return cost_per_s / tok_s * 1e6 if cost_per_s is not None and tok_s > 0 else None


def compute_economics(
    metrics: BenchMetrics,
    num_accelerators: int,
    accelerator_hour_cost: float | None = None,
    prices: Prices | None = None,
) -> Economics:
    if num_accelerators <= 0:
        raise ValueError(f"--accelerators must be > 0, got {num_accelerators}")
    hit = metrics.cache_hit_rate or 0.0
    rates = {
        "input": metrics.input_throughput,
        "uncached_input": metrics.input_throughput * (1.0 - hit),
        "cached_input": metrics.input_throughput * hit,
        "output": metrics.output_throughput,
        "total": metrics.total_token_throughput,
    }
    cost_per_hour = (
        accelerator_hour_cost * num_accelerators if accelerator_hour_cost is not None else None
    )
    cost_per_s = cost_per_hour / 3600.0 if cost_per_hour is not None else None
    revenue_per_hour = None
    weighted: dict[str, float | None] = {k: None for k in TOKEN_KINDS if k != "total"}
    margin = None
    if prices is not None and prices.is_complete:
        assert prices.input_per_m is not None and prices.output_per_m is not None
        cached_price = (
            prices.cached_input_per_m
            if prices.cached_input_per_m is not None
            else prices.input_per_m
        )
        revenue_per_s = (
            rates["uncached_input"] * prices.input_per_m
            + rates["cached_input"] * cached_price
            + rates["output"] * prices.output_per_m
        ) / 1e6
        revenue_per_hour = revenue_per_s * 3600.0
        if cost_per_s is not None and revenue_per_s > 0:
            ratio = cost_per_s / revenue_per_s
            margin = 1.0 - ratio
            weighted = {
                "uncached_input": prices.input_per_m * ratio,
                "cached_input": cached_price * ratio,
                "input": ((1.0 - hit) * prices.input_per_m + hit * cached_price) * ratio,
                "output": prices.output_per_m * ratio,
            }
    return Economics(
        num_accelerators=num_accelerators,
        accelerator_hour_cost=accelerator_hour_cost,
        cost_per_hour=cost_per_hour,
        tokens_per_s=rates,
        tokens_per_accelerator_hour={k: v * 3600.0 / num_accelerators for k, v in rates.items()},
        sole_cost_per_m={k: _per_m(cost_per_s, v) for k, v in rates.items()},
        revenue_per_hour=revenue_per_hour,
        revenue_per_accelerator_hour=(
            revenue_per_hour / num_accelerators if revenue_per_hour is not None else None
        ),
        revenue_weighted_cost_per_m=weighted,
        margin=margin,
    )
