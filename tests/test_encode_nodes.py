"""Encode nodes with real processes (server/encode_node.py, server/image_transfer.py,
server/encoding.py): a coordinator, a mixed node and an encode node on the built-in tiny
DeepSeek-V4.1.

Oracles: the embeddings an encode node sends equal the mixed engine's in-process ones exactly
(fp32), and a request whose images were encoded there gives one engine's greedy tokens and
logprobs; a repeated image is encoded once and its prompt hits the mixed node's prefix cache;
kill -9 of the encode node mid-encode ends its request with an error naming it (or, through the
coordinator, a retry that encodes on the mixed node), within a bounded time, leaving nothing
running.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import msgspec
import openai
import processes
import pytest
import pytest_asyncio
import torch
from processes import clean_env, free_port
from prometheus_client.parser import text_string_to_metric_families
from test_v41_images import IMAGE_TOKEN, _image, _png

from deepinfer.config import Config, KVTransferConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.images import decode_images
from deepinfer.server.encoding import EncodedBackend
from deepinfer.server.kv_transfer import KVTransfers
from deepinfer.server.node_client import NodeClient
from deepinfer.server.pairing import PairKeys
from deepinfer.server.protocol import (
    EncodeRequest,
    GenerateRequest,
    HandOffRoute,
    ImageData,
    SamplingOptions,
)
from deepinfer.server.routing import NodeEntry, NodeError

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "DeepSeek-V4.1-Flash"
PAUSE_ENV = "DEEPINFER_TEST_ENCODE_PAUSE_S"
PAUSE_S = 1.5  # the encode node waits this long before each run of its tower
NODE_FLAGS = ("--device", "cpu", "--block-size", "16", "--num-threads", "1", "--lease-s", "5")
GREEDY = SamplingOptions(temperature=0.0, max_tokens=5, logprobs=0)
A, B = _image(1), _image(2)
PROMPT = [0, 5, 6, 7, IMAGE_TOKEN, *range(100, 140), IMAGE_TOKEN, 9, 10]
_ids = itertools.count()
_KEYS = PairKeys()


class Cluster(processes.Cluster):
    """An encode node, a mixed node and a coordinator over them (static nodes), as processes."""

    def __init__(self, folder: Path, model: Path) -> None:
        super().__init__(folder, model, ("encode", "mixed", "coordinator"))
        self.internal = free_port()

    def start(self, name: str) -> None:
        if name == "coordinator":
            args = ["coordinator", "--model", str(self.model), "--port", str(self.ports[name]),
                    "--internal-port", str(self.internal), "--node-probe-interval-s", "0.2",
                    "--encode-node", self.url("encode")]  # fmt: skip
        else:
            args = ["node", "--model", str(self.model), "--role", name,
                    "--port", str(self.ports[name]), *NODE_FLAGS]  # fmt: skip
        if name == "mixed":  # registers, and posts its prefix cache's events for routing
            args += ["--coordinator-internal-url", f"http://127.0.0.1:{self.internal}"]
        self.launch(name, args, clean_env(OMP_NUM_THREADS="1", **{PAUSE_ENV: str(PAUSE_S)}))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_v41_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("encode"), tiny_v41_dir)
    for name in ("encode", "mixed", "coordinator"):
        cluster.start(name)
    try:
        cluster.wait_ready("encode", "mixed", "coordinator")
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def engine(tiny_v41_dir: Path) -> LLMEngine:
    """One engine encoding in-process: what the nodes must reproduce."""
    model = {"device": "cpu", "path": str(tiny_v41_dir)}
    overrides = {"model": model, "cache": {"block_size": 16}, "kernel": {"num_threads": 1}}
    return LLMEngine(Config.load(overrides=overrides, environ={}))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _entries(cluster: Cluster, session: aiohttp.ClientSession) -> tuple[NodeEntry, NodeEntry]:
    encode = NodeEntry("e", NodeClient(cluster.url("encode"), session=session), 8192, role="encode")
    mixed = NodeEntry("m", NodeClient(cluster.url("mixed"), session=session), 8192)
    return encode, mixed


def _request(images: list) -> GenerateRequest:
    data = [ImageData(data=i.data, width=i.width, height=i.height) for i in images]
    return GenerateRequest(request_id=f"enc-{next(_ids)}", prompt_token_ids=PROMPT,
                           sampling=GREEDY, images=data)  # fmt: skip


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


async def _index_in_step(session: aiohttp.ClientSession, cluster: Cluster) -> None:
    deadline = time.monotonic() + 20
    while True:
        node = (await _metrics(session, cluster.url("mixed")))["deepinfer_cache_event_seq"]
        index = await _metrics(session, cluster.url("coordinator"))
        if index.get("deepinfer_router_index_seq") == node:
            return
        assert time.monotonic() < deadline, (node, index.get("deepinfer_router_index_seq"))
        await asyncio.sleep(0.05)


async def test_an_encode_nodes_embeddings_equal_the_engines_exactly(
    cluster: Cluster, session: aiohttp.ClientSession, engine: LLMEngine
) -> None:
    """The embeddings on the wire, received as a serving node receives them."""
    client = NodeClient(cluster.url("encode"), session=session)
    receiver = KVTransfers(KVTransferConfig(lease_s=10.0), hosts_store=False)
    route = HandOffRoute(pair_key=f"test-{next(_ids)}", transfer_id=1, peer="test")
    images = [ImageData(data=i.data, width=i.width, height=i.height) for i in (A, B)]
    frames = client.encode(EncodeRequest(request_id="direct", images=images, route=route))
    try:
        reserved = await anext(frames)
        route = reserved.route(route, "encode")
        receiving = asyncio.create_task(receiver.recv_parts(route))
        encoded = await anext(frames)
        assert encoded.num_images == 2
        header, parts = await asyncio.wait_for(receiving, 30)
        handed_off = await anext(frames)
        assert handed_off.num_bytes >= sum(p.numel() * p.element_size() for p in parts)
    finally:
        await frames.aclose()
        receiver.close()
    assert msgspec.msgpack.decode(header) == [A.digest, B.digest]
    want = engine.executor.images.embeddings(decode_images([A, B]))
    for image, part in zip((A, B), parts, strict=True):
        assert part.dtype == torch.float32
        assert torch.equal(part, want[image.digest].cpu())


async def test_a_request_encoded_there_gives_one_engines_tokens(
    cluster: Cluster, session: aiohttp.ClientSession, engine: LLMEngine
) -> None:
    encode, mixed = _entries(cluster, session)
    before = {n: await _metrics(session, cluster.url(n)) for n in ("encode", "mixed")}
    tokens, logprobs = [], []
    async for delta in EncodedBackend(encode, mixed, _KEYS).generate(_request([B, A])):
        tokens += delta.token_ids
        logprobs += delta.logprobs or []
    alone = engine.add_request("alone", PROMPT, GREEDY.to_sampling_params(), images=[B, A])
    while engine.has_unfinished_requests():
        engine.step()
    assert tokens == alone.output_token_ids
    want = [d[t] for d, t in zip(alone.output_logprobs, alone.output_token_ids, strict=True)]
    got = [d[t] for d, t in zip(logprobs, tokens, strict=True)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    after = {n: await _metrics(session, cluster.url(n)) for n in ("encode", "mixed")}

    def grew(node: str, name: str) -> float:
        return after[node].get(name, 0) - before[node].get(name, 0)

    # The images came from the encode node (its cache had both already: the test above).
    assert grew("mixed", "deepinfer_images_received_total") == 2
    assert grew("mixed", "deepinfer_images_encoded_total") == 0
    assert grew("encode", "deepinfer_image_cache_hits_total") == 2


async def test_through_the_coordinator_a_repeated_image_is_encoded_once_and_hits(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    oai = openai.AsyncOpenAI(base_url=cluster.url("coordinator") + "/v1", api_key="k",
                             max_retries=0)  # fmt: skip
    url = "data:image/png;base64," + base64.b64encode(_png(11)).decode()

    async def ask() -> openai.types.chat.ChatCompletion:
        content = [{"type": "image_url", "image_url": {"url": url}},
                   {"type": "text", "text": "What is in this image?"}]  # fmt: skip
        return await oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4,
            temperature=0,
        )  # fmt: skip

    before = await _metrics(session, cluster.url("encode"))
    first = await ask()
    # The coordinator's index has every block the node stored (its events) before the repeat.
    await _index_in_step(session, cluster)
    routed = await _metrics(session, cluster.url("coordinator"))
    again = await ask()
    after = await _metrics(session, cluster.url("encode"))
    assert first.choices[0].message.content == again.choices[0].message.content
    encoded = "deepinfer_images_encoded_total"
    assert after[encoded] - before[encoded] == 1  # the second found it cached
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 32
    # The routing keys run past the image (its digest and positions, as the node grows the
    # prompt): the hit the coordinator predicted is the node's, to the token.
    predicted = "deepinfer_router_predicted_cached_tokens_total"
    deadline = time.monotonic() + 10  # counted once the request's handler has ended
    while (now := await _metrics(session, cluster.url("coordinator")))[predicted] == routed.get(
        predicted, 0
    ):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert now[predicted] - routed.get(predicted, 0) == cached
    assert now.get("deepinfer_router_mispredicted_requests_total", 0) == 0
    mixed = await _metrics(session, cluster.url("mixed"))
    assert mixed["deepinfer_images_encoded_total"] == 0  # every image came from the encoder
    async with session.get(cluster.url("coordinator") + "/ready") as response:
        assert (await response.json())["num_encode_nodes"] == 1


async def test_an_image_that_does_not_decode_is_the_requests_400(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    encode, mixed = _entries(cluster, session)
    request = _request([A])
    request.images = [ImageData(data=b"not an image", width=A.width, height=A.height)]
    with pytest.raises(NodeError) as raised:
        async for _ in EncodedBackend(encode, mixed, _KEYS).generate(request):
            pass
    assert raised.value.status == 400 and "decoded" in raised.value.message
    assert not raised.value.is_node_failure


async def test_kill_9_of_the_encode_node_mid_encode(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    """A request waiting in the tower when its encode node dies: on its own it ends with an
    error naming the encode node; through the coordinator (nothing streamed yet) it is retried
    and encoded on the mixed node. Both within a bounded time; nothing stays on the mixed node."""
    encode, mixed = _entries(cluster, session)
    image = _image(21)

    async def direct() -> None:
        async for _ in EncodedBackend(encode, mixed, _KEYS).generate(_request([image])):
            pass

    oai = openai.AsyncOpenAI(base_url=cluster.url("coordinator") + "/v1", api_key="k",
                             max_retries=0)  # fmt: skip
    url = "data:image/png;base64," + base64.b64encode(_png(22)).decode()
    content = [{"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": "And this one?"}]  # fmt: skip
    served = asyncio.create_task(oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=3,
    ))  # fmt: skip
    failed = asyncio.create_task(direct())
    await asyncio.sleep(PAUSE_S / 2)  # both wait in the encode node's queue
    cluster.processes["encode"].popen.send_signal(signal.SIGKILL)
    cluster.processes["encode"].popen.wait()
    with pytest.raises(NodeError) as raised:
        await asyncio.wait_for(failed, 15)
    assert raised.value.node is encode and raised.value.is_node_failure
    answer = await asyncio.wait_for(served, 60)
    assert answer.choices[0].message.content is not None
    mixed_metrics = await _metrics(session, cluster.url("mixed"))
    assert mixed_metrics["deepinfer_images_encoded_total"] >= 1  # the retry, in-process
    assert mixed_metrics["deepinfer_num_requests_running"] == 0
    coordinator = await _metrics(session, cluster.url("coordinator"))
    assert coordinator["deepinfer_request_retries_total"] >= 1
    async with session.get(cluster.url("coordinator") + "/ready") as response:
        body = await response.json()
    assert response.status == 200 and body["num_encode_nodes"] == 0
