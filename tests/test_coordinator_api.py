"""The coordinator through the official openai and anthropic clients, on a local port, against a
scripted in-process node (tests/coordinator_fakes.py).

Token scripts are real DeepSeek V4 token ids: reasoning ends with ``</think>`` (128822), tool
calls are the DSML that deepseek-recipe renders, and EOS (1) ends a stopped request.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import anthropic
import openai
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from coordinator_fakes import (
    EOS,
    THINK_END,
    TOKENIZER_PATH,
    TOOL_CALL_TOKENS,
    FakeBackend,
    Script,
    chunked,
    ids,
)

from deepinfer.config import ServerConfig
from deepinfer.server.coordinator import create_coordinator_app
from deepinfer.server.routing import NodeError

pytestmark = pytest.mark.asyncio

MODEL = "deepinfer-test"
MAX_MODEL_LEN = 4096
USER = [{"role": "user", "content": "hi"}]
NUM_CHAT_PROMPT_TOKENS = 84  # USER in DeepSeek V4's encoding, thinking mode (default effort)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest_asyncio.fixture
async def server(backend: FakeBackend) -> AsyncIterator[TestServer]:
    app = create_coordinator_app(
        ServerConfig(),
        tokenizer_path=TOKENIZER_PATH,
        served_model_name=MODEL,
        backends=[backend],
        max_model_len=MAX_MODEL_LEN,
    )
    async with TestServer(app) as test_server:
        yield test_server


@pytest.fixture
def oai(server: TestServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k", max_retries=0)


@pytest.fixture
def claude(server: TestServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(server.make_url("")), api_key="k", max_retries=0)


# ---- chat completions -------------------------------------------------------------------------


async def test_chat_non_stream_reasoning_content_and_usage(oai, backend) -> None:
    backend.scripts.append(
        Script(
            steps=[ids("Let me think."), [THINK_END], ids("Hello world"), [EOS]],
            num_cached_tokens=64,
        )
    )
    reply = await oai.chat.completions.create(model=MODEL, messages=USER)
    choice = reply.choices[0]
    assert choice.message.reasoning_content == "Let me think."
    assert choice.message.content == "Hello world"
    assert choice.finish_reason == "stop"
    assert reply.model == MODEL and reply.id == backend.requests[0].request_id
    usage = reply.usage.model_dump()
    n_reasoning, n_content = len(ids("Let me think.")), len(ids("Hello world"))
    # EOS ends the request but is not part of the text, so the recipe does not count it.
    n_out = n_reasoning + 1 + n_content
    assert usage["prompt_tokens"] == NUM_CHAT_PROMPT_TOKENS
    assert usage["completion_tokens"] == n_out
    assert usage["total_tokens"] == NUM_CHAT_PROMPT_TOKENS + n_out
    assert usage["completion_tokens_details"]["reasoning_tokens"] == n_reasoning
    assert usage["prompt_tokens_details"]["cached_tokens"] == 64
    assert usage["prompt_cache_hit_tokens"] == 64
    assert usage["prompt_cache_miss_tokens"] == NUM_CHAT_PROMPT_TOKENS - 64


async def test_chat_stream_one_chunk_per_step_with_usage(oai, backend) -> None:
    backend.scripts.append(Script(steps=[ids("Hi"), [THINK_END], ids(" there"), ids("!"), [EOS]]))
    stream = await oai.chat.completions.create(
        model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    deltas = [
        (c.choices[0].delta.model_extra.get("reasoning_content"), c.choices[0].delta.content)
        for c in chunks
    ]
    assert deltas == [("", None), ("Hi", None), (None, " there"), (None, "!"), (None, "")]
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, None, "stop"]
    assert [c.usage is not None for c in chunks] == [False] * 4 + [True]
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 1


async def test_chat_tool_call_non_stream_and_stream(oai, backend) -> None:
    backend.scripts.append(Script(steps=chunked(TOOL_CALL_TOKENS, 5)))
    reply = await oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.model_extra["reasoning_content"] == "Need tool."
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    constraint = backend.requests[0].constraint  # auto tool choice: enforced once a block opens
    assert constraint is not None and constraint.kind == "tool_call"
    assert [t["function"]["name"] for t in json.loads(constraint.schema)] == ["get_weather"]

    backend.scripts.append(Script(steps=chunked(TOOL_CALL_TOKENS, 3)))
    stream = await oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, stream=True)
    name, arguments, finish = "", "", None
    async for chunk in stream:
        for tool_call in chunk.choices[0].delta.tool_calls or []:
            name += tool_call.function.name or ""
            arguments += tool_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, json.loads(arguments), finish) == ("get_weather", {"city": "Paris"}, "tool_calls")


async def test_chat_stop_string_finishes_on_node(oai, backend) -> None:
    steps = [[t] for t in ids("Hello world, END here and more")] + [[EOS]]
    backend.scripts.append(Script(steps=steps))
    reply = await oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        stop=["END", "zzz"],
        extra_body={"thinking": {"type": "disabled"}},
    )
    assert reply.choices[0].message.content == "Hello world, "
    assert reply.choices[0].finish_reason == "stop"
    request_id = backend.requests[0].request_id
    assert backend.finished == [(request_id, "END")]
    assert backend.aborted == []


async def test_thinking_mode_sampling_seed_and_extras(oai, backend) -> None:
    await oai.chat.completions.create(model=MODEL, messages=USER, temperature=0.3)
    await oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        temperature=0.3,
        seed=7,
        extra_body={
            "thinking": {"type": "disabled"},
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "logit_bias": {"100": 5},
            "cache_salt": "salt",
            "deterministic": True,
        },
    )
    await oai.chat.completions.create(model=MODEL, messages=USER)
    thinking, plain, again = (r.sampling for r in backend.requests)
    assert thinking.temperature == 1.0  # the recipe fixes it in thinking mode
    assert plain.temperature == pytest.approx(0.3)
    assert (plain.seed, plain.top_k, plain.min_p, plain.repetition_penalty) == (7, 20, 0.05, 1.1)
    assert plain.logit_bias == {100: 5.0} and backend.requests[1].cache_salt == "salt"
    assert plain.deterministic and not thinking.deterministic
    assert thinking.seed is not None and 0 <= thinking.seed < 2**63 and thinking.seed != again.seed
    assert thinking.max_tokens == MAX_MODEL_LEN - NUM_CHAT_PROMPT_TOKENS


async def test_chat_logprobs(oai, backend) -> None:
    backend.scripts.append(Script(steps=[ids("Hello"), ids(" world"), [EOS]], logprob=-0.25))
    reply = await oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        logprobs=True,
        top_logprobs=2,
        extra_body={"thinking": {"type": "disabled"}},
    )
    assert backend.requests[0].sampling.logprobs == 2
    content = reply.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in content] == [("Hello", -0.25), (" world", -0.25)]
    assert [len(c.top_logprobs) for c in content] == [2, 2]


async def test_json_response_format_is_sent_and_node_refusal_is_a_400(oai, backend) -> None:
    error = NodeError(400, "output constraint json is not supported")
    backend.scripts.append(Script(steps=[[EOS]], error=error))
    with pytest.raises(openai.BadRequestError, match="not supported") as info:
        await oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "answer in json"}],
            response_format={"type": "json_object"},
        )
    assert info.value.status_code == 400
    constraint = backend.requests[0].constraint
    assert constraint is not None and constraint.kind == "json"


async def test_node_failure_mid_stream_is_an_error_event(oai, claude, backend, caplog) -> None:
    """The client gets a stable message and the request id; the log has the node's details."""
    failure = NodeError(500, "device error in step")
    stable = r"^The server failed to process the request \(request id ((chatcmpl-|msg_)\w{32})\)$"
    backend.scripts.append(Script(steps=[ids("Hi"), ids(" there")], error=failure, error_at=1))
    stream = await oai.chat.completions.create(model=MODEL, messages=USER, stream=True)
    received = []
    with pytest.raises(openai.APIError, match=stable) as openai_error:
        async for chunk in stream:
            received.append(chunk.choices[0].delta.model_extra.get("reasoning_content"))
    assert received == ["", "Hi"]

    backend.scripts.append(Script(steps=[ids("Hi"), ids(" there")], error=failure, error_at=1))
    with pytest.raises(anthropic.APIStatusError) as anthropic_error:
        async with claude.messages.stream(model=MODEL, max_tokens=10, messages=USER) as stream:
            async for _ in stream:
                pass
    message = anthropic_error.value.body["error"]["message"]
    for request_id in (
        re.match(stable, openai_error.value.message)[1],
        re.match(stable, message)[1],
    ):
        assert (
            f"request {request_id} failed on node static-0: 500 device error in step" in caplog.text
        )


# ---- responses, messages, completions, models ------------------------------------------------


async def test_responses_non_stream_and_stream(oai, backend) -> None:
    response = await oai.responses.create(model=MODEL, input="hi")
    assert response.status == "completed"
    assert response.output_text == " there"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.usage.input_tokens == len(backend.requests[0].prompt_token_ids)
    assert response.usage.output_tokens_details.reasoning_tokens == 1

    stream = await oai.responses.create(model=MODEL, input="hi", stream=True)
    events = [event async for event in stream]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == " there"
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_messages_non_stream_stream_and_count_tokens(claude, backend) -> None:
    backend.scripts.append(
        Script(steps=[ids("Hi"), [THINK_END], ids(" there"), [EOS]], num_cached_tokens=16)
    )
    message = await claude.messages.create(model=MODEL, max_tokens=100, messages=USER)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Hi" and message.content[1].text == " there"
    assert message.stop_reason == "end_turn"
    num_prompt = len(backend.requests[0].prompt_token_ids)
    assert message.usage.cache_read_input_tokens == 16
    assert message.usage.input_tokens == num_prompt - 16  # Anthropic counts uncached input
    assert message.usage.output_tokens == 3

    steps = [[t] for t in ids("Hello STOP there")] + [[EOS]]
    backend.scripts.append(Script(steps=steps))
    async with claude.messages.stream(
        model=MODEL,
        max_tokens=100,
        messages=USER,
        stop_sequences=["STOP"],
        thinking={"type": "disabled"},
    ) as stream:
        types = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert final.content[0].text == "Hello "
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "STOP")
    assert backend.finished == [(backend.requests[1].request_id, "STOP")]

    counted = await claude.messages.count_tokens(model=MODEL, messages=USER)
    assert counted.input_tokens == num_prompt
    assert len(backend.requests) == 2  # counting tokens does not reach a node


async def test_completions_text_tokens_stop_and_stream_usage(oai, backend) -> None:
    backend.scripts.append(Script(steps=[ids(" Paris"), ids("."), [EOS]], num_cached_tokens=2))
    reply = await oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8
    )
    assert reply.choices[0].text == " Paris."
    assert reply.choices[0].finish_reason == "stop"
    prompt_ids = ids("The capital of France is")
    assert backend.requests[0].prompt_token_ids == prompt_ids
    assert backend.requests[0].sampling.max_tokens == 8
    assert reply.usage.prompt_tokens == len(prompt_ids) and reply.usage.completion_tokens == 3
    assert reply.usage.prompt_tokens_details.cached_tokens == 2
    assert reply.usage.model_extra["prompt_cache_miss_tokens"] == len(prompt_ids) - 2

    backend.scripts.append(Script(steps=[[t] for t in ids(" one two three four")]))
    stream = await oai.completions.create(
        model=MODEL,
        prompt=[100, 200, 300],
        stop=[" three"],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " one two"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert backend.requests[1].prompt_token_ids == [100, 200, 300]
    assert backend.finished == [(backend.requests[1].request_id, " three")]


async def test_completions_logprobs(oai, backend) -> None:
    backend.scripts.append(Script(steps=[ids(" Paris"), [EOS]], finish_reason="stop", logprob=-0.5))
    reply = await oai.completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=1)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == [" Paris", "<｜end▁of▁sentence｜>"]
    assert logprobs.token_logprobs == [-0.5, -0.5]
    assert logprobs.text_offset == [0, 6]


async def test_models_list_and_unknown_model(oai) -> None:
    models = await oai.models.list()
    assert [m.id for m in models.data] == [MODEL, "DeepSeek-V4-Pro"]
    await oai.chat.completions.create(model="DeepSeek-V4-Pro", messages=USER)  # official name
    with pytest.raises(openai.NotFoundError) as info:
        await oai.chat.completions.create(model="gpt-4o", messages=USER)
    assert info.value.code == "model_not_found"
    assert "gpt-4o" in info.value.message and MODEL in info.value.message


async def test_unknown_model_on_messages_is_an_anthropic_404(claude) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        await claude.messages.create(model="claude-x", max_tokens=10, messages=USER)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "not_found_error"
