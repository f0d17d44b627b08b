"""``deepinfer bench serve`` end to end against a fake OpenAI-compatible server on loopback.

The fake streams on an absolute schedule: token chunk k leaves at t0 + TTFT + k·ITL (t0 = when
the handler got the request), after a role-only chunk and an SSE comment, and ends with a usage
chunk 60 ms after the last token. Timing is checked twice: against the write times the fake
recorded (same process, same clock: only loopback delivery separates them) and against the
nominal schedule (allowing the fake's own lateness). Tolerances are declared next to the asserts;
they allow a loaded 2-core CI machine, while a wrong definition (a role-only chunk starting TTFT,
the usage chunk extending E2E, chunks counted as tokens) misses them by more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from deepinfer.bench import serve
from deepinfer.bench.client import RequestOutput
from deepinfer.bench.datasets import load_tokenizer
from deepinfer.bench.result_schema import validate
from deepinfer.bench.runner import RunResult, run_benchmark

pytestmark = pytest.mark.asyncio

# The trailing usage-only chunk comes this long after the last token: it must not extend E2E.
USAGE_DELAY_S = 0.060
# Chat-template tokens the fake adds to the user message's length, as a server's template would.
TEMPLATE_OVERHEAD = 7
MODEL = "fake-model"


@dataclass(frozen=True)
class Plan:
    """How the fake answers one request."""

    status: int = 200
    ttft_s: float = 0.050
    itl_s: float = 0.010
    num_chunks: int = 8
    tokens_per_chunk: int = 1
    num_reasoning_chunks: int = 0  # the first chunks carry reasoning_content
    cached_tokens: int = 0
    drop: bool = False  # close the connection after the first token chunk
    stall_s: float = 0.0  # sleep before answering at all
    stream_error: bool = False  # an error event in place of the second token chunk


class FakeOpenAI:
    """Records what it receives and streams each reply on the schedule ``plan(index)`` gives."""

    def __init__(self, plan: Callable[[int], Plan] = lambda i: Plan()) -> None:
        self.plan = plan
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.received_at: list[float] = []
        self.finished_at: dict[int, float] = {}
        self.replies: dict[int, str] = {}
        self.token_times: dict[int, list[float]] = {}  # perf_counter before each token chunk
        self.in_flight = 0
        self.max_in_flight = 0
        self.tokenizer = load_tokenizer(None)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/v1/completions", self.complete)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}, {"id": "other"}]})

    def _prompt_tokens(self, body: dict[str, Any]) -> int:
        if "messages" in body:
            text = "".join(m["content"] for m in body["messages"])
        else:
            text = body["prompt"]
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids) + TEMPLATE_OVERHEAD

    async def complete(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        body = await request.json()
        index = len(self.bodies)
        self.bodies.append(body)
        self.paths.append(request.path)
        self.received_at.append(t0)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request, body, index, t0, self.plan(index))
        finally:
            self.in_flight -= 1
            self.finished_at[index] = time.perf_counter()

    async def _answer(
        self, request: web.Request, body: dict[str, Any], index: int, t0: float, plan: Plan
    ) -> web.StreamResponse:
        if plan.stall_s:
            await asyncio.sleep(plan.stall_s)
        if plan.status != 200:
            error = {"error": {"message": "fake failure", "code": plan.status}}
            return web.json_response(error, status=plan.status)
        is_chat = "messages" in body
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(choice: dict[str, Any] | None, usage: dict | None = None) -> None:
            obj = {"id": f"r{index}", "choices": [choice] if choice else [], "usage": usage}
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        # Neither a role-only delta nor an SSE comment is a token: TTFT must not start here.
        if is_chat:
            await event({"index": 0, "delta": {"role": "assistant", "content": ""}})
        await resp.write(b": keep-alive\n\n")
        reply = ""
        writes = self.token_times.setdefault(index, [])
        for k in range(plan.num_chunks):
            await asyncio.sleep(max(0.0, t0 + plan.ttft_s + k * plan.itl_s - time.perf_counter()))
            text = f"w{index}.{k} "
            if not is_chat:
                choice = {"index": 0, "text": text}
            elif k < plan.num_reasoning_chunks:
                choice = {"index": 0, "delta": {"reasoning_content": text}}
            else:
                choice = {"index": 0, "delta": {"content": text}}
                reply += text
            if plan.stream_error and k == 1:
                await resp.write(b'data: {"error": {"message": "fake mid-stream error"}}\n\n')
                return resp
            writes.append(time.perf_counter())
            await event(choice)
            if plan.drop:
                request.transport.close()
                return resp
        self.replies[index] = reply
        finish = {"index": 0, "finish_reason": "length"}
        finish |= {"delta": {}} if is_chat else {"text": ""}
        await event(finish)
        await asyncio.sleep(USAGE_DELAY_S)
        prompt_tokens = self._prompt_tokens(body)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": plan.num_chunks * plan.tokens_per_chunk,
            "total_tokens": prompt_tokens + plan.num_chunks * plan.tokens_per_chunk,
            "prompt_tokens_details": {"cached_tokens": plan.cached_tokens},
        }
        await event(None, usage)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _ns(server: Any, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_bench_serve_arguments(parser)
    base = f"http://{server.host}:{server.port}"
    return parser.parse_args(["--base-url", base, "--disable-tqdm", "--seed", "1", *flags])


def _load(path: Path) -> dict[str, Any]:
    result = json.loads(path.read_text())
    assert validate(result) == []
    return result


def _capture_runs(monkeypatch: pytest.MonkeyPatch) -> list[RunResult]:
    """The runs' `RunResult`s (absolute ``perf_counter`` times, comparable with the fake's)."""
    runs: list[RunResult] = []

    async def spy(*args: Any, **kwargs: Any) -> RunResult:
        runs.append(await run_benchmark(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(serve, "run_benchmark", spy)
    return runs


# Client timestamps against the fake's write times (one process, one clock): a token cannot be
# seen before it is written (exact lower bound), and only loopback delivery through the shared
# event loop makes it later. 30 ms covers the process being descheduled on a 2-core machine
# under a load average of 6; a wrong definition misses by more (a role-only chunk starting TTFT:
# below the lower bound; the usage chunk ending E2E: +60 ms).
DELIVERY_TOL_S = 0.030
# The fake's own lateness against its nominal schedule on such a machine.
NOMINAL_TOL_MS = 30.0


def _assert_matches_writes(fake: FakeOpenAI, outputs: list[RequestOutput]) -> None:
    for o in outputs:
        writes = fake.token_times[int((o.reasoning + o.content).split(".")[0][1:])]
        assert len(o.itl) == len(writes) - 1
        assert 0 <= o.start_time + o.ttft - writes[0] <= DELIVERY_TOL_S
        assert 0 <= o.start_time + o.latency - writes[-1] <= DELIVERY_TOL_S
        assert sum(o.itl) == pytest.approx(o.latency - o.ttft, abs=1e-9)  # gaps tile E2E − TTFT


async def test_timing_tokens_cache_json_and_plots(
    aiohttp_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeOpenAI(lambda i: Plan(num_chunks=8, tokens_per_chunk=2, cached_tokens=24))
    server = await aiohttp_server(fake.app())
    runs = _capture_runs(monkeypatch)
    ns = _ns(
        server,
        *("--num-prompts", "8", "--random-input-len", "48", "--random-output-len", "16"),
        *("--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json"),
        *("--plot-dir", str(tmp_path / "plots"), "--accelerators", "2"),
    )
    assert await serve.run(ns) == 0
    r = _load(tmp_path / "r.json")
    assert r["model_id"] == MODEL  # --model defaults to the first id of GET /v1/models
    assert all(b["model"] == MODEL and b["max_tokens"] == 16 for b in fake.bodies)
    assert all(b["stream_options"] == {"include_usage": True} for b in fake.bodies)
    assert all("ignore_eos" not in b for b in fake.bodies)
    assert (r["completed"], r["failed"], r["errors_by_status"]) == (8, 0, {})
    # Tokens come from usage (2 per chunk), not from counting chunks or re-tokenizing.
    assert r["total_output_tokens"] == 8 * 16
    assert r["output_throughput"] == pytest.approx(8 * 16 / r["duration"], rel=1e-12)
    assert r["request_throughput"] == pytest.approx(8 / r["duration"], rel=1e-12)
    total = (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"]
    assert r["total_token_throughput"] == pytest.approx(total, rel=1e-12)
    assert r["per_accelerator"]["output_throughput"] == pytest.approx(r["output_throughput"] / 2)
    assert r["cache_hit_rate"] == pytest.approx(8 * 24 / r["total_input_tokens"], rel=1e-12)
    # Random prompts re-encode to the requested 48 tokens; the rest is the fake's template.
    # Tolerance: 0.5 token on the mean, for a prompt whose length-fixing rounds ran out.
    assert r["mean_prompt_overhead_tokens"] == pytest.approx(TEMPLATE_OVERHEAD, abs=0.5)
    _assert_matches_writes(fake, runs[0].outputs)
    m = r["metrics"]
    # Nominal schedule: TTFT 50 ms, then a chunk every 10 ms (8 chunks, 16 tokens), usage 60 ms
    # later. TTFT: at least 50 ms (the fake's clock starts after the client's), at most
    # 2·NOMINAL_TOL_MS late: connection setup and request parsing precede the fake's clock, and
    # a loaded 2-core machine delays them. Chunk gaps: ±NOMINAL_TOL_MS on a sum of gaps, spread
    # over its 7 gaps (or 15 tokens) for the means: the schedule is absolute, so lateness does
    # not add up.
    assert min(q["ttft_s"] for q in r["requests"]) >= 0.050
    assert 50 <= m["ttft"]["mean_ms"] <= 50 + 2 * NOMINAL_TOL_MS
    assert m["ttfct"]["mean_ms"] == pytest.approx(m["ttft"]["mean_ms"], abs=1e-9)
    assert m["itl"]["count"] == 8 * 7
    assert m["itl"]["mean_ms"] == pytest.approx(10, abs=NOMINAL_TOL_MS / 7)
    assert m["e2el"]["mean_ms"] - m["ttft"]["mean_ms"] == pytest.approx(70, abs=NOMINAL_TOL_MS)
    # TPOT = (E2E − TTFT) / (16 − 1): 70 ms over 15 tokens.
    assert m["tpot"]["mean_ms"] == pytest.approx(70 / 15, abs=NOMINAL_TOL_MS / 15)
    for q in r["requests"]:
        assert q["tpot_s"] == pytest.approx((q["e2el_s"] - q["ttft_s"]) / 15, rel=1e-9)
    # All 8 in flight at once: concurrency = Σ E2E / wall, at most 8. The wall adds the usage
    # tail and, on a loaded 2-core machine, the client's own start-up (4.97 seen under the full
    # suite), so the bound below only rules out requests run one after another (~1).
    e2e_sum = sum(q["e2el_s"] for q in r["requests"])
    assert r["concurrency"] == pytest.approx(e2e_sum / r["duration"], rel=1e-9)
    assert 3.0 < r["concurrency"] <= 8.0
    assert r["max_concurrent_requests"] == 8
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms"):
        assert key in r  # vLLM's flat keys
    plots = sorted((tmp_path / "plots").iterdir())
    assert [p.name for p in plots] == ["r_latency_cdf.png", "r_ttft_over_time.png"]
    for p in plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000


async def test_reasoning_then_content(
    aiohttp_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeOpenAI(lambda i: Plan(num_chunks=6, num_reasoning_chunks=3))
    server = await aiohttp_server(fake.app())
    runs = _capture_runs(monkeypatch)
    out = tmp_path / "r.json"
    ns = _ns(
        server,
        *("--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "6"),
        *("--result-dir", str(tmp_path), "--result-filename", out.name),
    )
    assert await serve.run(ns) == 0
    m = _load(out)["metrics"]
    _assert_matches_writes(fake, runs[0].outputs)
    # TTFT at the first (reasoning) chunk; TTFCT at the first content chunk, the 4th write.
    for o in runs[0].outputs:
        writes = fake.token_times[int(o.reasoning.split(".")[0][1:])]
        assert 0 <= o.start_time + o.ttfct - writes[3] <= DELIVERY_TOL_S
        assert o.reasoning.count(" ") == 3 and o.content.count(" ") == 3
    # Nominal: TTFCT − TTFT = 3 chunks of 10 ms.
    assert 50 <= m["ttft"]["mean_ms"] <= 50 + 2 * NOMINAL_TOL_MS
    assert m["ttfct"]["mean_ms"] - m["ttft"]["mean_ms"] == pytest.approx(30, abs=NOMINAL_TOL_MS)
    assert m["itl"]["count"] == 4 * 5  # reasoning chunks are token-bearing chunks too


async def test_completions_backend_payload_and_ignore_eos(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    fake = FakeOpenAI(lambda i: Plan(num_chunks=4))
    server = await aiohttp_server(fake.app())
    ns = _ns(
        server,
        *("--backend", "openai", "--model", "m", "--ignore-eos", "--num-prompts", "3"),
        *("--random-input-len", "16", "--random-output-len", "4"),
        *("--result-dir", str(tmp_path), "--result-filename", "r.json"),
    )
    assert await serve.run(ns) == 0
    assert fake.paths == ["/v1/completions"] * 3
    for body in fake.bodies:
        assert body["model"] == "m" and isinstance(body["prompt"], str)
        assert (body["max_tokens"], body["ignore_eos"], body["min_tokens"]) == (4, True, 4)
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    r = _load(tmp_path / "r.json")
    assert (r["completed"], r["total_output_tokens"], r["endpoint"]) == (3, 12, "/v1/completions")


async def test_goodput_counts_requests_within_every_slo(
    aiohttp_server: Any, tmp_path: Path
) -> None:
    # Every 4th request has a 400 ms TTFT, the others 50 ms; the 200 ms SLO is 150 ms from both
    # (a loaded machine adds tens of ms at most).
    fake = FakeOpenAI(lambda i: Plan(ttft_s=0.400 if i % 4 == 0 else 0.050, num_chunks=4))
    server = await aiohttp_server(fake.app())
    ns = _ns(
        server,
        *("--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "4"),
        *("--goodput", "ttft:200", "tpot:100"),
        *("--result-dir", str(tmp_path), "--result-filename", "r.json"),
    )
    assert await serve.run(ns) == 0
    r = _load(tmp_path / "r.json")
    assert r["goodput_slos_ms"] == {"ttft": 200.0, "tpot": 100.0}
    assert r["num_good_requests"] == 6
    assert r["request_goodput"] == pytest.approx(6 / r["duration"], rel=1e-12)


async def test_errors_are_counted_by_status(
    aiohttp_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plans = {0: Plan(status=500), 1: Plan(status=429), 2: Plan(status=429), 3: Plan(drop=True)}
    plans[4] = Plan(stall_s=2.0)  # past --timeout 0.5
    plans[5] = Plan(stream_error=True)
    fake = FakeOpenAI(lambda i: plans.get(i, Plan(num_chunks=3)))
    server = await aiohttp_server(fake.app())
    ns = _ns(
        server,
        *("--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "3"),
        *("--max-concurrency", "1", "--timeout", "0.5"),  # one at a time: index = send order
        *("--result-dir", str(tmp_path), "--result-filename", "r.json"),
    )
    assert await serve.run(ns) == 0
    r = _load(tmp_path / "r.json")
    expected = {"500": 1, "429": 2, "connection": 1, "timeout": 1, "stream_error": 1}
    assert (r["completed"], r["failed"], r["errors_by_status"]) == (2, 6, expected)
    assert r["total_output_tokens"] == 2 * 3  # failed requests add no tokens
    failed = [q for q in r["requests"] if not q["success"]]
    assert sorted(q["error"] for q in failed) == sorted(
        k for k, n in expected.items() for _ in range(n)
    )
    assert "fake failure" in next(q["error_detail"] for q in failed if q["error"] == "500")
    table = capsys.readouterr().out
    assert "errors (429):" in table and "Failed requests:" in table


async def test_multi_turn_sends_received_replies(aiohttp_server: Any, tmp_path: Path) -> None:
    fake = FakeOpenAI(lambda i: Plan(num_chunks=3, ttft_s=0.010, itl_s=0.005))
    server = await aiohttp_server(fake.app())
    ns = _ns(
        server,
        *("--dataset-name", "multi-turn", "--multi-turn-num-conversations", "2"),
        *("--multi-turn-turns", "3", "--multi-turn-user-len", "12", "--multi-turn-output-len", "3"),
        *("--result-dir", str(tmp_path), "--result-filename", "r.json"),
    )
    assert await serve.run(ns) == 0
    r = _load(tmp_path / "r.json")
    assert (r["num_sessions"], r["num_prompts"], r["completed"]) == (2, 6, 6)
    # Group the fake's requests into conversations by their first user message.
    conversations: dict[str, list[int]] = {}
    for i, body in enumerate(fake.bodies):
        conversations.setdefault(body["messages"][0]["content"], []).append(i)
    assert sorted(len(v) for v in conversations.values()) == [3, 3]
    for indices in conversations.values():
        indices.sort(key=lambda i: len(fake.bodies[i]["messages"]))
        for turn, i in enumerate(indices):
            messages = fake.bodies[i]["messages"]
            assert [m["role"] for m in messages] == ["user", "assistant"] * turn + ["user"]
            for k in range(turn):
                earlier = fake.bodies[indices[k]]["messages"]
                assert messages[2 * k] == earlier[-1]  # the earlier turn's user message
                assert messages[2 * k + 1]["content"] == fake.replies[indices[k]]
            if turn:  # sent only after the previous turn's stream ended
                assert fake.received_at[i] >= fake.finished_at[indices[turn - 1]]
    # Requested prompt tokens grow by the user text plus the reply tokens of earlier turns.
    by_turn = sorted(r["requests"], key=lambda q: (q["session"], q["turn"]))
    assert [q["requested_prompt_tokens"] for q in by_turn] == [12, 27, 42] * 2


def _shared_len(a: str, b: str) -> int:
    """Length of the common leading text of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _write_trace(path: Path, records: list[tuple[int, int, int, list[int]]]) -> Path:
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h})
        for t, n, o, h in records
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(("rate", "scale"), [("inf", 1.0), ("20", 0.5)])
async def test_trace_replay_honours_timestamps(
    aiohttp_server: Any, tmp_path: Path, rate: str, scale: float
) -> None:
    fake = FakeOpenAI(lambda i: Plan(num_chunks=2, ttft_s=0.005, itl_s=0.005))
    server = await aiohttp_server(fake.app())
    # Mean gap of this trace: 300 ms / 3 = 100 ms (10 req/s); --request-rate 20 halves it.
    trace = _write_trace(
        tmp_path / "trace.jsonl",
        [
            (1000, 600, 2, [7, 8]),
            (1100, 700, 2, [7, 8]),
            (1250, 300, 2, [9]),
            (1300, 520, 2, [7, 9]),
        ],
    )
    ns = _ns(
        server,
        *("--dataset-name", "trace", "--dataset-path", str(trace), "--request-rate", rate),
        *("--result-dir", str(tmp_path), "--result-filename", "r.json"),
    )
    assert await serve.run(ns) == 0
    r = _load(tmp_path / "r.json")
    assert r["completed"] == 4
    # Send offsets follow the trace: never early, at most 45 ms late (wake-ups on a loaded
    # 2-core machine; the schedule is absolute, so lateness does not add up). Record order =
    # send order here. Unscaled and scaled schedules differ by 50 ms or more.
    expected = [0.0, 0.100 * scale, 0.250 * scale, 0.300 * scale]
    offsets = sorted(q["send_offset_s"] for q in r["requests"])
    assert all(e - 1e-3 <= o <= e + 0.045 for o, e in zip(offsets, expected, strict=True))
    by_time = sorted(r["requests"], key=lambda q: q["send_offset_s"])
    assert [q["session"] for q in by_time] == [0, 1, 2, 3]  # trace order
    assert [q["requested_output_tokens"] for q in r["requests"]] == [2, 2, 2, 2]
    # Equal hash ids give equal text: every record but record 2 starts with block 7 (512
    # tokens, thousands of characters); record 2 starts with block 9 instead.
    prompts = [b["messages"][0]["content"] for b in fake.bodies]
    assert _shared_len(prompts[0], prompts[1]) > 1000
    assert _shared_len(prompts[0], prompts[3]) > 1000
    assert _shared_len(prompts[0], prompts[2]) < 100


async def test_sweep_max_concurrency(
    aiohttp_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    observed: list[int] = []
    fake = FakeOpenAI(lambda i: Plan(num_chunks=3, ttft_s=0.020))
    server = await aiohttp_server(fake.app())
    ns = _ns(
        server,
        *("--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "3"),
        *("--sweep-max-concurrency", "1,3", "--accelerators", "1"),
        *("--accelerator-hour-cost", "2.0", "--price-input-per-m", "0.5"),
        *("--price-output-per-m", "2.0", "--price-cached-input-per-m", "0.1"),
        *("--result-dir", str(tmp_path), "--result-filename", "sweep.json"),
        *("--plot-dir", str(tmp_path)),
    )

    async def spy(*args: Any, **kwargs: Any) -> RunResult:
        fake.max_in_flight = 0
        result = await run_benchmark(*args, **kwargs)
        observed.append(fake.max_in_flight)
        return result

    monkeypatch.setattr(serve, "run_benchmark", spy)
    assert await serve.run(ns) == 0
    assert observed == [1, 3]  # the semaphore bounds requests in flight
    r = _load(tmp_path / "sweep.json")
    assert (r["kind"], r["sweep_parameter"], r["sweep_values"]) == (
        "sweep",
        "max_concurrency",
        [1, 3],
    )
    assert [run["max_concurrency"] for run in r["runs"]] == [1, 3]
    assert [run["seed"] for run in r["runs"]] == [1, 2]  # fresh prompts per point
    econ = r["runs"][0]["economics"]
    assert econ["cost_per_hour"] == 2.0 and econ["margin"] is not None
    plot = tmp_path / "sweep_throughput_vs_latency.png"
    assert plot.read_bytes()[:4] == b"\x89PNG" and plot.stat().st_size > 1000
