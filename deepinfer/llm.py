"""LLM: the offline API, with the names users know from vLLM.

llm = LLM()                                   # the built-in tiny model
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
out[0].outputs[0].text
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from deepinfer.config import Config
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.outputs import CompletionOutput, FinishReason, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.output import RequestOutputDelta
from deepinfer.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

Prompt = str | list[int]


class LLM:
    """Offline generation on one device.

    ``model``: a local Hugging Face-style folder (None: the built-in tiny model). ``device``:
    "auto" | "cpu" | "cuda" | "npu". ``dtype``: "auto" (bf16 on accelerators, fp32 on CPU) |
    "float32" | "bfloat16". ``config``: a config.toml path or a Config; ``model``, ``device`` and
    ``dtype`` override it only when given (not None / "auto"). Any other keyword names a config
    key of any section (``max_num_batched_tokens=256``, ``num_blocks=64``, ...).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        device: str = "auto",
        dtype: str = "auto",
        *,
        config: Config | str | Path | None = None,
        **overrides: Any,
    ) -> None:
        sections = _split_overrides(overrides)
        # Only what the caller actually chose overrides ``config``.
        chosen = {"path": None if model is None else str(model)}
        chosen |= {"device": None if device == "auto" else device}
        chosen |= {"dtype": None if dtype == "auto" else dtype}
        model_section = sections.setdefault("model", {})
        model_section.update({k: v for k, v in chosen.items() if v is not None})
        if isinstance(config, Config):
            config = _replace(config, sections)
        else:
            config = Config.load(config, overrides=sections)
        self.config = config
        self.engine = LLMEngine(config)
        assert self.engine.tokenizer is not None
        self.tokenizer: Tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in prompt order.

        A prompt is a string (tokenized as is, no BOS added) or a list of token ids.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        tracks: dict[str, _Track] = {}
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                track = self._add(prompt, params)
                tracks[track.output.request_id] = track
            self._run(tracks, use_tqdm)
        except BaseException:
            self.engine.abort_requests(list(tracks))
            raise
        return [t.output for t in tracks.values()]

    def _add(self, prompt: Prompt, params: SamplingParams) -> _Track:
        tokenizer = self.tokenizer
        text = prompt if isinstance(prompt, str) else None
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, ids, params)
        return _Track(tokenizer, request_id, text, ids, params)

    def _run(self, tracks: dict[str, _Track], use_tqdm: bool) -> None:
        bar = tqdm(total=len(tracks), desc="generate", unit="req", disable=not use_tqdm)
        pending = set(tracks)
        while pending:
            for delta in self.engine.step():
                track = tracks.get(delta.request_id)
                if track is None or delta.request_id not in pending:
                    continue
                stop = track.push(delta)
                if stop is not None and not delta.is_finished:
                    self.engine.finish_requests([delta.request_id], stop)
                if track.output.finished:
                    pending.discard(delta.request_id)
                    bar.update(1)
        self.engine.complete_in_flight()  # only finished requests' dropped tokens are left
        bar.close()


class _Track:
    """One request's accumulating output, detokenizer and stop-string matcher."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.matcher = (
            StopStringMatcher(params.stop, params.include_stop_str_in_output)
            if params.stop
            else None
        )
        prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self.output = RequestOutput(request_id, prompt, prompt_ids, prompt_logprobs)
        self.completion = CompletionOutput(
            index=0, text="", token_ids=[], logprobs=[] if params.logprobs is not None else None
        )
        self.output.outputs.append(self.completion)
        self.stopped = False

    def push(self, delta: RequestOutputDelta) -> str | None:
        """Add a delta; returns the stop string when one matched in this delta's text."""
        out, done = self.completion, self.stopped
        self.output.num_cached_tokens = delta.num_cached_tokens
        if delta.new_prompt_logprobs and self.output.prompt_logprobs is not None:
            self.output.prompt_logprobs.extend(delta.new_prompt_logprobs)
        if done:
            return None
        out.token_ids.extend(delta.new_token_ids)
        if out.logprobs is not None and delta.new_logprobs:
            out.logprobs.extend(delta.new_logprobs)
        matched = None
        if delta.new_token_ids:
            new_text = self.detokenizer.push(delta.new_token_ids)
            text = self.detokenizer.text
            if self.matcher is not None:
                check = self.matcher.check(text, len(new_text))
                if check.is_stopped:
                    matched, text = check.stop_str, check.text
            out.text = text
        if matched is not None:
            self.stopped = True
            out.finish_reason, out.stop_reason = FinishReason.STOP, matched
        elif delta.is_finished:
            out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
        return matched


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    for p in prompts:
        is_ids = isinstance(p, list) and all(isinstance(t, int) for t in p)
        if not isinstance(p, str) and not is_ids:
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(p)}")
    return prompts


def _split_overrides(overrides: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Route flat keyword overrides to their config section by key name."""
    owners: dict[str, str] = {}
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory()):
            owners.setdefault(f.name, section.name)
    sections: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if key not in owners:
            raise TypeError(f"LLM() got an unknown keyword argument {key!r}")
        sections.setdefault(owners[key], {})[key] = value
    return sections


def _replace(config: Config, sections: dict[str, dict[str, Any]]) -> Config:
    changes = {
        name: dataclasses.replace(getattr(config, name), **values)
        for name, values in sections.items()
    }
    return dataclasses.replace(config, **changes)
