"""Whether kernel.side_stream changes an engine's results: the quantized tiny checkpoint in bf16
(packed experts; every linear FP8 unless --bf16-linears), greedy, no prefix cache, one engine
per setting in turn, each setting's tokens and logprobs compared with the others'.

    bash scripts/gpu_bench.sh benchmarks/side_stream_identity.py    (CUDA; decode graphs on)

Settings: side stream off twice and on twice (run-to-run identity of each), then off and on
with kernel.launch_pdl off, then off and on with bf16 linears. Prints each pair's count of
bit-identical requests and, where a request differs, the first token whose logprob does.
``tests/gpu/test_gpu_parity.py::test_side_stream_gives_the_results_of_one_stream`` asserts the
main pair.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from oracle import oracle_prompts

from deepinfer import LLM, SamplingParams
from deepinfer.model.tiny import make_tiny_model

SETTINGS: dict[str, dict[str, bool]] = {
    "off": {"side_stream": False},
    "off again": {"side_stream": False},
    "on": {"side_stream": True},
    "on again": {"side_stream": True},
    "off, no PDL": {"side_stream": False, "launch_pdl": False},
    "on, no PDL": {"side_stream": True, "launch_pdl": False},
    "off, bf16 linears": {"side_stream": False, "fp8_weights": False},
    "on, bf16 linears": {"side_stream": True, "fp8_weights": False},
}
PAIRS = [
    ("off", "off again"),
    ("on", "on again"),
    ("off", "on"),
    ("off, no PDL", "on, no PDL"),
    ("off", "off, no PDL"),
    ("off, bf16 linears", "on, bf16 linears"),
]

Run = list[tuple[list[int], list[float]]]


def run(folder: Path, max_tokens: int, **switches: bool) -> Run:
    """Each oracle prompt's greedy tokens and their logprobs, from a fresh engine."""
    kw = {"fp8_weights": True, **switches}
    llm = LLM(
        model=folder, device="cuda", dtype="bfloat16", max_model_len=1024,
        gpu_memory_utilization=0.1, enable_prefix_caching=False, fp8_min_weights=0, **kw,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
    outs = llm.generate(oracle_prompts(), params, use_tqdm=False)
    result = [
        (o.outputs[0].token_ids, [next(iter(d.values())) for d in o.outputs[0].logprobs])
        for o in outs
    ]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def compare(a: Run, b: Run) -> str:
    """ "k/n bit-identical", and each differing request's first differing token."""
    lines = [f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)} bit-identical"]
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:  # the first token whose id or logprob differs (or where one run ended)
            steps = list(zip(*x, strict=True)), list(zip(*y, strict=True))
            pairs = zip(*steps, strict=False)
            first = next((j for j, (p, q) in enumerate(pairs) if p != q), min(map(len, steps)))
            lines.append(f"  request {i}: first difference at token {first}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--max-tokens", type=int, default=32)
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("side_stream_identity.py needs CUDA (the side stream is CUDA's)")
    folder = make_tiny_model(Path(tempfile.mkdtemp()) / "quantized", seed=1, quantized=True)
    runs = {name: run(folder, ns.max_tokens, **switches) for name, switches in SETTINGS.items()}
    for a, b in PAIRS:
        print(f"{a} vs {b}: {compare(runs[a], runs[b])}")


if __name__ == "__main__":
    main()
