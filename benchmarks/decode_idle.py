"""Device idle time between decode steps, through the whole engine (scheduler, plans, graphs,
sampler), on V4-Flash-shaped layers with random weights.

    python benchmarks/decode_idle.py --device cuda [--batch 1,32,128] [--steps 64]

For each batch size: B requests of a 512-token prompt decode ``--steps`` tokens; once every
request is decoding, each engine step's wall time is taken on the host and the forward's device
time with CUDA events around it (the graph replay, or the eager forward). Idle share = 1 -
device forward time / step wall time: the part of a step the device waits for the host
(scheduling, planning, the copy of the plans, sampling and the token read-back). The engine
schedules synchronously (the next step starts after this one's tokens are on the host), so
this is the sync figure; it includes the sampler, which runs after the forward on the device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import write_config

from deepinfer import LLM, SamplingParams

PROMPT = 512


def measure(llm: LLM, batch: int, steps: int) -> tuple[float, float]:
    """Median (step wall ms, forward device ms) over the steady decode steps."""
    runner = llm.engine.executor
    forward = runner.graphs.run if runner.graphs is not None else runner.model.forward
    device_ms: list[float] = []
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # around each forward call

    def timed(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(*args, **kwargs)
        end.record()
        events.append((start, end))
        return out

    if runner.graphs is not None:
        runner.graphs.run = timed
    else:
        runner.model.forward = timed
    for i in range(batch):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(PROMPT)]
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        llm.engine.add_request(f"r{i}", prompt, params)
    walls = []
    while llm.engine.has_unfinished_requests():
        before = len(events)
        started = time.perf_counter()
        llm.engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - started) * 1e3
        scheduled = len(events) - before
        if scheduled == 1 and llm.engine.scheduler.num_running == batch:
            walls.append(wall)
            start, end = events[-1]
            device_ms.append(start.elapsed_time(end))
    skip = min(4, len(walls) // 2)  # graph capture and warm-up steps
    return statistics.median(walls[skip:]), statistics.median(device_ms[skip:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", default="1,32,128")
    ap.add_argument("--steps", type=int, default=64)
    ns = ap.parse_args()
    folder = write_config(
        tempfile.mkdtemp(), ["compressed_sparse_attention", "heavily_compressed_attention"]
    )
    print("| batch | graphs | step wall ms | forward device ms | idle share |")
    print("|---|---|---|---|---|")
    for graphs in (True, False):
        for batch in [int(b) for b in ns.batch.split(",")]:
            llm = LLM(
                model=folder,
                device=ns.device,
                random_weights=True,
                max_model_len=PROMPT + ns.steps + 8,
                max_num_seqs=batch,
                max_num_batched_tokens=max(PROMPT * batch, 8192),
                cuda_graph_max_batch=128 if graphs else 0,
                enable_prefix_caching=False,
            )
            wall, device = measure(llm, batch, ns.steps)
            print(
                f"| {batch} | {'on' if graphs else 'off'} | {wall:.2f} | {device:.2f} | "
                f"{1 - device / wall:.1%} |",
                flush=True,
            )
            del llm
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
