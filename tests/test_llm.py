"""The offline API and CLI on the built-in tiny model: finish reasons, stops, prompt forms,
errors, the default model's creation, and abort/cleanup."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    torch.set_num_threads(2)
    return LLM(model=tiny_dir, device="cpu", block_size=16, max_num_seqs=4)


PROMPT = [0, 3476, 477, 260, 11502, 22896, 16]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_default_max_tokens_and_length_finish(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16  # vLLM's default max_tokens
    assert out.outputs[0].finish_reason == "length"
    assert out.prompt_token_ids == PROMPT and out.prompt_logprobs is None
    assert out.outputs[0].logprobs is None


def test_string_prompt_is_tokenized_without_bos(llm: LLM) -> None:
    text = "You are a helpful assistant."
    out = llm.generate(text, _greedy(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt == text
    assert out.prompt_token_ids == [3476, 477, 260, 11502, 22896, 16]


def test_stop_token_id_and_eos(llm: LLM) -> None:
    ref = llm.generate([PROMPT], _greedy(max_tokens=8), use_tqdm=False)[0].outputs[0]
    stop_at = ref.token_ids[3]
    first = ref.token_ids.index(stop_at)
    out = llm.generate([PROMPT], _greedy(max_tokens=8, stop_token_ids=[stop_at]), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.token_ids == ref.token_ids[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_at
    # min_tokens holds the stop token back until enough tokens were generated.
    held = llm.generate(
        [PROMPT], _greedy(max_tokens=8, min_tokens=8, stop_token_ids=[stop_at]), use_tqdm=False
    )[0].outputs[0]
    assert len(held.token_ids) == 8 and held.finish_reason == "length"
    # A logit bias that forces EOS ends the request at once with stop_reason None.
    eos = llm.generate([PROMPT], _greedy(logit_bias={1: 100.0}), use_tqdm=False)[0].outputs[0]
    assert eos.token_ids == [1] and eos.finish_reason == "stop" and eos.stop_reason is None
    forced = llm.generate(
        [PROMPT], _greedy(max_tokens=3, logit_bias={1: 100.0}, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert forced.token_ids == [1, 1, 1] and forced.finish_reason == "length"


def test_stop_string_truncates_text(llm: LLM) -> None:
    ref = llm.generate([PROMPT], _greedy(max_tokens=12), use_tqdm=False)[0].outputs[0]
    stop = ref.text[5:8]
    assert stop and stop in ref.text
    cut = ref.text.index(stop)
    out = llm.generate([PROMPT], _greedy(max_tokens=12, stop=[stop]), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.text == ref.text[:cut]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert len(completion.token_ids) < len(ref.token_ids)
    kept = llm.generate(
        [PROMPT], _greedy(max_tokens=12, stop=stop, include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == ref.text[: cut + len(stop)]


def test_logprobs_shape(llm: LLM) -> None:
    out = llm.generate(
        [PROMPT], _greedy(max_tokens=3, logprobs=2, prompt_logprobs=3), use_tqdm=False
    )
    o = out[0]
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(PROMPT)
    for j, entry in enumerate(o.prompt_logprobs[1:], start=1):
        assert PROMPT[j] in entry and 3 <= len(entry) <= 4
    completion = o.outputs[0]
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        # Greedy: the chosen token is the top-1, so the dict has exactly the 2 asked for.
        assert len(entry) == 2 and max(entry, key=entry.get) == token


def test_bad_input_errors(llm: LLM) -> None:
    with pytest.raises(ValueError, match="outside"):
        llm.generate([[0, 200000]], _greedy(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    bad_params = [
        ({"temperature": math.nan}, "temperature must be a finite number, got nan"),
        ({"top_p": math.inf}, "top_p must be a finite number, got inf"),
        ({"presence_penalty": math.nan}, "presence_penalty must be a finite number"),
        ({"logit_bias": {5: math.nan}}, r"logit_bias\[5\] must be a finite number"),
        ({"max_tokens": 2**64}, r"max_tokens must be in \[1, 2\*\*31 - 1\]"),
        ({"seed": 2**64}, r"seed must be in \[0, 2\*\*63\)"),
        ({"seed": True}, "seed must be an integer, got True"),
        ({"top_k": 1.5}, "top_k must be an integer, got 1.5"),
    ]
    for kwargs, message in bad_params:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=r"at most 20 \(model.max_logprobs\)"):
        llm.generate([PROMPT], _greedy(max_tokens=1, prompt_logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="must not be empty"):
        llm.generate([[]], _greedy(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError):
        llm.generate([[0] * 9000], _greedy(max_tokens=1), use_tqdm=False)
    with pytest.raises(TypeError, match="unknown keyword"):
        LLM(model="x", no_such_knob=1)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([PROMPT], [_greedy(), _greedy()], use_tqdm=False)
    # Nothing was left behind by the failed calls.
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_default_model_is_built_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    llm = LLM(device="cpu", max_num_seqs=2)
    folder = llm.engine.model_dir
    assert folder.parent == tmp_path / "deepinfer" / "models"
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    out = llm.generate([PROMPT], _greedy(max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    again = LLM(device="cpu", max_num_seqs=2)
    assert again.engine.model_dir == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_cli_generate(tiny_dir: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "deepinfer.cli", "generate", "Hello", "--model", str(tiny_dir)]
    proc = subprocess.run(
        [*cmd, "--max-tokens", "5", "--device", "cpu"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    # The chat template made the prompt: BOS, <｜User｜>, "Hello", <｜Assistant｜>, </think>.
    assert "[5 prompt tokens, 5 generated, finish_reason=length]" in proc.stderr
    bad = subprocess.run(
        [*cmd[:-2], "--model", "/nonexistent"], capture_output=True, text=True, env=env
    )
    assert bad.returncode == 2 and "no config.json" in bad.stderr
