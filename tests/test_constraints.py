"""Structured output on the built-in tiny model: every sampled output satisfies its constraint.

The random model's outputs often run to max_tokens before the grammar completes: those must be a
valid prefix (the matcher accepted every token); completed ones must validate fully, and each kind
must complete at least a few times.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
import xgrammar as xgr
from aiohttp.test_utils import TestServer

from deepinfer import LLM, SamplingParams
from deepinfer.constraints import ConstraintError
from deepinfer.constraints.compiler import GrammarCompiler, _is_dsml_safe, leaves_think_open
from deepinfer.constraints.matcher import allowed_token_mask
from deepinfer.engine.async_engine import AsyncEngine
from deepinfer.model.tiny import make_tiny_model
from deepinfer.server.serve import create_serve_app
from deepinfer.tokenizer import Tokenizer

NUM_SEEDS = 16
PROMPT = [0, 3476, 477, 260, 11502, 22896, 16, 128804, 128822]  # ...<｜Assistant｜></think>
THINKING_PROMPT = [0, 3476, 477, 260, 11502, 22896, 16, 128804, 128821]  # ...<think>
EOS = 1

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"type": "string", "enum": ["a", "b", "c"]},
        "tags": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 3,
        },
        "inner": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 50}},
            "required": ["ok"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "kind", "inner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-\d{2,4}"
WEATHER = {
    "type": "object",
    "properties": {
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["days", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "ping",
            "parameters": {
                "type": "object",
                "properties": {"on": {"type": "boolean"}},
                "required": ["on"],
            },
        },
    },
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    torch.set_num_threads(4)
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    return LLM(model=model_dir, device="cpu", block_size=16, max_num_seqs=4 * NUM_SEEDS)


@pytest.fixture(scope="module")
def compiler(llm: LLM) -> GrammarCompiler:
    compiler = llm.engine.grammar_compiler
    assert compiler is not None
    return compiler


@pytest.fixture(scope="module")
def outputs(llm: LLM) -> dict[str, list]:
    """NUM_SEEDS sampled outputs per kind, all in one batch (temperature 1)."""
    constraints = {
        "json": ("json", json.dumps(SCHEMA)),
        "json_object": ("json_object", ""),
        "regex": ("regex", REGEX),
        "tool_call_required": ("tool_call_required", json.dumps(TOOLS)),
    }
    max_tokens = {"json": 64, "json_object": 64, "regex": 16, "tool_call_required": 128}
    prompts, params = [], []
    for name, constraint in constraints.items():
        for seed in range(NUM_SEEDS):
            prompts.append(PROMPT)
            params.append(
                SamplingParams(seed=seed, max_tokens=max_tokens[name], constraint=constraint)
            )
    results = llm.generate(prompts, params, use_tqdm=False)
    names = list(constraints)
    return {name: results[i * NUM_SEEDS : (i + 1) * NUM_SEEDS] for i, name in enumerate(names)}


def _replay(compiler: GrammarCompiler, kind: str, schema: str, token_ids: list[int]) -> bool:
    """Feed ``token_ids`` to a fresh matcher (each token checked against its mask); True when
    the grammar terminated on EOS."""
    matcher = compiler.matcher(compiler.compile(kind, schema), PROMPT)
    for token_id in token_ids:
        mask = allowed_token_mask([matcher], compiler.vocab_size, "cpu")
        assert mask is not None and mask[0, token_id], f"token {token_id} was not allowed"
        assert matcher.accept(token_id)
    return matcher.is_terminated


def _completed(compiler: GrammarCompiler, kind: str, schema: str, outputs: list) -> list[str]:
    """Texts of the outputs that completed; every output is checked to be a valid prefix."""
    texts = []
    for out in outputs:
        completion = out.outputs[0]
        is_done = _replay(compiler, kind, schema, completion.token_ids)
        assert is_done == (completion.finish_reason == "stop"), completion
        if is_done:
            assert completion.token_ids[-1] == EOS
            texts.append(completion.text)
    assert len(texts) >= 2, f"only {len(texts)}/{len(outputs)} {kind} outputs completed"
    return texts


def test_json_schema_outputs_validate(compiler: GrammarCompiler, outputs: dict) -> None:
    for text in _completed(compiler, "json", json.dumps(SCHEMA), outputs["json"]):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_outputs_are_objects(compiler: GrammarCompiler, outputs: dict) -> None:
    for text in _completed(compiler, "json_object", "", outputs["json_object"]):
        assert isinstance(json.loads(text), dict), text


def test_regex_outputs_match(compiler: GrammarCompiler, outputs: dict) -> None:
    for text in _completed(compiler, "regex", REGEX, outputs["regex"]):
        assert re.fullmatch(REGEX, text), text


_INVOKE = re.compile(r'<｜DSML｜invoke name="([^"]+)">\s*(.*?)</｜DSML｜invoke>', re.S)
_PARAM = re.compile(
    r'<｜DSML｜parameter name="([^"]+)" string="(true|false)">(.*?)</｜DSML｜parameter>', re.S
)


def test_tool_calls_name_declared_tools(compiler: GrammarCompiler, outputs: dict) -> None:
    """Parsed as DSML (the format the recipe renders and parses): every invoke names a declared
    tool and its arguments validate against that tool's parameters."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    texts = _completed(
        compiler, "tool_call_required", json.dumps(TOOLS), outputs["tool_call_required"]
    )
    for text in texts:
        assert text.rstrip().endswith("</｜DSML｜tool_calls>"), text
        invokes = _INVOKE.findall(text)
        assert invokes, text
        for name, body in invokes:
            arguments = {
                key: value if is_string == "true" else json.loads(value)
                for key, is_string, value in _PARAM.findall(body)
            }
            jsonschema.validate(arguments, schemas[name])


def test_rollback_matches_a_fresh_matcher(compiler: GrammarCompiler) -> None:
    """Advance k tokens, roll back, advance differently: every mask equals a fresh matcher's."""
    kind, schema = "json", json.dumps(SCHEMA)
    compiled = compiler.compile(kind, schema)
    tokenizer = xgr_tokenizer(compiler)
    first = tokenizer('{"id": 12, "kind": "a"')
    second = tokenizer('{"id": 7, "kind": "b", "tags": [1')
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert 0 < common < len(first) - 2
    matcher = compiler.matcher(compiled, PROMPT)
    for token_id in first:
        assert matcher.accept(token_id)
    matcher.rollback(len(first) - common)
    for token_id in second[common:]:
        assert matcher.accept(token_id)
    fresh = compiler.matcher(compiled, PROMPT)
    for token_id in second:
        assert fresh.accept(token_id)
    masks = allowed_token_mask([matcher, fresh], compiler.vocab_size, "cpu")
    assert masks is not None and torch.equal(masks[0], masks[1])
    assert int(masks[0].sum()) < compiler.vocab_size  # the grammar constrains this position


def test_thinking_gate_and_its_rollback(compiler: GrammarCompiler) -> None:
    """In thinking mode everything is allowed until </think>; rolling back past it closes the
    gate again."""
    assert leaves_think_open(THINKING_PROMPT) and not leaves_think_open(PROMPT)
    matcher = compiler.matcher(compiler.compile("regex", REGEX), THINKING_PROMPT)
    assert allowed_token_mask([matcher], compiler.vocab_size, "cpu") is None
    for token_id in (3476, 477, 128822):
        assert matcher.accept(token_id)
    mask = allowed_token_mask([matcher, None], compiler.vocab_size, "cpu")
    assert mask is not None and bool(mask[1].all()) and int(mask[0].sum()) < 10_000
    matcher.rollback(1)
    assert not matcher.is_active
    assert allowed_token_mask([matcher], compiler.vocab_size, "cpu") is None


def test_mask_unpacking_matches_xgrammar(compiler: GrammarCompiler) -> None:
    """Our bool mask equals xgrammar's own apply_token_bitmask_inplace on the same state."""
    compiled = compiler.compile("regex", REGEX)
    matcher = compiler.matcher(compiled, PROMPT)
    allowed = allowed_token_mask([matcher], compiler.vocab_size, "cpu")
    reference = xgr.GrammarMatcher(compiled.grammar)
    bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
    reference.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, compiler.vocab_size)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    assert allowed is not None and torch.equal(allowed, logits.isfinite())


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (("json", '{"type": "objec"}'), "invalid JSON schema"),
        (("json", "{not json"), "invalid JSON schema: not JSON"),
        (("regex", "[a-z"), "invalid regex"),
        (("tool_call_required", "{}"), "invalid tool list"),
        (("ebnf", "root ::= foo"), "invalid EBNF grammar"),
    ],
)
def test_invalid_constraint_is_a_value_error(llm: LLM, constraint: tuple, message: str) -> None:
    params = SamplingParams(max_tokens=4, constraint=constraint)
    with pytest.raises(ConstraintError, match=re.escape(message)):
        llm.generate([PROMPT], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_unknown_kind_and_eos_conflicts_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown output constraint kind 'yaml'"):
        SamplingParams(constraint=("yaml", ""))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(constraint=("regex", "a"), min_tokens=2)


def _ids(compiler: GrammarCompiler, text: str) -> list[int]:
    return Tokenizer.from_folder(compiler.tokenizer_path.parent).encode(text)


def _allowed(matcher, compiler: GrammarCompiler) -> torch.Tensor:
    mask = allowed_token_mask([matcher], compiler.vocab_size, "cpu")
    assert mask is not None
    return mask[0]


def test_tool_call_auto_frees_text_until_the_block_opens(compiler: GrammarCompiler) -> None:
    """Auto tool choice: any text (and EOS) until ``<｜DSML｜tool_calls>`` opens a block; from
    there only invokes of the declared tools with valid arguments, then the block's end."""
    matcher = compiler.matcher(compiler.compile("tool_call", json.dumps(TOOLS)), PROMPT)
    hello = _ids(compiler, " hello")[0]
    allowed = _allowed(matcher, compiler)
    assert allowed[hello] and allowed[EOS]
    for token_id in _ids(compiler, "Sure.\n\n<｜DSML｜tool_calls>\n"):
        assert _allowed(matcher, compiler)[token_id] and matcher.accept(token_id)
    allowed = _allowed(matcher, compiler)
    assert not allowed[hello] and not allowed[EOS]
    wrong = _ids(compiler, '<｜DSML｜invoke name="send_email">')
    block = (
        '<｜DSML｜invoke name="ping">\n'
        '<｜DSML｜parameter name="on" string="false">true</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    accepted = 0
    for token_id in wrong:  # an undeclared tool is refused partway through its name
        if not _allowed(matcher, compiler)[token_id]:
            break
        assert matcher.accept(token_id)
        accepted += 1
    assert accepted < len(wrong)
    matcher.rollback(accepted)
    for token_id in _ids(compiler, block):
        assert _allowed(matcher, compiler)[token_id], compiler
        assert matcher.accept(token_id)
    assert _allowed(matcher, compiler)[EOS] and matcher.accept(EOS) and matcher.is_terminated


@pytest.mark.asyncio
async def test_required_tool_calls_parse_with_the_recipe(llm: LLM) -> None:
    """tool_choice="required" through `deepinfer serve` (coordinator, recipe, node, engine): over
    many seeds, the calls the recipe's parser returns name declared tools and their arguments
    validate against those tools' schemas."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    server = TestServer(create_serve_app(AsyncEngine(llm.engine), llm.engine.config))
    await server.start_server()
    try:
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k")
        model = (await client.models.list()).data[0].id

        async def ask(seed: int):
            return await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "What is the weather?"}],
                tools=TOOLS,
                tool_choice="required",
                max_tokens=128,
                seed=seed,
                extra_body={"thinking": {"type": "disabled"}},
            )

        answers = await asyncio.gather(*(ask(seed) for seed in range(NUM_SEEDS)))
    finally:
        await server.close()
    complete = [a.choices[0] for a in answers if a.choices[0].finish_reason == "tool_calls"]
    assert len(complete) >= 2, [a.choices[0].finish_reason for a in answers]
    for choice in complete:
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_compile_cache_is_bounded_lru(tmp_path: Path, compiler: GrammarCompiler) -> None:
    small = GrammarCompiler(compiler.tokenizer_path, compiler.vocab_size, EOS, max_cached=2)
    try:
        first = small.compile_async("regex", "a")
        first.result()
        assert small.compile_async("regex", "a") is first  # cached
        small.compile("regex", "b")
        small.compile_async("regex", "a")  # refresh: "b" is now the oldest
        small.compile("regex", "c")
        assert small.num_cached() == 2
        assert small.compile_async("regex", "a") is first
        failed = small.compile_async("regex", "[")
        with pytest.raises(ConstraintError):
            failed.result()
        assert small.compile_async("regex", "[") is not failed  # failures are not cached
    finally:
        small.shutdown()


def xgr_tokenizer(compiler: GrammarCompiler):
    """Text -> token ids with the model's tokenizer."""
    from deepinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(compiler.tokenizer_path.parent)
    return lambda text: tokenizer.backend.encode(text, add_special_tokens=False).ids


@pytest.mark.asyncio
async def test_node_enforces_and_refuses_constraints(aiohttp_client, llm: LLM) -> None:
    """Through the node's HTTP API on the tiny model: an invalid regex is a 400 naming it; a
    valid one streams a matching output."""
    from deepinfer.config import Config, NodeConfig
    from deepinfer.engine.async_engine import AsyncEngine
    from deepinfer.server.node import create_node_app
    from deepinfer.server.node_client import NodeClient, NodeError
    from deepinfer.server.protocol import GenerateRequest, OutputConstraint, SamplingOptions

    config = Config(node=NodeConfig(node_id="n0"))
    engine = AsyncEngine(llm.engine, max_step_s=config.node.max_step_s)
    client = await aiohttp_client(create_node_app(engine, config))
    api = NodeClient(str(client.make_url("")), session=client.session)

    def request(rid: str, pattern: str) -> GenerateRequest:
        return GenerateRequest(
            request_id=rid,
            prompt_token_ids=PROMPT,
            sampling=SamplingOptions(seed=3, max_tokens=16),
            constraint=OutputConstraint(kind="regex", schema=pattern),
        )

    with pytest.raises(NodeError) as info:
        async for _ in api.generate(request("bad", "[a-z")):
            pass
    assert info.value.status == 400 and "invalid regex" in info.value.message
    token_ids = []
    async for delta in api.generate(request("good", REGEX)):
        token_ids.extend(delta.token_ids)
    assert token_ids[-1] == EOS
    text = llm.engine.tokenizer.decode(token_ids[:-1])
    assert re.fullmatch(REGEX, text), text


def test_dsml_token_rule() -> None:
    """The tokens a DSML tool call may not use: the marker's bar spelled in ordinary tokens,
    and ``<`` / ``</`` glued to other bytes (the recipe would read either as argument text)."""
    for text in (b"<", b"</", b"hello", b">\n", b"\xef\xbc\x8c"):  # the last: a fullwidth comma
        assert _is_dsml_safe(text), text
    for text in (b"\r</", b"\n\n<", b'="<', b"\xef", b"a\xef\xbd", b"\xef\xbd\x9cDSML"):
        assert not _is_dsml_safe(text), text
