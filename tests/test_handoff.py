"""Prefill/decode hand-off, engine side (deepinfer/engine/handoff.py): a prompt computed on one
engine and decoded on another gives the tokens and logprobs of one engine doing both, for every
prompt shape; held hand-offs free what they hold; a state that does not fit is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from oracle import oracle_prompts
from rank_workers import drain

from deepinfer.config import Config
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.sampling_params import SamplingParams

THINK, USER, ASSISTANT = 128821, 128803, 128804
TOL = 1e-5


def _config(model: Path | None = None, kv_dtype: str = "auto") -> Config:
    # 16-token blocks, chunks of 32 tokens, a snapshot every 4 blocks of a long prefill.
    return Config.load(
        overrides={
            "model": {"device": "cpu", "path": None if model is None else str(model)},
            "cache": {"block_size": 16, "snapshot_interval_blocks": 4, "kv_dtype": kv_dtype},
            "scheduler": {"max_num_batched_tokens": 32},
            "kernel": {"num_threads": 2},
        }
    )


class Engines:
    """A mixed engine (the reference), a prefill engine and a decode engine of one model."""

    def __init__(self, config: Config) -> None:
        self.mixed, self.prefill, self.decode = (LLMEngine(config) for _ in range(3))
        self._ids = 0

    def mixed_run(self, prompt: list[int], params: SamplingParams) -> tuple[list, list]:
        return _run(self.mixed, self._id(), prompt, params)

    def handed_off(self, prompt: list[int], params: SamplingParams) -> tuple[list, list, int]:
        """(tokens, logprobs, prompt tokens the prefill engine had cached)."""
        request_id = self._id()
        first, first_logprobs = _run(self.prefill, request_id, prompt, params, hand_off=True)
        assert len(first) == 1 and self.prefill.scheduler.num_held == 1
        state = self.prefill.export_request(request_id)
        self.prefill.release_hand_off(request_id)
        self.decode.import_request(state, params)
        rest, rest_logprobs = drain(self.decode)
        for engine in (self.prefill, self.decode):
            engine.scheduler.check_integrity()
            assert engine.scheduler.block_manager.num_used_blocks == 0
            assert engine.scheduler.state_slots.num_used_slots == 0
        return first + rest, first_logprobs + rest_logprobs, state.num_cached_tokens

    def _id(self) -> str:
        self._ids += 1
        return str(self._ids)


def _run(engine: LLMEngine, request_id: str, prompt, params, **kw) -> tuple[list, list]:
    engine.add_request(request_id, prompt, params, **kw)
    return drain(engine)


def _assert_same(got: tuple[list, list], want: tuple[list, list]) -> None:
    (tokens, logprobs), (want_tokens, want_logprobs) = got[:2], want
    assert tokens == want_tokens
    for ours, theirs, token in zip(logprobs, want_logprobs, want_tokens, strict=True):
        assert abs(ours[token] - theirs[token]) <= TOL


@pytest.fixture(scope="module")
def builtin() -> Engines:
    return Engines(_config())


def _prompt(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128000, (n,), generator=gen).tolist()


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)


@pytest.mark.parametrize(
    "prompt",
    [
        _prompt(5),  # shorter than a block
        _prompt(32),  # exactly two blocks
        _prompt(37),  # not aligned
        _prompt(150),  # many blocks: chunked, a state snapshot every 4 blocks
        [0, *_prompt(20), USER, *_prompt(9, 1), ASSISTANT, THINK],  # thinking mode
    ],
    ids=["short", "aligned", "unaligned", "many-blocks", "thinking"],
)
def test_a_handed_off_request_decodes_as_one_engine(builtin, prompt):
    want = builtin.mixed_run(prompt, GREEDY)
    _assert_same(builtin.handed_off(prompt, GREEDY), want)


def test_prefix_cache_hits_and_seeded_sampling_hand_off_exactly(builtin):
    prompt = _prompt(70, 3)
    builtin.handed_off(prompt, GREEDY)  # fills the prefill engine's prefix cache
    *got, cached = builtin.handed_off(prompt, GREEDY)
    assert cached >= 64
    _assert_same(got, builtin.mixed_run(prompt, GREEDY))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=12, logprobs=1)
    _assert_same(
        builtin.handed_off(_prompt(21, 4), seeded), builtin.mixed_run(_prompt(21, 4), seeded)
    )


def test_a_constrained_request_hands_off_exactly_and_its_output_keeps_the_constraint(builtin):
    """The prefill engine samples the first token under the grammar; the decode engine rebuilds
    the matcher, feeds it that token, and samples on under it."""
    schema = {"type": "object", "properties": {"c": {"enum": ["red", "green"]}}, "required": ["c"],
              "additionalProperties": False}  # fmt: skip
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, logprobs=1,
                            constraint=("json", json.dumps(schema)))  # fmt: skip
    prompt = _prompt(30, 5)
    got = builtin.handed_off(prompt, params)
    _assert_same(got, builtin.mixed_run(prompt, params))
    assert len(got[0]) < 24  # it ended: a whole object
    assert json.loads(builtin.mixed.tokenizer.decode(got[0]))["c"] in ("red", "green")


def test_the_oracle_checkpoint_hands_off_exactly(oracle_hf_dir):
    engines = Engines(_config(oracle_hf_dir))
    for prompt in oracle_prompts()[:2]:
        _assert_same(engines.handed_off(prompt, GREEDY), engines.mixed_run(prompt, GREEDY))


def test_an_fp8_kv_cache_hands_off_exactly() -> None:
    """cache.kv_dtype = "fp8" on both sides: the packed entries and rings travel as bytes."""
    engines = Engines(_config(kv_dtype="fp8"))
    assert engines.decode.executor.kv_cache[1, "entries"].dtype == torch.uint8
    prompt = _prompt(150, 6)  # chunked, snapshots on the way
    _assert_same(engines.handed_off(prompt, GREEDY), engines.mixed_run(prompt, GREEDY))
    # A decode engine of the other layout refuses the state instead of misreading its bytes.
    _run(engines.prefill, "fp8-to-bf16", _prompt(40, 7), GREEDY, hand_off=True)
    state = engines.prefill.export_request("fp8-to-bf16")
    engines.prefill.release_hand_off("fp8-to-bf16")
    with pytest.raises(ValueError, match="another model or cache layout"):
        LLMEngine(_config()).import_request(state, GREEDY)


def test_held_hand_offs_free_what_they_hold_and_bad_states_are_refused(builtin):
    engine = builtin.prefill
    _run(engine, "held", _prompt(40), GREEDY, hand_off=True)
    assert engine.scheduler.block_manager.num_used_blocks == 3  # 40 tokens: 3 blocks kept
    engine.scheduler.check_integrity()
    state = engine.export_request("held")
    engine.abort_requests(["held"])  # not collected (a client abort, an expired lease)
    assert engine.scheduler.num_held == 0 and engine.scheduler.block_manager.num_used_blocks == 0
    with pytest.raises(KeyError, match="not a held hand-off"):
        engine.export_request("held")
    decode = builtin.decode
    foreign = dataclasses.replace(state, model_salt=b"another model")
    with pytest.raises(ValueError, match="another model or cache layout"):
        decode.import_request(foreign, GREEDY)
    short = dataclasses.replace(state, blocks=[t[:2] for t in state.blocks])
    with pytest.raises(ValueError, match="2 blocks for 40 prompt tokens"):
        decode.import_request(short, GREEDY)
    mangled = dataclasses.replace(state, slot=[t[..., :1] for t in state.slot])
    with pytest.raises(ValueError, match="do not fit"):
        decode.import_request(mangled, GREEDY)
    assert decode.scheduler.block_manager.num_used_blocks == 0  # nothing held after refusals
    assert decode.scheduler.state_slots.num_used_slots == 0
    decode.import_request(state, GREEDY)  # the state itself still continues
    drain(decode)
    decode.scheduler.check_integrity()


def test_a_yoco_truncated_v41_prompt_hands_off_exactly(tiny_v41_dir):
    """DeepSeek-V4.1 under YoCo compact (keep 12): the consumer half's window rings of the kept
    tail travel with the rest of the state; the decode engine continues as the mixed one."""
    config = _config(tiny_v41_dir)
    model = dataclasses.replace(config.model, yoco_truncation="compact", yoco_keep_tokens=12)
    engines = Engines(dataclasses.replace(config, model=model))
    prompt = oracle_prompts()[1]  # 88 tokens: chunks of 32, the first two wholly before the tail
    _assert_same(engines.handed_off(prompt, GREEDY), engines.mixed_run(prompt, GREEDY))
