"""A prefill/decode hand-off's bytes through the pair transport: V4-Flash-sized states, on
either path.

    python benchmarks/handoff_transfer.py [--prompt 1024,8192,32768] [--repeats 3]
        [--device cpu|cuda] [--path host,ipc]

What moves: a request's hand-off state (deepinfer/engine/handoff.py) in V4-Flash's cache layout (43
layers: 21 CSA, 20 HCA, 2 sliding; 128-token blocks, bf16): every paged part (all the prompt's
blocks' rows of it in one tensor) and the whole state slot, as ``pack_state`` lays them out. The
parts hold random bytes of the right shapes (the transport does not look at values). A receiver
process joins the pair (deepinfer/parallel/transfer.py, gloo over loopback TCP, checksums off) and
the sender times ``send`` until the receiver has every part (it acknowledges). The reference is a
memory copy of the same bytes in one process (``torch.cat`` of the parts, on the parts' device),
measured in the same run: the ratio says how far the transport is from moving bytes at memory
speed.

``--device cuda``: the parts live on GPU 0 and both processes use it, as a prefill node and a
decode node sharing one GPU. Path "host": the parts go through host memory and gloo (the
receiver's land on the CPU, as between machines); "ipc": both ends offer the GPU, the sender
packs the parts into one buffer there and the receiver copies it out through CUDA IPC (two
device copies, against the reference's one). Between GPUs the same interface runs on NCCL (not
measured here: one GPU cannot hold both ends).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import FULL_DEPTH_LAYERS, LAYER_TYPES, config_dict

from deepinfer.model.deepseek_v4.args import ModelArgs
from deepinfer.model.deepseek_v4.cache import cache_spec
from deepinfer.parallel.group import free_port
from deepinfer.parallel.transfer import PairTransport

BLOCK_SIZE = 128


def _state(num_tokens: int, device: torch.device) -> list[torch.Tensor]:
    """The parts of one hand-off of ``num_tokens`` prompt tokens, in pack_state's order."""
    types = [LAYER_TYPES[kind] for kind, n in FULL_DEPTH_LAYERS.items() for _ in range(n)]
    args = ModelArgs.from_dict(config_dict(types))
    spec = cache_spec(args, block_size=BLOCK_SIZE, ring_margin=16, max_draft=0)
    num_blocks = math.ceil(num_tokens / BLOCK_SIZE)

    def part(p, *leading: int) -> torch.Tensor:
        dtype, shape = p.tensor_dtype(torch.bfloat16), (*leading, *p.row_shape())
        if dtype.is_floating_point:
            return torch.randn(shape, dtype=dtype, device=device)
        return torch.randint(0, 127, shape, dtype=dtype, device=device)

    paged = [part(p, num_blocks) for p in spec.paged]  # every block's rows, stacked
    return paged + [part(p) for p in spec.state]


def _receiver(
    port: int, counts: list[int], repeats: int, offer: str | None, conn: Connection
) -> None:
    gpu = torch.device(offer) if offer else None
    pair = PairTransport.connect("127.0.0.1", port, 1, timeout_s=120.0, ipc_device=gpu)
    conn.send("joined")
    transfer_id = 0
    for _ in counts:
        for _ in range(repeats + 1):
            transfer_id += 1
            pair.recv(transfer_id)
            conn.send(transfer_id)  # the acknowledgement the sender times to


def _copy_s(parts: list[torch.Tensor]) -> float:
    """One memory copy of the parts' bytes on their device (the reference)."""
    on_gpu = parts[0].is_cuda
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cat([t.view(torch.uint8).flatten() for t in parts])
    if on_gpu:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _measure(path: str, device: torch.device, prompts: list[int], repeats: int) -> list[tuple]:
    port = free_port()
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    offer = str(device) if path == "ipc" else None
    args = (port, prompts, repeats, offer, theirs)
    receiver = context.Process(target=_receiver, args=args)
    receiver.start()
    gpu = device if path == "ipc" else None
    pair = PairTransport.connect("127.0.0.1", port, 0, timeout_s=120.0, ipc_device=gpu)
    assert ours.recv() == "joined"
    assert (pair.shared_gpu is not None) == (path == "ipc"), "the ends do not share the GPU"
    rows, transfer_id = [], 0
    for num_tokens in prompts:
        parts = _state(num_tokens, device)
        nbytes = sum(t.numel() * t.element_size() for t in parts)
        times = []
        for attempt in range(repeats + 1):  # the first one warms the pair up
            transfer_id += 1
            start = time.perf_counter()
            took = pair.send(transfer_id, b"", parts)
            assert ours.recv() == transfer_id and took == path, took
            if attempt:
                times.append(time.perf_counter() - start)
        copies = [_copy_s(parts) for _ in range(repeats + 1)][1:]
        send_s, copy_s = statistics.median(times), statistics.median(copies)
        rate, copy_rate = nbytes / send_s / 1e9, nbytes / copy_s / 1e9
        row = (path, num_tokens, len(parts), nbytes / 1e6, send_s * 1e3, rate, copy_rate)
        print(
            f"{path:>5} {num_tokens:>7} {len(parts):>6} {nbytes / 1e6:>8.1f} "
            f"{send_s * 1e3:>9.2f} {rate:>7.2f} {copy_rate:>11.2f} {rate / copy_rate:.3f}"
        )
        rows.append(row)
        del parts
    receiver.join(timeout=30)
    pair.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--prompt", default="1024,8192,32768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--path", default="host", help="host and/or ipc (ipc needs --device cuda)")
    ns = ap.parse_args()
    prompts = [int(p) for p in ns.prompt.split(",")]
    paths = ns.path.split(",")
    if "ipc" in paths and ns.device != "cuda":
        ap.error("--path ipc needs --device cuda")
    device = torch.device("cuda", 0) if ns.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    print(
        f"{'path':>5} {'prompt':>7} {'parts':>6} {'MB':>8} {'send ms':>9} {'GB/s':>7} "
        f"{'memcpy GB/s':>11} ratio"
    )
    rows = [row for path in paths for row in _measure(path, device, prompts, ns.repeats)]
    print("RESULTS:")
    for path, num_tokens, count, mb, ms, rate, copy_rate in rows:
        print(
            f"| {path} | {num_tokens} | {count} | {mb:.1f} | {ms:.2f} | {rate:.2f} | "
            f"{copy_rate:.2f} | {rate / copy_rate:.3f} |"
        )


if __name__ == "__main__":
    main()
