"""Device idle time between decode steps, through the whole engine (scheduler, plans, graphs,
sampler), on V4-Flash-shaped layers with random weights, with synchronous and asynchronous
scheduling.

    python benchmarks/decode_idle.py --device cuda [--batch 1,32,128] [--steps 64]
        [--graphs on,off] [--async on,off]

For each setting: B requests of a 512-token prompt decode ``--steps`` tokens. Three CUDA events
per launched step, on the device's timeline: before the forward (the graph's replay, its plan
already copied in; or the eager forward, whose kernels are launched inside it), after it, and at
the end of the launch (after the sampler and the copy of its results). Over
the steps where every request decodes (warm-up and graph capture skipped), medians of:

    period   = forward start of step N -> forward start of step N+1
    forward  = forward start -> forward end
    gap      = end of step N's launch -> forward start of step N+1 (the device waits: the host is
               still scheduling, planning, sampling or reading tokens back)
    idle share = gap / period

Nothing synchronizes between steps except what the engine itself does: with synchronous
scheduling it waits for each step's tokens before scheduling the next; with asynchronous
scheduling it schedules and launches step N+1 first.
"""

from __future__ import annotations

import argparse
import gc
import itertools
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


def measure(llm: LLM, batch: int, steps: int) -> dict[str, float]:
    """Medians (ms) of period, forward and gap over the steady decode steps, and the host's
    wall time per engine step."""
    runner = llm.engine.executor
    # The forward proper: a graph's replay (its plan is built and copied in before), or the
    # eager forward (its plan is uploaded before; its kernels are launched inside).
    owner = torch.cuda.CUDAGraph if runner.graphs is not None else runner.model
    name = "replay" if runner.graphs is not None else "forward"
    forward, launch = getattr(owner, name), runner.launch
    marks: list[list] = []  # per launch: [steady, forward start, forward end, launch end]

    def event() -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def timed_forward(*args, **kwargs):
        marks[-1].append(event())
        out = forward(*args, **kwargs)
        marks[-1].append(event())
        return out

    def timed_launch(scheduler_output):
        scheduled = scheduler_output.scheduled
        steady = len(scheduled) == batch and all(s.num_tokens == 1 for s in scheduled)
        marks.append([steady])
        out = launch(scheduler_output)
        marks[-1].append(event())
        return out

    setattr(owner, name, timed_forward)
    runner.launch = timed_launch
    llm.engine._launch = timed_launch if llm.engine._launch is not None else None
    for i in range(batch):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(PROMPT)]
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        llm.engine.add_request(f"r{i}", prompt, params)
    walls = []
    while llm.engine.has_unfinished_requests():
        started = time.perf_counter()
        llm.engine.step()
        if marks and marks[-1][0]:
            walls.append((time.perf_counter() - started) * 1e3)
    torch.cuda.synchronize()
    setattr(owner, name, forward)
    periods, forwards, gaps = [], [], []
    for this, following in itertools.pairwise(marks):
        if this[0] and following[0] and len(this) == len(following) == 4:
            periods.append(this[1].elapsed_time(following[1]))
            forwards.append(this[1].elapsed_time(this[2]))
            gaps.append(this[3].elapsed_time(following[1]))
    skip = min(4, len(periods) // 2)  # graph capture and warm-up steps

    def median(values: list[float]) -> float:
        return statistics.median(values[skip:])

    return {
        "period": median(periods),
        "forward": median(forwards),
        "gap": median(gaps),
        "wall": median(walls),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", default="1,32,128")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--graphs", default="on,off")
    ap.add_argument("--async", dest="async_modes", default="on,off")
    ns = ap.parse_args()
    folder = write_config(
        tempfile.mkdtemp(), ["compressed_sparse_attention", "heavily_compressed_attention"]
    )
    print(
        "| batch | graphs | scheduling | host ms/step | period ms | forward ms | gap ms "
        "| idle share |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for graphs in ns.graphs.split(","):
        for batch in [int(b) for b in ns.batch.split(",")]:
            for mode in ns.async_modes.split(","):
                llm = LLM(
                    model=folder,
                    device=ns.device,
                    random_weights=True,
                    max_model_len=PROMPT + ns.steps + 8,
                    max_num_seqs=batch,
                    max_num_batched_tokens=max(PROMPT * batch, 8192),
                    cuda_graph_max_batch=128 if graphs == "on" else 0,
                    enable_prefix_caching=False,
                    async_scheduling=mode == "on",
                )
                m = measure(llm, batch, ns.steps)
                print(
                    f"| {batch} | {graphs} | {'async' if mode == 'on' else 'sync'} | "
                    f"{m['wall']:.2f} | {m['period']:.2f} | {m['forward']:.2f} | {m['gap']:.3f} | "
                    f"{m['gap'] / m['period']:.1%} |",
                    flush=True,
                )
                del llm
                gc.collect()  # the engine's reference cycles hold the weights and the cache
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
