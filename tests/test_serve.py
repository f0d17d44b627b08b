"""`deepinfer serve` end to end through the official openai client: the coordinator, the recipe,
the in-process node and the scheduler are real; the model is a scripted test double (exact
reasoning/content/usage, disconnect accounting) or the built-in tiny model (prefix-cache usage).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from coordinator_fakes import EOS, THINK_END, TOKENIZER_PATH, ids
from prometheus_client.parser import text_string_to_metric_families
from scripted_executor import ScriptedExecutor

from deepinfer.config import Config
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.model.tiny import make_tiny_model
from deepinfer.server.serve import create_serve_app

pytestmark = pytest.mark.asyncio

MARKER = ids(" zebra")[-1]  # a user message ending in " zebra" selects SCRIPT
SCRIPT = [*ids("Let me think."), THINK_END, *ids("Hello there."), EOS]
STOP_MARKER = ids(" giraffe")[-1]  # selects STOP_SCRIPT: text with "STOP" inside, then more
STOP_SCRIPT = [*ids("Hi"), THINK_END, *ids("Hello STOP there and more"), EOS]
LONG_SCRIPT = ids(" word") * 200


def _config(**cache) -> Config:
    return Config.load(
        overrides={"model": {"device": "cpu"}, "cache": {"block_size": 16, **cache}}, environ={}
    )


async def _server(engine: LLMEngine, config: Config, **kw) -> TestServer:
    app = create_serve_app(AsyncEngine(engine), config, **kw)
    server = TestServer(app)
    await server.start_server()
    return server


@pytest_asyncio.fixture
async def scripted() -> AsyncIterator[tuple[openai.AsyncOpenAI, LLMEngine]]:
    scripts = {MARKER: SCRIPT, STOP_MARKER: STOP_SCRIPT}
    executor = ScriptedExecutor(scripts, default_script=LONG_SCRIPT, step_delay_s=0.01)
    engine = LLMEngine(_config(), executor=executor)
    server = await _server(engine, _config(), tokenizer_path=TOKENIZER_PATH)
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k", max_retries=0)
    yield client, engine
    await server.close()


async def test_reasoning_content_and_usage(scripted) -> None:
    client, _ = scripted
    messages = [{"role": "user", "content": "Say hi, zebra"}]
    out = await client.chat.completions.create(model="deepinfer-tiny", messages=messages)
    message = out.choices[0].message
    assert message.reasoning_content == "Let me think."
    assert message.content == "Hello there."
    assert out.choices[0].finish_reason == "stop"
    # EOS ends the request and is not counted; </think> counts as a completion token but, as
    # deepseek-recipe counts them, not as a reasoning token.
    assert out.usage.completion_tokens == len(SCRIPT) - 1
    assert out.usage.completion_tokens_details.reasoning_tokens == len(ids("Let me think."))
    stream = await client.chat.completions.create(
        model="deepinfer-tiny", messages=messages, stream=True
    )
    reasoning, content = "", ""
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert (reasoning, content) == ("Let me think.", "Hello there.")


async def test_stop_string_ends_the_request_on_the_node(scripted) -> None:
    client, engine = scripted
    messages = [{"role": "user", "content": "Say it, giraffe"}]
    out = await client.chat.completions.create(
        model="deepinfer-tiny", messages=messages, stop=["STOP"]
    )
    assert out.choices[0].message.content == "Hello "
    assert out.choices[0].finish_reason == "stop"
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_used_blocks == 0


async def test_messages_responses_and_completions(scripted) -> None:
    client, _ = scripted
    base = str(client.base_url).removesuffix("/v1/")
    claude = anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
    messages = [{"role": "user", "content": "Say hi, zebra"}]
    message = await claude.messages.create(model="deepinfer-tiny", max_tokens=64, messages=messages)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == (
        "Let me think.",
        "Hello there.",
    )
    assert message.stop_reason == "end_turn"
    response = await client.responses.create(model="deepinfer-tiny", input="Say hi, zebra")
    assert response.status == "completed" and response.output_text == "Hello there."
    completion = await client.completions.create(
        model="deepinfer-tiny", prompt="Once upon a time, zebra", max_tokens=40
    )
    # Raw completions: no chat template, so the script's reasoning marker is plain text.
    assert completion.choices[0].text == "Let me think.</think>Hello there."
    assert completion.choices[0].finish_reason == "stop"


async def test_disconnect_mid_stream_frees_every_block(scripted) -> None:
    client, engine = scripted
    stream = await client.chat.completions.create(
        model="deepinfer-tiny",
        messages=[{"role": "user", "content": "talk forever"}],
        max_tokens=150,
        stream=True,
    )
    received = 0
    async for _ in stream:
        received += 1
        if received == 5:
            break
    await stream.close()
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        await asyncio.sleep(0.01)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_used_blocks == 0
    engine.scheduler.check_integrity()


async def test_prefix_cache_hits_show_in_usage(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "tiny", seed=0)
    config = Config.load(
        overrides={"model": {"device": "cpu", "path": str(folder)}, "cache": {"block_size": 16}},
        environ={},
    )
    engine = await asyncio.get_running_loop().run_in_executor(None, LLMEngine, config)
    server = await _server(engine, config)
    try:
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k")
        messages = [{"role": "user", "content": "A long shared question. " * 20}]
        model = (await client.models.list()).data[0].id
        assert model == "tiny"  # the checkpoint folder's name
        kw = dict(model=model, messages=messages, max_tokens=2)
        first = await client.chat.completions.create(**kw)
        second = await client.chat.completions.create(**kw)
        prompt = first.usage.prompt_tokens
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = (prompt - 1) // 16 * 16
        assert second.usage.prompt_tokens_details.cached_tokens == cached
        extra = second.usage.model_extra
        assert (extra["prompt_cache_hit_tokens"], extra["prompt_cache_miss_tokens"]) == (
            cached,
            prompt - cached,
        )
    finally:
        await server.close()


@pytest.mark.parametrize("export_vllm_names", [True, False])
async def test_one_scrape_holds_the_coordinator_and_the_node(export_vllm_names: bool) -> None:
    executor = ScriptedExecutor({MARKER: SCRIPT}, default_script=LONG_SCRIPT)
    config = Config.load(
        overrides={
            "cache": {"block_size": 16},
            "metrics": {"export_vllm_names": export_vllm_names},
        },
        environ={},
    )
    server = await _server(
        LLMEngine(config, executor=executor), config, tokenizer_path=TOKENIZER_PATH
    )
    try:
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k")
        messages = [{"role": "user", "content": "Say hi, zebra"}]
        await client.chat.completions.create(model="deepinfer-tiny", messages=messages)
        async with (
            aiohttp.ClientSession() as session,
            session.get(str(server.make_url("/metrics"))) as response,
        ):
            text = await response.text()
    finally:
        await server.close()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    components = {
        name: sorted({s.labels.get("component") for s in f.samples}) for name, f in families.items()
    }
    # Both components' series of a family both have, in one family.
    for name in ("deepinfer_num_requests_running", "deepinfer_prompt_tokens"):
        assert components[name] == ["coordinator", "node"], name
    assert components["deepinfer_step_time_seconds"] == ["node"]
    assert components["deepinfer_time_to_first_token_seconds"] == ["coordinator"]
    # (name, component) -> value, of the samples with no labels besides the series' own.
    own = {"component", "model_name", "node"}
    samples = {
        (s.name, s.labels["component"]): s.value
        for f in families.values()
        for s in f.samples
        if set(s.labels) <= own
    }
    assert samples["deepinfer_prompt_tokens_total", "node"] > 0
    assert (
        samples["deepinfer_prompt_tokens_total", "node"]
        == samples["deepinfer_prompt_tokens_total", "coordinator"]
    )
    assert not [s.name for f in families.values() for s in f.samples if s.name.endswith("_created")]
    vllm = {name for name in families if name.startswith("vllm:")}
    if not export_vllm_names:
        assert vllm == set()
        return
    assert vllm == {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions",
        "vllm:request_success", "vllm:iteration_tokens_total", "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens", "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds", "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
    }  # fmt: skip
    # Taken from the component vLLM measures them in: no series counted twice.
    assert components["vllm:prompt_tokens"] == ["node"]
    assert components["vllm:time_to_first_token_seconds"] == ["coordinator"]
    assert (
        samples["vllm:prompt_tokens_total", "node"]
        == samples["deepinfer_prompt_tokens_total", "node"]
    )
    assert samples["vllm:request_prompt_tokens_count", "node"] == 1
    success = families["vllm:request_success"].samples
    assert [(s.labels["finished_reason"], s.value) for s in success] == [("stop", 1.0)]
