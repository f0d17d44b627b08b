"""The FlashMLA attention backend in a V4-Flash-shaped model over an FP8 KV cache.

A decode step of 4 requests (1,024 tokens of context each) through three layers of V4-Flash's
attention shapes (CSA, sliding, HCA; 64 heads of 512; 8 routed experts, to keep it small) with
``attention = "flashmla"`` and its token threshold lowered to 1: every layer's attention must go
to FlashMLA (block_size 256, so that HCA's entries, two a block, are 16-byte aligned as FlashMLA
loads them) and give, on the same sources, what the Triton kernels give (the backend with
FlashMLA refused: ``takes_queries`` false), within FlashMLA's own decode tolerances
(tests/gpu/test_gpu_flashmla.py: every element within 1e-2 absolute or 2.01/128 relative, a
cosine difference under 5e-6). Likewise a prompt's two chunks through its sparse prefill
(its prefill test's tolerances). The logits of the two runs are not compared: a last-bit change
of an attention output may flip the random router's or the indexer's choices downstream.
A CUDA graph of the step (the engine's decode graphs) replays the eager step's logits.

Skipped where flash_mla is not importable (bash scripts/build_flashmla.sh, then
PYTHONPATH=/tmp/flashmla-site) or the GPU is not SM90.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.ops.attention import flashmla

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

OUT_ABS_TOL, OUT_REL_TOL, COS_DIFF_TOL = 1e-2, 2.01 / 128, 5e-6
# FlashMLA's sparse prefill test's (tests/gpu/test_gpu_flashmla.py): 8e-3, 3.01/128, 7e-6.
PREFILL_ABS_TOL, PREFILL_REL_TOL, PREFILL_COS_DIFF_TOL = 8e-3, 3.01 / 128, 7e-6


def _cos_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return (1 - 2 * (a * b).sum() / (a.square().sum() + b.square().sum())).item()


@pytest.fixture(scope="module")
def backend_module():
    ok, why = flashmla.is_available(torch.device("cuda"))
    if not ok:
        pytest.skip(why)
    from triton_modules import compiled

    compiled("deepinfer.ops.attention.triton")
    from deepinfer.ops.attention import flashmla_backend

    return flashmla_backend


@pytest.fixture(scope="module")
def flash_model(backend_module):
    """Three V4-Flash-shaped layers (CSA, sliding, HCA; 8 experts) on the flashmla backend,
    block_size 256, and what builds their inputs."""
    import v4_flash as bench

    from deepinfer.model.deepseek_v4.args import CSA, HCA, SLIDING, ModelArgs

    setup = dataclasses.replace(bench.make_setup(tiny=False), block_size=256)
    config = {**bench.config_dict([CSA, SLIDING, HCA]), "num_local_experts": 8}
    args = ModelArgs.from_dict(config)
    kernels = bench.select_kernels(bench.kernel_config("attention=flashmla"), setup.device)
    assert isinstance(kernels.attention, backend_module.FlashMLAAttentionBackend)
    model = bench.build_model(args, kernels, setup, seed=0, fp4_experts=True, fp8_linears=True)
    return bench, setup, args, model


def _against_triton(backend_module, patch: pytest.MonkeyPatch, tolerances) -> list:
    """Every attention call from here on also runs on Triton with the same sources (FlashMLA
    refused: ``takes_queries`` false); returns the list each call's (elements out of
    ``tolerances`` = (abs, rel), max error, cosine difference) goes to."""
    gaps = []
    attend = backend_module.FlashMLAAttentionBackend.sparse_attention
    out_abs, out_rel = tolerances

    def both(self, *a, **kw):
        ours = attend(self, *a, **kw)
        with pytest.MonkeyPatch.context() as inner:
            inner.setattr(backend_module, "takes_queries", lambda q: False)
            triton = attend(self, *a, **kw).float()
        err = (ours.float() - triton).abs()
        close = (err <= out_abs) | (err <= out_rel * triton.abs())
        gaps.append((int((~close).sum()), err.max().item(), _cos_diff(ours, triton)))
        return ours

    patch.setattr(backend_module.FlashMLAAttentionBackend, "sparse_attention", both)
    return gaps


def _count(patch: pytest.MonkeyPatch, name: str) -> list:
    calls = []
    real = getattr(flashmla, name)

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    patch.setattr(flashmla, name, counted)
    return calls


def _check(gaps: list, cos_tol: float) -> None:
    for layer, (outside, worst, cos_diff) in enumerate(gaps):
        assert outside == 0, f"call {layer}: {outside} elements out, max err {worst:.3e}"
        assert cos_diff < cos_tol, f"call {layer}: cosine difference {cos_diff:.2e}"


def test_flashmla_decodes_every_layer_as_triton_would(
    backend_module, flash_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench, setup, args, model = flash_model
    monkeypatch.setattr(backend_module, "MIN_TOKENS", 1)
    calls = _count(monkeypatch, "sparse_decode")
    with monkeypatch.context() as patch:
        gaps = _against_triton(backend_module, patch, (OUT_ABS_TOL, OUT_REL_TOL))
        batch, cache = bench.decode_inputs(args, setup, 4, 1024, seed=1, kv_dtype="fp8")
        with torch.inference_mode():
            model(batch, cache)
    assert len(calls) == 3, f"FlashMLA ran in {len(calls)} of 3 layers"
    _check(gaps, COS_DIFF_TOL)

    batch, cache = bench.decode_inputs(args, setup, 4, 1024, seed=1, kv_dtype="fp8")
    bench.graph_plans(batch, cache)
    with torch.inference_mode():
        eager = model(batch, cache).clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(batch, cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(batch, cache)
        graph.replay()
    torch.cuda.synchronize()
    assert len(calls) == 3 + 3 * 3  # eager, warm-up and capture: FlashMLA in the graph
    assert torch.equal(captured, eager)


def test_flashmla_prefills_every_layer_as_triton_would(
    backend_module, flash_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1,024-token prompt in two chunks of 512: the second reads the first's ring rows and
    compressed entries, all packed; FlashMLA's sparse prefill takes every layer's call."""
    bench, setup, args, model = flash_model
    calls = _count(monkeypatch, "sparse_prefill")
    gaps = _against_triton(backend_module, monkeypatch, (PREFILL_ABS_TOL, PREFILL_REL_TOL))
    batches, cache = bench.prefill_inputs(args, setup, 1024, 512, seed=2, kv_dtype="fp8")
    with torch.inference_mode():
        for batch in batches:
            model(batch, cache)
    assert len(calls) == 2 * 3, f"FlashMLA prefilled {len(calls)} of 6 layer calls"
    _check(gaps, PREFILL_COS_DIFF_TOL)
