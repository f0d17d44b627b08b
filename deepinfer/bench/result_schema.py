"""The JSON result's schema (``schema_version`` 1) and a validator for it.

Producer of results: ``report.py``. Consumers: users, ``plots.py``, and tools that read vLLM
``bench serve`` JSON: the scalar keys vLLM writes keep vLLM's names and units (``duration`` s,
``*_throughput`` per s, ``mean_ttft_ms``, ``p99_itl_ms`` ...). Bump ``SCHEMA_VERSION`` when a key
is removed, renamed or changes meaning; adding keys keeps the version.

Schema (``schema_version`` 1; `RESULT_SCHEMA` is the JSON Schema, `validate` checks it with
jsonschema-rs, numbers finite). A file is
one run (``kind: "run"``) or a sweep (``kind: "sweep"``, ``runs``: a list of run objects). A run:

- identity: ``schema_version``, ``kind``, ``tool``, ``date`` (ISO 8601), ``backend``,
  ``base_url``, ``endpoint``, ``model_id``, ``tokenizer_id``, ``dataset_name``, ``config``
  (every CLI flag as parsed), ``num_prompts`` (requests), ``num_sessions``, ``request_rate``
  (req/s, or ``"inf"``), ``burstiness``, ``max_concurrency`` (null = unbounded), ``seed``,
  ``ignore_eos``, ``goodput_slos_ms``, ``percentiles``;
- totals: ``duration`` (s), ``completed``, ``failed``, ``errors_by_status`` ({"500": 1,
  "timeout": 2, ...}), ``total_input_tokens`` (Σ usage.prompt_tokens), ``total_output_tokens``,
  ``total_cached_tokens``, ``num_missing_usage``;
- rates (per s): ``request_throughput``, ``request_goodput`` (null without SLOs),
  ``num_good_requests``, ``input_throughput``, ``output_throughput``, ``total_token_throughput``,
  ``max_output_tokens_per_s``, ``max_concurrent_requests``, ``concurrency``;
  ``per_accelerator`` (null, or the four throughputs divided by ``num_accelerators``);
- cache: ``cache_hit_rate`` (null when no input tokens), ``cache_hit_rate_by_field``,
  ``mean_prompt_overhead_tokens`` (server prompt tokens − requested: the chat template);
- ``metrics``: for each of ttft, ttfct, tpot, itl, e2el: ``count``, ``mean_ms``, ``median_ms``,
  ``std_ms``, ``percentiles_ms`` ({"90": ..., "99": ...}); plus vLLM's flat keys
  ``{mean,median,std,pNN}_{metric}_ms`` for the ``--percentile-metrics``;
- ``economics``: null, or see ``economics.py`` (``method`` states how costs are split);
- ``requests``: one object per request, in completion order: ``session``, ``turn``, ``success``,
  ``error``, ``error_detail``, ``send_offset_s`` (from the run start), ``ttft_s``, ``ttfct_s``,
  ``e2el_s``, ``tpot_s``, ``itls_s``, ``prompt_tokens``, ``requested_prompt_tokens``,
  ``output_tokens``, ``requested_output_tokens``, ``cached_tokens``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jsonschema_rs

from deepinfer.bench.metrics import PERCENTILE_METRICS

SCHEMA_VERSION = 1

_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": ["number", "null"]}
_INT = {"type": "integer"}
_INT_OR_NULL = {"type": ["integer", "null"]}
_STR = {"type": "string"}
_NUM_MAP = {"type": "object", "additionalProperties": _NUM}
_NUM_OR_NULL_MAP = {"type": "object", "additionalProperties": _NUM_OR_NULL}


def _object(properties: dict[str, Any], nullable: bool = False) -> dict[str, Any]:
    """An object whose every listed key is required."""
    kind: Any = ["object", "null"] if nullable else "object"
    return {"type": kind, "required": list(properties), "properties": properties}


_DISTRIBUTION = _object(
    {
        "count": _INT,
        "mean_ms": _NUM_OR_NULL,
        "median_ms": _NUM_OR_NULL,
        "std_ms": _NUM_OR_NULL,
        "percentiles_ms": _NUM_OR_NULL_MAP,
    }
)
_REQUEST = _object(
    {
        "session": _INT,
        "turn": _INT,
        "success": {"type": "boolean"},
        "error": {"type": ["string", "null"]},
        "error_detail": _STR,
        "send_offset_s": _NUM,
        "ttft_s": _NUM_OR_NULL,
        "ttfct_s": _NUM_OR_NULL,
        "e2el_s": _NUM_OR_NULL,
        "tpot_s": _NUM_OR_NULL,
        "itls_s": {"type": "array", "items": _NUM},
        "prompt_tokens": _INT_OR_NULL,
        "requested_prompt_tokens": _INT,
        "output_tokens": _INT_OR_NULL,
        "requested_output_tokens": _INT,
        "cached_tokens": _INT,
    }
)
_ECONOMICS = _object(
    {
        "num_accelerators": _INT,
        "accelerator_hour_cost": _NUM_OR_NULL,
        "cost_per_hour": _NUM_OR_NULL,
        "tokens_per_s": _NUM_MAP,
        "tokens_per_accelerator_hour": _NUM_MAP,
        "sole_cost_per_m": _NUM_OR_NULL_MAP,
        "revenue_per_hour": _NUM_OR_NULL,
        "revenue_per_accelerator_hour": _NUM_OR_NULL,
        "revenue_weighted_cost_per_m": _NUM_OR_NULL_MAP,
        "margin": _NUM_OR_NULL,
        "method": _STR,
    },
    nullable=True,
)
_RUN_PROPERTIES: dict[str, Any] = {
    "schema_version": {"type": "integer", "enum": [SCHEMA_VERSION]},
    "kind": {"type": "string", "enum": ["run"]},
    "tool": _STR,
    "date": _STR,
    "backend": {"type": "string", "enum": ["openai-chat", "openai"]},
    "base_url": _STR,
    "endpoint": _STR,
    "model_id": _STR,
    "tokenizer_id": _STR,
    "dataset_name": _STR,
    "config": {"type": "object"},
    "num_prompts": _INT,
    "num_sessions": _INT,
    "request_rate": {"type": ["number", "string"]},
    "burstiness": _NUM,
    "max_concurrency": _INT_OR_NULL,
    "seed": _INT,
    "ignore_eos": {"type": "boolean"},
    "goodput_slos_ms": _NUM_MAP,
    "percentiles": {"type": "array", "items": _NUM},
    "duration": _NUM,
    "completed": _INT,
    "failed": _INT,
    "errors_by_status": {"type": "object", "additionalProperties": _INT},
    "total_input_tokens": _INT,
    "total_output_tokens": _INT,
    "total_cached_tokens": _INT,
    "num_missing_usage": _INT,
    "request_throughput": _NUM,
    "request_goodput": _NUM_OR_NULL,
    "num_good_requests": _INT_OR_NULL,
    "input_throughput": _NUM,
    "output_throughput": _NUM,
    "total_token_throughput": _NUM,
    "max_output_tokens_per_s": _NUM,
    "max_concurrent_requests": _INT,
    "concurrency": _NUM,
    "per_accelerator": {"type": ["object", "null"], "additionalProperties": _NUM},
    "cache_hit_rate": _NUM_OR_NULL,
    "cache_hit_rate_by_field": _NUM_MAP,
    "mean_prompt_overhead_tokens": _NUM_OR_NULL,
    "metrics": {
        "type": "object",
        "required": list(PERCENTILE_METRICS),
        "properties": {m: _DISTRIBUTION for m in PERCENTILE_METRICS},
    },
    "economics": _ECONOMICS,
    "requests": {"type": "array", "items": _REQUEST},
}
RUN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": list(_RUN_PROPERTIES),
    "properties": _RUN_PROPERTIES,
    # vLLM's flat keys ({mean,median,std,pNN}_{metric}_ms) vary with the flags.
    "additionalProperties": _NUM_OR_NULL,
}
SWEEP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "schema_version",
        "kind",
        "tool",
        "date",
        "sweep_parameter",
        "sweep_values",
        "runs",
    ],
    "properties": {
        "schema_version": {"type": "integer", "enum": [SCHEMA_VERSION]},
        "kind": {"type": "string", "enum": ["sweep"]},
        "tool": _STR,
        "date": _STR,
        "sweep_parameter": {"type": "string", "enum": ["request_rate", "max_concurrency"]},
        "sweep_values": {"type": "array", "items": {"type": ["number", "string"]}},
        "runs": {"type": "array", "items": RUN_SCHEMA},
    },
    "additionalProperties": False,
}
RESULT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "deepinfer bench serve result",
    "oneOf": [RUN_SCHEMA, SWEEP_SCHEMA],
}
# By "kind", so that a problem is reported where it is, not as "matches none of oneOf".
_VALIDATORS = {
    "run": jsonschema_rs.validator_for(RUN_SCHEMA),
    "sweep": jsonschema_rs.validator_for(SWEEP_SCHEMA),
}
_ANY_KIND = jsonschema_rs.validator_for(RESULT_SCHEMA)


def validate(instance: Any) -> list[str]:
    """Problems of ``instance`` against ``RESULT_SCHEMA`` (empty = valid), one a line: where
    (a JSON path) and what. NaN and infinities are problems too: JSON has neither (Python's
    json writes them, other readers fail on them)."""
    kind = instance.get("kind") if isinstance(instance, dict) else None
    validator = _VALIDATORS.get(kind, _ANY_KIND) if isinstance(kind, str) else _ANY_KIND
    non_finite: dict[str, float] = {}
    try:
        json.dumps(instance, allow_nan=False)  # C speed; the walk below finds where
    except ValueError:
        non_finite = dict(_non_finite(instance))
    # jsonschema-rs reads a NaN as null: its message there would mislead.
    errors = ((_json_path(e.instance_path), e.message) for e in validator.iter_errors(instance))
    problems = [f"{path}: {message}" for path, message in errors if path not in non_finite]
    return problems + [
        f"{path}: {value} is not a finite number" for path, value in non_finite.items()
    ]


def _json_path(parts: Sequence[str | int]) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def _non_finite(value: Any, path: str = "$") -> Iterator[tuple[str, float]]:
    if isinstance(value, float) and not math.isfinite(value):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _non_finite(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _non_finite(item, f"{path}[{i}]")
