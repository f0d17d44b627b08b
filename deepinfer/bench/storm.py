"""A cancel storm: clients that give up at random points, against a running server.

    storm ──long streams (keep the engine stepping)──────────────────────────▶ server
          ──N short streams, each cancelled after a random 0..max_delay_s────▶ (client gone:
            (some before the add is applied, some during prefill or decode)     abort, free)
          ──then: the node's gauges must fall to zero, and a good request must be answered

What a client can do to a server must never stop it serving (issue: a cancelled consumer
killed the engine loop). ``run_storm`` returns the counts; the CPU test asserts them and
``benchmarks/cancel_storm.py`` records them with the server's RSS before and after.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

_IDLE_GAUGES = (
    "deepinfer_num_requests_running",
    "deepinfer_num_requests_waiting",
    "deepinfer_kv_blocks_used",
    "deepinfer_state_slots_used",
)


@dataclass
class StormResult:
    num_cancelled: int = 0  # short requests whose client gave up
    num_completed: int = 0  # short requests that finished before their client gave up
    num_failed: int = 0  # short requests answered with an error status or event
    num_long_ok: int = 0  # long streams that ended normally
    long_errors: list[str] = field(default_factory=list)  # how the others ended
    idle_gauges: dict[str, float] = field(default_factory=dict)  # once idle (all must be 0)
    good_status: int = 0  # the good request's status after the storm
    good_text: str = ""


async def run_storm(
    base_url: str,
    model: str,
    *,
    num_requests: int = 400,
    concurrency: int = 16,
    max_delay_s: float = 0.15,
    node_metrics_url: str | None = None,
    seed: int = 0,
    long_tokens: int = 200,
    timeout_s: float = 60.0,
) -> StormResult:
    """Run the storm against ``base_url`` (an OpenAI-compatible server), then read the node's
    gauges (``component="node"``) at ``node_metrics_url`` (default: ``base_url/metrics``, where
    ``serve`` has them)."""
    rng = random.Random(seed)
    result = StormResult()
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(base_url, timeout=timeout) as session:

        def chat(max_tokens: int, words: int) -> dict:
            content = " ".join(rng.choice(("sea", "wind", "stone", "light")) for _ in range(words))
            return {
                "model": model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
                "thinking": {"type": "disabled"},
            }

        async def stream(body: dict, limit: aiohttp.ClientTimeout = timeout) -> bool:
            """True when the stream ended with [DONE] and no error event."""
            async with session.post("/v1/chat/completions", json=body, timeout=limit) as response:
                text = await response.text()
            return response.status == 200 and "[DONE]" in text and '"error"' not in text

        async def long_stream() -> None:
            try:
                # Their own time limit: the whole storm's, not one short request's.
                long_limit = aiohttp.ClientTimeout(total=2 * timeout_s)
                ok = await stream(chat(max_tokens=long_tokens, words=8), long_limit)
            except (TimeoutError, aiohttp.ClientError) as e:
                result.long_errors.append(repr(e))
                return
            if ok:
                result.num_long_ok += 1
            else:
                result.long_errors.append("error status or event")

        async def short(delay_s: float) -> None:
            # Prompts of a few to a few hundred words: some cancels land in a chunked prefill.
            task = asyncio.create_task(stream(chat(max_tokens=24, words=rng.choice((3, 300)))))
            done, _ = await asyncio.wait([task], timeout=delay_s)
            if not done:
                task.cancel()
                result.num_cancelled += 1
                await asyncio.gather(task, return_exceptions=True)
            elif task.exception() is None and task.result():
                result.num_completed += 1
            else:
                result.num_failed += 1

        longs = [asyncio.create_task(long_stream()) for _ in range(2)]
        await asyncio.sleep(0.2)  # the long streams are stepping
        limit = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            # A fifth of the clients leave within 3 ms: before their add is applied.
            delay_s = rng.uniform(0, 0.003) if i % 5 == 0 else rng.uniform(0, max_delay_s)
            async with limit:
                await short(delay_s)

        await asyncio.gather(*(one(i) for i in range(num_requests)))
        await asyncio.gather(*longs, return_exceptions=True)
        result.idle_gauges = await _wait_idle(session, node_metrics_url or "/metrics")
        body = {**chat(max_tokens=8, words=3), "stream": False}
        async with session.post("/v1/chat/completions", json=body) as response:
            result.good_status = response.status
            payload = await response.json()
            if response.status == 200:
                result.good_text = payload["choices"][0]["message"]["content"]
    return result


async def _wait_idle(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The node's idle gauges, once they are all zero (aborts land between steps) or after 5 s."""
    gauges: dict[str, float] = {}
    for _ in range(100):
        async with session.get(url) as response:
            text = await response.text()
        gauges = {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name in _IDLE_GAUGES and sample.labels.get("component") == "node"
        }
        if len(gauges) == len(_IDLE_GAUGES) and not any(gauges.values()):
            break
        await asyncio.sleep(0.05)
    return gauges
