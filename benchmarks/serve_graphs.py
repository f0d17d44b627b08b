"""`deepinfer serve` on a V4-Flash-shaped model: start-up graph capture, then TTFT and ITL
through `deepinfer bench serve` at concurrency 1 and 64, and proof that no decode graph was
captured while serving.

    python3 -P benchmarks/serve_graphs.py [--layers swa,csa,hca,csa] [--max-model-len 65536]
        [--weights bf16,fp4,fp4-fp8,fp4-fp8-kv8] [--concurrency 1,64] [--out DIR]
        (on the device machine: bash scripts/gpu_bench.sh benchmarks/...)
    python3 -P benchmarks/serve_graphs.py --tiny   # the built-in model on the CPU (smoke test)

The server is a real process (random weights in V4-Flash shapes, `model.random_weights`, kept
as --weights says: dense bf16, routed experts packed FP4, or also the FP8 linears FP8, and
the KV cache FP8 with fp4-fp8-kv8);
start-up time is process start -> /ready 200, and the capture time and memory are read from its
log ("captured N decode graphs ... in S s, +M MiB"). The counter that proves the point is the
node's ``deepinfer_decode_graph_captures{phase="serving"}``, which must stay 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from v4_flash import LAYER_TYPES, write_config

_CAPTURED = re.compile(r"captured (\d+) decode graphs .* in ([\d.]+) s, ([+-][\d.]+) MiB")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def _graph_captures(base: str) -> dict[str, float]:
    _, text = _get(base + "/metrics")
    return {
        sample.labels["phase"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "deepinfer_decode_graph_captures"
    }


def _bench(
    base: str, concurrency: int, num_prompts: int, ns: argparse.Namespace, weights: str
) -> dict:
    name = f"{weights}/serve_c{concurrency}.json"
    command = [
        sys.executable, "-P", "-m", "deepinfer.cli", "bench", "serve", "--base-url", base,
        "--dataset-name", "random", "--random-input-len", str(ns.input_len),
        "--random-output-len", str(ns.output_len), "--ignore-eos",
        "--max-concurrency", str(concurrency), "--num-prompts", str(num_prompts),
        "--request-rate", "inf", "--save-result", "--result-dir", str(ns.out),
        "--result-filename", name, "--disable-tqdm",
    ]  # fmt: skip
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True)
    return json.loads((ns.out / name).read_text())


# --weights: what the random weights are kept as (the V4-Flash-shaped config ships FP4 experts
# and FP8 linears, as the checkpoint does).
WEIGHTS = {
    "bf16": {"DEEPINFER_MODEL_FP4_EXPERTS": "false", "DEEPINFER_MODEL_FP8_WEIGHTS": "false"},
    "fp4": {"DEEPINFER_MODEL_FP4_EXPERTS": "true", "DEEPINFER_MODEL_FP8_WEIGHTS": "false"},
    "fp4-fp8": {"DEEPINFER_MODEL_FP4_EXPERTS": "true", "DEEPINFER_MODEL_FP8_WEIGHTS": "true"},
}
WEIGHTS["fp4-fp8-kv8"] = {**WEIGHTS["fp4-fp8"], "DEEPINFER_CACHE_KV_DTYPE": "fp8"}  # FP8 KV too


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="swa,csa,hca,csa")
    ap.add_argument("--max-model-len", type=int, default=65536)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument(
        "--weights",
        default="fp4",
        help="one server after the other, each on: bf16 (experts and linears dense), fp4 "
        "(routed experts packed, the default), fp4-fp8 (and the FP8 linears kept FP8)",
    )
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/serve_graphs")))
    ap.add_argument("--tiny", action="store_true", help="the built-in model on the CPU")
    ns = ap.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    variants = [w.strip() for w in ns.weights.split(",") if w.strip()]
    if not variants or set(variants) - set(WEIGHTS):
        raise SystemExit(f"--weights: expected some of {list(WEIGHTS)}, got {ns.weights!r}")
    table = []
    serving_captures = 0.0
    for weights in variants:
        result = _serve(ns, weights)
        if result is None:
            return 1
        rows, captures = result
        table += [(weights, *row) for row in rows]
        serving_captures += captures.get("serving", 0)
    print(
        "| weights | concurrency | completed | failed | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
        "ITL p50 ms | ITL p99 ms | output tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        print(
            "| {} | {} | {} | {} | {:.1f} | {:.1f} | {:.2f} | {:.2f} | {:.2f} | {:.0f} |".format(
                *row
            )
        )
    return 0 if serving_captures == 0 else 2


def _serve(ns: argparse.Namespace, weights: str) -> tuple[list[tuple], dict] | None:
    """One server on ``weights``: start-up, the bench runs, the graph-capture counters; None
    when it did not come up (its log's tail printed)."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DEEPINFER_MODEL_MAX_MODEL_LEN": str(ns.max_model_len)}
    args = ["serve", "--port", str(port)]
    if ns.tiny:
        args += ["--device", "cpu"]
        env["DEEPINFER_MODEL_MAX_MODEL_LEN"] = "8192"
    else:
        layers = [LAYER_TYPES[name] for name in ns.layers.split(",")]
        model_dir = write_config(ns.out / "v4-flash-shaped", layers)
        args += ["--model", str(model_dir)]
        env |= {"DEEPINFER_MODEL_RANDOM_WEIGHTS": "true", **WEIGHTS[weights]}
    ns.out.joinpath(weights).mkdir(exist_ok=True)
    log_path = ns.out / weights / "serve.log"
    started = time.monotonic()
    print(f"== weights {weights}", flush=True)
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-P", "-m", "deepinfer.cli", *args], env=env, stdout=log, stderr=log
        )
    try:
        while _get(base + "/ready")[0] != 200:
            if server.poll() is not None or time.monotonic() - started > 480:
                print(log_path.read_text(errors="replace")[-4000:])
                return None
            time.sleep(0.5)
        startup_s = time.monotonic() - started
        captured = _CAPTURED.search(log_path.read_text(errors="replace"))
        print(f"start-up: {startup_s:.1f} s to /ready")
        if captured:
            print(
                f"start-up capture: {captured[1]} graphs in {captured[2]} s, {captured[3]} MiB "
                "reserved"
            )
        print(f"graph captures before traffic: {_graph_captures(base)}", flush=True)
        rows = []
        for concurrency in map(int, ns.concurrency.split(",")):
            result = _bench(base, concurrency, max(16, 5 * concurrency), ns, weights)
            m = result["metrics"]
            rows.append(
                (
                    concurrency,
                    result["completed"],
                    result["failed"],
                    m["ttft"]["median_ms"],
                    m["ttft"]["percentiles_ms"]["99"],
                    m["tpot"]["median_ms"],
                    m["itl"]["median_ms"],
                    m["itl"]["percentiles_ms"]["99"],
                    result["output_throughput"],
                )
            )
        captures = _graph_captures(base)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"graph captures after traffic: {captures}", flush=True)
    return rows, captures


if __name__ == "__main__":
    sys.exit(main())
