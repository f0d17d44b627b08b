"""LLM: the offline API, with the names users know from vLLM.

llm = LLM()                                   # the built-in tiny model
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
out[0].outputs[0].text

llm = LLM(model, data_parallel_size=2, enable_expert_parallel=True)   # two rank processes

One process runs the engine loop (``loop.py``) here; with several ranks (config [parallel]),
``ranks.py`` starts one process per rank, spreads the prompts over them and gathers the outputs
in prompt order.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepinfer.config import Config
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.flags import speculative_keys
from deepinfer.llm.loop import EngineLoop, Prompt
from deepinfer.llm.ranks import RankPool
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import Tokenizer


class LLM:
    """Offline generation on one device, or over ``data_parallel_size`` rank processes.

    ``model``: a local Hugging Face-style folder (None: the built-in tiny model). ``device``:
    "auto" | "cpu" | "cuda" | "npu". ``dtype``: "auto" (bf16 on accelerators, fp32 on CPU) |
    "float32" | "bfloat16". ``config``: a config.toml path or a Config; ``model``, ``device`` and
    ``dtype`` override it only when given (not None / "auto"). Any other keyword names a config
    key of any section (``max_num_batched_tokens=256``, ``num_blocks=64``,
    ``data_parallel_size=2``, ``enable_expert_parallel=True``, ...); ``speculative_config``
    takes the [speculative] keys as a dict, as vLLM's does (``{"method": "ngram",
    "num_speculative_tokens": 3}``).

    With ``data_parallel_size`` > 1 the engine runs in rank processes (``self.ranks``; one
    thread each on the CPU): ``self.engine`` is None there. A rank's failure ends them all:
    ``generate`` raises ``RankGroupError`` naming every request it leaves unfinished, and so
    does every later call.
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
        self.engine: LLMEngine | None = None
        self.ranks: RankPool | None = None
        if config.parallel.data_parallel_size > 1:
            self.ranks = RankPool(config)
            self.tokenizer: Tokenizer = self.ranks.tokenizer
        else:
            self.engine = LLMEngine(config)
            self._loop = EngineLoop(self.engine)
            self.tokenizer = self._loop.tokenizer
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
        work = [
            (str(next(self._ids)), prompt, params)
            for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
        if self.ranks is not None:
            return self.ranks.generate(work, use_tqdm)
        return self._loop.generate(work, use_tqdm)

    def close(self) -> None:
        """Stop the rank processes (no-op in one process); also at exit."""
        if self.ranks is not None:
            self.ranks.close()


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
    if "speculative_config" in overrides:  # vLLM's form: LLM(speculative_config={...})
        value = overrides.pop("speculative_config")
        sections["speculative"] = dict(speculative_keys(value, "speculative_config"))
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
