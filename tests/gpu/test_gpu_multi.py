"""Lock-step ranks over several GPUs (the multi-GPU issue's run 1): expert parallelism over NCCL
gives one GPU's greedy tokens in fp32 on the oracle checkpoint, and a rank killed mid-step ends
the group with an error for every open request, not a hang.

Each test needs as many GPUs as it has ranks and skips, saying so, on a machine with fewer (one
GPU: ``test_gpu_ranks.py`` checks the path over a group of one). NVLink multicast stays off.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from oracle import oracle_prompts

from deepinfer import LLM, SamplingParams
from deepinfer.parallel.group import RankGroupError

pytestmark = pytest.mark.gpu

ENGINE = {"device": "cuda", "dtype": "float32", "max_model_len": 1024}
os.environ |= {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"


def _needs(ranks: int) -> None:
    visible = torch.cuda.device_count()
    if visible < ranks:
        pytest.skip(f"{ranks} ranks need {ranks} GPUs; {visible} visible")


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_ranks_give_one_gpus_tokens(oracle_hf_dir, ranks: int) -> None:
    _needs(ranks)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = oracle_prompts()
    one = LLM(oracle_hf_dir, **ENGINE, gpu_memory_utilization=0.2)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    del one
    torch.cuda.empty_cache()
    ranked = LLM(
        oracle_hf_dir,
        **ENGINE,
        gpu_memory_utilization=0.2,
        data_parallel_size=ranks,
        enable_expert_parallel=True,
    )
    try:
        got = [o.outputs[0].token_ids for o in ranked.generate(prompts, params, use_tqdm=False)]
        stats = ranked.ranks.stats
    finally:
        ranked.close()
    assert got == want
    assert all(s["exchange_seconds"] > 0 for s in stats)  # the tokens crossed the GPUs


def test_killing_a_gpu_rank_ends_the_group_with_an_error(oracle_hf_dir) -> None:
    _needs(2)
    timeout_s = 20.0
    llm = LLM(
        oracle_hf_dir,
        **(ENGINE | {"max_model_len": 4096}),  # room for a decode that outlasts the kill
        gpu_memory_utilization=0.2,
        data_parallel_size=2,
        enable_expert_parallel=True,
        collective_timeout_s=timeout_s,
    )
    params = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            llm.generate(oracle_prompts()[:4], params, use_tqdm=False)
        except BaseException as error:
            raised.append(error)

    work = threading.Thread(target=run)
    work.start()
    time.sleep(3.0)  # into decoding: 3,000 steps take far longer
    killed = time.monotonic()
    os.kill(llm.ranks.pids[1], signal.SIGKILL)
    work.join(timeout=timeout_s + 20)
    assert not work.is_alive(), "generate still waits on the group"
    assert time.monotonic() - killed < timeout_s + 5
    assert len(raised) == 1 and isinstance(raised[0], RankGroupError), raised
    assert "rank 1's process died (exit code -9)" in str(raised[0])
    assert all(not p.is_alive() for p in llm.ranks.processes)
