"""The node's internal HTTP API through real HTTP (aiohttp_client) and NodeClient: token
streams, aborts and text-side finishes, client disconnects freeing every block, auth, refused
requests, /health /ready /metrics, step failures, registration with heartbeats, and the built-in
tiny model end to end."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from scripted_executor import ScriptedExecutor
from test_async_engine import assert_all_freed, wait_until_idle

from deepinfer.config import CacheConfig, Config, NodeConfig, SchedulerConfig, ServerConfig
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.server.node import create_node_app
from deepinfer.server.node_client import NodeClient, NodeError
from deepinfer.server.node_metrics import NodeMetrics
from deepinfer.server.protocol import (
    FRAME_CONTENT_TYPE,
    MESSAGE_CONTENT_TYPE,
    FrameReader,
    GenerateRequest,
    NodeHeartbeat,
    NodeLease,
    NodeRegistration,
    OutputConstraint,
    SamplingOptions,
    TokenDelta,
    decode,
    encode,
)

pytestmark = pytest.mark.asyncio

EOS = 1
SCRIPTS = {7: [10, 11, 12, 13], 8: [20, 21], 9: list(range(100, 400))}
TOKEN = "s3cret"


@dataclasses.dataclass
class Node:
    client: Any  # aiohttp TestClient
    engine: AsyncEngine
    executor: ScriptedExecutor
    api: NodeClient


async def start_node(
    aiohttp_client: Callable[..., Any],
    executor: ScriptedExecutor | None = None,
    num_blocks: int = 64,
    server: ServerConfig | None = None,
    **node_keys: Any,
) -> Node:
    executor = executor or ScriptedExecutor(SCRIPTS, eos_token_id=EOS, num_blocks=num_blocks)
    config = Config(
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=48, max_num_batched_tokens=64),
        server=server or ServerConfig(),
        node=NodeConfig(node_id="n0", **node_keys),
    )
    engine = AsyncEngine(LLMEngine(config, executor=executor), max_step_s=config.node.max_step_s)
    client = await aiohttp_client(create_node_app(engine, config))
    token = config.server.node_token
    api = NodeClient(str(client.make_url("")), token=token, session=client.session)
    return Node(client, engine, executor, api)


def gen_request(request_id: str, prompt: list[int], **sampling: Any) -> GenerateRequest:
    sampling = {"temperature": 0.0, "max_tokens": 300} | sampling
    return GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=SamplingOptions(**sampling)
    )


async def collect(api: NodeClient, request: GenerateRequest) -> list[TokenDelta]:
    return [frame async for frame in api.generate(request)]


async def scrape(node: Node) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """deepinfer_* samples by (name, labels other than the node's own three), each carrying
    them; every vllm:* sample equals its deepinfer_* one."""
    response = await node.client.get("/metrics")
    assert response.status == 200
    samples, mirrored = {}, {}
    own = {"component": "node", "model_name": "deepinfer-tiny", "node": "n0"}
    for family in text_string_to_metric_families(await response.text()):
        for sample in family.samples:
            assert {k: sample.labels.pop(k) for k in own} == own, sample
            key = (sample.name, tuple(sorted(sample.labels.items())))
            (mirrored if sample.name.startswith("vllm:") else samples)[key] = sample.value
    expected = {}
    for (name, labels), value in samples.items():
        for family, vllm_families in NodeMetrics.vllm_names.items():
            suffix = name.removeprefix(family)
            if suffix in ("", "_total", "_bucket", "_sum", "_count"):
                expected |= {(vllm + suffix, labels): value for vllm in vllm_families}
    assert mirrored == expected
    return samples


async def test_generate_round_trip(aiohttp_client: Callable[..., Any]) -> None:
    node = await start_node(aiohttp_client)
    frames = await collect(node.api, gen_request("a", [3, 4, 7], logprobs=1))
    assert [(f.token_ids, f.finish_reason) for f in frames] == [
        ([10], None),
        ([11], None),
        ([12], None),
        ([13], None),
        ([EOS], "stop"),
    ]
    # Counts ride on the first and the last frame only.
    counts = [(f.num_prompt_tokens, f.num_cached_tokens) for f in frames]
    assert counts == [(3, 0), (0, 0), (0, 0), (0, 0), (3, 0)]
    assert frames[0].logprobs == [{10: -0.25, 11: -2.0}]
    assert_all_freed(node.engine)


async def test_abort_and_finish_through_the_internal_api(
    aiohttp_client: Callable[..., Any],
) -> None:
    node = await start_node(aiohttp_client)

    async def run(request_id: str) -> list[TokenDelta]:
        frames = []
        async for frame in node.api.generate(gen_request(request_id, [9])):
            frames.append(frame)
            if len(frames) == 2:
                if request_id == "a":
                    await node.api.abort(["a", "unknown"])
                else:
                    await node.api.finish("b", "</stop>")
        return frames

    aborted, finished = await asyncio.gather(run("a"), run("b"))
    assert (aborted[-1].finish_reason, aborted[-1].stop_reason) == ("abort", None)
    assert (finished[-1].finish_reason, finished[-1].stop_reason) == ("stop", "</stop>")
    assert finished[-1].num_prompt_tokens == 1
    assert_all_freed(node.engine)


async def test_client_disconnect_frees_every_block(aiohttp_client: Callable[..., Any]) -> None:
    node = await start_node(
        aiohttp_client, ScriptedExecutor(SCRIPTS, eos_token_id=EOS, step_delay_s=0.002)
    )
    response = await node.client.post("/internal/generate", data=encode(gen_request("a", [9] * 33)))
    assert response.status == 200 and response.headers["Content-Type"] == FRAME_CONTENT_TYPE
    reader, frames = FrameReader(), []
    while len(frames) < 3:
        frames += reader.feed(await response.content.readany())
    assert node.engine.engine.scheduler.block_manager.num_used_blocks >= 3  # 36+ positions / 16
    response.close()
    await wait_until_idle(node.engine)
    assert_all_freed(node.engine)
    # The same through NodeClient: leaving the iteration closes the response.
    async with contextlib.aclosing(node.api.generate(gen_request("b", [9] * 40))) as frames_b:
        assert (await anext(frames_b)).token_ids == [100]
    await wait_until_idle(node.engine)
    assert_all_freed(node.engine)
    samples = await scrape(node)
    assert samples["deepinfer_aborted_requests_total", ()] == 2


async def test_node_token_is_required_when_configured(aiohttp_client: Callable[..., Any]) -> None:
    node = await start_node(aiohttp_client, server=ServerConfig(node_token=TOKEN))
    assert len(await collect(node.api, gen_request("a", [8]))) == 3
    anonymous = NodeClient(node.api.base_url, session=node.client.session)
    wrong = NodeClient(node.api.base_url, token="guess", session=node.client.session)
    for api in (anonymous, wrong):
        with pytest.raises(NodeError) as info:
            await collect(api, gen_request("b", [8]))
        assert (info.value.status, info.value.message) == (401, "missing or wrong bearer token")
        with pytest.raises(NodeError) as info:
            await api.abort(["a"])
        assert info.value.status == 401
    assert await anonymous.health() and await anonymous.ready()  # probes stay open


async def test_metrics_key_guards_metrics(aiohttp_client: Callable[..., Any]) -> None:
    node = await start_node(aiohttp_client, server=ServerConfig(metrics_key="mk"))
    for headers, status in (({}, 401), ({"Authorization": "Bearer mk2"}, 401)):
        response = await node.client.get("/metrics", headers=headers)
        assert (response.status, response.headers["WWW-Authenticate"]) == (status, "Bearer")
    assert (await node.client.get("/metrics", headers={"Authorization": "Bearer mk"})).status == 200
    assert [(await node.client.get(path)).status for path in ("/health", "/ready")] == [200, 200]
    assert len(await collect(node.api, gen_request("a", [8]))) == 3  # no node token: open


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("json", "output constraints need a model with a tokenizer"),
        ("yaml", "unknown output constraint kind 'yaml'"),
    ],
)
async def test_output_constraints_without_a_tokenizer_are_refused(
    aiohttp_client: Callable[..., Any], kind: str, message: str
) -> None:
    """The scripted executor has no tokenizer, so no grammar (invalid schemas on the real tiny
    model: tests/test_constraints.py)."""
    node = await start_node(aiohttp_client)
    request = gen_request("a", [7])
    request.constraint = OutputConstraint(kind=kind, schema="")
    with pytest.raises(NodeError) as info:
        await collect(node.api, request)
    assert info.value.status == 400
    assert message in info.value.message
    request.constraint = OutputConstraint(kind="tool_call", schema="...")
    assert (await collect(node.api, request))[-1].finish_reason == "stop"


async def test_refused_requests(aiohttp_client: Callable[..., Any]) -> None:
    node = await start_node(aiohttp_client)
    response = await node.client.post("/internal/generate", data=b"\x93not a request")
    assert response.status == 400 and response.content_type == "application/x-msgpack"
    cases = [
        (gen_request("a", [7], temperature=-1.0), "temperature must be >= 0, got -1.0"),
        (gen_request("a", [5] * 4096), "max_model_len is 4096"),
        (gen_request("a", [200000]), "token ids [200000] are outside [0, 129280)"),
        # NaN passes every range check: refused as not finite. Big asks for alternatives are
        # capped (model.max_logprobs), or 129,279 of them would be megabytes per token.
        (gen_request("a", [7], repetition_penalty=float("nan")), "must be a finite number"),
        (gen_request("a", [7], logprobs=129279), "at most 20 (model.max_logprobs)"),
        (gen_request("a", [7], prompt_logprobs=21), "at most 20 (model.max_logprobs)"),
    ]
    for request, message in cases:
        with pytest.raises(NodeError) as info:
            await collect(node.api, request)
        assert info.value.status == 400 and message in info.value.message
    async with contextlib.aclosing(node.api.generate(gen_request("dup", [9]))) as frames:
        await anext(frames)
        with pytest.raises(NodeError) as info:
            await collect(node.api, gen_request("dup", [7]))
        assert (info.value.status, info.value.message) == (
            400,
            "request id 'dup' is already in use",
        )
    await wait_until_idle(node.engine)
    await node.engine.drain(0.0)
    with pytest.raises(NodeError) as info:
        await collect(node.api, gen_request("late", [7]))
    assert info.value.status == 503 and "shutting down" in info.value.message
    assert (await node.client.get("/ready")).status == 503


async def test_health_ready_and_metrics(aiohttp_client: Callable[..., Any]) -> None:
    node = await start_node(aiohttp_client)
    assert (await node.client.get("/health")).status == 200
    assert await node.api.ready()
    before = await scrape(node)
    assert before["deepinfer_prompt_tokens_total", ()] == 0
    await collect(node.api, gen_request("a", [2, 3, 7]))
    await collect(node.api, gen_request("b", [8], max_tokens=1))
    samples = await scrape(node)
    assert samples["deepinfer_prompt_tokens_total", ()] == 4
    assert samples["deepinfer_generation_tokens_total", ()] == 6
    assert samples["deepinfer_cached_prompt_tokens_total", (("tier", "device"),)] == 0
    assert samples["deepinfer_finished_requests_total", (("finished_reason", "stop"),)] == 1
    assert samples["deepinfer_finished_requests_total", (("finished_reason", "length"),)] == 1
    assert samples["deepinfer_request_queue_time_seconds_count", ()] == 2
    assert samples["deepinfer_step_time_seconds_count", ()] == 6  # 5 steps for "a", 1 for "b"
    # One step of "a"'s 3 prompt tokens, 4 of one decode token, one of "b"'s prompt token.
    assert samples["deepinfer_iteration_tokens_count", ()] == 6
    assert samples["deepinfer_iteration_tokens_sum", ()] == 3 + 4 + 1
    assert samples["deepinfer_iteration_tokens_bucket", (("le", "1.0"),)] == 5
    assert samples["deepinfer_request_prompt_tokens_sum", ()] == 4
    assert samples["deepinfer_request_prompt_tokens_bucket", (("le", "2.0"),)] == 1
    assert samples["deepinfer_request_generation_tokens_sum", ()] == 6
    for phase in ("prefill", "decode", "inference"):
        assert samples[f"deepinfer_request_{phase}_time_seconds_count", ()] == 2
    assert samples["deepinfer_num_requests_running", ()] == 0
    assert samples["deepinfer_kv_blocks_used", ()] == 0
    assert samples["deepinfer_preemptions_total", ()] == 0
    # The same 41-token prompt again: its 2 full blocks of 16 come from the prefix cache.
    prompt = [5] * 40 + [8]
    assert (await collect(node.api, gen_request("c", prompt)))[0].num_cached_tokens == 0
    frames = await collect(node.api, gen_request("d", prompt))
    assert (frames[0].num_cached_tokens, frames[-1].num_cached_tokens) == (32, 32)
    samples = await scrape(node)
    assert samples["deepinfer_cached_prompt_tokens_total", (("tier", "device"),)] == 32
    assert samples["deepinfer_prompt_tokens_total", ()] == 4 + 2 * 41


async def test_preemptions_are_counted_and_outputs_stay_exact(
    aiohttp_client: Callable[..., Any],
) -> None:
    # 4 blocks x 16 tokens: two requests of 20 + 30 tokens cannot both hold their blocks.
    node = await start_node(aiohttp_client, num_blocks=4)
    script = list(range(300, 330))
    node.executor.scripts = {6: script}
    requests = [gen_request(rid, [5] * 19 + [6], max_tokens=30) for rid in ("a", "b")]
    results = await asyncio.gather(*(collect(node.api, r) for r in requests))
    for frames in results:
        assert [t for f in frames for t in f.token_ids] == script
    samples = await scrape(node)
    assert samples["deepinfer_preemptions_total", ()] >= 1
    assert_all_freed(node.engine)


async def test_ready_turns_503_while_a_step_stalls(aiohttp_client: Callable[..., Any]) -> None:
    executor = ScriptedExecutor(SCRIPTS, eos_token_id=EOS, step_delay_s=0.4)
    node = await start_node(aiohttp_client, executor, max_step_s=0.1)
    assert await node.api.ready()
    task = asyncio.create_task(collect(node.api, gen_request("a", [8], max_tokens=1)))
    statuses = []
    while not task.done():  # one 0.4 s step: /ready is 503 from 0.1 s into it
        response = await node.client.get("/ready")
        statuses.append((response.status, await response.text()))
        await asyncio.sleep(0.02)
    assert (503, "engine loop not turning\n") in statuses
    assert (await node.client.get("/health")).status == 200
    assert (await task)[-1].finish_reason == "length"
    assert await node.api.ready()


async def test_failed_step_is_an_error_frame_and_the_node_keeps_serving(
    aiohttp_client: Callable[..., Any],
) -> None:
    node = await start_node(
        aiohttp_client, ScriptedExecutor(SCRIPTS, eos_token_id=EOS, step_delay_s=0.002)
    )
    frames = []
    with pytest.raises(NodeError) as info:
        async for frame in node.api.generate(gen_request("a", [9])):
            frames.append(frame)
            if len(frames) == 1:
                node.executor.num_failing_steps = 1
    assert info.value.status == 500
    assert "ScriptedStepError: scripted failure in step" in info.value.message
    tokens = [t for f in frames for t in f.token_ids]
    assert tokens == list(range(100, 100 + len(tokens))) and frames[-1].finish_reason is None
    assert [t for f in await collect(node.api, gen_request("b", [8])) for t in f.token_ids] == [
        20,
        21,
        EOS,
    ]
    samples = await scrape(node)
    assert samples["deepinfer_finished_requests_total", (("finished_reason", "error"),)] == 1
    assert_all_freed(node.engine)


async def test_unreachable_node_is_a_503() -> None:
    async with NodeClient("http://127.0.0.1:9") as api:
        with pytest.raises(NodeError) as info:
            await collect(api, gen_request("a", [7]))
        assert info.value.status == 503
        assert info.value.message.startswith("node http://127.0.0.1:9 unreachable")
        assert not await api.health()


async def test_registration_and_heartbeats(
    aiohttp_client: Callable[..., Any],
    aiohttp_server: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Register is refused once (401, retried), a heartbeat is answered 404 (the coordinator
    forgot the node), another 403 (its lease was replaced): each time the node registers again,
    and every heartbeat carries the lease of the registration before it. The refusal is logged
    without the bearer token."""
    seen: list[tuple[str, Any, str | None]] = []
    statuses = {"register": [401, 200, 200, 200], "heartbeat": [404, 403, 200]}
    done = asyncio.Event()

    def endpoint(kind: str, message_type: type) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.Response:
            message = decode(await request.read(), message_type)
            seen.append((kind, message, request.headers.get("Authorization")))
            status = statuses[kind].pop(0) if statuses[kind] else 200
            if len(seen) == 7:
                done.set()
            if kind == "register" and status == 200:
                lease = NodeLease(node_id="n0", lease_id=f"L{len(seen)}", heartbeat_timeout_s=1)
                return web.Response(body=encode(lease), content_type=MESSAGE_CONTENT_TYPE)
            return web.Response(status=status)

        return handle

    coordinator = web.Application()
    coordinator.router.add_post("/internal/register", endpoint("register", NodeRegistration))
    coordinator.router.add_post("/internal/heartbeat", endpoint("heartbeat", NodeHeartbeat))
    server = await aiohttp_server(coordinator)
    with caplog.at_level(logging.INFO, logger="deepinfer.server.node"):
        node = await start_node(
            aiohttp_client,
            server=ServerConfig(node_token=TOKEN),
            coordinator_internal_url=str(server.make_url("")),
            heartbeat_interval_s=0.01,
            advertise_url="http://node0:8100",
        )
        await asyncio.wait_for(done.wait(), 2.0)
    kinds = ["register", "register", "heartbeat", "register", "heartbeat", "register", "heartbeat"]
    assert [kind for kind, _, _ in seen[:7]] == kinds
    assert {auth for _, _, auth in seen} == {f"Bearer {TOKEN}"}
    registration = seen[0][1]
    assert (registration.node_id, registration.url, registration.role) == (
        "n0",
        "http://node0:8100",
        "mixed",
    )
    assert (registration.model, registration.max_model_len, registration.max_num_seqs) == (
        "deepinfer-tiny",
        4096,
        48,
    )
    heartbeats = [message for kind, message, _ in seen[:7] if kind == "heartbeat"]
    assert [(h.node_id, h.lease_id) for h in heartbeats] == [
        ("n0", "L2"),
        ("n0", "L4"),
        ("n0", "L6"),
    ]
    assert heartbeats[0].load.num_total_blocks == 64
    assert node.engine.is_turning
    base = str(server.make_url("")).rstrip("/")
    assert (
        f"registration with coordinator {base} failed (HTTP 401 Unauthorized); retrying in 0.0 s"
        in caplog.text
    )
    assert TOKEN not in caplog.text


async def test_built_in_tiny_model_through_the_node(aiohttp_client: Callable[..., Any]) -> None:
    config = Config.load(
        overrides={"model": {"device": "cpu"}, "cache": {"num_blocks": 8}}, environ={}
    )
    engine = AsyncEngine(LLMEngine(config))
    client = await aiohttp_client(create_node_app(engine, config))
    api = NodeClient(str(client.make_url("")), session=client.session)
    frames = await collect(api, gen_request("a", [0, 3476, 477], max_tokens=4, logprobs=0))
    tokens = [t for f in frames for t in f.token_ids]
    assert len(tokens) == 4 and frames[-1].finish_reason == "length"
    assert all(len(f.logprobs or []) == len(f.token_ids) for f in frames)
    assert frames[0].num_prompt_tokens == 3
    assert_all_freed(engine)
