"""Prefill/decode disaggregation with real processes (server/kv_transfer.py, server/pairing.py):
a prefill node and a decode node (and a coordinator over them, `--prefill-node/--decode-node`)
give one engine's tokens and logprobs; kill -9 of either node at each phase, a client that goes
away, a lease that runs out and a storm of these end every request with an error within a
bounded time and leave no block or slot in use on any surviving node."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import processes
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from oracle import oracle_prompts
from processes import clean_env, free_port
from prometheus_client.parser import text_string_to_metric_families
from rank_workers import drain

from deepinfer.config import Config
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.model.tiny import make_tiny_model
from deepinfer.server.node_client import NodeClient
from deepinfer.server.pairing import PairedBackend, PairKeys
from deepinfer.server.protocol import GenerateRequest, SamplingOptions
from deepinfer.server.routing import NodeEntry
from deepinfer.server.serve import create_serve_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "deepinfer-tiny"
THINK, USER, ASSISTANT = 128821, 128803, 128804
LEASE_S = 4.0
# Small blocks (prompts of many blocks, state snapshots in play), small chunks and a pause after
# each chunk sent (a transfer lasts about a second: tests act while it is in flight).
ENGINE = {
    "cache": {"block_size": 16, "num_blocks": 512, "snapshot_interval_blocks": 4},
    "scheduler": {"max_num_batched_tokens": 64},
    "kernel": {"num_threads": 1},
}
NODE_FLAGS = ("--device", "cpu", "--block-size", "16", "--num-blocks", "512",
              "--snapshot-interval-blocks", "4", "--max-num-batched-tokens", "64",
              "--num-threads", "1", "--checksum", "--lease-s", str(LEASE_S),
              "--chunk-mib", "0.004")  # fmt: skip
PAUSE_S = "0.05"


class Cluster(processes.Cluster):
    """A decode node, a prefill node and a coordinator over them, as processes logging into
    ``folder``; ``restart`` brings a killed node back on its port."""

    def __init__(self, folder: Path, model: Path) -> None:
        super().__init__(folder, model, ("decode", "prefill", "coordinator"))

    def start(self, name: str) -> None:
        if name == "coordinator":
            args = ["coordinator", "--port", str(self.ports[name]),
                    "--internal-port", str(free_port()), "--max-model-len", "8192",
                    "--node-probe-interval-s", "0.2",
                    "--prefill-node", self.url("prefill"),
                    "--decode-node", self.url("decode")]  # fmt: skip
        else:
            args = ["node", "--model", str(self.model), "--role", name,
                    "--port", str(self.ports[name]), *NODE_FLAGS]  # fmt: skip
        env = clean_env(OMP_NUM_THREADS="1", DEEPINFER_TEST_TRANSFER_PAUSE_S=PAUSE_S)
        self.launch(name, args, env)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.processes[name].popen.send_signal(sig)
        if sig == signal.SIGKILL:
            self.processes[name].popen.wait()

    def restart(self, name: str) -> None:
        self.start(name)
        self.wait_ready(name, "coordinator")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / MODEL)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("disagg"), tiny_dir)
    for name in ("decode", "prefill", "coordinator"):
        cluster.start(name)
    try:
        cluster.wait_ready("decode", "prefill", "coordinator")
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def mixed(tiny_dir: Path) -> LLMEngine:
    """One engine computing whole requests: what the pair must reproduce."""
    model = {"device": "cpu", "path": str(tiny_dir)}
    return LLMEngine(Config.load(overrides={**ENGINE, "model": model}))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


# ---- exactness ---------------------------------------------------------------------------------

_KEYS = PairKeys()
_ids = iter(range(10**6))


async def _pair_run(
    cluster: Cluster, session: aiohttp.ClientSession, prompt: list[int], sampling: SamplingOptions
) -> tuple[list[int], list[dict[int, float]], int]:
    """(tokens, logprobs, prompt tokens the prefill node had cached) through the coordinator's
    PairedBackend over the two node processes."""
    prefill = NodeEntry("p", NodeClient(cluster.url("prefill"), session=session), 8192)
    decode = NodeEntry("d", NodeClient(cluster.url("decode"), session=session), 8192)
    request = GenerateRequest(request_id=f"pair-{next(_ids)}", prompt_token_ids=prompt,
                              sampling=sampling)  # fmt: skip
    tokens, logprobs, cached = [], [], 0
    async for delta in PairedBackend(prefill, decode, _KEYS).generate(request):
        tokens += delta.token_ids
        logprobs += delta.logprobs or []
        cached = max(cached, delta.num_cached_tokens)
    return tokens, logprobs, cached


def _mixed_run(engine: LLMEngine, prompt: list[int], sampling: SamplingOptions) -> tuple:
    engine.add_request(f"mixed-{next(_ids)}", prompt, sampling.to_sampling_params())
    return drain(engine)


def _assert_same(got: tuple, want: tuple) -> None:
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1]) == len(want[0])
    for g, w in zip(got[1], want[1], strict=True):
        assert g.keys() == w.keys()
        assert all(abs(g[k] - w[k]) <= 1e-5 for k in w), (g, w)


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 128000) for _ in range(n)]


GREEDY = SamplingOptions(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


async def test_a_pair_of_node_processes_gives_one_engines_tokens_and_logprobs(
    cluster: Cluster, session: aiohttp.ClientSession, mixed: LLMEngine
) -> None:
    prompts = [
        _prompt(5),  # shorter than a block
        _prompt(32),  # exactly two blocks
        _prompt(37),  # not aligned
        _prompt(150),  # many blocks: chunked, a state snapshot every 4 blocks
        [0, *_prompt(20), USER, *_prompt(9, 1), ASSISTANT, THINK],  # thinking mode
    ]
    for prompt in prompts:
        got = await _pair_run(cluster, session, prompt, GREEDY)
        _assert_same(got[:2], _mixed_run(mixed, prompt, GREEDY))
    prompt = _prompt(70, 3)
    await _pair_run(cluster, session, prompt, GREEDY)
    *got, cached = await _pair_run(cluster, session, prompt, GREEDY)  # from the prefix cache
    assert cached >= 64
    _assert_same(got, _mixed_run(mixed, prompt, GREEDY))
    seeded = SamplingOptions(temperature=0.8, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True,
                             logprobs=1)  # fmt: skip
    got = await _pair_run(cluster, session, _prompt(21, 4), seeded)
    _assert_same(got[:2], _mixed_run(mixed, _prompt(21, 4), seeded))
    # A request that ends with its first token ends on the prefill node.
    one = SamplingOptions(temperature=0.0, max_tokens=1, logprobs=0)
    assert (await _pair_run(cluster, session, _prompt(9), one))[0] == _mixed_run(
        mixed, _prompt(9), one
    )[0]
    await _assert_idle(session, cluster, "prefill", "decode")


async def test_the_oracle_checkpoint_over_a_pair_gives_one_engines_tokens_and_logprobs(
    tmp_path: Path, oracle_hf_dir: Path, session: aiohttp.ClientSession
) -> None:
    pair = Cluster(tmp_path, oracle_hf_dir)
    try:
        pair.start("decode")
        pair.start("prefill")
        model = {"device": "cpu", "path": str(oracle_hf_dir)}
        engine = LLMEngine(Config.load(overrides={**ENGINE, "model": model}))
        pair.wait_ready("decode", "prefill")
        for prompt in oracle_prompts()[:2]:
            got = await _pair_run(pair, session, prompt, GREEDY)
            _assert_same(got[:2], _mixed_run(engine, prompt, GREEDY))
    finally:
        pair.stop()


async def test_the_openai_client_through_the_coordinator_gets_serves_completion(
    cluster: Cluster, session: aiohttp.ClientSession, mixed: LLMEngine
) -> None:
    client = openai.AsyncOpenAI(base_url=cluster.url("coordinator") + "/v1", api_key="k",
                                max_retries=0)  # fmt: skip
    messages = [{"role": "user", "content": "Tell me about the sea"}]
    extra = {"thinking": {"type": "disabled"}, "ignore_eos": True}
    got = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                               temperature=0, extra_body=extra)  # fmt: skip
    text = ""
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=extra, stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert got.choices[0].message.content == text and got.usage.completion_tokens == 12
    # A structured answer: the first token under the grammar on the prefill node, the rest on
    # the decode node under the matcher it rebuilt.
    schema = {"type": "object", "properties": {"c": {"enum": ["red", "green"]}},
              "required": ["c"], "additionalProperties": False}  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "colour", "schema": schema}}
    structured = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 1.0,
                  "seed": 3, "extra_body": {"thinking": {"type": "disabled"}},
                  "response_format": response_format}  # fmt: skip
    got_structured = await client.chat.completions.create(**structured)
    assert json.loads(got_structured.choices[0].message.content)["c"] in ("red", "green")
    # `deepinfer serve`'s answers: the same engine, whole, behind the same frontend.
    async with TestServer(create_serve_app(AsyncEngine(mixed), mixed.config)) as server:
        serve_client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k",
                                          max_retries=0)  # fmt: skip
        want = await serve_client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=extra
        )
        want_structured = await serve_client.chat.completions.create(**structured)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got_structured.choices[0].message.content == want_structured.choices[0].message.content
    # The coordinator splits a pair's TTFT and counts its requests.
    async with session.get(cluster.url("coordinator") + "/metrics") as response:
        families = {f.name: f for f in text_string_to_metric_families(await response.text())}
    phase_samples = families["deepinfer_handoff_phase_seconds"].samples
    phases = {s.labels["phase"]: s.value for s in phase_samples if s.name.endswith("_count")}
    assert phases["prefill"] == phases["transfer"] == phases["first_decode"] == 3
    pair_samples = families["deepinfer_pair_requests"].samples
    outcomes = {s.labels["outcome"]: s.value for s in pair_samples if s.name.endswith("_total")}
    assert outcomes == {"handed_off": 3.0}
    samples = await _metrics(session, cluster, "prefill")
    assert samples[("deepinfer_kv_transfer_bytes_total", "send", "host")] > 0
    assert (await _metrics(session, cluster, "decode"))[
        ("deepinfer_kv_transfer_bytes_total", "recv", "host")
    ] == samples[("deepinfer_kv_transfer_bytes_total", "send", "host")]


# ---- failures --------------------------------------------------------------------------------


def _chat(max_tokens: int, words: int = 4) -> dict[str, Any]:
    """A streamed chat request; its own cache salt, so that no prompt of it is ever served
    from the prefill node's prefix cache (each prefill takes its full time)."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": " ".join(["sea"] * words)}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "thinking": {"type": "disabled"},
        "cache_salt": uuid.uuid4().hex,
    }


async def _stream(session: aiohttp.ClientSession, cluster: Cluster, body: dict) -> tuple[int, str]:
    async with session.post(cluster.url("coordinator") + "/v1/chat/completions", json=body) as r:
        return r.status, await r.text()


def _failed(status: int, text: str) -> bool:
    """An error: a status, or (once the stream began) an error event and no [DONE]."""
    return status >= 500 or ('"error"' in text and "[DONE]" not in text)


async def _metrics(session: aiohttp.ClientSession, cluster: Cluster, name: str) -> dict:
    async with session.get(cluster.url(name) + "/metrics") as response:
        text = await response.text()
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name if "direction" not in s.labels else (s.name, s.labels["direction"])
            if "reason" in s.labels:
                key = (s.name, s.labels["direction"], s.labels["reason"])
            if "path" in s.labels:
                key = (s.name, s.labels["direction"], s.labels["path"])
            out[key] = s.value
    return out


async def _wait_for(session, cluster, name: str, key, value: float, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        samples = await _metrics(session, cluster, name)
        if samples.get(key) == value:
            return
        assert time.monotonic() < deadline, f"{name}: {key} never {value}: {samples.get(key)}"
        await asyncio.sleep(0.03)


IDLE = ("deepinfer_num_requests_running", "deepinfer_num_requests_waiting",
        "deepinfer_kv_blocks_used", "deepinfer_state_slots_used")  # fmt: skip


async def _assert_idle(session, cluster, *names: str, timeout_s: float = LEASE_S + 6) -> None:
    """Every ``names`` node holds no request, block or slot within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            samples = await _metrics(session, cluster, name)
            held = {k: samples[k] for k in IDLE if samples[k]}
            in_flight = sum(
                samples[("deepinfer_kv_transfer_in_flight", d)] for d in ("send", "recv")
            )
            if not held and not in_flight:
                break
            assert time.monotonic() < deadline, f"{name} still holds {held}, {in_flight} transfers"
            await asyncio.sleep(0.05)


async def _within(task: asyncio.Task, timeout_s: float, cluster: Cluster) -> Any:
    try:
        return await asyncio.wait_for(task, timeout_s)
    except TimeoutError:
        raise AssertionError(f"no answer within {timeout_s} s\n{cluster.logs()}") from None


IN_FLIGHT = "deepinfer_kv_transfer_in_flight"
FAILED = "deepinfer_kv_transfer_failures_total"


def _count(after: dict, before: dict, *key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


# Where each phase shows: (the node, the sample that says the request is in that phase there).
_PHASES = {
    "prefill": ("prefill", "deepinfer_num_requests_running"),
    "transfer": ("decode", (IN_FLIGHT, "recv")),
    "decode": ("decode", "deepinfer_num_requests_running"),
}


@pytest.mark.parametrize(
    ("victim", "phase"),
    [("decode", "transfer"), ("decode", "decode"), ("prefill", "prefill"), ("prefill", "transfer")],
)
async def test_kill_9_of_a_node(cluster, session, victim: str, phase: str) -> None:
    """The client gets an error within a bounded time; the surviving node holds nothing once
    idle; mid-transfer, the survivor's side of it failed as the peer's (at once, not at the
    lease), and nothing received was decoded from."""
    survivor = "prefill" if victim == "decode" else "decode"
    body = _chat(200) if phase == "decode" else _chat(8, words=600)
    request = asyncio.create_task(_stream(session, cluster, body))
    await _wait_for(session, cluster, *_PHASES[phase], 1.0)
    before = await _metrics(session, cluster, survivor)
    cluster.kill(victim)
    killed = time.monotonic()
    assert _failed(*await _within(request, 15.0, cluster))
    assert time.monotonic() - killed < 10.0
    await _assert_idle(session, cluster, survivor)
    direction = "send" if survivor == "prefill" else "recv"
    failed = _count(await _metrics(session, cluster, survivor), before, FAILED, direction, "peer")
    assert failed == (phase == "transfer")
    cluster.restart(victim)


@pytest.mark.parametrize("phase", ["prefill", "transfer"])
async def test_a_client_that_goes_away(cluster, session, phase: str) -> None:
    request = asyncio.create_task(_stream(session, cluster, _chat(8, words=600)))
    if phase == "prefill":
        await _wait_for(session, cluster, "prefill", "deepinfer_num_requests_running", 1.0)
    else:
        await _wait_for(session, cluster, "prefill", (IN_FLIGHT, "send"), 1.0)
    request.cancel()
    await _assert_idle(session, cluster, "prefill", "decode")
    status, text = await _stream(session, cluster, _chat(4))
    assert status == 200 and "[DONE]" in text


async def test_a_lease_that_runs_out(cluster, session) -> None:
    """The decode node stops (SIGSTOP) after its reservation: it never collects, so the prefill
    node gives the state up after the lease and the client gets an error; once the decode node
    runs again it finds its stream gone and gives its reservation back."""
    assert (await _stream(session, cluster, _chat(2)))[0] == 200  # the pair is joined
    before = await _metrics(session, cluster, "prefill")
    request = asyncio.create_task(_stream(session, cluster, _chat(8, words=300)))
    await _wait_for(session, cluster, "prefill", "deepinfer_num_requests_running", 1.0)
    cluster.kill("decode", signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert _failed(*await _within(request, LEASE_S + 10, cluster))
        assert LEASE_S - 1 < time.monotonic() - started < LEASE_S + 8
        after = await _metrics(session, cluster, "prefill")
        assert _count(after, before, FAILED, "send", "timeout") == 1
        await _assert_idle(session, cluster, "prefill")
    finally:
        cluster.kill("decode", signal.SIGCONT)
    await _assert_idle(session, cluster, "decode")
    cluster.wait_ready("coordinator")
    status, text = await _stream(session, cluster, _chat(4))
    assert status == 200 and "[DONE]" in text, cluster.logs()


async def test_nodes_restarted_while_idle_pair_again_at_once(cluster, session) -> None:
    """A node restarted (SIGTERM, then started again) leaves its partner a pair with a process
    that is gone: the next request builds a new one, with no failure and no wait."""
    for name in ("decode", "prefill"):
        before = {n: await _metrics(session, cluster, n) for n in ("prefill", "decode")}
        cluster.kill(name, signal.SIGTERM)
        assert cluster.processes[name].popen.wait(timeout=30) == 0
        cluster.restart(name)
        started = time.monotonic()
        status, text = await _stream(session, cluster, _chat(4))
        assert status == 200 and "[DONE]" in text, cluster.logs()
        assert time.monotonic() - started < LEASE_S
        survivor = "prefill" if name == "decode" else "decode"
        after = await _metrics(session, cluster, survivor)
        failures = {k: v - before[survivor].get(k, 0) for k, v in after.items() if k[0] == FAILED}
        assert not any(failures.values()), failures


async def test_a_storm_of_aborts_and_a_kill(cluster, session) -> None:
    """Requests of every length, half of them abandoned at random points, and kill -9 of the
    decode node in the middle: each ends (done, error or abandoned) in bounded time, and the
    nodes hold nothing once idle; the pair serves again after the restart."""
    rng = random.Random(11)

    async def one(i: int) -> str:
        body = _chat(rng.choice([1, 4, 30]), words=rng.choice([3, 100, 400]))
        task = asyncio.create_task(_stream(session, cluster, body))
        if i % 2:
            await asyncio.sleep(rng.uniform(0.0, 2.0))
            task.cancel()
            return "abandoned"
        status, text = await task
        return "done" if status == 200 and "[DONE]" in text else "error"

    async def long() -> str:  # still decoding at the kill
        status, text = await _stream(session, cluster, _chat(400))
        return "done" if status == 200 and "[DONE]" in text else "error"

    storm = asyncio.gather(long(), *(one(i) for i in range(16)), return_exceptions=True)
    await asyncio.sleep(1.5)
    cluster.kill("decode")
    results = await _within(asyncio.ensure_future(storm), 60.0, cluster)
    assert sorted(set(results)) == ["abandoned", "done", "error"], results
    await _assert_idle(session, cluster, "prefill")
    cluster.restart("decode")
    await _assert_idle(session, cluster, "decode")
    status, text = await _stream(session, cluster, _chat(4))
    assert status == 200 and "[DONE]" in text
