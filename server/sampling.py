"""Sampling options for the node: the recipe's inference options plus the raw body's extras.

deepseek-recipe's conversion carries temperature, top_p, seed, max_tokens, logprobs and the
output constraint. The token-level parameters it does not carry (vLLM's names: ``top_k``,
``min_p``, penalties, ``logit_bias``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``,
``cache_salt``, and ours: ``deterministic``) are read here from the raw JSON body, checked (a
400 names the field) and sent to the node in ``SamplingOptions``. A request without a seed gets
one drawn here, so that every sampled request is reproducible from what the server logged.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from deepinfer.server.errors import ApiError, bad_request
from deepinfer.server.protocol import SamplingOptions

_SEED_LIMIT = 2**63


@dataclass(frozen=True)
class ExtraSampling:
    """The extras of one request, checked; None/defaults when the body does not give them."""

    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    cache_salt: str | None = None
    deterministic: bool = False


def _boolean(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"Invalid {name}: expected a boolean, got {value!r}", name)
    return bool(value)


def _number(body: dict[str, Any], name: str, low: float, high: float, *, open_low: bool = False):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"Invalid {name}: expected a number, got {value!r}", name)
    if value < low or (open_low and value == low) or value > high:
        low_bracket = "(" if open_low else "["
        raise bad_request(
            f"Invalid {name} value, the valid range of {name} is {low_bracket}{low}, {high}]",
            name,
        )
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"Invalid {name}: expected an integer, got {value!r}", name)
    if not low <= value <= high:
        raise bad_request(
            f"Invalid {name} value, the valid range of {name} is [{low}, {high}]", name
        )
    return value


def read_extra_sampling(body: dict[str, Any], vocab_size: int) -> ExtraSampling:
    """Raises ApiError(400) naming the first bad field."""
    top_k = _integer(body, "top_k", -1, vocab_size)
    min_p = _number(body, "min_p", 0.0, 1.0)
    presence = _number(body, "presence_penalty", -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", -2.0, 2.0)
    repetition = _number(body, "repetition_penalty", 0.0, 2.0, open_low=True)
    min_tokens = _integer(body, "min_tokens", 0, 2**31 - 1)
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise bad_request("Invalid cache_salt: expected a non-empty string", "cache_salt")
    return ExtraSampling(
        top_k=0 if top_k in (None, -1) else top_k,
        min_p=min_p or 0.0,
        presence_penalty=presence or 0.0,
        frequency_penalty=frequency or 0.0,
        repetition_penalty=1.0 if repetition is None else repetition,
        min_tokens=min_tokens or 0,
        stop_token_ids=_token_ids(body.get("stop_token_ids"), vocab_size),
        ignore_eos=_boolean(body, "ignore_eos"),
        logit_bias=_logit_bias(body.get("logit_bias"), vocab_size),
        cache_salt=cache_salt,
        deterministic=_boolean(body, "deterministic"),
    )


def _token_ids(value: Any, vocab_size: int) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in value
    ):
        raise bad_request(
            f"Invalid stop_token_ids: expected a list of token ids in [0, {vocab_size})",
            "stop_token_ids",
        )
    return tuple(value)


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's form: ``{"<token id>": bias}`` with bias in [-100, 100]."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(
            "Invalid logit_bias: expected an object of token id -> bias", "logit_bias"
        )
    bias: dict[int, float] = {}
    for key, b in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(
                f"Invalid logit_bias key {key!r}: not a token id", "logit_bias"
            ) from None
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"Invalid logit_bias key {key!r}: token ids are in [0, {vocab_size})", "logit_bias"
            )
        if isinstance(b, bool) or not isinstance(b, int | float) or not -100 <= b <= 100:
            raise bad_request(
                f"Invalid logit_bias value for {key!r}: expected a number in [-100, 100]",
                "logit_bias",
            )
        bias[token_id] = float(b)
    return bias or None


def draw_seed() -> int:
    return secrets.randbelow(_SEED_LIMIT)


def build_sampling_options(
    *,
    temperature: float,
    top_p: float,
    seed: int | None,
    max_tokens: int,
    logprobs: int | None,
    extra: ExtraSampling,
) -> SamplingOptions:
    """The node's options; raises ApiError(400) when the combination is invalid."""
    options = SamplingOptions(
        temperature=temperature,
        top_p=top_p,
        top_k=extra.top_k,
        min_p=extra.min_p,
        seed=draw_seed() if seed is None else seed,
        presence_penalty=extra.presence_penalty,
        frequency_penalty=extra.frequency_penalty,
        repetition_penalty=extra.repetition_penalty,
        logit_bias=extra.logit_bias,
        max_tokens=max_tokens,
        min_tokens=extra.min_tokens,
        stop_token_ids=list(extra.stop_token_ids),
        ignore_eos=extra.ignore_eos,
        logprobs=logprobs,
        deterministic=extra.deterministic,
    )
    try:
        options.to_sampling_params()  # the engine's own checks, so the node will accept it
    except ValueError as e:
        raise ApiError(
            400, f"Invalid sampling parameters: {e}", code="invalid_request_error"
        ) from e
    return options
