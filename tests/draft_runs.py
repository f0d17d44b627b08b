"""Runs that speculative-decoding tests compare token for token: a batch of prompts, then the
first of them again (prefix hits), on an engine with or without drafts."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams

Outputs = list[tuple[list[int], object]]  # (tokens, logprobs) per request

# Four requests of 21, 9, 40 and 3 tokens: long enough to cross blocks and windows, one short.
PROMPTS = [
    [(11 * i + 5) % 997 + 3 for i in range(21)],
    [(13 * i + 7) % 991 + 3 for i in range(9)],
    [(17 * i + 1) % 983 + 3 for i in range(40)],
    [101, 102, 103],
]


def sampling(max_tokens: int) -> list[SamplingParams]:
    """PROMPTS' parameters: greedy with logprobs, seeded sampling, greedy, greedy."""
    common = {"max_tokens": max_tokens, "ignore_eos": True}
    return [
        SamplingParams(temperature=0.0, logprobs=1, **common),
        SamplingParams(temperature=0.8, seed=3, **common),
        SamplingParams(temperature=0.0, **common),
        SamplingParams(temperature=0.0, **common),
    ]


def cpu_llm(folder: Path, **kw: object) -> LLM:
    """The engine on ``folder`` on 2 CPU threads, blocks of 16, chunks of 24 tokens."""
    torch.set_num_threads(2)
    return LLM(model=folder, device="cpu", block_size=16, max_num_batched_tokens=24, **kw)


def run_with_prefix_hits(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], again: int
) -> Outputs:
    """Every prompt, then the first ``again`` ones once more (which must hit the prefix cache);
    checks the scheduler's books after."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    repeated = llm.generate(prompts[:again], params[:again], use_tqdm=False)
    assert any(o.num_cached_tokens for o in repeated), "the repeated prompts hit no prefix"
    assert llm.engine is not None
    llm.engine.scheduler.check_integrity()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs + repeated]


def assert_same_outputs(got: Outputs, want: Outputs, atol: float = 1e-4) -> None:
    """The same tokens, and logprobs of the same tokens within ``atol``."""
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for a, b in zip(logprobs or [], want_logprobs or [], strict=True):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < atol for t in a)
