"""The coordinator over raw HTTP (aiohttp_client): exact SSE bytes, disconnects, admission
control, bad input, authentication, metrics, node registration and drain."""

from __future__ import annotations

import asyncio
import json
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
from deepinfer.server.coordinator import FRONTEND, INTERNAL_APP, SERVICE, create_coordinator_app
from deepinfer.server.protocol import NodeHeartbeat, NodeLease, NodeLoad, NodeRegistration
from deepinfer.server.routing import NodeError

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


async def test_no_node_is_503_and_ready_follows_registration(make_client, aiohttp_client) -> None:
    client = await make_client(backends=[], heartbeat_timeout_s=0.2)
    internal = await aiohttp_client(client.app[INTERNAL_APP])
    assert (await client.get("/health")).status == 200
    assert (await client.get("/ready")).status == 503
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status == 503 and "Retry-After" in resp.headers
    resp = await client.post("/v1/messages/count_tokens", json=M)
    assert resp.status == 503 and "Retry-After" in resp.headers

    registration = NodeRegistration(
        node_id="n1", url="http://node", role="mixed", model=MODEL, max_model_len=2048
    )
    resp = await internal.post(
        "/internal/register",
        data=msgspec.msgpack.encode(registration),
        headers={"Content-Type": "application/msgpack"},
    )
    assert resp.status == 200
    lease = msgspec.msgpack.decode(await resp.read(), type=NodeLease)
    assert (lease.node_id, lease.heartbeat_timeout_s, len(lease.lease_id)) == ("n1", 0.2, 22)
    assert (await client.get("/ready")).status == 200
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    heartbeat = NodeHeartbeat(node_id="n1", load=NodeLoad(num_running=1), lease_id=lease.lease_id)
    resp = await internal.post("/internal/heartbeat", data=msgspec.json.encode(heartbeat),
                               headers={"Content-Type": "application/json"})  # fmt: skip
    assert resp.status == 200
    unknown = NodeHeartbeat(node_id="n2", load=NodeLoad())
    resp = await internal.post("/internal/heartbeat", data=msgspec.msgpack.encode(unknown))
    assert resp.status == 404
    await asyncio.sleep(0.35)  # no heartbeat for longer than heartbeat_timeout_s
    assert (await client.get("/ready")).status == 503
    resp = await internal.post("/internal/heartbeat", data=msgspec.msgpack.encode(heartbeat))
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
    # Values JSON (and the recipe's number types) cannot hold, and what json.loads lets through.
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2**64}, 400, "out of range", None),
    ("/v1/chat/completions", {**CHAT, "seed": 2**64}, 400, "out of range", None),
    ("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 2**64}, 400,
     "out of range", None),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "seed": 2**64}, 400, "seed", "seed"),
    ("/v1/chat/completions", b'{"model": "m", "messages": [], "temperature": NaN}', 400,
     "NaN is not a valid JSON number", None),
    ("/v1/responses", b'{"model": "m", "input": "x", "top_p": Infinity}', 400,
     "Infinity is not a valid JSON number", None),
    ("/v1/completions", b'{"model": "m", "prompt": "a", "repetition_penalty": NaN}', 400,
     "NaN is not a valid JSON number", None),
    ("/v1/chat/completions", b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     400, "nested too deeply", None),
    ("/v1/completions", b'{"a": ' * 5000 + b"1" + b"}" * 5000, 400, "nested too deeply", None),
]  # fmt: skip
BAD_MESSAGES = [
    ("/v1/messages", b"{oops", 400, "Invalid JSON body"),
    ("/v1/messages", {**M, "model": "claude-3"}, 404, "`claude-3` does not exist"),
    ("/v1/messages", {**M, "messages": []}, 400, "at least one message"),
    ("/v1/messages", {**M, "messages": [{"role": "user", "content": LONG}]}, 400,
     "maximum context length"),
    ("/v1/messages", {**M, "top_k": -5}, 400, "top_k"),
    ("/v1/messages/count_tokens", b"", 400, "body is empty"),
    ("/v1/messages", {**M, "max_tokens": 2**64}, 400, "out of range"),
    ("/v1/messages", b'{"model": "m", "max_tokens": 5, "temperature": -Infinity}', 400,
     "-Infinity is not a valid JSON number"),
    ("/v1/messages/count_tokens", b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000
     + b"}", 400, "nested too deeply"),
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
    # Too many images: refused before anything is fetched (tests/test_v41_images.py serves
    # images through the allow-list).
    content[1:] = [content[1]] * 17
    resp = await (await aiohttp_client(make(("169.254.169.254",)))).post(
        "/v1/chat/completions", json=body
    )
    error = (await resp.json())["error"]
    assert resp.status == 400 and "17 images, more than the 16" in error["message"]
    assert backend.requests == []


# ---- authentication ----------------------------------------------------------------------------


async def test_api_keys_and_node_token(make_client, aiohttp_client) -> None:
    client = await make_client(api_keys=("k1", "k2"), node_token="secret")
    internal = await aiohttp_client(client.app[INTERNAL_APP])
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
    for token in (None, "k1", "secre"):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        resp = await internal.post("/internal/heartbeat", data=heartbeat, headers=headers)
        assert resp.status == 401, token
        assert (await resp.json())["error"]["message"] == (
            "Authentication failed: wrong or missing node token"
        )
    resp = await internal.post(
        "/internal/heartbeat", data=heartbeat, headers={"Authorization": "Bearer secret"}
    )
    assert resp.status == 404  # authenticated; the node is just unknown


def _registration(node_id: str, url: str = "http://node") -> bytes:
    return msgspec.msgpack.encode(
        NodeRegistration(node_id=node_id, url=url, role="mixed", model=MODEL, max_model_len=2048)
    )


async def test_control_plane_is_not_on_the_public_port(make_client, aiohttp_client) -> None:
    client = await make_client(node_token="secret", max_registered_nodes=1)
    internal = await aiohttp_client(client.app[INTERNAL_APP])
    token = {"Authorization": "Bearer secret"}
    heartbeat = msgspec.msgpack.encode(NodeHeartbeat(node_id="n1", load=NodeLoad()))
    for headers in ({}, token):
        for path, body in (("/internal/register", _registration("n1")),
                           ("/internal/heartbeat", heartbeat)):  # fmt: skip
            assert (await client.post(path, data=body, headers=headers)).status == 404
    assert (await internal.post("/v1/chat/completions", json=CHAT)).status == 404

    async def register(body: bytes) -> tuple[int, str]:
        resp = await internal.post("/internal/register", data=body, headers=token)
        return resp.status, (await resp.json())["error"]["message"] if resp.status != 200 else ""

    assert await register(_registration("static-0")) == (
        409,
        "Registration refused: node id 'static-0' belongs to a static node",
    )
    assert await register(_registration("n1")) == (200, "")
    assert await register(_registration("n1", "http://elsewhere")) == (
        409,
        "Registration refused: node id 'n1' is held by a live node at another URL; give this "
        "node another node.node_id",
    )
    assert await register(_registration("n2")) == (
        503,
        "Registration refused: the node registry is full: 1 live nodes "
        "(server.max_registered_nodes = 1)",
    )
    assert await register(_registration("")) == (
        400,
        "Registration refused: node_id must be 1 to 128 printable characters",
    )
    # A heartbeat without n1's lease cannot take it out of rotation.
    draining = NodeHeartbeat(node_id="n1", load=NodeLoad(is_draining=True), lease_id="guess")
    resp = await internal.post(
        "/internal/heartbeat", data=msgspec.msgpack.encode(draining), headers=token
    )
    assert resp.status == 403
    assert (await resp.json())["error"]["message"] == (
        "This heartbeat does not carry node 'n1''s lease; register"
    )
    assert (await client.get("/ready")).status == 200
    assert [n.node_id for n in client.app[SERVICE].registry.ready_nodes()] == ["static-0", "n1"]


async def test_observability_behind_a_key_or_on_the_internal_listener(
    make_client, aiohttp_client
) -> None:
    client = await make_client(metrics_key="mk")
    internal = await aiohttp_client(client.app[INTERNAL_APP])
    for app_client in (client, internal):
        resp = await app_client.get("/metrics")
        assert resp.status == 401
        assert (await resp.json())["error"]["message"] == (
            "Authentication failed: a valid metrics key is required "
            "(Authorization: Bearer <server.metrics_key>)"
        )
        assert (await app_client.get("/metrics", headers={"x-api-key": "nope"})).status == 401
        resp = await app_client.get("/metrics", headers={"Authorization": "Bearer mk"})
        assert resp.status == 200 and "deepinfer_num_nodes_ready" in await resp.text()
        assert [(await app_client.get(p)).status for p in ("/health", "/ready")] == [200, 200]

    client = await make_client(public_observability=False)
    internal = await aiohttp_client(client.app[INTERNAL_APP])
    for path in ("/health", "/ready", "/metrics"):
        assert ((await client.get(path)).status, (await internal.get(path)).status) == (404, 200)
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200


async def test_node_failures_reach_clients_as_a_stable_message(
    make_client, backend, caplog
) -> None:
    """No node URL or exception text leaves the server: the client gets the status, a stable
    message and the request id; the log has the details under that id."""
    client = await make_client()
    leaky = "node http://10.9.8.7:8100 unreachable: ClientConnectorError(ConnectionKey(...))"
    cases = [
        (NodeError(503, leaky), 503, "No inference node could take the request; retry shortly"),
        (NodeError(401, "missing or wrong bearer token"), 502,
         "The inference node failed to process the request"),
        (RuntimeError("parser broke on http://10.9.8.7"), 500,
         "The server failed to process the request"),
    ]  # fmt: skip
    for error, status, message in cases:
        backend.scripts.append(Script(steps=[ids("a"), [EOS]], error=error, error_at=1))
        resp = await client.post("/v1/chat/completions", json=CHAT)
        text = (await resp.json())["error"]["message"]
        request_id = backend.requests[-1].request_id
        assert (resp.status, text) == (status, f"{message} (request id {request_id})")
        assert request_id in caplog.text and str(error) in caplog.text
    assert client.app[SERVICE].admission.num_running == 0
    backend.scripts.append(Script(steps=[[EOS]], error=NodeError(400, "temperature must be >= 0")))
    resp = await client.post("/v1/chat/completions", json=CHAT)
    assert (resp.status, (await resp.json())["error"]["message"]) == (
        400,
        "temperature must be >= 0",  # the request's own fault, in our words: passed on
    )


class _NoTokenizing:
    """A prompt encoding that renders but must not tokenize."""

    def __init__(self, encoding: Any) -> None:
        self.render_conversation = encoding.render_conversation

    def encode(self, conversation: Any) -> list[int]:
        raise AssertionError("tokenized a prompt that cannot fit")


async def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(make_client) -> None:
    client = await make_client()
    frontend = client.app[FRONTEND]
    assert frontend.max_token_chars == 128  # V4's longest tokens: 128 spaces, 128 dots
    frontend.encoding = _NoTokenizing(frontend.encoding)
    text = "x" * (MAX_MODEL_LEN * 128)
    body = {**M, "messages": [{"role": "user", "content": text}]}
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"):
        resp = await client.post(path, json=body)
        payload = await resp.json()
        assert resp.status == 400, payload
        match = re.fullmatch(
            r"This model's maximum context length is 4096 tokens\. However, your prompt has at "
            r"least (\d+) tokens \((\d+) characters, and no token is longer than 128\)\. "
            r"Please reduce the length of the prompt\.",
            payload["error"]["message"],
        )
        num_tokens, num_chars = int(match[1]), int(match[2])
        # The rendered prompt: the text and the template's few hundred characters.
        assert len(text) < num_chars < len(text) + 1000 and num_tokens == -(-num_chars // 128)
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": text + "x"})
    error = (await resp.json())["error"]
    assert (resp.status, error["param"]) == (400, "prompt")
    assert "at least 4097 tokens (524289 characters" in error["message"]


async def test_default_limits_follow_the_nodes(make_client, backend) -> None:
    """The default config with one node of the default max_num_seqs (64): 64 run, 64 wait, and
    of k more concurrent requests exactly k get 429 with Retry-After."""
    client = await make_client()
    client.session.connector._limit = 0  # every request concurrently
    admission = client.app[SERVICE].admission
    assert (admission.max_running, admission.max_queued_requests) == (64, 64)
    gate = asyncio.Event()
    k = 5
    backend.default = Script(steps=[ids("a"), [EOS]], gate=gate)
    tasks = [
        asyncio.create_task(client.post("/v1/chat/completions", json=CHAT)) for _ in range(128 + k)
    ]
    for _ in range(500):
        if (admission.num_running, admission.num_waiting) == (64, 64):
            break
        await asyncio.sleep(0.01)
    refused = [t for t in tasks if t.done()]
    while len(refused) < k:
        await asyncio.sleep(0.01)
        refused = [t for t in tasks if t.done()]
    assert (admission.num_running, admission.num_waiting, len(refused)) == (64, 64, k)
    for task in refused:
        resp = task.result()
        assert (resp.status, resp.headers["Retry-After"]) == (429, "1")
    gate.set()
    statuses = [(await t).status for t in tasks]
    assert (statuses.count(200), statuses.count(429)) == (128, k)


async def test_a_slow_body_is_cut_off(make_client) -> None:
    client = await make_client(body_read_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n" + b'{"model": '
    )
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5.0)  # until the server closes
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"Connection: close" in head
    assert json.loads(body)["error"] == {
        "message": "The request body did not arrive within 0.3 s (server.body_read_timeout_s)",
        "type": "timeout_error",
        "param": None,
        "code": "request_timeout",
    }
    writer.close()
    assert client.app[SERVICE].preparation.num_requests == 0


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


async def test_a_node_of_another_model_is_refused(make_client, aiohttp_client) -> None:
    client = await make_client(backends=[])
    internal = await aiohttp_client(client.app[INTERNAL_APP])
    resp = await _register(internal, model="other-model")
    assert resp.status == 409
    assert (await resp.json())["error"]["message"] == (
        "node n1 serves 'other-model' but this coordinator serves 'm': refused "
        "(set the node's server.served_model_name)"
    )
    ready = await client.get("/ready")
    assert (ready.status, await ready.json()) == (
        503, {
            "status": "no node ready",
            "num_ready_nodes": 0,
            "num_encode_nodes": 0,
            "nodes_not_ready": {},
        }
    )  # fmt: skip


async def test_a_prefill_node_serves_once_a_decode_node_is_there_and_ready_says_so(
    make_client, aiohttp_client
) -> None:
    client = await make_client(backends=[])
    internal = await aiohttp_client(client.app[INTERNAL_APP])
    assert (await _register(internal, role="prefill")).status == 200
    ready = await client.get("/ready")
    assert (ready.status, await ready.json()) == (
        503,
        {
            "status": "no node ready",
            "num_ready_nodes": 0,
            "num_encode_nodes": 0,
            "nodes_not_ready": {"n1": "role prefill: no decode node is in rotation to pair with"},
        },
    )
    assert (await _register(internal, node_id="n2", role="decode")).status == 200
    ready = await client.get("/ready")
    assert ready.status == 200 and (await ready.json())["num_ready_nodes"] == 2
    routes = client.app[SERVICE].registry.routes()
    assert [(r.node_id, r.role) for r in routes] == [("n1+n2", "pair")]
