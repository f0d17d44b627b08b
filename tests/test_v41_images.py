"""Images end to end on the built-in tiny DeepSeek-V4.1 (a toy vision tower): the engine grows
each placeholder to the image's positions, encodes each image once (cached by its bytes' digest)
and keys the prefix cache by the images' digests; `serve` takes images through the official
openai client (an allow-listed loopback URL and a data URL), refuses other hosts without
fetching them, and refuses too many or too large images.

Oracles: the same request alone, batched, chunked through its images and served from the
prefix cache gives the same greedy tokens and logprobs (1e-5); swapping the images changes the
answer and misses the cache past the first image.
"""

from __future__ import annotations

import base64
import io
import itertools
from pathlib import Path
from typing import Any

import deepseek_recipe as recipe
import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer import LLM, SamplingParams
from deepinfer.images import ImageInput
from deepinfer.kv_cache.events import CacheLayout, block_key
from deepinfer.model.families import image_expansion, read_config
from deepinfer.scheduler.request import Request
from deepinfer.server.cache_index import prompt_keys

IMAGE_TOKEN = 129279  # the tiny V4.1's image_token_id (the tokenizer's <｜image｜>)
SELF_ATOL = 1e-5
_ids = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)


def _png(seed: int, width: int = 64, height: int = 48) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def _image(seed: int) -> ImageInput:
    """What the request side sends for an image: recipe's preprocessing of it."""
    info = recipe.OpenCvImagePreprocessor().preprocess(
        _png(seed), recipe.PreprocessOptions("high", 10000, 1000)
    )
    return ImageInput(info.data, info.width, info.height)


A, B = _image(1), _image(2)
PROMPT = [0, 5, 6, 7, IMAGE_TOKEN, *range(100, 140), IMAGE_TOKEN, 9, 10]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)


def _run(llm: LLM, work: list[tuple[list[int], list[ImageInput]]]) -> list[Request]:
    engine = llm.engine
    assert engine is not None
    requests = [
        engine.add_request(f"r{next(_ids)}", prompt, GREEDY, images=images)
        for prompt, images in work
    ]
    while engine.has_unfinished_requests():
        engine.step()
    return requests


def _logprobs(request: Request) -> torch.Tensor:
    pairs = zip(request.output_logprobs, request.output_token_ids, strict=True)
    return torch.tensor([d[t] for d, t in pairs])


def _same(a: Request, b: Request) -> None:
    assert b.output_token_ids == a.output_token_ids
    assert (_logprobs(a) - _logprobs(b)).abs().max().item() < SELF_ATOL


def test_embeddings_evicted_to_the_tiers_come_back_without_encoding(
    tiny_v41_dir: Path, tmp_path: Path
) -> None:
    """A device cache that holds one image's embeddings, a host tier that holds two, and a disk
    tier that a second cache (a restarted node, or another one on the mount) reads."""
    from deepinfer.engine.image_embeddings import ImageEmbeddings
    from deepinfer.images import decode_images
    from deepinfer.kv_cache.disk_tier import DiskTier
    from deepinfer.kv_cache.tiers import HostTier

    llm = LLM(tiny_v41_dir, device="cpu", dtype="float32", block_size=16)
    encode = llm.engine.executor.images.encode
    a, b, c, d = decode_images([A, B, _image(3), _image(4)])
    want = llm.engine.executor.images.embeddings([a, b, c, d])
    size = want[a.digest].numel() * want[a.digest].element_size()

    def cache(host: int) -> ImageEmbeddings:
        tiers = HostTier(host, pin_memory=False) if host else None
        disk = DiskTier(tmp_path / "embeddings", 8 * size, b"salt")
        return ImageEmbeddings(encode, torch.device("cpu"), torch.from_numpy, size, tiers, disk)

    first = cache(host=2 * size)
    for image in (a, b, c):  # a, then b, go to the host tier
        first.embeddings([image])
    got = first.embeddings([a, b])
    assert first.stats.num_encoded == 3 and first.stats.num_host_hits == 2
    # Room for three in memory: a fourth pushes the least recently used (c) on to the disk.
    first.embeddings([d])
    first.embeddings([c])
    assert first.stats.num_encoded == 4 and first.stats.num_disk_hits == 1
    assert first.disk is not None
    first.disk.flush()

    second = cache(host=0)  # what the first wrote to the disk tier, none of its memory
    got.update(second.embeddings([a, b, c, d]))
    assert (
        second.stats.num_encoded < 4 and second.stats.num_disk_hits == 4 - second.stats.num_encoded
    )
    assert all(torch.equal(got[i.digest], want[i.digest]) for i in (a, b, c, d))


def test_images_batched_chunked_and_cached_match_alone(tiny_v41_dir: Path) -> None:
    llm = LLM(tiny_v41_dir, device="cpu", dtype="float32", block_size=16)
    (alone,) = _run(llm, [(PROMPT, [A, B])])
    grid_tokens = [s.num_tokens for s in alone.images]
    assert len(alone.prompt_token_ids) == len(PROMPT) - 2 + sum(grid_tokens)
    assert alone.num_cached_tokens == 0
    images = llm.engine.executor.images
    assert images.stats.num_encoded == 2

    # The same images again: none encoded, the prompt served from the prefix cache.
    (again,) = _run(llm, [(PROMPT, [A, B])])
    _same(alone, again)
    assert images.stats.num_encoded == 2
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 16

    # The coordinator's routing keys (the prompt grown by the family table's expansion, off
    # the checkpoint's config.json) are the node's block keys, images' digests included.
    expand = image_expansion(read_config(tiny_v41_dir))
    assert expand is not None
    grown, spans = expand(PROMPT, [A, B])
    assert grown == again.prompt_token_ids
    prefix = llm.engine.scheduler.prefix
    assert prefix is not None
    keys = prompt_keys(grown, CacheLayout(prefix.cache.salt, 16), None, spans)
    assert keys == [block_key(h) for h in again.reuse.block_hashes[: len(keys)]]
    assert len(keys) == (len(grown) - 1) // 16

    # Other images in the same places: another answer, no hit past the first image.
    (swapped,) = _run(llm, [(PROMPT, [B, A])])
    assert swapped.output_token_ids != alone.output_token_ids
    assert swapped.num_cached_tokens <= alone.images[0].offset
    assert images.stats.num_encoded == 2  # both were cached

    # Batched with a text request, chunked through both images (37-token steps), no cache.
    chunked = LLM(
        tiny_v41_dir,
        device="cpu",
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=37,
        enable_prefix_caching=False,
    )
    text, together = _run(chunked, [(list(range(200, 260)), []), (PROMPT, [A, B])])
    _same(alone, together)
    assert chunked.engine.executor.images.stats.num_encoded == 2  # once per image, not chunk
    assert not text.images

    with pytest.raises(ValueError, match=r"2 image placeholders \(token 129279\) for 1 images"):
        _run(llm, [(PROMPT, [A])])
    broken = ImageInput(A.data[:100], A.width, A.height)
    with pytest.raises(ValueError, match="could not be decoded"):
        _run(llm, [(PROMPT, [A, broken])])
    with pytest.raises(ValueError, match="whole number of 14-pixel patches"):
        _run(llm, [(PROMPT, [A, ImageInput(_png(3), 64, 48)])])


# --- serve: the official openai client ---------------------------------------------------------


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.mark.asyncio
async def test_serve_answers_image_requests(tiny_v41_dir: Path) -> None:
    import aiohttp
    import openai
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from deepinfer.config import Config
    from deepinfer.engine.async_engine import AsyncEngine
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.server.serve import create_serve_app

    fetched: list[str] = []

    async def picture(request: web.Request) -> web.Response:
        fetched.append(request.path)
        big = request.match_info["name"] == "big"
        body = _png(9, width=200, height=200) if big else _png(7)
        return web.Response(body=body, content_type="image/png")

    pictures = web.Application()
    pictures.router.add_get("/{name}.png", picture)
    config = Config.load(
        overrides={
            "model": {"device": "cpu", "path": str(tiny_v41_dir)},
            "cache": {"block_size": 16},
            "server": {
                "image_url_allowlist": ["127.0.0.1"],
                "max_images_per_request": 3,
                "max_image_bytes": 20000,
            },
        },
        environ={},
    )
    engine = LLMEngine(config)
    async with (
        TestServer(pictures, host="127.0.0.1") as images,
        TestServer(create_serve_app(AsyncEngine(engine), config)) as server,
    ):
        oai = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k", max_retries=0)

        async def ask(*parts: dict[str, Any]) -> Any:
            content = [*parts, {"type": "text", "text": "What is in these images?"}]
            return await oai.chat.completions.create(
                model="DeepSeek-V4.1-Flash",
                messages=[{"role": "user", "content": content}],
                max_tokens=4,
                temperature=0,
            )

        def image(url: str) -> dict[str, Any]:
            return {"type": "image_url", "image_url": {"url": url}}

        url = str(images.make_url("/cat.png"))
        first = await ask(image(url), image(_data_url(_png(8))))
        assert fetched == ["/cat.png"] and first.choices[0].message.content is not None
        stats = engine.executor.images.stats
        assert stats.num_encoded == 2
        # The usage counts every image position: more than the text and two placeholders.
        assert first.usage.prompt_tokens > 2 * 100

        again = await ask(image(url), image(_data_url(_png(8))))
        assert again.choices[0].message.content == first.choices[0].message.content
        assert stats.num_encoded == 2  # both images' embeddings cached
        assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32
        async with aiohttp.ClientSession() as session:
            metrics = await (await session.get(str(server.make_url("/metrics")))).text()
        assert 'deepinfer_images_encoded_total{component="node"' in metrics
        encoded = [line for line in metrics.splitlines() if "images_encoded_total{" in line]
        assert encoded and encoded[0].endswith(" 2.0"), encoded

        # Refused before anything is fetched: another host (the same server), too many images,
        # a data URL over server.max_image_bytes.
        other_host = url.replace("127.0.0.1", "localhost")
        with pytest.raises(openai.BadRequestError, match=r"not in server\.image_url_allowlist"):
            await ask(image(other_host))
        with pytest.raises(openai.BadRequestError, match=r"server\.max_images_per_request"):
            await ask(*[image(url)] * 4)
        large = _png(9, width=200, height=200)
        assert len(large) > 20000
        with pytest.raises(openai.BadRequestError, match=r"server\.max_image_bytes"):
            await ask(image(_data_url(large)))
        assert fetched == ["/cat.png"] * 2
        # A download over the limit, and bytes that are no image: the recipe's errors, 400.
        with pytest.raises(openai.BadRequestError):
            await ask(image(str(images.make_url("/big.png"))))
        assert fetched[-1] == "/big.png"
        with pytest.raises(openai.BadRequestError, match="unsupported image"):
            await ask(image("data:image/png;base64,iVBORw0KGgo="))


def test_an_image_request_hands_off_exactly(tiny_v41_dir: Path) -> None:
    """Prefill on one engine, decode on another: the decode engine expands the request as sent
    (its images undecoded: it never computes their positions) and continues as the prefill
    engine alone would; its cache keys the prompt's blocks by the images' digests, so the same
    images hit there and swapped ones do not."""
    from rank_workers import drain

    from deepinfer.config import Config
    from deepinfer.engine.llm_engine import LLMEngine

    config = Config.load(
        overrides={
            "model": {"device": "cpu", "path": str(tiny_v41_dir)},
            "cache": {"block_size": 16},
        },
        environ={},
    )
    prefill, decode = LLMEngine(config), LLMEngine(config)
    prefill.add_request("alone", PROMPT, GREEDY, images=[A, B])
    alone, _ = drain(prefill)
    prefill.add_request("sent", PROMPT, GREEDY, images=[A, B], hand_off=True)
    first, _ = drain(prefill)
    state = prefill.export_request("sent")
    prefill.release_hand_off("sent")
    sent = [ImageInput(i.data, i.width, i.height) for i in (A, B)]  # as the wire gives them
    prompt, spans = decode.expand_images("sent", PROMPT, sent)
    assert prompt == state.prompt_token_ids
    decode.import_request(state, GREEDY, images=spans)
    rest, _ = drain(decode)
    assert first + rest == alone
    assert decode.image_stats()["num_encoded"] == 0
    for name, images, hits in (("again", [A, B], True), ("swapped", [B, A], False)):
        request = decode.add_request(name, PROMPT, GREEDY, images=images)
        drain(decode)
        assert (request.num_cached_tokens > spans[1].offset) is hits, (name, request)
