"""The prefill/decode hand-off on CUDA: a prompt computed by one engine and decoded by another
(decode graphs on) gives one engine's greedy tokens, its state copied to the host or kept on the
device (as for a decode node on the same GPU), and the decode engine's steps replay graphs.
fp32 (TF32 off): the two engines run the same kernels on the same shapes."""

from __future__ import annotations

import pytest
import torch
from oracle import oracle_prompts

from deepinfer.config import Config
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def _engine(model) -> LLMEngine:
    overrides = {
        "model": {"device": "cuda", "dtype": "float32", "path": str(model), "max_model_len": 1024},
        "cache": {"block_size": 16, "gpu_memory_utilization": 0.1},
    }
    return LLMEngine(Config.load(overrides=overrides))


def _drain(engine: LLMEngine) -> list[int]:
    tokens = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.new_token_ids
    return tokens


@pytest.mark.parametrize("on_device", [False, True], ids=["host-copies", "device-copies"])
def test_hand_off_on_cuda_decodes_as_one_engine(oracle_hf_dir, on_device):
    mixed, prefill, decode = (_engine(oracle_hf_dir) for _ in range(3))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    graphs = decode.executor.graphs
    assert graphs is not None
    for i, prompt in enumerate(oracle_prompts()):
        mixed.add_request(f"m{i}", prompt, params)
        want = _drain(mixed)
        prefill.add_request(f"h{i}", prompt, params, hand_off=True)
        first = _drain(prefill)
        state = prefill.export_request(f"h{i}", on_device=on_device)
        prefill.release_hand_off(f"h{i}")  # the device copies are the state's own
        device = "cuda" if on_device else "cpu"
        assert all(t.device.type == device for t in [*state.slot, *state.blocks])
        decode.import_request(state, params)
        assert first + _drain(decode) == want
    assert graphs.num_replays >= 15 * len(oracle_prompts())  # the decode steps after import
    for engine in (prefill, decode):
        engine.scheduler.check_integrity()
        assert engine.scheduler.block_manager.num_used_blocks == 0
    torch.cuda.synchronize()
