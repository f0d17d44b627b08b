"""One benchmark run: sessions in, timed `RequestOutput`s out.

Data flow::

    sessions + arrival offsets --> one task per session: sleep until its offset, then for each
    turn: [semaphore] --> send_request --> RequestOutput (+ the reply joins the history)
    --> gather --> RunResult(outputs, duration) --> metrics

A session's arrival offset comes from the trace timestamps (trace replay) or the arrival process;
``--request-rate`` therefore counts sessions, which are requests except in multi-turn workloads
(conversations/s there). ``--max-concurrency`` bounds requests in flight, not sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
import tokenizers
from tqdm import tqdm

from deepinfer.bench.arrivals import arrival_offsets, trace_offsets
from deepinfer.bench.client import RequestInput, RequestOutput, send_request
from deepinfer.bench.datasets import Session, Turn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSettings:
    """How to send one run's requests (from the CLI flags)."""

    url: str
    backend: str
    model: str
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float | None = 0.0
    api_key: str | None = None
    timeout_s: float = 6 * 3600.0
    disable_tqdm: bool = False
    num_warmups: int = 0
    seed: int = 0


@dataclass
class RunResult:
    """Outputs in completion order; ``start_time`` is the ``perf_counter`` origin of offsets."""

    outputs: list[RequestOutput]
    duration_s: float
    start_time: float
    send_offsets: list[float]


def schedule(sessions: list[Session], settings: RunSettings) -> list[float]:
    """Send offsets (s) per session: the trace's timestamps if every session has one."""
    if sessions and all(s.arrival_s is not None for s in sessions):
        return trace_offsets([s.arrival_s or 0.0 for s in sessions], settings.request_rate)
    rng = np.random.default_rng(settings.seed)
    return arrival_offsets(len(sessions), settings.request_rate, settings.burstiness, rng)


def request_input(
    settings: RunSettings, session: Session, history: list[dict[str, str]], turn: Turn
) -> RequestInput:
    """Chat: [system] + history + user; completions: the same texts joined by blank lines."""
    user = {"role": "user", "content": turn.user}
    messages = [{"role": "system", "content": session.system}] if session.system else []
    messages += [*history, user]
    common = dict(
        url=settings.url,
        backend=settings.backend,
        model=settings.model,
        max_tokens=turn.max_tokens,
        ignore_eos=settings.ignore_eos,
        temperature=settings.temperature,
        api_key=settings.api_key,
    )
    if settings.backend == "openai-chat":
        return RequestInput(messages=messages, **common)
    return RequestInput(prompt="\n\n".join(m["content"] for m in messages), **common)


class _Run:
    """State shared by one run's session tasks."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        settings: RunSettings,
        tokenizer: tokenizers.Tokenizer | None,
        pbar: tqdm,
    ) -> None:
        self.http = http
        self.settings = settings
        self.tokenizer = tokenizer
        self.pbar = pbar
        self.outputs: list[RequestOutput] = []
        limit = settings.max_concurrency
        self.semaphore = asyncio.Semaphore(limit) if limit else None

    async def session(self, index: int, session: Session, send_at: float) -> None:
        delay = send_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        history: list[dict[str, str]] = []
        requested_before = 0  # requested tokens of the history: earlier turns + replies
        for k, turn in enumerate(session.turns):
            req = request_input(self.settings, session, history, turn)
            async with self.semaphore or contextlib.nullcontext():
                out = await send_request(self.http, req)
            out.session_index, out.turn_index = index, k
            out.requested_prompt_tokens = requested_before + turn.num_prompt_tokens
            self._fill_missing_usage(out)
            self._record(out)
            if not out.success:
                self._abort(index, session, k + 1, out.error)
                return
            # The reply's content as received; its reasoning stays out of the history, as chat
            # templates drop earlier turns' reasoning.
            history += [
                {"role": "user", "content": turn.user},
                {"role": "assistant", "content": out.content},
            ]
            requested_before = out.requested_prompt_tokens + (out.output_tokens or 0)

    def _fill_missing_usage(self, out: RequestOutput) -> None:
        # vLLM's fallback; counted in num_missing_usage so that it is never silent.
        if not out.success or out.has_usage:
            return
        if out.prompt_tokens is None:
            out.prompt_tokens = out.requested_prompt_tokens
        if out.output_tokens is None and self.tokenizer is not None:
            text = out.reasoning + out.content
            out.output_tokens = len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _abort(self, index: int, session: Session, first: int, cause: str | None) -> None:
        """Later turns of a failed conversation are failures too, not silent omissions."""
        for k in range(first, len(session.turns)):
            out = RequestOutput(start_time=time.perf_counter(), session_index=index, turn_index=k)
            out.requested_output_tokens = session.turns[k].max_tokens
            self._record(out.fail("conversation_aborted", f"an earlier turn failed: {cause}"))

    def _record(self, out: RequestOutput) -> None:
        self.outputs.append(out)
        self.pbar.update(1)


async def _warm_up(run: _Run, sessions: list[Session], num_warmups: int) -> None:
    warm = [sessions[i % len(sessions)] for i in range(num_warmups)]
    outs = await asyncio.gather(
        *(send_request(run.http, request_input(run.settings, s, [], s.turns[0])) for s in warm)
    )
    for out in outs:
        if not out.success:
            logger.warning("warm-up request failed: %s %s", out.error, out.error_detail)


async def run_benchmark(
    sessions: list[Session],
    settings: RunSettings,
    tokenizer: tokenizers.Tokenizer | None = None,
    desc: str | None = None,
) -> RunResult:
    """Send every session's turns at their scheduled times; return when all have finished."""
    offsets = schedule(sessions, settings)
    num_requests = sum(len(s.turns) for s in sessions)
    limit = settings.max_concurrency or 0
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=True) as http:
        with tqdm(total=num_requests, disable=settings.disable_tqdm, desc=desc) as pbar:
            run = _Run(http, settings, tokenizer, pbar)
            if settings.num_warmups > 0 and sessions:
                await _warm_up(run, sessions, settings.num_warmups)
            start = time.perf_counter()
            await asyncio.gather(
                *(
                    run.session(i, s, start + t)
                    for i, (s, t) in enumerate(zip(sessions, offsets, strict=True))
                )
            )
            duration = time.perf_counter() - start
    assert len(run.outputs) == num_requests, f"{len(run.outputs)} outputs for {num_requests}"
    return RunResult(run.outputs, duration, start, offsets)
