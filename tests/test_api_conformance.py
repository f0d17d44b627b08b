"""What the official SDKs and peer clients send is honoured, or refused out loud (issue 16).

Through the openai and anthropic clients (and vLLM's shapes over plain HTTP) against `deepinfer
serve`: the coordinator, the recipe, the in-process node and the scheduler are real. The model is
a scripted test double (exact tokens) or, where a grammar must steer the sampling, the built-in
tiny model, which guidellm also benchmarks.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from coordinator_fakes import EOS, THINK_END, TOKENIZER_PATH, TOOL_CALL_TOKENS, ids
from scripted_executor import ScriptedExecutor

from deepinfer.config import Config
from deepinfer.constraints.compiler import GrammarCompiler
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.model.tiny import make_tiny_model
from deepinfer.server.errors import ApiError
from deepinfer.server.response_store import ResponseStore
from deepinfer.server.serve import create_serve_app
from deepinfer.tokenizer import Tokenizer

MODEL = "deepinfer-tiny"
MAX_MODEL_LEN = 4096  # ScriptedExecutor's
REASONING_MARKER = ids(" zebra")[-1]  # a user message ending in " zebra" selects SCRIPT
SCRIPT = [*ids("Let me think."), THINK_END, *ids("Hello there."), EOS]
PLAIN_MARKER = ids(" penguin")[-1]
PLAIN_SCRIPT = [*ids("Plain answer."), EOS]
TOOL_MARKER = ids(" giraffe")[-1]
# get_weather(city="Paris") as a required tool call is sampled: the prompt already opened the
# DSML block, so the output starts at its first invoke.
REQUIRED_CALL = TOOL_CALL_TOKENS[TOOL_CALL_TOKENS.index(THINK_END) + 8 :]
LONG_SCRIPT = ids(" word") * 200
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


class Served:
    """One `serve` app on a local port, with clients for it."""

    def __init__(self, server: TestServer, engine: LLMEngine) -> None:
        self.server = server
        self.engine = engine
        self.url = str(server.make_url(""))
        self.oai = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="k", max_retries=0)
        self.claude = anthropic.AsyncAnthropic(base_url=self.url, api_key="k", max_retries=0)

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(self.url + path, json=body) as r,
        ):
            return r.status, await r.json(content_type=None)


def _config(**server: Any) -> Config:
    return Config.load(
        overrides={"model": {"device": "cpu"}, "cache": {"block_size": 16}, "server": server},
        environ={},
    )


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    """``await serve(**server_config)``: a scripted `serve` whose engine compiles grammars."""
    servers: list[TestServer] = []

    async def start(**server: Any) -> Served:
        scripts = {REASONING_MARKER: SCRIPT, PLAIN_MARKER: PLAIN_SCRIPT, TOOL_MARKER: REQUIRED_CALL}
        executor = ScriptedExecutor(scripts, default_script=LONG_SCRIPT)
        engine = LLMEngine(_config(), executor=executor)
        # The scripted executor samples its script regardless of the mask, but the scheduler
        # still checks every token against the grammar.
        engine.tokenizer = Tokenizer.from_folder(TOKENIZER_PATH.parent)
        engine.grammar_compiler = GrammarCompiler(TOKENIZER_PATH, executor.vocab_size, EOS)
        app = create_serve_app(
            AsyncEngine(engine), _config(**server), tokenizer_path=TOKENIZER_PATH
        )
        test_server = TestServer(app)
        await test_server.start_server()
        servers.append(test_server)
        return Served(test_server, engine)

    yield start
    for test_server in servers:
        await test_server.close()


# ---- 1. max_completion_tokens -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_max_completion_tokens_is_honoured_and_wins_over_max_tokens(serve) -> None:
    served = await serve()
    messages = [{"role": "user", "content": "talk"}]
    out = await served.oai.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=3
    )
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (3, "length")
    both = await served.oai.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=2, max_tokens=9
    )
    assert both.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as info:
        await served.oai.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=0
        )
    assert info.value.body["param"] == "max_completion_tokens"
    assert "the valid range of max_completion_tokens is [1, 4096]" in info.value.message


# ---- 2. default max_tokens, the range against the context, Messages' required max_tokens -------


@pytest.mark.asyncio
async def test_default_max_tokens_range_and_messages_require_max_tokens(serve) -> None:
    served = await serve(default_max_tokens=7)
    messages = [{"role": "user", "content": "talk"}]
    out = await served.oai.chat.completions.create(model=MODEL, messages=messages)
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (7, "length")
    response = await served.oai.responses.create(model=MODEL, input="talk")
    assert (response.usage.output_tokens, response.status) == (7, "incomplete")
    with pytest.raises(openai.BadRequestError, match=r"valid range of max_tokens is \[1, 4096\]"):
        await served.oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=5000)
    with pytest.raises(anthropic.BadRequestError) as info:
        await served.claude.messages.create(
            model=MODEL, messages=messages, max_tokens=anthropic.NOT_GIVEN, timeout=30
        )
    assert info.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    counted = await served.claude.messages.count_tokens(model=MODEL, messages=messages)
    assert counted.input_tokens > 0  # counting needs no max_tokens


# ---- 3. Anthropic tool_choice any ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_tool_choice_any_is_a_required_tool_call(serve) -> None:
    served = await serve()
    kw: dict[str, Any] = dict(
        model=MODEL,
        max_tokens=256,
        messages=[{"role": "user", "content": "Weather, giraffe"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "any"},
    )
    with pytest.raises(anthropic.BadRequestError, match="Thinking mode does not support this"):
        await served.claude.messages.create(**kw)
    message = await served.claude.messages.create(**kw, thinking={"type": "disabled"})
    assert message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in message.content] == [
        ("tool_use", "get_weather", {"city": "Paris"})
    ]
    # The prompt ends in the opened DSML block, as for OpenAI's "required" (a scripted answer
    # that did not start at an invoke would have been cut by the grammar).
    counted = await served.claude.messages.count_tokens(
        model=MODEL,
        messages=kw["messages"],
        tools=kw["tools"],
        tool_choice={"type": "any"},
        thinking={"type": "disabled"},
    )
    auto = await served.claude.messages.count_tokens(
        model=MODEL, messages=kw["messages"], tools=kw["tools"], thinking={"type": "disabled"}
    )
    assert counted.input_tokens - auto.input_tokens == len(ids("\n\n<｜DSML｜tool_calls>\n"))


# ---- 4. Responses: thinking, previous_response_id, store, GET ------------------------------------


@pytest.mark.asyncio
async def test_responses_take_thinking_as_chat_does(serve) -> None:
    served = await serve()
    plain = await served.oai.responses.create(
        model=MODEL, input="Answer, penguin", extra_body={"thinking": {"type": "disabled"}}
    )
    assert [item.type for item in plain.output] == ["message"]
    assert plain.output_text == "Plain answer." and plain.reasoning.effort == "none"
    thinking = await served.oai.responses.create(
        model=MODEL, input="Say hi, zebra", extra_body={"thinking": {"type": "enabled"}}
    )
    assert [item.type for item in thinking.output] == ["reasoning", "message"]
    assert thinking.output_text == "Hello there." and thinking.reasoning.effort == "high"
    with pytest.raises(openai.BadRequestError, match="Invalid thinking"):
        await served.oai.responses.create(
            model=MODEL, input="x", extra_body={"thinking": {"type": "maybe"}}
        )


@pytest.mark.asyncio
async def test_responses_are_stored_continued_and_retrieved(serve) -> None:
    served = await serve()
    first = await served.oai.responses.create(model=MODEL, input="Say hi, zebra")
    second = await served.oai.responses.create(
        model=MODEL, input="Once more, zebra", previous_response_id=first.id
    )
    assert second.previous_response_id == first.id and second.output_text == "Hello there."
    # The same conversation sent whole, stateless.
    whole = await served.oai.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Say hi, zebra"},
            *(item.model_dump(exclude_none=True) for item in first.output),
            {"role": "user", "content": "Once more, zebra"},
        ],
        store=False,
    )
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert (await served.oai.responses.retrieve(second.id)) == second
    stream = await served.oai.responses.create(
        model=MODEL, input="Again, zebra", previous_response_id=second.id, stream=True
    )
    events = [event async for event in stream]
    completed = events[-1].response
    assert events[0].response.previous_response_id == second.id
    assert completed.previous_response_id == second.id and completed.status == "completed"
    assert (await served.oai.responses.retrieve(completed.id)) == completed
    for missing in (whole.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError, match=f"'{missing}' not found"):
            await served.oai.responses.retrieve(missing)
    with pytest.raises(openai.NotFoundError, match="Previous response with id 'resp_x'"):
        await served.oai.responses.create(model=MODEL, input="x", previous_response_id="resp_x")


def test_response_store_bounds_its_bytes_least_recently_used_first() -> None:
    def response(response_id: str) -> dict[str, Any]:
        return {"id": response_id, "output": [{"type": "message", "content": response_id}]}

    size = len(json.dumps([{"role": "user", "content": "q"}])) + len(json.dumps(response("r1")))
    store = ResponseStore(max_bytes=2 * size + 1)
    for response_id in ("r1", "r2"):
        _, turn = store.begin({"input": "q"})
        turn.finish(response(response_id))
    store.get("r1")  # now r2 is the least recently used
    body, turn = store.begin({"input": "again", "previous_response_id": "r1", "store": True})
    assert body == {
        "input": [
            {"role": "user", "content": "q"},
            {"type": "message", "content": "r1"},
            {"role": "user", "content": "again"},
        ],
        "store": True,
    }
    _, unstored = store.begin({"input": "q", "store": False})
    unstored.finish(response("r9"))
    assert (len(store), store.num_bytes) == (2, 2 * size)
    store.put([{"role": "user", "content": "q"}], response("r3"))
    assert (len(store), store.num_bytes) == (2, 2 * size)
    assert [store.get(r)["id"] for r in ("r1", "r3")] == ["r1", "r3"]
    for missing in ("r2", "r9"):
        with pytest.raises(ApiError, match=f"'{missing}' not found"):
            store.get(missing)
    turn.finish(response("r4"))  # its whole conversation outgrows the store: not kept
    assert turn.input_items == body["input"] and len(store) == 2
    with pytest.raises(ApiError, match="'r4' not found"):
        store.get("r4")


@pytest.mark.asyncio
async def test_no_response_store_refuses_previous_response_id(serve) -> None:
    served = await serve(response_store_mib=0)
    first = await served.oai.responses.create(model=MODEL, input="Say hi, zebra")
    with pytest.raises(openai.NotFoundError, match="response_store_mib"):
        await served.oai.responses.create(model=MODEL, input="x", previous_response_id=first.id)


# ---- 5. structured output: the refusals (the enforcement is on the tiny model below) -------------


STRUCTURED_REFUSALS = [
    # (extra body, 400 message part, param)
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "one structured output at most", None),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
     "cannot be combined with the request's response_format", "guided_json"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag is not",
     "structured_outputs.structural_tag"),
    ({"guided_choice": []}, "non-empty list of strings", "guided_choice"),
    ({"guided_json": "{not json"}, "Invalid guided_json: not JSON", "guided_json"),
    ({"guided_regex": "[a-"}, "invalid regex", None),  # the node's compile error
    ({"guided_grammar": "root ::= ("}, "invalid EBNF grammar", None),
]  # fmt: skip


@pytest.mark.asyncio
async def test_structured_output_fields_that_cannot_be_honoured_are_refused(serve) -> None:
    served = await serve()
    messages = [{"role": "user", "content": "json please"}]
    for extra, text, param in STRUCTURED_REFUSALS:
        with pytest.raises(openai.BadRequestError) as info:
            await served.oai.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, extra_body=extra
            )
        assert text in info.value.message, (extra, info.value.message)
        assert info.value.body["param"] == param, (extra, info.value.body)
    assert not served.engine.has_unfinished_requests()


# ---- 6. vLLM's endpoints and GET /v1/models/{id} -----------------------------------------------


@pytest.mark.asyncio
async def test_tokenize_detokenize_version_ping_and_one_model(serve) -> None:
    served = await serve()
    status, body = await served.post(
        "/tokenize", {"prompt": "Hello world", "return_token_strs": True}
    )
    assert status == 200
    assert body == {
        "count": 2,
        "max_model_len": MAX_MODEL_LEN,
        "tokens": ids("Hello world"),
        "token_strs": ["Hello", "Ġworld"],
    }
    messages = [{"role": "user", "content": "Say hi, zebra"}]
    chat = await served.oai.chat.completions.create(model=MODEL, messages=messages)
    status, body = await served.post("/tokenize", {"model": MODEL, "messages": messages})
    assert (status, body["count"], body["token_strs"]) == (200, chat.usage.prompt_tokens, None)
    status, refused = await served.post(
        "/tokenize", {"messages": messages, "continue_final_message": True}
    )
    assert status == 400 and refused["error"]["param"] == "continue_final_message"
    status, body = await served.post("/detokenize", {"tokens": ids("Hello world")})
    assert (status, body) == (200, {"prompt": "Hello world"})
    status, body = await served.post("/detokenize", {"model": "gpt-x", "tokens": [1]})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{served.url}/version") as r:
            assert (r.status, await r.json()) == (200, {"version": "0.1.0"})
        for method in ("GET", "POST"):
            async with session.request(method, f"{served.url}/ping") as r:
                assert (r.status, await r.read()) == (200, b"")
    keyed = await serve(api_keys="secret")
    status, body = await keyed.post("/tokenize", {"prompt": "Hello world"})
    assert status == 401 and "API key" in body["error"]["message"]
    model = await served.oai.models.retrieve(MODEL)
    assert (model.id, model.model_extra["max_model_len"]) == (MODEL, MAX_MODEL_LEN)
    with pytest.raises(openai.NotFoundError, match="`gpt-x` does not exist"):
        await served.oai.models.retrieve("gpt-x")


# ---- the built-in tiny model: grammars steer the sampling; guidellm ----------------------------


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", seed=0)
    return LLMEngine(_tiny_config(folder))


def _tiny_config(folder: Path) -> Config:
    return Config.load(
        overrides={"model": {"device": "cpu", "path": str(folder)}, "cache": {"block_size": 16}},
        environ={},
    )


@pytest_asyncio.fixture
async def tiny(tiny_engine: LLMEngine) -> AsyncIterator[Served]:
    app = create_serve_app(AsyncEngine(tiny_engine), tiny_engine.config)
    async with TestServer(app) as server:
        yield Served(server, tiny_engine)


@pytest.mark.asyncio
async def test_vllm_structured_output_fields_are_enforced(tiny: Served) -> None:
    off = {"thinking": {"type": "disabled"}}
    messages = [{"role": "user", "content": "Pick one."}]

    async def chat(**kw: Any) -> str:
        out = await tiny.oai.chat.completions.create(
            model="tiny", messages=messages, max_tokens=24, seed=1, **kw
        )
        assert out.choices[0].finish_reason == "stop", out.choices[0]
        return out.choices[0].message.content

    choices = ["red", "green", "blue"]
    assert await chat(extra_body={**off, "guided_choice": choices}) in choices
    color = json.loads(await chat(extra_body={**off, "guided_json": {"enum": choices}}))
    assert color in choices
    schema = {"name": "color", "schema": {"enum": choices}, "strict": True}
    strict = await chat(
        response_format={"type": "json_schema", "json_schema": schema}, extra_body=off
    )
    assert json.loads(strict) in choices
    outputs = {"regex": "[a-c]{2}-[0-9]", "json_object": False, "grammar": None}
    code = await chat(extra_body={**off, "structured_outputs": outputs})
    assert len(code) == 4 and code[:2] in {a + b for a in "abc" for b in "abc"} and code[2] == "-"
    completion = await tiny.oai.completions.create(
        model="tiny",
        prompt="Answer:",
        max_tokens=8,
        extra_body={"guided_grammar": 'root ::= "yes" | "no"'},
    )
    assert completion.choices[0].text in ("yes", "no")


@pytest.mark.asyncio
async def test_guidellm_concurrent_profile_completes_every_request(
    tiny: Served, tmp_path: Path
) -> None:
    """guidellm's concurrent profile (4 streams, 16 requests of 128 prompt and 16 output tokens,
    sent as max_completion_tokens), tokenizing with the model's own folder (no network)."""
    # A test extra: missing, this fails (it is no reason to skip).
    assert importlib.util.find_spec("guidellm"), "guidellm is missing: pip install -e '.[test]'"
    out = tmp_path / "benchmarks.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={tiny.url.rstrip('/')}",
        "--profile", "kind=concurrent,streams=4",
        "--constraint", "kind=max_requests,count=16",
        "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=16",
        "--tokenizer", f"kind=huggingface_auto,model={tiny.engine.model_dir}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env, cwd=tmp_path,
    )  # fmt: skip
    log, _ = await asyncio.wait_for(proc.communicate(), timeout=240)
    assert proc.returncode == 0, log.decode()[-3000:]
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    assert totals == {"successful": 16, "errored": 0, "incomplete": 0, "total": 16}
    requests = benchmark["requests"]["successful"]
    # The limit is honoured; random weights sampled at temperature 1 may end a request early (a
    # sampled end or tool-call token), so not every one reaches it.
    assert all(1 <= r["output_tokens"] <= 16 for r in requests), requests
    assert sum(r["output_tokens"] == 16 for r in requests) >= 12, requests
