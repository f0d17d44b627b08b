"""The coordinator over raw HTTP (aiohttp_client): exact SSE bytes, disconnects, admission
control, bad input, authentication, metrics, node registration and drain."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from coordinator_fakes import EOS, THINK_END, TOKENIZER_PATH, FakeBackend, Script, ids
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.config import ServerConfig
from deepinfer.server.coordinator import SERVICE, create_coordinator_app
from deepinfer.server.protocol import NodeHeartbeat, NodeLoad, NodeRegistration

pytestmark = pytest.mark.asyncio

MODEL = "m"
MAX_MODEL_LEN = 4096
USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": USER}

ClientFactory = Callable[..., Any]


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def make_client(aiohttp_client, backend: FakeBackend) -> ClientFactory:
    async def make(backends: list | None = None, **config: Any) -> TestClient:
        app = create_coordinator_app(
            ServerConfig(**config),
            tokenizer_path=TOKENIZER_PATH,
            served_model_name=MODEL,
            backends=[backend] if backends is None else backends,
            max_model_len=MAX_MODEL_LEN,
            backend_factory=lambda url: FakeBackend(),
        )
        return await aiohttp_client(app)

    return make


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Samples by (name, labels other than component and model_name), each carrying those."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            own = {k: s.labels.pop(k) for k in ("component", "model_name")}
            assert own == {"component": "coordinator", "model_name": MODEL}, s
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    return samples


# ---- SSE framing ------------------------------------------------------------------------------


async def test_chat_sse_bytes_exact(make_client) -> None:
    client = await make_client()
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["Cache-Control"] == "no-cache"
    body = (await resp.read()).decode()
    request_id, created = re.match(r'data: \{"id":"([^"]+)",[^}]*"created":(\d+)', body).groups()
    head = (
        f'data: {{"id":"{request_id}","object":"chat.completion.chunk","created":{created},'
        f'"model":"{MODEL}","system_fingerprint":null,"choices":[{{"index":0,"delta":'
    )
    tail = ',"logprobs":null,"finish_reason":null}]}\n\n'
    expected = (
        head + '{"role":"assistant","content":null,"reasoning_content":""}' + tail
        + head + '{"content":null,"reasoning_content":"Hi"}' + tail
        + head + '{"content":" there","reasoning_content":null}' + tail
        + head + '{"content":"","reasoning_content":null},"logprobs":null,"finish_reason":"stop"}],'
        '"usage":{"prompt_tokens":84,"completion_tokens":3,"total_tokens":87,'
        '"prompt_tokens_details":{"cached_tokens":0},"completion_tokens_details":'
        '{"reasoning_tokens":1},"prompt_cache_hit_tokens":0,"prompt_cache_miss_tokens":84}}\n\n'
        "data: [DONE]\n\n"
    )  # fmt: skip
    assert body == expected


async def test_messages_sse_named_events_and_completions_sse(make_client, backend) -> None:
    client = await make_client()
    body = {**CHAT, "max_tokens": 10, "stream": True, "thinking": {"type": "disabled"}}
    backend.scripts.append(Script(steps=[ids("Hello"), [EOS]]))
    text = (await (await client.post("/v1/messages", json=body)).read()).decode()
    events = [block.split("\n") for block in text.split("\n\n") if block]
    names = [lines[0] for lines in events]
    assert names == [
        "event: message_start",
        "event: content_block_start",
        "event: ping",
        "event: content_block_delta",
        "event: content_block_stop",
        "event: message_delta",
        "event: message_stop",
    ]
    assert all(len(lines) == 2 and lines[1].startswith("data: {") for lines in events)
    assert text.endswith('event: message_stop\ndata: {"type":"message_stop"}\n\n')

    backend.scripts.append(Script(steps=[ids(" a"), ids(" b"), [EOS]]))
    resp = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}
    )
    text = (await resp.read()).decode()
    request_id, created = re.match(r'data: \{"id":"([^"]+)",[^}]*"created":(\d+)', text).groups()
    head = f'data: {{"id":"{request_id}","object":"text_completion","created":{created},"model":"m"'
    assert text == (
        head + ',"choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":null}]}\n\n'
        + head + ',"choices":[{"index":0,"text":" b","logprobs":null,"finish_reason":null}]}\n\n'
        + head + ',"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"stop"}]}\n\n'
        "data: [DONE]\n\n"
    )  # fmt: skip


# ---- lifecycle: disconnect, admission, timeout, node errors -----------------------------------


async def test_client_disconnect_aborts_on_node(make_client, backend) -> None:
    client = await make_client()
    backend.scripts.append(Script(steps=[ids(" tok")] * 200, delay=0.02))
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    resp.close()  # the client goes away mid-stream
    await asyncio.wait_for(backend.aborted_event.wait(), 5)
    assert backend.aborted == [backend.requests[0].request_id]
    metrics = metric_samples(await (await client.get("/metrics")).text())
    assert metrics[("deepinfer_aborted_requests_total", ())] == 1
    labels = (("endpoint", "chat_completions"), ("finished_reason", "abort"))
    assert metrics[("deepinfer_finished_requests_total", labels)] == 1


async def test_queue_full_is_429_with_retry_after(make_client, backend) -> None:
    client = await make_client(max_running_requests=1, max_queued_requests=1, retry_after_s=3)
    admission = client.app[SERVICE].admission
    gate = asyncio.Event()
    backend.scripts.extend([Script(steps=[ids("a"), [EOS]], gate=gate), Script(steps=[[EOS]])])
    running = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
    queued = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
    for _ in range(200):
        if admission.num_running == 1 and admission.num_waiting == 1:
            break
        await asyncio.sleep(0.01)
    assert (admission.num_running, admission.num_waiting) == (1, 1)
    refused = await client.post("/v1/chat/completions", json=CHAT)
    assert refused.status == 429
    assert refused.headers["Retry-After"] == "3"
    error = (await refused.json())["error"]
    assert error["type"] == "rate_limit_error" and "max_queued_requests" in error["message"]
    gate.set()
    assert [(await t).status for t in (running, queued)] == [200, 200]
    metrics = metric_samples(await (await client.get("/metrics")).text())
    assert metrics[("deepinfer_admission_rejections_total", (("reason", "queue_full"),))] == 1
    assert metrics[("deepinfer_request_queue_time_seconds_count", ())] == 2


async def test_queued_prompt_tokens_bound_is_429(make_client, backend) -> None:
    client = await make_client(max_running_requests=1, max_queued_prompt_tokens=100)
    admission = client.app[SERVICE].admission
    gate = asyncio.Event()
    backend.scripts.extend([Script(steps=[[EOS]], gate=gate), Script(steps=[[EOS]])])
    running = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
    while admission.num_running == 0:
        await asyncio.sleep(0.01)
    long_prompt = {**CHAT, "messages": [{"role": "user", "content": "word " * 50}]}
    refused = await client.post("/v1/chat/completions", json=long_prompt)  # 134 tokens > 100
    assert refused.status == 429
    assert "max_queued_prompt_tokens = 100" in (await refused.json())["error"]["message"]
    queued = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))  # 84 fit
    while admission.num_waiting == 0:
        await asyncio.sleep(0.01)
    assert admission.num_waiting_tokens == 84
    gate.set()
    assert [(await t).status for t in (running, queued)] == [200, 200]


async def test_request_timeout_aborts(make_client, backend) -> None:
    client = await make_client(request_timeout_s=0.2)
    backend.scripts.append(Script(steps=[ids("a")] * 100, delay=0.05))
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 504
    assert "server.request_timeout_s" in (await resp.json())["error"]["message"]
    await asyncio.wait_for(backend.aborted_event.wait(), 2)
    backend.aborted_event.clear()
    backend.scripts.append(Script(steps=[ids("a")] * 100, delay=0.05))
    resp = await client.post("/v1/messages", json={**CHAT, "max_tokens": 5, "stream": True})
    text = (await resp.read()).decode()
    assert resp.status == 200
    assert text.endswith(
        'event: error\ndata: {"type":"error","error":{"type":"timeout_error","message":'
        '"The request timed out after 0.2 s (server.request_timeout_s)"}}\n\n'
    )
    await asyncio.wait_for(backend.aborted_event.wait(), 2)


async def test_no_node_is_503_and_ready_follows_registration(make_client) -> None:
    client = await make_client(backends=[], heartbeat_timeout_s=0.2)
    assert (await client.get("/health")).status == 200
    assert (await client.get("/ready")).status == 503
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 503 and "Retry-After" in resp.headers

    registration = NodeRegistration(
        node_id="n1", url="http://node", role="mixed", model=MODEL, max_model_len=2048
    )
    resp = await client.post(
        "/internal/register",
        data=msgspec.msgpack.encode(registration),
        headers={"Content-Type": "application/msgpack"},
    )
    assert resp.status == 200
    assert (await client.get("/ready")).status == 200
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    heartbeat = NodeHeartbeat(node_id="n1", load=NodeLoad(num_running=1))
    resp = await client.post("/internal/heartbeat", data=msgspec.json.encode(heartbeat),
                             headers={"Content-Type": "application/json"})  # fmt: skip
    assert resp.status == 200
    unknown = NodeHeartbeat(node_id="n2", load=NodeLoad())
    resp = await client.post("/internal/heartbeat", data=msgspec.msgpack.encode(unknown))
    assert resp.status == 404
    await asyncio.sleep(0.35)  # no heartbeat for longer than heartbeat_timeout_s
    assert (await client.get("/ready")).status == 503
    resp = await client.post("/internal/heartbeat", data=msgspec.msgpack.encode(heartbeat))
    assert (await client.get("/ready")).status == 200


async def test_drain_finishes_in_flight_and_refuses_new(make_client, backend) -> None:
    client = await make_client()
    service = client.app[SERVICE]
    backend.scripts.append(Script(steps=[ids("a")] * 5 + [[EOS]], delay=0.05))
    body = {**CHAT, "thinking": {"type": "disabled"}}
    in_flight = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    while service.admission.num_running == 0:
        await asyncio.sleep(0.01)
    drain = asyncio.create_task(service.drain(timeout=5))
    await asyncio.sleep(0)
    refused = await client.post("/v1/chat/completions", json=CHAT)
    assert refused.status == 503 and refused.headers["Retry-After"] == "5"
    assert (await client.get("/ready")).status == 503
    resp = await in_flight
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"] == "aaaaa"
    assert await drain is True
    assert backend.aborted == []


async def test_drain_timeout_aborts_the_rest(make_client, backend) -> None:
    client = await make_client()
    service = client.app[SERVICE]
    backend.scripts.append(Script(steps=[ids("a")] * 100, delay=0.05))
    in_flight = asyncio.create_task(
        client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    )
    while service.admission.num_running == 0:
        await asyncio.sleep(0.01)
    assert await service.drain(timeout=0.1) is False
    assert backend.aborted == [backend.requests[0].request_id]
    in_flight.cancel()


# ---- bad input --------------------------------------------------------------------------------

LONG = "hello " * 5000
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
M = {"model": MODEL, "max_tokens": 10, "messages": USER}
BAD_INPUT = [
    # (path, body (bytes or JSON), status, text in the message, param)
    ("/v1/chat/completions", b"{not json", 400, "Invalid JSON body", None),
    ("/v1/chat/completions", b"[1, 2]", 400, "must be a JSON object", None),
    ("/v1/chat/completions", b"", 400, "body is empty", None),
    ("/v1/chat/completions", {"messages": USER}, 400, "model parameter", "model"),
    ("/v1/chat/completions", {"model": 5, "messages": USER}, 400, "Invalid model", "model"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "`gpt-4` does not exist", "model"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "missing field `messages`", None),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "Empty input messages", None),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "invalid type", None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "x", "content": "a"}]}, 400,
     "unknown variant `x`", None),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "invalid type", None),
    ("/v1/chat/completions", {**CHAT, "temperature": 5}, 400, "temperature", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**7}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 4050}, 400, "maximum context length", None),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONG}]}, 400,
     "maximum context length", None),
    ("/v1/chat/completions", {**CHAT, "n": 2}, 400, "only n = 1", None),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400,
     "json_schema", None),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400,
     "must contain the word 'json'", None),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400,
     "missing field `function`", None),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": "required"}, 400,
     "Thinking mode does not support this tool_choice", None),
    ("/v1/chat/completions", {**CHAT, "top_k": "x"}, 400, "Invalid top_k", "top_k"),
    ("/v1/chat/completions", {**CHAT, "min_p": 2}, 400, "min_p", "min_p"),
    ("/v1/chat/completions", {**CHAT, "deterministic": "yes"}, 400, "deterministic",
     "deterministic"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, 400, "repetition_penalty",
     "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1}}, 400, "not a token id",
     "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [-1]}, 400, "stop_token_ids",
     "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "cache_salt": ""}, 400, "cache_salt", "cache_salt"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs", None),
    ("/v1/chat/completions", {**CHAT, "thinking": {"type": "bogus"}}, 400, "unknown variant",
     None),
    ("/v1/chat/completions", {**CHAT, "seed": -1}, 400, "invalid value", None),
    ("/v1/chat/completions", {**CHAT, "min_tokens": 20, "max_tokens": 10}, 400,
     "min_tokens (20) must not exceed max_tokens (10)", None),
    ("/v1/responses", {"model": MODEL}, 400, "input or instructions", None),
    ("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 10**7}, 400,
     "max_tokens", None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt is empty", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "token ids", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "one prompt", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "echo": True}, 400, "echo", "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens",
     "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 5000}, 400,
     "maximum context length", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stop": [""]}, 400, "stop", "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "temperature": "x"}, 400,
     "temperature", "temperature"),
    ("/v1/nothing", {}, 404, "Not Found", None),
]  # fmt: skip
BAD_MESSAGES = [
    ("/v1/messages", b"{oops", 400, "Invalid JSON body"),
    ("/v1/messages", {**M, "model": "claude-3"}, 404, "`claude-3` does not exist"),
    ("/v1/messages", {**M, "messages": []}, 400, "at least one message"),
    ("/v1/messages", {**M, "messages": [{"role": "user", "content": LONG}]}, 400,
     "maximum context length"),
    ("/v1/messages", {**M, "top_k": -5}, 400, "top_k"),
    ("/v1/messages/count_tokens", b"", 400, "body is empty"),
]  # fmt: skip


async def test_bad_input_is_named_and_the_server_keeps_serving(make_client, backend) -> None:
    client = await make_client(max_body_bytes=256 * 1024)
    for path, body, status, text, param in BAD_INPUT:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        resp = await client.post(path, **kwargs)
        payload = await resp.json()
        assert resp.status == status, (path, body, payload)
        assert set(payload) == {"error"}, payload
        error = payload["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert text in error["message"], (text, error)
        assert error["param"] == param, (path, body, error)
    for path, body, status, text in BAD_MESSAGES:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        resp = await client.post(path, **kwargs)
        payload = await resp.json()
        assert resp.status == status, (path, body, payload)
        assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
        assert text in payload["error"]["message"], (text, payload)
    resp = await client.get("/v1/chat/completions")
    assert resp.status == 405 and set((await resp.json())["error"]) >= {"message", "type"}
    resp = await client.post("/v1/chat/completions", data=b"x" * (300 * 1024))
    assert resp.status == 413
    assert "Maximum request body size" in (await resp.json())["error"]["message"]
    assert backend.requests == []  # nothing bad reached the node

    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"] == " there"


async def test_image_urls_need_the_allow_list(aiohttp_client, backend) -> None:
    def make(allow: tuple[str, ...]) -> web.Application:
        return create_coordinator_app(
            ServerConfig(image_url_allowlist=allow),
            tokenizer_path=TOKENIZER_PATH,
            served_model_name=MODEL,
            model_type="deepseek_v41",  # the vision model: the recipe keeps image sources
            backends=[backend],
            max_model_len=MAX_MODEL_LEN,
        )

    content = [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}},
    ]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    resp = await (await aiohttp_client(make(()))).post("/v1/chat/completions", json=body)
    error = (await resp.json())["error"]
    assert resp.status == 400 and "not in server.image_url_allowlist" in error["message"]
    resp = await (await aiohttp_client(make(("169.254.169.254",)))).post(
        "/v1/chat/completions", json=body
    )
    assert resp.status == 400 and "not supported" in (await resp.json())["error"]["message"]
    assert backend.requests == []


# ---- authentication ----------------------------------------------------------------------------


async def test_api_keys_and_node_token(make_client) -> None:
    client = await make_client(api_keys=("k1", "k2"), node_token="secret")
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 401
    assert (await resp.json())["error"]["code"] == "invalid_api_key"
    resp = await client.post("/v1/messages", json=M, headers={"x-api-key": "nope"})
    assert resp.status == 401
    assert (await resp.json())["error"]["type"] == "authentication_error"
    ok = await client.post(
        "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k2"}
    )
    assert ok.status == 200
    assert (await client.post("/v1/messages", json=M, headers={"x-api-key": "k1"})).status == 200
    assert (await client.get("/health")).status == 200
    assert (await client.get("/metrics")).status == 200
    heartbeat = msgspec.msgpack.encode(NodeHeartbeat(node_id="x", load=NodeLoad()))
    assert (await client.post("/internal/heartbeat", data=heartbeat)).status == 401
    resp = await client.post(
        "/internal/heartbeat", data=heartbeat, headers={"Authorization": "Bearer secret"}
    )
    assert resp.status == 404  # authenticated; the node is just unknown


# ---- metrics -----------------------------------------------------------------------------------


async def test_metrics_parse_and_move(make_client, backend) -> None:
    client = await make_client()
    before = metric_samples(await (await client.get("/metrics")).text())
    assert before[("deepinfer_prompt_tokens_total", ())] == 0
    assert before[("deepinfer_num_nodes_ready", ())] == 1
    backend.scripts.append(
        Script(steps=[ids("Hi"), [THINK_END], ids(" there"), [EOS]], num_cached_tokens=64)
    )
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    assert (await client.post("/v1/chat/completions", json={**CHAT, "model": "x"})).status == 404
    resp = await client.get("/metrics")
    assert resp.headers["Content-Type"].startswith("text/plain")
    after = metric_samples(await resp.text())
    assert after[("deepinfer_prompt_tokens_total", ())] == 84
    assert after[("deepinfer_cached_prompt_tokens_total", ())] == 64
    assert after[("deepinfer_generation_tokens_total", ())] == 4  # EOS included: the node made it
    labels = (("endpoint", "chat_completions"), ("finished_reason", "stop"))
    assert after[("deepinfer_finished_requests_total", labels)] == 1
    assert after[("deepinfer_time_to_first_token_seconds_count", ())] == 1
    assert after[("deepinfer_inter_token_latency_seconds_count", ())] == 3
    assert after[("deepinfer_e2e_request_latency_seconds_count", ())] == 1
    assert after[("deepinfer_num_requests_running", ())] == 0
    assert after[("deepinfer_num_requests_waiting", ())] == 0
    # vLLM's names of the latency histograms, the same samples; no _created series.
    vllm_names = {name for name, _ in after if name.startswith("vllm:")}
    assert {name.rsplit("_", 1)[0] for name in vllm_names} == {
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
    }
    assert after[("vllm:time_per_output_token_seconds_count", ())] == 3
    assert after[("vllm:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 1
    assert not [name for name, _ in after if name.endswith("_created")]


async def _register(client: TestClient, **fields: Any) -> Any:
    registration = NodeRegistration(
        **{"node_id": "n1", "url": "http://node", "role": "mixed", "model": MODEL,
           "max_model_len": 2048, **fields}
    )  # fmt: skip
    return await client.post("/internal/register", data=msgspec.msgpack.encode(registration))


async def test_a_node_of_another_model_is_refused(make_client) -> None:
    client = await make_client(backends=[])
    resp = await _register(client, model="other-model")
    assert resp.status == 409
    assert (await resp.json())["error"]["message"] == (
        "node n1 serves 'other-model' but this coordinator serves 'm': refused "
        "(set the node's server.served_model_name)"
    )
    ready = await client.get("/ready")
    assert (ready.status, await ready.json()) == (
        503, {"status": "no node ready", "num_ready_nodes": 0, "nodes_not_ready": {}}
    )  # fmt: skip


async def test_prefill_node_is_accepted_and_ready_says_why_it_is_unused(
    make_client, caplog: pytest.LogCaptureFixture
) -> None:
    client = await make_client(backends=[])
    with caplog.at_level(logging.WARNING, logger="deepinfer.server.coordinator"):
        assert (await _register(client, role="prefill")).status == 200
    assert "node n1 has role 'prefill': registered, but it gets no traffic" in caplog.text
    ready = await client.get("/ready")
    assert (ready.status, await ready.json()) == (
        503,
        {
            "status": "no node ready",
            "num_ready_nodes": 0,
            "nodes_not_ready": {
                "n1": "role prefill: no traffic until prefill/decode disaggregation lands"
            },
        },
    )
    assert (await _register(client, node_id="n2")).status == 200
    ready = await client.get("/ready")
    assert ready.status == 200 and (await ready.json())["num_ready_nodes"] == 1
