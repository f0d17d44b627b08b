"""The links between ranks, and expert parallelism's dispatch and combine on them (V4-Flash).

    python benchmarks/ep_collectives.py [--ranks 2] [--device cpu|cuda] [--sizes-mb 1,16,128]
        [--decode 1,32,256] [--prefill 4096,16384] [--repeats 5] [--json PATH]

Spawns --ranks processes, joined as the engine's ranks join (``RankGroup.join``): one a GPU
over NCCL (NVLink multicast off, as the deployment sets it), or on the CPU over gloo (a smoke
run: the CPU's figures are not the links'). Rank 0 prints three tables:

- all-to-all: ``all_to_all_single`` of S bytes a rank in equal splits; bus bandwidth
  S / t x (N - 1) / N (nccl-tests' busbw: what each link carries);
- point to point: rank 0 sends S bytes to rank 1 (``send`` / ``recv``), S / t;
- dispatch + combine: ``ExpertParallelMoEBackend.fused_moe`` on x [T, 4096] a rank (bf16 on
  CUDA, fp32 on the CPU), V4-Flash's 256 routed experts and top 6, chosen uniformly at random,
  the rank's experts replaced by a pass-through (each pair's weight x its row), so that the
  time is the exchange, its packing and the combine. Bytes a rank: its pairs' rows (the row,
  an int64 id, an fp32 weight) out, and their outputs back; the rate against the all-to-all's
  bus bandwidth at the nearest size measured. Each size's output is checked first: a token's
  row times the sum of its weights.

Each figure: a barrier, then --repeats calls timed one by one (CUDA: synchronized), the median.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HIDDEN, EXPERTS, TOP_K = 4096, 256, 6


class PassThrough:
    """A rank's experts as a pass-through: each pair's output is its weight times its row."""

    def fused_moe(self, x, w1, w2, w3, topk_ids, topk_weights, limit, residual=None):
        out = x * topk_weights.to(x.dtype)
        return out if residual is None else out + residual


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after one warm-up, all ranks in step."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _all_to_all(size: int, world: int, device: torch.device, repeats: int) -> float:
    """Seconds of one all_to_all_single of ``size`` bytes a rank (equal splits)."""
    size -= size % world
    inp = torch.empty(size, dtype=torch.uint8, device=device)
    out = torch.empty_like(inp)
    return _timed(lambda: dist.all_to_all_single(out, inp), device, repeats)


def _point_to_point(size: int, rank: int, device: torch.device, repeats: int) -> float:
    """Seconds for rank 0 to send ``size`` bytes to rank 1 (the others wait at the barrier)."""
    buf = torch.empty(size, dtype=torch.uint8, device=device)

    def once() -> None:
        if rank == 0:
            dist.send(buf, dst=1)
        elif rank == 1:
            dist.recv(buf, src=0)

    return _timed(once, device, repeats)


def _dispatch_combine(
    tokens: int, backend: Any, device: torch.device, dtype: torch.dtype, repeats: int, seed: int
) -> tuple[float, int]:
    """(seconds a fused_moe call, bytes this rank sends out and gets back) for ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(device, dtype)
    ids = torch.rand(tokens, EXPERTS, generator=gen).argsort(-1)[:, :TOP_K].to(device)
    weights = torch.rand(tokens, TOP_K, generator=gen).to(device)
    per_rank = EXPERTS // backend.parallel.world_size
    w = torch.empty(per_rank, 1, 1, device=device)  # only its row count is read
    out = backend.fused_moe(x, w, w, w, ids, weights, 10.0)
    # Pass-through experts: a token's output is its row times its weights' sum.
    expected = x.float() * weights.sum(-1, keepdim=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.float(), expected, rtol=tol, atol=tol), "dispatch/combine"
    seconds = _timed(lambda: backend.fused_moe(x, w, w, w, ids, weights, 10.0), device, repeats)
    mine = ids // per_rank != backend.parallel.rank
    row = HIDDEN * x.element_size()
    return seconds, int(mine.sum()) * ((row + 12) + row)


def _worker(rank: int, ns: argparse.Namespace, port: int, results: Any) -> None:
    from deepinfer.config import ParallelConfig
    from deepinfer.ops.moe.expert_parallel import ExpertParallelMoEBackend
    from deepinfer.parallel.group import RankGroup

    torch.set_num_threads(1)
    config = ParallelConfig(
        data_parallel_size=ns.ranks,
        data_parallel_rank=rank,
        enable_expert_parallel=True,
        data_parallel_master_port=port,
        collective_timeout_s=300.0,
    )
    group = RankGroup.join(config, ns.device)
    device, world = group.device, group.world_size
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows: dict[str, list[dict[str, Any]]] = {"all_to_all": [], "p2p": [], "moe": []}
    for mb in _floats(ns.sizes_mb):
        size = int(mb * 2**20)
        seconds = _all_to_all(size, world, device, ns.repeats)
        busbw = size / seconds * (world - 1) / world
        rows["all_to_all"].append({"bytes": size, "s": seconds, "busbw": busbw})
        seconds = _point_to_point(size, rank, device, ns.repeats)
        rows["p2p"].append({"bytes": size, "s": seconds, "bw": size / seconds})
    backend = ExpertParallelMoEBackend(device, group.moe_context(), PassThrough())
    for kind, counts in (("decode", ns.decode), ("prefill", ns.prefill)):
        for tokens in _ints(counts):
            seconds, moved = _dispatch_combine(tokens, backend, device, dtype, ns.repeats, rank)
            rows["moe"].append({"kind": kind, "tokens": tokens, "s": seconds, "bytes": moved})
    if rank == 0:
        results.put(rows)
    dist.barrier()
    group.close()


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _tables(rows: dict[str, list[dict[str, Any]]], ns: argparse.Namespace) -> str:
    sys.path.insert(0, str(Path(__file__).parent))
    from v4_flash_report import markdown

    a2a = [[r["bytes"] / 2**20, r["s"] * 1e6, r["busbw"] / 1e9] for r in rows["all_to_all"]]
    p2p = [[r["bytes"] / 2**20, r["s"] * 1e6, r["bw"] / 1e9] for r in rows["p2p"]]
    moe = []
    for r in rows["moe"]:
        near = min(rows["all_to_all"], key=lambda a: abs(a["bytes"] - r["bytes"] / 2))
        rate = r["bytes"] / r["s"]
        moe.append([r["kind"], r["tokens"], r["s"] * 1e6, r["bytes"] / 2**20, rate / 1e9,
                    rate / near["busbw"]])  # fmt: skip
    where = f"{ns.ranks} ranks, {ns.device}"
    return "\n\n".join(
        [
            f"all-to-all ({where}):\n" + markdown(["MiB a rank", "µs", "bus GB/s"], a2a),
            "point to point, rank 0 -> 1:\n" + markdown(["MiB", "µs", "GB/s"], p2p),
            f"dispatch + combine, x [T, {HIDDEN}] a rank, {EXPERTS} experts, top {TOP_K}:\n"
            + markdown(
                ["step", "T a rank", "µs", "MiB moved a rank", "GB/s", "of all-to-all bus"], moe
            ),
        ]
    )


def _collect(results: Any, workers: list[Any]) -> dict[str, list[dict[str, Any]]]:
    """Rank 0's figures; a rank that exits with an error ends the run (the others stopped)."""
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            failed = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if failed:
                for worker in workers:
                    worker.terminate()
                raise SystemExit(f"ep_collectives: a rank exited with {failed}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--sizes-mb", default="1,16,128", help="all-to-all and p2p sizes, MiB a rank")
    ap.add_argument("--decode", default="1,32,256", help="tokens a rank, decode steps")
    ap.add_argument("--prefill", default="4096,16384", help="tokens a rank, prefill chunks")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write every figure here")
    ns = ap.parse_args()
    assert ns.ranks >= 2, "the links need two ranks"
    if ns.device == "cuda":
        assert torch.cuda.device_count() >= ns.ranks, (
            f"--ranks {ns.ranks} needs as many GPUs; {torch.cuda.device_count()} visible"
        )
        # NVLink multicast off (the ranks inherit the environment).
        os.environ |= {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
        os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    from deepinfer.parallel.group import free_port

    port = free_port()
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [
        context.Process(target=_worker, args=(rank, ns, port, results)) for rank in range(ns.ranks)
    ]
    for worker in workers:
        worker.start()
    rows = _collect(results, workers)
    for worker in workers:
        worker.join(timeout=120)
    print(_tables(rows, ns))
    if ns.json:
        Path(ns.json).write_text(json.dumps({"ranks": ns.ranks, "device": ns.device, **rows}))


if __name__ == "__main__":
    main()
