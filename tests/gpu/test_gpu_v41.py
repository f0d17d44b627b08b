"""The tiny DeepSeek-V4.1 on CUDA: the Triton kernels (shifted hyper-connections, the indexer,
sparse attention, MoE) and decode graphs give the torch reference's greedy tokens, fp32, TF32
off; and the CPU run's, within the parity tolerance."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from oracle import oracle_prompts, sampled_logprobs

from deepinfer import LLM, SamplingParams
from deepinfer.outputs import RequestOutput

pytestmark = pytest.mark.gpu

SELF_ATOL = 1e-4  # as test_gpu_parity.py: CUDA against CPU, or Triton against torch_ref, fp32
TORCH_REF = {"attention": "torch_ref", "moe": "torch_ref", "norm": "torch_ref"}


def _llm(folder: Path, device: str, **kw) -> LLM:
    torch.set_num_threads(2)
    return LLM(
        model=folder,
        device=device,
        dtype="float32",
        max_model_len=1024,
        gpu_memory_utilization=0.1,
        **kw,
    )


def _batched(llm: LLM) -> list[RequestOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0)
    return llm.generate(oracle_prompts(), params, use_tqdm=False)


def _diff(a: list[RequestOutput], b: list[RequestOutput]) -> float:
    return max(
        (sampled_logprobs(x) - sampled_logprobs(y)).abs().max().item()
        for x, y in zip(a, b, strict=True)
    )


def test_triton_and_graphs_match_torch_ref_and_the_cpu(
    tiny_v41_dir: Path, ieee_fp32: None, record_figure: Callable[[str], None]
) -> None:
    fast = _llm(tiny_v41_dir, "cuda")
    kernels = fast.engine.executor.kernels
    assert type(kernels.norm).__module__.endswith("triton")
    reference = _llm(tiny_v41_dir, "cuda", cuda_graph_max_batch=0, **TORCH_REF)
    cpu = _llm(tiny_v41_dir, "cpu")
    runs = {name: _batched(llm) for name, llm in (("fast", fast), ("ref", reference), ("cpu", cpu))}
    graphs = fast.engine.executor.graphs
    assert graphs is not None and graphs.num_replays > 0, "no decode step replayed a graph"
    tokens = {name: [o.outputs[0].token_ids for o in run] for name, run in runs.items()}
    triton_diff, cpu_diff = _diff(runs["fast"], runs["ref"]), _diff(runs["fast"], runs["cpu"])
    record_figure(
        f"tiny V4.1 fp32 CUDA, Triton + graphs vs torch_ref eager: max |logprob diff| "
        f"{triton_diff:.2e}; vs CPU {cpu_diff:.2e}"
    )
    assert tokens["fast"] == tokens["ref"] == tokens["cpu"]
    assert triton_diff < SELF_ATOL and cpu_diff < SELF_ATOL
