"""Host time of a V4 step's index plans (``step_arrays``): long prompts in chunks, and decode.

    python3 -P benchmarks/step_plan_host.py [--against REV] [--repeats 7]

V4-Flash geometry (window 128, ring 144, block 128, ratios 4 and 128). A prompt of P tokens in
chunks of C runs as the engine schedules it (one request, start_pos growing); decode is B
requests of one token each at a context. Every figure is the best of ``--repeats`` runs of all
the case's steps, in ms. ``--against REV`` also times ``deepinfer/model/deepseek_v4/step_plan.py``
as it was at git revision REV (``git show``), in the same run, and prints the ratio. CPU only:
the plans are numpy; their upload is the prefill benchmark's "plans" row.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash_report import load_module

from deepinfer.model.batch import SeqSpan
from deepinfer.model.deepseek_v4 import step_plan
from deepinfer.model.deepseek_v4.plan_inputs import CacheGeometry

GEOMETRY = CacheGeometry(
    window=128, ring_size=144, block_size=128, ratios=(4, 128), dense_ratios=(128,),
    scratch_slot=255, scratch_block=0,
)  # fmt: skip
MODULE = "deepinfer/model/deepseek_v4/step_plan.py"


def prompt_steps(prompt: int, chunk: int) -> list[list[SeqSpan]]:
    blocks = list(range(1, prompt // GEOMETRY.block_size + 2))
    return [
        [
            SeqSpan(
                offset=0, num_tokens=min(chunk, prompt - s), start_pos=s, slot=0, block_ids=blocks
            )
        ]
        for s in range(0, prompt, chunk)
    ]


def decode_steps(batch: int, context: int) -> list[list[SeqSpan]]:
    blocks = list(range(1, context // GEOMETRY.block_size + 2))
    spans = [
        SeqSpan(offset=b, num_tokens=1, start_pos=context, slot=b, block_ids=blocks)
        for b in range(batch)
    ]
    return [spans]


CASES: dict[str, Callable[[], list[list[SeqSpan]]]] = {
    "prompt 8,192 in one chunk": lambda: prompt_steps(8192, 8192),
    "prompt 16,384 in chunks of 4,096": lambda: prompt_steps(16384, 4096),
    "prompt 32,768 in chunks of 8,192": lambda: prompt_steps(32768, 8192),
    "decode, 128 requests at 4,096": lambda: decode_steps(128, 4096),
}


def best_ms(module: ModuleType, steps: list[list[SeqSpan]], repeats: int) -> float:
    def run() -> None:
        for seqs in steps:
            n = sum(s.num_tokens for s in seqs)
            module.step_arrays(seqs, list(range(n)), [n - 1], GEOMETRY)

    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def module_at(rev: str) -> ModuleType:
    """step_plan.py as it was at git revision ``rev``, imported under another name."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "show", f"{rev}:{MODULE}"], cwd=root, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "step_plan_at_rev.py"
    path.write_text(source)
    return load_module(path, "step_plan_at_rev")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--against", help="also time step_plan.py at this git revision")
    ap.add_argument("--repeats", type=int, default=7)
    ns = ap.parse_args()
    other = module_at(ns.against) if ns.against else None
    head = "| case | ms |" + (f" ms at {ns.against} | {ns.against} / now |" if other else "")
    print(head)
    print("|---|---|" + ("---|---|" if other else ""))
    for name, make in CASES.items():
        steps = make()
        now = best_ms(step_plan, steps, ns.repeats)
        row = f"| {name} | {now:.2f} |"
        if other:
            then = best_ms(other, steps, ns.repeats)
            row += f" {then:.2f} | {then / now:.1f}x |"
        print(row)


if __name__ == "__main__":
    main()
