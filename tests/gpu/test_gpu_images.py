"""Images on CUDA (the tiny DeepSeek-V4.1's toy tower): an image request batched with a text one,
its decode steps replaying graphs, gives the CPU run's greedy tokens (fp32, TF32 off, within the
parity tolerance), and a repeated image is served from the embeddings and prefix caches."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_gpu_v41 import _llm
from test_v41_images import PROMPT, A, B, _logprobs, _run

pytestmark = pytest.mark.gpu

SELF_ATOL = 1e-4  # as test_gpu_parity.py: CUDA against CPU, fp32


def test_images_on_cuda_match_the_cpu(tiny_v41_dir: Path, ieee_fp32: None) -> None:
    text = list(range(200, 260))
    runs = {}
    for device in ("cuda", "cpu"):
        llm = _llm(tiny_v41_dir, device, block_size=16)
        runs[device] = (llm, _run(llm, [(text, []), (PROMPT, [A, B])]))
    gpu, (gpu_text, gpu_image) = runs["cuda"]
    _, (cpu_text, cpu_image) = runs["cpu"]
    assert gpu_image.output_token_ids == cpu_image.output_token_ids
    assert gpu_text.output_token_ids == cpu_text.output_token_ids
    diff = (_logprobs(gpu_image) - _logprobs(cpu_image)).abs().max().item()
    assert diff < SELF_ATOL, f"image request's logprobs differ by {diff:.2e}"
    graphs = gpu.engine.executor.graphs
    assert graphs is not None and graphs.num_replays > 0, "no decode step replayed a graph"
    (again,) = _run(gpu, [(PROMPT, [A, B])])
    assert again.output_token_ids == gpu_image.output_token_ids
    assert gpu.engine.image_stats()["num_encoded"] == 2
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 16
