"""A prefill node and a decode node as processes on the one GPU (fp32, the oracle checkpoint):
their hand-offs move through CUDA IPC by default (once the pair is joined: the first one,
exported before that, goes through the host) and through host memory with
``--kv-transfer-path host``; either way the pair gives one engine's greedy tokens, and the
nodes count the bytes under the path they took."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import processes
import pytest
from oracle import oracle_prompts
from processes import clean_env
from prometheus_client.parser import text_string_to_metric_families
from rank_workers import drain

from deepinfer.config import Config
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.server.node_client import NodeClient
from deepinfer.server.pairing import PairedBackend, PairKeys
from deepinfer.server.protocol import GenerateRequest, SamplingOptions
from deepinfer.server.routing import NodeEntry

pytestmark = pytest.mark.gpu

ENGINE = ("--device", "cuda", "--dtype", "float32", "--max-model-len", "1024",
          "--block-size", "16", "--gpu-memory-utilization", "0.05", "--checksum")  # fmt: skip
GREEDY = SamplingOptions(temperature=0.0, max_tokens=12, ignore_eos=True)


class Pair(processes.Cluster):
    def __init__(self, folder: Path, model: Path, path: str) -> None:
        super().__init__(folder, model, ("decode", "prefill"))
        for name in self.ports:
            args = ["node", "--model", str(model), "--role", name, "--port",
                    str(self.ports[name]), "--kv-transfer-path", path, *ENGINE]  # fmt: skip
            self.launch(name, args, clean_env())


async def _bytes_by_path(
    session: aiohttp.ClientSession, url: str, since: dict | None = None
) -> dict[tuple[str, str], float]:
    """The node's hand-off bytes by (direction, path), less ``since``'s."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    since = since or {}
    return {
        (s.labels["direction"], s.labels["path"]): s.value
        - since.get((s.labels["direction"], s.labels["path"]), 0)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "deepinfer_kv_transfer_bytes_total"
    }


async def _through_the_pair(pair: Pair) -> tuple[list[list[int]], dict, dict]:
    """Each oracle prompt's tokens through the pair, then the bytes each node counted."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        prefill = NodeEntry("p", NodeClient(pair.url("prefill"), session=session), 1024)
        decode = NodeEntry("d", NodeClient(pair.url("decode"), session=session), 1024)
        keys, outputs = PairKeys(), []
        # A first hand-off joins the pair (its state is exported before the join completes,
        # so it goes through the host); the bytes are counted from after it.
        warm_up = GenerateRequest(request_id="warm-up", prompt_token_ids=oracle_prompts()[0],
                                  sampling=GREEDY)  # fmt: skip
        async for _ in PairedBackend(prefill, decode, keys).generate(warm_up):
            pass
        sent_before = await _bytes_by_path(session, pair.url("prefill"))
        received_before = await _bytes_by_path(session, pair.url("decode"))
        for i, prompt in enumerate(oracle_prompts()):
            request = GenerateRequest(request_id=f"g{i}", prompt_token_ids=prompt,
                                      sampling=GREEDY)  # fmt: skip
            outputs.append([])
            async for delta in PairedBackend(prefill, decode, keys).generate(request):
                outputs[-1] += delta.token_ids
        sent = await _bytes_by_path(session, pair.url("prefill"), sent_before)
        received = await _bytes_by_path(session, pair.url("decode"), received_before)
    return outputs, sent, received


@pytest.mark.parametrize("path", ["auto", "host"])
def test_a_pair_on_one_gpu_gives_one_engines_tokens_through_either_path(
    tmp_path: Path, oracle_hf_dir: Path, path: str
) -> None:
    pair = Pair(tmp_path, oracle_hf_dir, path)
    try:
        overrides = {
            "model": {"device": "cuda", "dtype": "float32", "path": str(oracle_hf_dir),
                      "max_model_len": 1024},
            "cache": {"block_size": 16, "gpu_memory_utilization": 0.05},
        }  # fmt: skip
        mixed = LLMEngine(Config.load(overrides=overrides))
        want = []
        for i, prompt in enumerate(oracle_prompts()):
            mixed.add_request(f"m{i}", prompt, GREEDY.to_sampling_params())
            want.append(drain(mixed)[0])
        pair.wait_ready("decode", "prefill", timeout_s=180.0)
        got, sent, received = asyncio.run(_through_the_pair(pair))
        assert got == want
        taken = "ipc" if path == "auto" else "host"
        other = "host" if path == "auto" else "ipc"
        assert sent[("send", taken)] == received[("recv", taken)] > 0
        assert sent.get(("send", other), 0) == received.get(("recv", other), 0) == 0
    finally:
        pair.stop()
