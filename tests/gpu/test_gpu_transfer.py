"""The pair transport between two processes on one GPU (deepinfer/parallel/transfer.py): when
both ends offer the same GPU, CUDA parts move through CUDA IPC and arrive on the device, bit for
bit (mixed dtypes, odd sizes, checksums on); an end that offers none gets the host path; a
receiver killed before its ack, or a sender killed after sharing, fails the other end's transfer
within the pair's timeout, and the sender's buffer is freed."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
from rank_workers import receive_on_gpu, share_then_die

from deepinfer.parallel.group import free_port
from deepinfer.parallel.transfer import PairTransport, TransferError

pytestmark = pytest.mark.gpu

GPU = torch.device("cuda", 0)


def _parts() -> list[torch.Tensor]:
    gen = torch.Generator(device=GPU).manual_seed(3)
    return [
        torch.randn(3, 1000, 64, device=GPU, generator=gen).to(torch.bfloat16),
        torch.randint(-128, 127, (4097,), device=GPU, generator=gen).to(torch.int8),  # odd size
        torch.randn(257, 3, device=GPU, generator=gen),  # after it: a misaligned fp32 part
        torch.arange(7, device=GPU, dtype=torch.int64),
    ]


def _pair(offer_gpu: bool, num_transfers: int):
    port = free_port()
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    args = (port, offer_gpu, num_transfers, theirs)
    receiver = context.Process(target=receive_on_gpu, args=args)
    receiver.start()
    pair = PairTransport.connect("127.0.0.1", port, 0, timeout_s=10.0, ipc_device=GPU)
    return pair, receiver, ours


@pytest.mark.parametrize("offer_gpu", [True, False], ids=["both-offer", "one-offers"])
def test_parts_arrive_whole_through_ipc_on_a_shared_gpu_else_through_the_host(offer_gpu):
    pair, receiver, conn = _pair(offer_gpu, 2)
    try:
        assert conn.recv() is offer_gpu
        assert (pair.shared_gpu is not None) is offer_gpu
        parts = _parts()
        want = [p.cpu() for p in parts]
        assert pair.send(1, b"first", parts, checksum_parts=True) == (
            "ipc" if offer_gpu else "host"
        )
        header, devices, got = conn.recv()
        assert header == b"first"
        assert devices == ["cuda:0" if offer_gpu else "cpu"] * len(parts)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w)
        # The sender's buffer is gone once the receiver has acknowledged its copy.
        before = torch.cuda.memory_allocated(GPU)
        assert pair.send(2, b"second", parts[:1]) in ("ipc", "host")
        assert conn.recv()[0] == b"second"
        assert torch.cuda.memory_allocated(GPU) == before
    finally:
        pair.close()
        receiver.join(timeout=30)


def test_a_receiver_killed_before_its_ack_fails_the_sender_and_frees_the_buffer():
    pair, receiver, conn = _pair(True, 1)
    assert conn.recv() is True
    parts = _parts()
    before = torch.cuda.memory_allocated(GPU)

    def kill() -> None:
        os.kill(receiver.pid, signal.SIGKILL)
        receiver.join()

    pair.on_shared = kill
    start = time.monotonic()
    with pytest.raises(TransferError, match="sending failed"):
        pair.send(1, b"header", parts, checksum_parts=True)
    assert time.monotonic() - start < 10.0
    assert torch.cuda.memory_allocated(GPU) == before
    pair.close()


def test_a_sender_killed_after_sharing_fails_the_receiver_within_the_timeout():
    port = free_port()
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    sender = context.Process(target=share_then_die, args=(port, theirs))
    sender.start()
    pair = PairTransport.connect("127.0.0.1", port, 1, timeout_s=5.0, ipc_device=GPU)
    assert ours.recv() is True
    start = time.monotonic()
    with pytest.raises(TransferError):
        pair.recv(1)
    assert time.monotonic() - start < 10.0
    sender.join(timeout=10)
    assert sender.exitcode == -signal.SIGKILL
    pair.close()
