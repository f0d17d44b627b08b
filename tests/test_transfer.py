"""The pair transport (deepinfer/parallel/transfer.py) between real processes on gloo: hand-offs
sent concurrently decode on the other side as one engine would; a transfer cut short is never
applied; a receiver killed mid-transfer fails the sender's transfer within the timeout."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from rank_workers import decode_handoffs, drain, receive_forever

from deepinfer.config import Config
from deepinfer.engine.handoff import pack_state
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.model.tiny import ensure_tiny_model
from deepinfer.parallel.group import free_port
from deepinfer.parallel.transfer import PairTransport, TransferError, checksum
from deepinfer.sampling_params import SamplingParams

MAX_TOKENS = 8


def _config() -> Config:
    base = Config.load(
        overrides={
            "model": {"device": "cpu", "path": str(ensure_tiny_model(0))},
            "cache": {"block_size": 16},
            "kernel": {"num_threads": 1},
        }
    )
    return base


def _tokens(engine: LLMEngine, request_id: str, prompt: list[int], **kw) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request(request_id, prompt, params, **kw)
    return drain(engine)[0]


def test_hand_offs_over_the_pair_decode_as_one_engine_and_a_cut_transfer_is_not_applied():
    config = _config()
    gen = torch.Generator().manual_seed(5)
    prompts = {1: torch.randint(1, 128000, (23,), generator=gen).tolist(),
               2: torch.randint(1, 128000, (70,), generator=gen).tolist()}  # fmt: skip
    port = free_port()
    plan = {"ids": [1, 2], "broken": 3, "max_tokens": MAX_TOKENS, "timeout_s": 5.0}
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    decoder = context.Process(target=decode_handoffs, args=(config, port, plan, theirs))
    decoder.start()
    prefill = LLMEngine(config)
    want = {i: _tokens(prefill, f"mixed-{i}", p) for i, p in prompts.items()}
    states = {}
    for i, prompt in prompts.items():
        _tokens(prefill, f"r{i}", prompt, hand_off=True)
        states[i] = prefill.export_request(f"r{i}")
        prefill.release_hand_off(f"r{i}")
    assert ours.recv() == "ready"
    pair = PairTransport.connect("127.0.0.1", port, 0, timeout_s=20.0)
    senders = []
    for i in prompts:
        header, parts = pack_state(states[i])
        kwargs = {"checksum_parts": True}
        senders.append(threading.Thread(target=pair.send, args=(i, header, parts), kwargs=kwargs))
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()

    def cut(chunk: int) -> None:
        if chunk == 1:
            raise TransferError("cut after chunk 1 (test)")

    pair.on_chunk = cut
    pair.chunk_bytes = 4096  # several chunks: the cut falls inside the parts
    header, parts = pack_state(states[1])
    with pytest.raises(TransferError, match="cut after chunk 1"):
        pair.send(3, header, parts, checksum_parts=True)
    pair.close()  # the sender gives up: the receiver's transfer 3 fails (its 5 s timeout)
    cut_at = time.monotonic()
    results, blocks_in_use = ours.recv()
    assert time.monotonic() - cut_at < 15
    decoder.join(timeout=30)
    assert results[1] == want[1] and results[2] == want[2]
    assert str(results[3]).startswith("TransferError"), results[3]
    assert blocks_in_use == 0


def test_a_receiver_killed_mid_transfer_fails_the_sender_within_the_timeout():
    port = free_port()
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    receiver = context.Process(target=receive_forever, args=(port, theirs))
    receiver.start()
    pair = PairTransport.connect("127.0.0.1", port, 0, timeout_s=10.0)
    assert ours.recv() == "joined"
    killed = threading.Event()

    def pause(chunk: int) -> None:
        if chunk == 0:
            os.kill(receiver.pid, signal.SIGKILL)
            receiver.join()
            killed.set()
        time.sleep(0.1)

    pair.on_chunk = pause
    pair.chunk_bytes = 1 << 16
    parts = [torch.arange(1 << 16, dtype=torch.float32) + i for i in range(8)]
    start = time.monotonic()
    with pytest.raises(TransferError, match="sending failed"):
        pair.send(1, b"header", parts)
    assert killed.is_set() and time.monotonic() - start < 10.0


def test_checksum_sees_a_missing_or_moved_part():
    a, b = torch.arange(10, dtype=torch.int32), torch.arange(10, 20, dtype=torch.int32)
    assert int(checksum(a)) != int(checksum(b))
    assert int(checksum(torch.cat([a, b]))) != int(checksum(torch.cat([b, a])))
    assert int(checksum(torch.zeros(4))) == 0
