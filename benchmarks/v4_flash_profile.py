"""Where a V4-Flash-shaped layer's time goes: its kernels, grouped, from the CUDA profiler.

    bash scripts/gpu_bench.sh benchmarks/v4_flash_profile.py [--layers csa,hca,swa]
        [--decode 1,128] [--context 4096] [--prefill 8192] [--top 12]
        [--experts bf16|fp4|fp4-fp8|fp4-fp8-kv8] [--graphed] [--json PATH]

For each layer type, one model of one layer (v4_flash.each_layer_model, random bf16 weights)
runs a decode step of each batch size (v4_flash.decode_inputs) and one prefill chunk
(v4_flash.prefill_inputs), after warm-up, under torch.profiler with CUDA activity. The outer
model (embedding, LM head, no layer) is profiled the same way, so what a layer adds is the
difference. Reported per case: kernels launched, the sum of kernel times (device busy), the
step's wall time on CUDA events, the top kernels by total time (name, calls, µs, share of
the busy time), and the launches that are not ours (cuBLAS, torch: outside the programmatic
launch chain of our Triton kernels). ``--experts`` picks the weights as v4_flash_decode.py
does (one variant). The step is eager: with decode graphs the same kernels run without the
launch gaps, so "busy" is what a graph replay approaches.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import (
    WEIGHTS,
    add_common_args,
    decode_inputs,
    each_layer_model,
    graph_plans,
    kernel_switches,
    make_setup,
    parse_ints,
    parse_layers,
    prefill_inputs,
    release,
    weight_flags,
)
from v4_flash_report import device_name, header, median_time, write_json

SCRIPT = "v4_flash_profile.py"


def kernel_name(name: str) -> str:
    """A kernel's name without template arguments and launch parameters, cut to 70 chars."""
    name = re.sub(r"<.*>", "", name)
    name = re.sub(r"\(.*\)", "", name)
    return name.strip()[:70]


def profile_step(step, setup) -> dict:
    """Kernels of one ``step`` (after warm-up): count, busy µs, top kernels by total µs."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[kernel_name(event.name)]
            entry[0] += 1
            entry[1] += event.device_time_total
    busy = sum(us for _, us in totals.values())
    wall = median_time(step, setup, 2, 5)
    kernels = sorted(
        ({"name": n, "calls": c, "us": us} for n, (c, us) in totals.items()),
        key=lambda k: -k["us"],
    )
    return {
        "launches": sum(c for c, _ in totals.values()),
        "busy_us": busy,
        "wall_us": wall * 1e6,
        "kernels": kernels,
    }


def show(title: str, result: dict, top: int) -> None:
    print(
        f"\n{title}: {result['launches']} kernels, busy {result['busy_us']:.0f} µs, "
        f"wall {result['wall_us']:.0f} µs"
    )
    for k in result["kernels"][:top]:
        share = 100 * k["us"] / result["busy_us"]
        print(f"  {k['us']:9.1f} µs {share:5.1f}%  x{k['calls']:<4} {k['name']}")
    others = [k for k in result["kernels"] if not is_ours(k["name"])]
    print(
        f"  ours (Triton, chained by programmatic launch): "
        f"{result['launches'] - sum(k['calls'] for k in others)} launches; others (cuBLAS, "
        f"torch, copies: each starts after its predecessor ends): "
        f"{sum(k['calls'] for k in others)} launches, {sum(k['us'] for k in others):.0f} µs"
    )
    for k in others[:8]:
        print(f"    x{k['calls']:<4} {k['us']:9.1f} µs  {k['name']}")


def is_ours(name: str) -> bool:
    """Whether a kernel is one of our Triton kernels (``_*_kernel``, ops/triton_pdl.py)."""
    return re.fullmatch(r"_[a-z0-9_]+_kernel", name) is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--decode", default="1,128", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=8192, help="prefill chunk tokens (0: none)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--experts", default="bf16", choices=WEIGHTS)
    ap.add_argument(
        "--graphed",
        action="store_true",
        help="decode steps with the plans a decode graph of the engine replays (context bucket, "
        "candidate windows pooled), run eagerly",
    )
    add_common_args(ap, warmup=3, repeats=5)
    ns = ap.parse_args()
    setup = make_setup(ns.tiny)
    if not setup.is_cuda:
        sys.exit("v4_flash_profile.py needs CUDA (the profiler's kernel times)")
    print(f"{device_name(setup)}, weights {ns.experts}")
    kv_dtype = "fp8" if ns.experts.endswith("kv8") else "auto"
    rows: list[dict] = []
    payload = {**header(setup), "script": SCRIPT, "rows": rows}

    def measure(kind: str, args, model) -> None:
        for batch_size in parse_ints(ns.decode):
            batch, cache = decode_inputs(
                args, setup, batch_size, ns.context, ns.seed, kv_dtype=kv_dtype
            )
            if ns.graphed:
                graph_plans(batch, cache)
            result = profile_step(lambda batch=batch, cache=cache: model(batch, cache), setup)
            rows.append({"layer": kind, "case": f"decode b{batch_size}", **result})
            show(f"{kind} decode batch {batch_size} ctx {ns.context}", result, ns.top)
            del batch, cache
            release()
        if ns.prefill:
            batches, cache = prefill_inputs(
                args, setup, ns.prefill, ns.prefill, ns.seed, kv_dtype=kv_dtype
            )
            (batch,) = batches
            result = profile_step(lambda: model(batch, cache), setup)
            rows.append({"layer": kind, "case": f"prefill {ns.prefill}", **result})
            show(f"{kind} prefill {ns.prefill}", result, ns.top)
            del batches, batch, cache
            release()
        write_json(ns.json, payload)

    payload["kernels"] = each_layer_model(
        parse_layers(ns.layers), 1, ns.backend, setup, ns.seed, measure,
        **weight_flags(ns.experts), switches=kernel_switches(ns),
    )  # fmt: skip
    write_json(ns.json, payload)


if __name__ == "__main__":
    main()
