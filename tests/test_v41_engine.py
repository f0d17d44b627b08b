"""The engine's invariants on the built-in tiny DeepSeek-V4.1 (every block kind: C1 and C2
layers, KV / index-key / top-k sharing, candidate blocks, engram, drafter layers loaded): batched,
chunked and preempted runs reproduce the run alone; seeded sampling is batch invariant; decode
steps shaped as CUDA graphs run them reproduce the eager path; prefix hits from the device (with
a bounded replay or a snapshot), host and disk tiers reproduce a cold run.

Tolerance: 1e-5 on logprobs between our own runs (same kernels, other shapes); greedy tokens
identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_spies import graph_shaped, record_preemptions
from oracle import oracle_prompts, prompt_token_logprobs, sampled_logprobs

from deepinfer import LLM, SamplingParams
from deepinfer.outputs import RequestOutput

SELF_ATOL = 1e-5
NUM_NEW = 12
BLOCK = 16
BASE = 96  # the prefix-hit prompts share the first BASE tokens of the first 200 of the longest
REPLAY_BOUND = 8 * (8 - 1)  # num_layers * (window - 1)


@pytest.fixture(scope="module", autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)


def _llm(folder: Path, **kw: Any) -> LLM:
    return LLM(model=folder, device="cpu", dtype="float32", **kw)


@pytest.fixture(scope="module")
def alone(tiny_v41_dir: Path) -> list[RequestOutput]:
    llm = _llm(tiny_v41_dir)
    return [llm.generate([p], _greedy(), use_tqdm=False)[0] for p in oracle_prompts()]


def _greedy(prompt_logprobs: int | None = 0) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW, logprobs=0, prompt_logprobs=prompt_logprobs
    )


def _assert_same(alone: list[RequestOutput], together: list[RequestOutput], prompt: bool) -> None:
    for a, b in zip(alone, together, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        fns = (("sampled", sampled_logprobs),) + ((("prompt", prompt_token_logprobs),) * prompt)
        for name, fn in fns:
            diff = (fn(a) - fn(b)).abs().max().item()
            assert diff < SELF_ATOL, f"{name} logprobs differ by {diff:.2e}"


def test_batched_chunked_preempted_match_alone(
    tiny_v41_dir: Path, alone: list[RequestOutput]
) -> None:
    # Blocks of 16, 26 of them: the three prompts (+12 tokens each) need 29, so the youngest
    # request is preempted and recomputed; chunks of 37 tokens split prefills inside C2 windows
    # and candidate blocks, and mix them with decode tokens.
    tight = _llm(tiny_v41_dir, block_size=BLOCK, num_blocks=26, max_num_batched_tokens=37)
    preempted = record_preemptions(tight)
    together = tight.generate(oracle_prompts(), _greedy(), use_tqdm=False)
    assert preempted, "the memory limit was meant to force a preemption"
    _assert_same(alone, together, prompt=True)
    assert tight.engine.scheduler.block_manager.num_used_blocks == 0
    tight.engine.scheduler.check_integrity()


def test_seeded_sampling_is_batch_invariant(tiny_v41_dir: Path) -> None:
    llm = _llm(tiny_v41_dir)
    prompts = oracle_prompts()
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=NUM_NEW)
    other = SamplingParams(temperature=1.0, max_tokens=NUM_NEW)
    alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate(prompts, [other, seeded, other], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    reseeded = SamplingParams(temperature=0.8, top_p=0.95, seed=4321, max_tokens=NUM_NEW)
    assert llm.generate([prompts[1]], reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_graph_shaped_decode_steps_match_the_eager_path(
    tiny_v41_dir: Path, alone: list[RequestOutput]
) -> None:
    """Decode steps as CUDA graphs run them (requests padded onto the scratch slot, entry lists
    padded to the context bucket, the engram windows gathered from the uploaded ids), run
    eagerly on the CPU: the same tokens and logprobs as alone."""
    padded = _llm(tiny_v41_dir, block_size=BLOCK)
    steps = graph_shaped(padded.engine.executor)
    together = padded.generate(oracle_prompts(), _greedy(), use_tqdm=False)
    assert (3, 1) in steps, f"no decode step of all three requests ran padded: {steps}"
    _assert_same(alone, together, prompt=True)


def _first() -> list[int]:
    return oracle_prompts()[2][:200]


def _diverging(offset: int) -> list[int]:
    return _first()[: BASE + offset] + oracle_prompts()[1][1:41]


PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)


def _hit(llm: LLM, cold: LLM, offset: int) -> dict[str, int]:
    """Serve a prompt diverging from the first at BASE + offset; check it against a cold run;
    return the cached tokens by tier and the tokens replayed."""
    stats = llm.engine.scheduler.prefix.stats
    before, replayed = dict(stats.cached_tokens_by_tier), stats.num_replayed_tokens
    prompt = _diverging(offset)
    out = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    _assert_same([cold.generate([prompt], PARAMS, use_tqdm=False)[0]], [out], prompt=False)
    after = dict(stats.cached_tokens_by_tier)
    hits = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {
        **{k: v for k, v in hits.items() if v},
        "replayed": stats.num_replayed_tokens - replayed,
    }


def test_prefix_hits_match_cold(tiny_v41_dir: Path, tmp_path: Path) -> None:
    cold = _llm(tiny_v41_dir, block_size=BLOCK, enable_prefix_caching=False)
    # Device: no snapshot on the path (a bounded replay from an empty slot), then one.
    warm = _llm(tiny_v41_dir, block_size=BLOCK, snapshot_interval_blocks=0)
    warm.generate([_first()], PARAMS, use_tqdm=False)
    assert _hit(warm, cold, 3) == {"device": BASE, "replayed": REPLAY_BOUND}
    assert _hit(warm, cold, 1) == {"device": BASE, "replayed": 0}
    # Host and disk tiers: the first prompt evicted from the device by a long other one.
    for tier, kw in (
        ("host", {"host_tier_gib": 0.01}),
        ("disk", {"host_tier_gib": 0, "disk_tier_dir": str(tmp_path)}),
    ):
        llm = _llm(tiny_v41_dir, block_size=BLOCK, num_blocks=14, **kw)
        llm.generate([_first()], PARAMS, use_tqdm=False)
        other = (oracle_prompts()[1] * 4)[: 14 * BLOCK - PARAMS.max_tokens]
        llm.generate([other], PARAMS, use_tqdm=False)
        if llm.engine.tiers is not None:
            llm.engine.tiers.flush()
        hits = _hit(llm, cold, 8)
        assert hits.get(tier) == BASE and "device" not in hits, hits


# --- deepinfer serve on the tiny V4.1: the official clients, the V4.1 prompt encoding --------


@pytest.mark.asyncio
async def test_serve_answers_the_official_clients(tiny_v41_dir: Path) -> None:
    """The openai and anthropic clients against `serve` on the tiny V4.1: the prompt is the
    V4.1 encoding's (a system prompt spelled with <｜System｜>, which the V4 tokenizer lacks),
    the answers stream; a broken image gets a 400 that says why."""
    import anthropic
    import openai
    from aiohttp.test_utils import TestServer

    from deepinfer.config import Config
    from deepinfer.engine.async_engine import AsyncEngine
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.server.serve import create_serve_app

    config = Config.load(
        overrides={
            "model": {"device": "cpu", "path": str(tiny_v41_dir)},
            "cache": {"block_size": 16},
        },
        environ={},
    )
    engine = LLMEngine(config)
    prompts: list[list[int]] = []
    add = engine.add_request

    def spy(request_id: str, prompt_token_ids: list[int], *args: Any, **kw: Any) -> Any:
        prompts.append(list(prompt_token_ids))
        return add(request_id, prompt_token_ids, *args, **kw)

    engine.add_request = spy  # type: ignore[method-assign]
    app = create_serve_app(AsyncEngine(engine), config)
    async with TestServer(app) as server:
        url = str(server.make_url("")).rstrip("/")
        oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        out = await oai.chat.completions.create(
            model="DeepSeek-V4.1-Flash", messages=messages, max_tokens=6, seed=3
        )
        assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason
        system_id = engine.tokenizer.token_to_id("<｜System｜>")
        assert system_id is not None and system_id in prompts[-1]
        stream = await oai.chat.completions.create(
            model="DeepSeek-V4.1-Flash", messages=messages, max_tokens=4, stream=True
        )
        assert [chunk async for chunk in stream]
        claude = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)
        reply = await claude.messages.create(
            model="DeepSeek-V4.1-Flash",
            max_tokens=6,
            system="Be brief.",
            messages=[{"role": "user", "content": "Hi"}],
        )
        assert reply.usage.output_tokens >= 1
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        with pytest.raises(openai.BadRequestError, match="unsupported image"):
            await oai.chat.completions.create(
                model="DeepSeek-V4.1-Flash",
                messages=[{"role": "user", "content": [image, {"type": "text", "text": "?"}]}],
                max_tokens=4,
            )
