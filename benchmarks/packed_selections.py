"""Packed vs dequantized FP4 experts: where two runs' greedy logprobs part, and whether a router
or indexer choice flipped there.

    bash scripts/gpu_bench.sh benchmarks/packed_selections.py [--tokens 24] [--graphs 0,128]
    python benchmarks/packed_selections.py --device cpu --perturb 1e-7,1e-6

The quantized tiny checkpoint (seed 1, as tests/gpu/test_gpu_parity.py's packed-experts test),
fp32, the oracle prompts, greedy. CUDA: the engine with packed experts, then with the same
values dequantized; each run records every call of the MoE backend's ``route`` and the
attention backend's ``indexer_topk`` (decode graphs replay without calling them: eager steps
record all), and the script prints, per request, the largest logprob difference and the first
token past 1e-5, then the first recorded call whose chosen rows differ, if any. CPU (torch_ref,
packed and dequantized give the same values): the routed experts' output is scaled by
1 + eps instead, to show how far a perturbation of that size moves the logprobs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from oracle import oracle_prompts, sampled_logprobs

from deepinfer import LLM, SamplingParams
from deepinfer.model.tiny import make_tiny_model

Selections = list[tuple[str, torch.Tensor]]  # (op, its chosen rows, sorted), call by call


def recorded(op: Callable[..., object], name: str, calls: Selections) -> Callable[..., object]:
    """``op`` that appends the rows it chose (route's ids, indexer_topk's rows) to ``calls``."""

    def call(*args: object, **kwargs: object) -> object:
        out = op(*args, **kwargs)
        rows = out[1] if name == "route" else out  # route: (weights, ids)
        assert isinstance(rows, torch.Tensor)
        calls.append((name, rows.detach().sort(-1).values.cpu()))
        return out

    return call


def run(
    folder: Path, device: str, fp4: bool, graphs: int, tokens: int, perturb: float = 0.0
) -> tuple[list[torch.Tensor], Selections]:
    llm = LLM(
        model=folder,
        device=device,
        dtype="float32",
        max_model_len=1024,
        fp4_experts=fp4,
        cuda_graph_max_batch=graphs,
    )
    kernels = llm.engine.executor.kernels
    calls: Selections = []
    kernels.moe.route = recorded(kernels.moe.route, "route", calls)
    kernels.attention.indexer_topk = recorded(kernels.attention.indexer_topk, "topk", calls)
    if perturb:
        fused_moe = kernels.moe.fused_moe
        kernels.moe.fused_moe = lambda *a, **k: fused_moe(*a, **k) * (1 + perturb)
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=0)
    outputs = llm.generate(oracle_prompts(), greedy, use_tqdm=False)
    return [sampled_logprobs(o) for o in outputs], calls


def compare(name: str, a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        diff = (x - y).abs()
        over = (diff > 1e-5).nonzero()
        first = over[0].item() if over.numel() else None
        worst = diff.max().item()
        print(f"  {name}, request {i}: max |logprob diff| {worst:.2e}, first past 1e-5: {first}")


def first_flip(a: Selections, b: Selections) -> str:
    for j, ((op, rows_a), (_, rows_b)) in enumerate(zip(a, b, strict=True)):
        if rows_a.shape != rows_b.shape or not torch.equal(rows_a, rows_b):
            return f"call {j} ({op}) chose other rows"
    return f"none of {len(a)} calls chose other rows"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens a request")
    ap.add_argument("--graphs", default="0,128", help="CUDA: cuda_graph_max_batch values")
    ap.add_argument("--perturb", default="1e-7,1e-6", help="CPU: relative MoE perturbations")
    ns = ap.parse_args()
    torch.set_num_threads(2)
    folder = make_tiny_model(Path(tempfile.mkdtemp()) / "quantized", seed=1, quantized=True)
    if ns.device == "cpu":
        base, _ = run(folder, "cpu", True, 0, ns.tokens)
        for eps in (float(e) for e in ns.perturb.split(",")):
            moved, _ = run(folder, "cpu", True, 0, ns.tokens, perturb=eps)
            compare(f"MoE output x (1 + {eps:g})", base, moved)
        return
    for graphs in (int(g) for g in ns.graphs.split(",")):
        packed, packed_calls = run(folder, ns.device, True, graphs, ns.tokens)
        dense, dense_calls = run(folder, ns.device, False, graphs, ns.tokens)
        compare(f"graphs up to {graphs}", packed, dense)
        print(f"  graphs up to {graphs}: {first_flip(packed_calls, dense_calls)}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
