"""What the offline API returns (vLLM's names, so user code carries over), and why a request
ends: ``FinishReason``, the one vocabulary of the scheduler, the engine, the node's frames and
the coordinator (torch-free)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    """OpenAI's ``finish_reason`` (a str: it compares, formats and serializes as its value)."""

    STOP = "stop"  # EOS, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens, or the context / KV pool limit
    ABORT = "abort"  # the client left, a timeout, a drain, or the engine aborted it
    ERROR = "error"  # a failed step (metrics; the client gets an error, not this reason)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """One request's result.

    ``prompt_logprobs[0]`` is None (nothing predicts the first token); entry j holds
    ``{token_id: logprob}`` for prompt token j and the top alternatives asked for.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
