"""The CUDA path computes what the CPU path computes, on the oracle checkpoint.

float32 on CUDA (TF32 off): greedy tokens identical to our CPU run, prompt logprobs within
ORACLE_ATOL of transformers (CPU, fp32), sampled-token logprobs within SELF_ATOL of our CPU run.
bfloat16 on CUDA: the top-1 agreement with the fp32 logits over every prompt position is
reported as a figure (gpu_results.txt) and must stay above BF16_TOP1_FLOOR. Prefix hits on CUDA
(snapshot restore, bounded replay, host-tier load) give the tokens of a cold run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from oracle import hf_prompt_logprobs, oracle_prompts, prompt_token_logprobs, sampled_logprobs

from deepinfer import LLM, SamplingParams
from deepinfer.outputs import RequestOutput

pytestmark = pytest.mark.gpu

# fp32 against transformers on the CPU: the CPU oracle test's bound (other op order; cuBLAS
# GEMMs reduce in another order than the CPU's).
ORACLE_ATOL = 1e-4
# fp32 CUDA against fp32 CPU, our own engine: same ops, other reduction order.
SELF_ATOL = 1e-4
# Prefix hit vs cold run, both on CUDA fp32: the hit computes the suffix in other GEMM shapes,
# for which cuBLAS may pick kernels that reduce in another order.
PREFIX_ATOL = 1e-4
# bf16 vs fp32 top-1 over the ~400 prompt positions. The random tiny model's logits are nearly
# flat over 129,280 tokens (top-1 margins of a few hundredths of a nat), so bf16 rounding (2^-8
# relative), which also flips the learned gates' expert choice and the indexer's top-k, changes
# the argmax often: bf16 on the CPU agrees on 0.908 of these positions. 0.8 is ~6 standard
# deviations under that; a broken bf16 path (a wrong cast, a stale cache) lands near 0.
BF16_TOP1_FLOOR = 0.8
NUM_NEW = 32
MAX_MODEL_LEN = 1024  # the prompts need < 400; also bounds the profile step at start
UTILIZATION = 0.1  # several engines live in this process; each takes a tenth of the device


def _llm(folder: Path, device: str, dtype: str = "float32", **kw) -> LLM:
    torch.set_num_threads(2)
    return LLM(
        model=folder,
        device=device,
        dtype=dtype,
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=UTILIZATION,
        **kw,
    )


@pytest.fixture(scope="module")
def cpu_fp32(oracle_hf_dir: Path) -> LLM:
    return _llm(oracle_hf_dir, "cpu")


@pytest.fixture(scope="module")
def cuda_fp32(oracle_hf_dir: Path) -> LLM:
    return _llm(oracle_hf_dir, "cuda")


@pytest.fixture(scope="module")
def cuda_bf16(oracle_hf_dir: Path) -> LLM:
    return _llm(oracle_hf_dir, "cuda", "bfloat16")


def _greedy(max_tokens: int = NUM_NEW, prompt_logprobs: int = 0) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=0, prompt_logprobs=prompt_logprobs
    )


def _top1(out: RequestOutput) -> list[int]:
    """The most likely next token at every prompt position (needs prompt_logprobs >= 1)."""
    assert out.prompt_logprobs is not None
    return [max(entry, key=entry.__getitem__) for entry in out.prompt_logprobs[1:]]


def test_cuda_runs_on_cuda(cuda_fp32: LLM) -> None:
    runner = cuda_fp32.engine.executor
    assert runner.device.type == "cuda" and runner.kv_cache[0, "ring"].is_cuda
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize("index", [0, 1, 2])
def test_fp32_matches_cpu_and_transformers(
    index: int,
    cpu_fp32: LLM,
    cuda_fp32: LLM,
    oracle_hf_dir: Path,
    record_figure: Callable[[str], None],
) -> None:
    prompt = oracle_prompts()[index]
    cpu = cpu_fp32.generate([prompt], _greedy(), use_tqdm=False)[0]
    cuda = cuda_fp32.generate([prompt], _greedy(), use_tqdm=False)[0]
    assert cuda.outputs[0].token_ids == cpu.outputs[0].token_ids
    oracle_diff = (prompt_token_logprobs(cuda) - hf_prompt_logprobs(oracle_hf_dir, prompt)).abs()
    self_diff = (sampled_logprobs(cuda) - sampled_logprobs(cpu)).abs()
    record_figure(
        f"fp32 CUDA, prompt of {len(prompt)} tokens: max |prompt logprob - transformers| "
        f"{oracle_diff.max().item():.2e}, max |sampled logprob - CPU| {self_diff.max().item():.2e}"
    )
    assert oracle_diff.max().item() < ORACLE_ATOL
    assert self_diff.max().item() < SELF_ATOL


def test_bf16_top1_agreement(
    cuda_fp32: LLM, cuda_bf16: LLM, record_figure: Callable[[str], None]
) -> None:
    params = _greedy(max_tokens=1, prompt_logprobs=1)
    agree = total = 0
    max_diff = 0.0
    for prompt in oracle_prompts():
        fp32 = cuda_fp32.generate([prompt], params, use_tqdm=False)[0]
        bf16 = cuda_bf16.generate([prompt], params, use_tqdm=False)[0]
        pairs = list(zip(_top1(fp32), _top1(bf16), strict=True))
        agree += sum(a == b for a, b in pairs)
        total += len(pairs)
        diff = (prompt_token_logprobs(fp32) - prompt_token_logprobs(bf16)).abs().max().item()
        max_diff = max(max_diff, diff)
    agreement = agree / total
    record_figure(
        f"bf16 vs fp32 on CUDA: top-1 agreement {agreement:.4f} ({agree}/{total} prompt "
        f"positions), max |prompt logprob diff| {max_diff:.3f}"
    )
    assert agreement > BF16_TOP1_FLOOR


def test_sampling_on_cuda(cpu_fp32: LLM, cuda_fp32: LLM) -> None:
    """Unseeded rows draw from the runner's generator on the device. Seeded rows draw their
    uniforms on the CPU, so with the fp32 logits this close a seeded request gives the CPU's
    tokens."""
    prompts = oracle_prompts()
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=NUM_NEW)
    free = SamplingParams(temperature=1.0, top_k=50, max_tokens=NUM_NEW, ignore_eos=True)
    cpu = cpu_fp32.generate([prompts[1]], seeded, use_tqdm=False)[0]
    cuda = cuda_fp32.generate([prompts[0], prompts[1]], [free, seeded], use_tqdm=False)
    assert cuda[1].outputs[0].token_ids == cpu.outputs[0].token_ids
    unseeded = cuda[0].outputs[0].token_ids
    assert len(unseeded) == NUM_NEW and all(0 <= t < 129280 for t in unseeded)


# ---- prefix caching on CUDA ------------------------------------------------------------------

BLOCK = 16  # a multiple of the oracle's ratios (CSA 4, HCA 16)
BASE = 160  # the diverging prompts share the first prompt's first 160 tokens (10 blocks)
PREFIX_PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)


def _first() -> list[int]:
    return oracle_prompts()[2]


def _diverging(offset: int) -> list[int]:
    return _first()[: BASE + offset] + oracle_prompts()[1][1:41]


@pytest.fixture(scope="module")
def cold(oracle_hf_dir: Path) -> LLM:
    return _llm(oracle_hf_dir, "cuda", block_size=BLOCK, enable_prefix_caching=False)


def _assert_same(warm: RequestOutput, cold: RequestOutput) -> None:
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    diff = (sampled_logprobs(warm) - sampled_logprobs(cold)).abs().max().item()
    assert diff < PREFIX_ATOL, f"logprobs differ by {diff:.2e}"


@pytest.mark.parametrize("interval", [0, 2], ids=["replay", "snapshot"])
def test_prefix_hit_matches_cold(oracle_hf_dir: Path, cold: LLM, interval: int) -> None:
    """interval 0: the first hit finds no snapshot at BASE and replays from an empty slot;
    interval 2: a snapshot every 2 blocks sits at BASE and is restored on the device."""
    warm = _llm(oracle_hf_dir, "cuda", block_size=BLOCK, snapshot_interval_blocks=interval)
    prefix = warm.engine.scheduler.prefix
    warm.generate([_first()], PREFIX_PARAMS, use_tqdm=False)
    for offset in (0, 3, 8, 15):
        prompt = _diverging(offset)
        out = warm.generate([prompt], PREFIX_PARAMS, use_tqdm=False)[0]
        assert out.num_cached_tokens == BASE, offset
        _assert_same(out, cold.generate([prompt], PREFIX_PARAMS, use_tqdm=False)[0])
    # As on the CPU: with interval 0 the first hit replays num_layers * (window - 1) = 35 tokens
    # and leaves a snapshot at BASE that the later three restore; with interval 2 all four do.
    restored, replayed = prefix.snapshots.stats.num_restored, prefix.stats.num_replayed_tokens
    assert (restored, replayed) == ((4, 0) if interval else (3, 35))
    warm.engine.scheduler.check_integrity()


def test_prefix_hit_from_the_pinned_host_tier(oracle_hf_dir: Path, cold: LLM) -> None:
    """Blocks evicted to the host tier (pinned memory on CUDA) and loaded back give the same
    tokens as a cold run."""
    num_blocks = 22  # the first prompt and its reply need 20
    warm = _llm(oracle_hf_dir, "cuda", block_size=BLOCK, num_blocks=num_blocks, host_tier_gib=0.01)
    warm.generate([_first()], PREFIX_PARAMS, use_tqdm=False)
    other = (oracle_prompts()[1] * 4)[: num_blocks * BLOCK - PREFIX_PARAMS.max_tokens]
    warm.generate([other], PREFIX_PARAMS, use_tqdm=False)  # evicts every block of the first
    assert warm.engine.tiers is not None and warm.engine.tiers.host is not None
    warm.engine.tiers.flush()
    assert warm.engine.tiers.host.pin_memory
    prompt = _diverging(8)
    out = warm.generate([prompt], PREFIX_PARAMS, use_tqdm=False)[0]
    hits = warm.engine.scheduler.prefix.stats.cached_tokens_by_tier
    assert hits.get("host", 0) == BASE and out.num_cached_tokens == BASE
    _assert_same(out, cold.generate([prompt], PREFIX_PARAMS, use_tqdm=False)[0])


# ---- Triton backends and decode graphs ---------------------------------------------------------

TORCH_REF = {"attention": "torch_ref", "moe": "torch_ref", "norm": "torch_ref"}


def _batched(llm: LLM) -> list[RequestOutput]:
    return llm.generate(oracle_prompts(), _greedy(), use_tqdm=False)


def _max_logprob_diff(a: list[RequestOutput], b: list[RequestOutput]) -> float:
    return max(
        (sampled_logprobs(x) - sampled_logprobs(y)).abs().max().item()
        for x, y in zip(a, b, strict=True)
    )


def _first_over(a: list[RequestOutput], b: list[RequestOutput], bound: float) -> str:
    """Where the sampled logprobs of two runs first differ by more than ``bound``, per request
    ("request i: token j"), or "none": a discrete choice that flipped shows as a jump there."""
    places = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        over = ((sampled_logprobs(x) - sampled_logprobs(y)).abs() > bound).nonzero()
        if over.numel():
            places.append(f"request {i}: token {over[0].item()}")
    return ", ".join(places) or "none"


def test_triton_backends_match_torch_ref(
    cuda_fp32: LLM, oracle_hf_dir: Path, record_figure: Callable[[str], None]
) -> None:
    """fp32, TF32 off: the Triton kernels (and decode graphs) give the torch reference's greedy
    tokens on the oracle prompts, batched."""
    kernels = cuda_fp32.engine.executor.kernels
    assert [type(k).__module__.rsplit(".", 1)[-1] for k in (kernels.attention, kernels.moe)] == [
        "triton",
        "triton",
    ]
    reference = _llm(oracle_hf_dir, "cuda", cuda_graph_max_batch=0, **TORCH_REF)
    fast, ref = _batched(cuda_fp32), _batched(reference)
    diff = _max_logprob_diff(fast, ref)
    record_figure(f"fp32 CUDA, Triton + graphs vs torch_ref eager: max |logprob diff| {diff:.2e}")
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in ref]
    assert diff < SELF_ATOL


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_graphs_on_and_off(
    dtype: str, oracle_hf_dir: Path, record_figure: Callable[[str], None]
) -> None:
    """Graphs on vs off: identical greedy tokens in fp32; bf16 pads the batch (other matrix
    shapes), so its agreement is reported."""
    on = _llm(oracle_hf_dir, "cuda", dtype)
    off = _llm(oracle_hf_dir, "cuda", dtype, cuda_graph_max_batch=0)
    with_graphs, eager = _batched(on), _batched(off)
    graphs = on.engine.executor.graphs
    assert graphs is not None and graphs.num_replays > 0, "no decode step replayed a graph"
    # Every shape was captured at start-up: none while serving.
    assert graphs.num_captures_while_serving == 0
    assert sorted(graphs._graphs) == sorted(graphs.shapes)
    same = [
        a.outputs[0].token_ids == b.outputs[0].token_ids
        for a, b in zip(with_graphs, eager, strict=True)
    ]
    record_figure(
        f"{dtype} CUDA, decode graphs on vs off: {sum(same)}/{len(same)} requests with identical "
        f"greedy tokens, max |logprob diff| {_max_logprob_diff(with_graphs, eager):.2e}, "
        f"{len(graphs._graphs)} graphs captured"
    )
    if dtype == "float32":
        assert all(same)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_scheduling_on_and_off(
    dtype: str, oracle_hf_dir: Path, record_figure: Callable[[str], None]
) -> None:
    """Asynchronous vs synchronous scheduling (graphs on; a seeded top-p row, whose filter runs
    without a host sync on CUDA, a greedy one, and a penalised one with min_tokens, which count
    the pending token on the device), each prompt once per kind: identical tokens in fp32;
    bf16 reported (a request retired one step later can change a step's batch, and with it
    bf16 rounding)."""
    kinds = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=NUM_NEW, logprobs=0),
        _greedy(),
        SamplingParams(
            temperature=0.0, presence_penalty=-2.0, min_tokens=8, max_tokens=NUM_NEW, logprobs=0
        ),
    ]
    prompts = [p for p in oracle_prompts() for _ in kinds]
    params = kinds * len(oracle_prompts())
    runs = {}
    for mode in (True, False):
        llm = _llm(oracle_hf_dir, "cuda", dtype, async_scheduling=mode)
        runs[mode] = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.scheduler.check_integrity()
        assert llm.engine.scheduler.block_manager.num_used_blocks == 0
    same = [
        a.outputs[0].token_ids == b.outputs[0].token_ids
        for a, b in zip(runs[True], runs[False], strict=True)
    ]
    record_figure(
        f"{dtype} CUDA, async vs sync scheduling: {sum(same)}/{len(same)} requests with "
        f"identical tokens, max |logprob diff| {_max_logprob_diff(runs[True], runs[False]):.2e}"
    )
    if dtype == "float32":
        assert all(same)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_fp4_experts_give_the_tokens_of_dequantized_ones(
    dtype: str, tmp_path: Path, record_figure: Callable[[str], None]
) -> None:
    """The tiny checkpoint in V4-Flash's formats (FP4 experts), Triton MoE with decode graphs:
    packed experts vs the same values dequantized. fp32: identical tokens, logprobs within
    SELF_ATOL (the values are exact; the packed kernel sums in another order); bf16: reported."""
    from deepinfer.model.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "quantized", seed=1, quantized=True)
    runs = {}
    for fp4 in (True, False):
        llm = _llm(folder, "cuda", dtype, fp4_experts=fp4)
        assert type(llm.engine.executor.kernels.moe).__module__.endswith("triton")
        runs[fp4] = (_batched(llm), llm.engine.executor.weight_bytes.routed_experts)
    (packed, packed_bytes), (dense, dense_bytes) = runs[True], runs[False]
    same = [
        a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(packed, dense, strict=True)
    ]
    diff = _max_logprob_diff(packed, dense)
    record_figure(
        f"{dtype} CUDA, packed FP4 experts vs dequantized: {sum(same)}/{len(same)} requests with "
        f"identical greedy tokens, max |logprob diff| {diff:.2e} (first over {SELF_ATOL}: "
        f"{_first_over(packed, dense, SELF_ATOL)}); routed experts {packed_bytes} B vs "
        f"{dense_bytes} B"
    )
    if dtype == "float32":
        assert all(same) and diff < SELF_ATOL


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_side_stream_gives_the_results_of_one_stream(
    dtype: str, tmp_path: Path, record_figure: Callable[[str], None]
) -> None:
    """kernel.side_stream on vs off, decode graphs on, on the tiny checkpoint in V4-Flash's
    formats with every linear FP8 (split-K GEMMs take tickets on both streams) and packed
    experts: the same kernels on the same inputs, so the same tokens and logprobs, bit for bit,
    in both dtypes. No prefix cache: a hit changes the rows a forward computes, and the FP8
    GEMM's tiles follow the rows (test_gpu_linear_fp8.py's run-to-run test says so)."""
    from deepinfer.model.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "quantized", seed=1, quantized=True)
    runs = {}
    for side in (True, False):
        llm = _llm(
            folder, "cuda", dtype, side_stream=side, fp8_weights=True, fp8_min_weights=0,
            enable_prefix_caching=False,
        )  # fmt: skip
        assert llm.engine.executor.kernels.side_stream is side
        runs[side] = _batched(llm)
        assert llm.engine.executor.graphs.num_replays > 0, "no decode step replayed a graph"
    diff = _max_logprob_diff(runs[True], runs[False])
    record_figure(f"{dtype} CUDA, side stream on vs off: max |logprob diff| {diff:.2e}")
    assert [o.outputs[0].token_ids for o in runs[True]] == [
        o.outputs[0].token_ids for o in runs[False]
    ]
    assert diff == 0.0
