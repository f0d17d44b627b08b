"""DeepSeek's DeepGEMM as the MoE backend (grouped FP8 GEMMs on FP8 experts), on CUDA, at
DeepSeek-V4-Flash shapes: 256 experts, top-6, hidden 4096, intermediate 2048.

The experts are MXFP4 (random, quantized) converted to FP8 blocks as the loader does (exact).
References, errors ||y - ref|| / ||ref||: our layout around ``torch_grouped_gemm`` (DeepGEMM's
contract in fp32 torch: the W8A8 arithmetic, so only accumulation order and the bf16 roundings
it moves differ: ``W8A8_TOL``), and torch_ref on the same FP8 experts with unquantized
activations (two e4m3 roundings in a row: ``ORACLE_TOL``, as tests/test_moe_deepgemm.py).
Skips with the backend's own reason where deep_gemm cannot run (scripts/build_deepgemm.sh).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from triton_modules import compiled

from deepinfer.ops import moe
from deepinfer.ops.linear import deepgemm as linear_deepgemm
from deepinfer.ops.linear import torch_ref as linear_ref
from deepinfer.ops.moe import torch_ref as moe_ref

pytestmark = pytest.mark.gpu

NUM_EXPERTS, TOP_K, DIM, INTER, LIMIT = 256, 6, 4096, 2048, 10.0
W8A8_TOL = 1e-2
ORACLE_TOL = 8e-2
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def deepgemm() -> ModuleType:
    """ops/moe/deepgemm.py, imported here, not at collection: it imports the Triton modules,
    which must come compiled (a CPU test may have imported them interpreted in this session;
    reloaded in place, so deepgemm.py sees the new kernels), and a first ``import triton``
    without TRITON_INTERPRET would make every CPU test's interpreter fail."""
    ok, why = linear_deepgemm.is_available(CUDA)
    if not ok:
        pytest.skip(why)
    compiled("deepinfer.ops.linear.triton")
    compiled("deepinfer.ops.moe.triton")
    return importlib.import_module("deepinfer.ops.moe.deepgemm")


@pytest.fixture(scope="module")
def experts() -> list[moe.Fp8ExpertWeight]:
    gen = torch.Generator(device=CUDA).manual_seed(0)

    def fp8(rows: int, cols: int) -> moe.Fp8ExpertWeight:
        dense = torch.randn(NUM_EXPERTS, rows, cols, generator=gen, device=CUDA) * 0.02
        packed = moe.quantize_mxfp4(dense.bfloat16())
        del dense
        converted = moe.to_fp8_experts(packed)
        assert torch.equal(converted.expert(7), packed.expert(7))  # exact, as on the CPU
        return converted

    return [fp8(INTER, DIM), fp8(DIM, INTER), fp8(INTER, DIM)]


def torch_grouped_gemm(a: tuple, b: tuple, d: torch.Tensor, m_indices: torch.Tensor) -> None:
    """DeepGEMM's contiguous-layout contract in fp32 torch, an expert at a time."""
    (qa, sa), (wb, sb) = a, b
    x = qa.float() * sa.repeat_interleave(128, 1)[:, : qa.shape[1]]
    for expert in torch.unique(m_indices).tolist():
        if expert >= 0:
            rows = m_indices == expert
            w = linear_ref.dequantize_fp8(wb[expert], sb[expert])
            d[rows] = (x[rows] @ w.T).to(d.dtype)


def _batch(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=CUDA).manual_seed(num_tokens)
    x = torch.randn(num_tokens, DIM, generator=gen, device=CUDA).bfloat16()
    scores = torch.rand(num_tokens, NUM_EXPERTS, generator=gen, device=CUDA)
    topk_ids = scores.topk(TOP_K, dim=-1).indices
    return x, topk_ids, torch.rand(num_tokens, TOP_K, generator=gen, device=CUDA)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_selected_by_name_only_and_asks_for_fp8_experts(deepgemm: ModuleType) -> None:
    """The loader's conversion for it is tested on the CPU (test_moe_deepgemm.py)."""
    backend = moe.BACKENDS.select("deepgemm", CUDA)
    assert type(backend).__name__ == "DeepGEMMMoEBackend" and backend.fp8_experts
    assert type(moe.BACKENDS.select("auto", CUDA)).__name__ == "TritonMoEBackend"


@pytest.mark.parametrize("num_tokens", [1, 32, 512, 4096])
def test_matches_the_references(
    deepgemm: ModuleType,
    num_tokens: int,
    experts: list[moe.Fp8ExpertWeight],
    ieee_fp32: None,
    record_figure: Callable[[str], None],
) -> None:
    backend = moe.BACKENDS.select("deepgemm", CUDA)
    x, topk_ids, topk_weights = _batch(num_tokens)
    out = backend.fused_moe(x, *experts, topk_ids, topk_weights, LIMIT)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    w8a8 = deepgemm.fused_moe(x, *experts, topk_ids, topk_weights, LIMIT, torch_grouped_gemm)
    oracle = moe_ref.fused_moe(x.float(), *experts, topk_ids, topk_weights, LIMIT)
    emulated, exact = _rel_err(out, w8a8), _rel_err(out, oracle)
    record_figure(
        f"deepgemm fused_moe T={num_tokens}: rel err {emulated:.2e} vs W8A8 in torch, "
        f"{exact:.2e} vs torch_ref"
    )
    assert emulated < W8A8_TOL and exact < ORACLE_TOL


def test_a_cuda_graph_replays_the_eager_result(
    deepgemm: ModuleType, experts: list[moe.Fp8ExpertWeight]
) -> None:
    """Nothing in the step reads the device from the host: it captures, and a replay on new
    routing gives what an eager call gives."""
    backend = moe.BACKENDS.select("deepgemm", CUDA)
    x, topk_ids, topk_weights = _batch(32)
    static = [x.clone(), topk_ids.clone(), topk_weights.clone()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.fused_moe(static[0], *experts, static[1], static[2], LIMIT)  # warm-up (JIT)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.fused_moe(static[0], *experts, static[1], static[2], LIMIT)
    x2, ids2, weights2 = _batch(33)
    for dst, src in zip(static, (x2[:32], ids2[:32], weights2[:32]), strict=True):
        dst.copy_(src)
    graph.replay()
    eager = backend.fused_moe(x2[:32], *experts, ids2[:32], weights2[:32], LIMIT)
    assert torch.equal(out, eager)
