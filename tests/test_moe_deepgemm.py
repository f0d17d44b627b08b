"""Routed experts in FP8 blocks for DeepGEMM's grouped GEMMs (ops/moe/deepgemm.py), on the CPU.

DeepGEMM itself runs only on SM90 (tests/gpu/test_gpu_deepgemm.py). Here: the conversion from
the checkpoint's MXFP4 (exact), our side of the contiguous layout (sorting, padding, quantizing,
gathering, combining) around ``emulated_grouped_gemm``, an fp32 implementation of DeepGEMM's
contract, against the W8A8 arithmetic pair by pair and against torch_ref; and the engine
converting the experts at load for a backend that takes them.
"""

from __future__ import annotations

import os

_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
# deepgemm.py imports the Triton modules (align_by_expert, the quantizer) though nothing here
# launches a kernel: imported interpreted, as the other CPU tests need them (triton_modules.py).
os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.cli import main as cli_main  # noqa: E402
from deepinfer.ops import moe  # noqa: E402
from deepinfer.ops.linear import torch_ref as linear_ref  # noqa: E402
from deepinfer.ops.moe import deepgemm  # noqa: E402
from deepinfer.ops.moe import torch_ref as moe_ref  # noqa: E402
from deepinfer.ops.registry import BackendEntry, always  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def interpreter_flag_restored() -> Iterator[None]:
    yield
    if _INTERPRET_BEFORE is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _INTERPRET_BEFORE


LIMIT = 7.0


def emulated_grouped_gemm(a: tuple, b: tuple, d: torch.Tensor, m_indices: torch.Tensor) -> None:
    """``m_grouped_fp8_gemm_nt_contiguous``'s contract in fp32: per 128-row block, the expert
    of its first row (-1: the block is skipped and d keeps what it held); 1 x 128 activation
    scales, 128 x 128 weight scales; d in bf16."""
    (qa, sa), (wb, sb) = a, b
    rows, k = qa.shape
    assert rows % deepgemm.BLOCK_M == 0 and m_indices.shape == (rows,)
    x = qa.float() * sa.repeat_interleave(128, 1)[:, :k]
    for start in range(0, rows, deepgemm.BLOCK_M):
        block = slice(start, start + deepgemm.BLOCK_M)
        expert = m_indices[block]
        assert (expert == expert[0]).all(), "an M block holds one expert"
        if expert[0] < 0:
            continue
        w = linear_ref.dequantize_fp8(wb[expert[0]], sb[expert[0]])
        d[block] = (x[block] @ w.T).to(d.dtype)


def w8a8_moe(x, w1, w2, w3, topk_ids, topk_weights) -> torch.Tensor:
    """The arithmetic the backend should do, pair by pair: activations quantized per token per
    128 (torch_ref's quantizer), fp32 products, gate/up and down outputs rounded to bf16."""

    def linear(inputs: torch.Tensor, w: moe.Fp8ExpertWeight, expert: int) -> torch.Tensor:
        q, s = linear_ref.quantize_activations(inputs)
        values = q.float() * s.repeat_interleave(128, 1)[:, : inputs.shape[1]]
        return (values @ w.expert(expert).T).bfloat16()

    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = moe_ref.swiglu(linear(x[t : t + 1], w1, e), linear(x[t : t + 1], w3, e), LIMIT)
            out[t] += topk_weights[t, j] * linear(h, w2, e)[0].float()
    return out.to(x.dtype)


def _experts(gen: torch.Generator, num: int, dim: int, inter: int) -> list[moe.Mxfp4Weight]:
    def packed(rows: int, cols: int) -> moe.Mxfp4Weight:
        return moe.quantize_mxfp4(torch.randn(num, rows, cols, generator=gen) * 0.05)

    return [packed(inter, dim), packed(dim, inter), packed(inter, dim)]


def test_fp8_conversion_of_packed_experts_is_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 256, 384, generator=gen)
    weight *= torch.exp2(torch.randint(-6, 6, (3, 256, 1), generator=gen).float())  # rows vary
    packed = moe.quantize_mxfp4(weight)
    fp8 = moe.to_fp8_experts(packed)
    assert fp8.weight.dtype == torch.float8_e4m3fn and tuple(fp8.scale.shape) == (3, 2, 3)
    assert torch.equal(fp8.dequantize(), packed.dequantize())
    mantissa, _ = torch.frexp(fp8.scale)
    assert (mantissa == 0.5).all(), "block scales are powers of two"
    # A dense weight rounds like any e4m3 quantization: within half an ulp of 3 mantissa bits.
    dense = moe.to_fp8_experts(weight)
    assert ((dense.dequantize() - weight).abs() <= weight.abs() * 2**-4 + 2**-9 * 16).all()


@pytest.mark.parametrize("num_tokens", [1, 5, 23])
def test_contiguous_layout_computes_each_pair_as_w8a8(num_tokens: int) -> None:
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, dim, inter, top_k = 8, 256, 128, 3
    w1, w2, w3 = (moe.to_fp8_experts(w) for w in _experts(gen, num_experts, dim, inter))
    x = torch.randn(num_tokens, dim, generator=gen).bfloat16()
    topk_ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)

    out = deepgemm.fused_moe(
        x, w1, w2, w3, topk_ids, topk_weights, LIMIT, grouped_gemm=emulated_grouped_gemm
    )
    assert out.shape == x.shape and out.dtype == x.dtype
    expected = w8a8_moe(x, w1, w2, w3, topk_ids, topk_weights)
    # The same arithmetic; only fp32 sums in another order, then one bf16 rounding.
    assert torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=1e-3)
    # Against the oracle (activations unquantized): two e4m3 roundings in a row (x, then h),
    # each ~3e-2 of relative error (a FP8 linear's figure in benchmarks/RESULTS.md).
    oracle = moe_ref.fused_moe(x.float(), w1, w2, w3, topk_ids, topk_weights, LIMIT)
    error = ((out.float() - oracle).norm() / oracle.norm()).item()
    assert error < 8e-2, f"W8A8 vs the fp32 oracle on the same FP8 experts: {error:.2e}"


def test_dense_or_packed_experts_are_refused_with_the_reason() -> None:
    gen = torch.Generator().manual_seed(1)
    w1, w2, w3 = _experts(gen, 2, 128, 128)
    x = torch.randn(1, 128, generator=gen)
    ids, weights = torch.tensor([[0]]), torch.ones(1, 1)
    with pytest.raises(TypeError, match="takes FP8 experts, w1 is a Mxfp4Weight"):
        deepgemm.fused_moe(x, w1, w2, w3, ids, weights, LIMIT, emulated_grouped_gemm)
    with pytest.raises(TypeError, match=r"kernel\.moe = 'deepgemm' or 'torch_ref'"):
        from deepinfer.ops.moe import triton

        triton.fused_moe(x, *(moe.to_fp8_experts(w) for w in (w1, w2, w3)), ids, weights, LIMIT)


class Fp8ReferenceMoEBackend(moe_ref.TorchRefMoEBackend):
    """The oracle on experts the loader converted to FP8 (as for the deepgemm backend)."""

    fp8_experts = True


def test_engine_converts_experts_for_a_backend_that_takes_fp8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny quantized checkpoint's MXFP4 experts converted at load: exact, so the oracle
    gives the packed run's tokens and logprobs (fp32), in FP8's bytes."""
    torch.set_num_threads(2)
    folder = tmp_path / "quantized"
    assert cli_main(["make-tiny-model", str(folder), "--quantized", "--seed", "2"]) == 0
    entry = BackendEntry("fp8_reference", f"{__name__}:Fp8ReferenceMoEBackend", always)
    monkeypatch.setitem(moe.BACKENDS._entries, "fp8_reference", entry)
    prompts = ["Hello, my name is", "1 2 3 4 5"]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    runs = {}
    for backend in ("torch_ref", "fp8_reference"):
        llm = LLM(model=folder, device="cpu", block_size=16, moe=backend)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs[backend] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
        executor = llm.engine.executor
        experts = executor.model.layers[0].ffn.experts
        weight_bytes = executor.weight_bytes.routed_experts
        if backend == "fp8_reference":
            assert experts.w1.dtype == torch.float8_e4m3fn and not hasattr(experts, "w1_scales")
            e, rows, cols = experts.w1.shape
            # A byte a value and one fp32 scale per 128 x 128 block (one here: 32 x 64).
            layers = sum(hasattr(m, "to_fp8") for m in executor.model.modules())
            assert weight_bytes == layers * 3 * e * (rows * cols + 4)
        else:
            assert experts.packed
    assert runs["fp8_reference"] == runs["torch_ref"]
