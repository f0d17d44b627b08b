"""SamplingParams: what a user asks of one request's sampling (torch-free).

Defaults follow vLLM's ``SamplingParams`` so that code written for it carries over.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
_MAX_INT32 = 2**31 - 1


@dataclass
class SamplingParams:
    """Sampling and stopping options of one request.

    temperature 0 means greedy; ``top_k`` 0 (or -1) and ``top_p`` 1 and ``min_p`` 0 mean "off".
    ``seed`` makes sampling reproducible: the random draw for the token at absolute position ``p``
    depends only on ``(seed, p)``, never on batch composition, chunking or preemption.
    ``logprobs``/``prompt_logprobs`` ask for that many top alternatives (plus the chosen token).
    ``stop`` strings are matched on detokenized text by the offline API (and by the service's text
    side); ``stop_token_ids``, EOS, ``max_tokens`` and the context length are token-level stops.
    ``constraint`` ``(kind, schema)`` constrains the output to a grammar (deepinfer.constraints:
    json, json_object, regex, ebnf, tool_call_required, tool_call).
    It cannot be combined with ``min_tokens`` or ``ignore_eos``: both can forbid EOS where the
    grammar allows nothing else.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    constraint: tuple[str, str] | None = None
    # This request's tokens are bit-identical whatever runs beside it: its tokens run one per
    # forward (kernel.deterministic does this for every request).
    deterministic: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.top_k == -1:
            self.top_k = 0
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        self._validate_types()
        if self.n != 1:
            raise ValueError(f"n must be 1 for now, got {self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off), -1 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= _MAX_INT32:
            raise ValueError(f"max_tokens must be in [1, 2**31 - 1], got {self.max_tokens}")
        if not 0 <= self.min_tokens <= _MAX_INT32:
            raise ValueError(f"min_tokens must be in [0, 2**31 - 1], got {self.min_tokens}")
        if self.top_k > _MAX_INT32:
            raise ValueError(f"top_k must be at most 2**31 - 1, got {self.top_k}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= _MAX_INT32:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if any(not 0 <= t <= _MAX_INT32 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids, got {self.stop_token_ids}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.constraint is not None:
            self._validate_constraint()

    def _validate_types(self) -> None:
        """Integers are ints (not bools), numbers are finite: NaN passes every range check."""
        for name in ("n", "top_k", "min_tokens"):
            _check_int(name, getattr(self, name))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            _check_number(name, getattr(self, name))
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict, got {type(self.logit_bias).__name__}")
            for token_id, bias in self.logit_bias.items():
                _check_int("logit_bias token id", token_id)
                _check_number(f"logit_bias[{token_id}]", bias)

    def check_limits(self, *, max_logprobs: int) -> None:
        """The engine's limits (LLMEngine.add_request): raises ValueError past them."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > max_logprobs:
                raise ValueError(
                    f"{name} asks for {value} alternatives; at most {max_logprobs} "
                    "(model.max_logprobs)"
                )

    def _validate_constraint(self) -> None:
        from deepinfer.constraints import check_constraint_kind

        if not isinstance(self.constraint, tuple | list) or len(self.constraint) != 2:
            raise ValueError(f"constraint must be a (kind, schema) pair, got {self.constraint!r}")
        self.constraint = (kind, schema) = tuple(self.constraint)
        check_constraint_kind(kind)
        if not isinstance(schema, str):
            raise ValueError(f"constraint schema must be a string, got {type(schema).__name__}")
        if self.min_tokens or self.ignore_eos:
            raise ValueError(
                f"an output constraint ({kind}) cannot be combined with min_tokens "
                f"({self.min_tokens}) or ignore_eos ({self.ignore_eos})"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
