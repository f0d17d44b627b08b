"""Lock-step ranks on CUDA with one GPU: the expert-parallel path over an NCCL group of one.

One GPU cannot hold two NCCL ranks, so this checks the path, not the collectives between
devices: the group joins on NCCL (with its gloo control group), the engine agrees on every step,
the MoE backend is the expert-parallel one, and the tokens are those of the plain engine. The
dispatch/combine itself runs on CUDA through the one-rank group against the Triton kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from oracle import oracle_prompts
from triton_modules import compiled

from deepinfer import LLM, SamplingParams
from deepinfer.ops.moe.expert_parallel import ExpertParallelMoEBackend
from deepinfer.ops.registry import ParallelContext

pytestmark = pytest.mark.gpu

ENGINE = {"device": "cuda", "dtype": "float32", "max_model_len": 1024}


@pytest.fixture(scope="module")
def ep_llm(oracle_hf_dir):
    llm = LLM(oracle_hf_dir, **ENGINE, gpu_memory_utilization=0.2, enable_expert_parallel=True)
    yield llm
    llm.engine.group.close()


def test_nccl_group_of_one_gives_the_plain_engines_tokens(oracle_hf_dir, ep_llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = oracle_prompts()
    plain = LLM(oracle_hf_dir, **ENGINE, gpu_memory_utilization=0.2)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    del plain
    got = [o.outputs[0].token_ids for o in ep_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    engine = ep_llm.engine
    assert dist.get_backend(engine.group.data) == "nccl"
    assert isinstance(engine.executor.kernels.moe, ExpertParallelMoEBackend)
    stats = engine.lockstep.stats
    assert stats.steps >= 24 and stats.forward_steps >= 24 and stats.placeholder_steps == 0
    assert engine.executor.graphs is not None  # a group of one keeps its decode graphs


def test_exchange_on_cuda_matches_the_triton_kernel(ep_llm):
    group = ep_llm.engine.group
    triton_moe = compiled("deepinfer.ops.moe.triton").TritonMoEBackend(group.device)
    moe = ExpertParallelMoEBackend(group.device, ParallelContext(1, 0, group.data), triton_moe)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t, e, d, i, k = 37, 16, 256, 128, 6
    dev, dt = group.device, torch.bfloat16
    x = torch.randn(t, d, device=dev, generator=gen).to(dt)
    w1 = (torch.randn(e, i, d, device=dev, generator=gen) / d**0.5).to(dt)
    w3 = (torch.randn(e, i, d, device=dev, generator=gen) / d**0.5).to(dt)
    w2 = (torch.randn(e, d, i, device=dev, generator=gen) / i**0.5).to(dt)
    ids = torch.rand(t, e, device=dev, generator=gen).topk(k, dim=1).indices
    weights = torch.rand(t, k, device=dev, generator=gen)
    want = moe.inner.fused_moe(x, w1, w2, w3, ids, weights, 10.0)
    got = moe.exchange_moe(x, w1, w2, w3, ids, weights, 10.0)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # No tokens of its own (a placeholder step): nothing comes back, nothing fails.
    empty = moe.exchange_moe(x[:0], w1, w2, w3, ids[:0], weights[:0], 10.0)
    assert empty.shape == (0, d)
