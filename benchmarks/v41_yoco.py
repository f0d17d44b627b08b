"""Prefill with YoCo truncation (compact) against without (off), V4.1-Flash shapes.

    bash scripts/gpu_bench.sh benchmarks/v41_yoco.py [--prompt 8192,32768] [--chunk 8192]
        [--keep 140] [--json PATH]
    python benchmarks/v41_yoco.py --tiny          # CPU smoke test, every shape shrunk

DeepSeek says that sending only each prompt's last ~140 tokens through V4.1's consumer half
(its first C1 layer on) nearly halves prefill compute. Models (random weights, FP4 experts, the
shapes of v41_flash.py), each timed over one prompt in chunks of ``--chunk`` tokens (CUDA
events, median of 3 after a warm-up), in both modes:

    producers  [c2 source, c2 consumer]                       (the producer half's two kinds)
    boundary   producers + [c1 source: the YoCo boundary]
    consumers  boundary + [c1 own top-k, c1 consumer]

Per part: producer layer = producers / 2; boundary = boundary - producers; consumer layer =
(consumers - boundary) / 2. Full depth (V4.1-Flash: 20 producer layers, the boundary, 19
consumer layers) is extrapolated from those parts, per mode, not measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import (
    describe_kernels,
    kernel_config,
    make_setup,
    parse_ints,
    prefill_inputs,
    release,
)
from v4_flash_report import (
    device_name,
    header,
    markdown,
    median_time,
    ms,
    results_block,
    table,
    write_json,
)
from v41_flash import FAMILY, TEXT, TINY, build

from deepinfer.model.deepseek_v41.args import ModelArgs
from deepinfer.ops import select_kernels

SCRIPT = "v41_yoco.py"
MODELS = {
    "producers": [2, 2],
    "boundary": [2, 2, 1],
    "consumers": [2, 2, 1, 1, 1],
}
FULL_DEPTH = {"producer": 20, "boundary": 1, "consumer": 19}


def config(ratios: list[int], tiny: bool, mode: str, keep: int) -> ModelArgs:
    boundary = [2] if 1 in ratios else []
    text = {
        **TEXT,
        **(TINY if tiny else {}),
        "num_hidden_layers": len(ratios),
        "compress_ratios": ratios,
        "kv_source_layer_ids": [0, *boundary],
        "index_source_layer_ids": [0, *boundary, *([3] if len(ratios) > 3 else [])],
        "candidate_source_layer_id": 2 if boundary else None,
    }
    cfg = {"model_type": "deepseek_v41", "text_config": text, "bos_token_id": 0, "eos_token_id": 1}
    cfg["quantization_config"] = {"quant_method": "fp8", "expert_dtype": "fp4"}
    truncates = mode != "off" and boundary
    return ModelArgs.from_dict(cfg) if not truncates else _with(cfg, mode, keep)


def _with(cfg: dict[str, Any], mode: str, keep: int) -> ModelArgs:
    import dataclasses

    return dataclasses.replace(ModelArgs.from_dict(cfg), yoco_mode=mode, yoco_keep=keep)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--prompt", help="prompt lengths (default 8192,32768; --tiny 96)")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--keep", type=int, help="kept tokens (default 140; --tiny 12)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true")
    ns = ap.parse_args()
    setup = make_setup(ns.tiny)
    prompts = parse_ints(ns.prompt or ("96" if ns.tiny else "8192,32768"))
    keep = ns.keep or (12 if ns.tiny else 140)
    chunk = 32 if ns.tiny else ns.chunk
    kernels = select_kernels(kernel_config(ns.backend), setup.device)
    print(f"{device_name(setup)}: kernels {describe_kernels(kernels)}")
    times: dict[tuple[str, str, int], float] = {}
    for name, ratios in MODELS.items():
        for mode in ("off", "compact") if name != "producers" else ("off",):
            args = config(ratios, setup.tiny, mode, keep)
            model = build(args, kernels, setup, ns.seed)
            for prompt in prompts:
                batches, cache = prefill_inputs(args, setup, prompt, chunk, ns.seed, FAMILY)
                for b in batches:
                    b.seqs[0].num_prompt_tokens = prompt  # what compact keeps is decided by it

                def run(batches=batches, cache=cache, model=model) -> None:
                    for b in batches:
                        model(b, cache)

                times[name, mode, prompt] = median_time(run, setup, 1, 3)
                seconds = times[name, mode, prompt]
                print(f"  {name:9} {mode:7} prompt {prompt:6}: {seconds * 1e3:.1f} ms")
                del batches, cache, run
                release()
            del model
            release()
    rows, full = [], []
    for prompt in prompts:
        producer = times["producers", "off", prompt] / 2
        parts = {}
        for mode in ("off", "compact"):
            boundary = times["boundary", mode, prompt] - times["producers", "off", prompt]
            consumer = (times["consumers", mode, prompt] - times["boundary", mode, prompt]) / 2
            parts[mode] = {"producer": producer, "boundary": boundary, "consumer": consumer}
            rows.append([prompt, mode, ms(producer), ms(boundary), ms(consumer)])
        totals = {m: sum(FULL_DEPTH[k] * p[k] for k in FULL_DEPTH) for m, p in parts.items()}
        ratio = totals["compact"] / totals["off"]
        full.append([prompt, ms(totals["off"]), ms(totals["compact"]), round(ratio, 3)])
    headers = ["prompt", "mode", "producer layer ms", "boundary ms", "consumer layer ms"]
    full_headers = ["prompt", "off ms (40 layers)", "compact ms", "compact / off"]
    print(table(headers, rows))
    print(table(full_headers, full))
    write_json(ns.json, {**header(setup), "script": SCRIPT, "rows": rows, "full_depth": full})
    print()
    print(
        results_block(
            "V4.1-Flash prefill, YoCo truncation (compact) vs off",
            SCRIPT,
            setup,
            [
                "Shapes: the reported V4.1-Flash hyper-parameters (unverified), random weights, "
                f"FP4 experts, no engram; keep {keep} tokens; chunks of {chunk}; kernels "
                f"{describe_kernels(kernels)}.",
                "Parts from three models per mode (module docstring), median of 3; full depth "
                "(20 producer layers + the boundary + 19 consumer layers) extrapolated, not "
                "measured. DeepSeek's claim: compact nearly halves prefill compute.",
            ],
            [markdown(headers, rows), markdown(full_headers, full)],
        )
    )


if __name__ == "__main__":
    main()
