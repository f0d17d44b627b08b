"""GrammarCompiler: output constraints -> xgrammar CompiledGrammars, cached, compiled off-thread.

One per tokenizer (engine). ``compile_async`` runs xgrammar in a small thread pool (xgrammar's
compile releases the GIL), so an engine loop waits for a grammar without stalling other requests;
``compile`` waits with a timeout. Compiled grammars are kept in a bounded LRU keyed by
(kind, schema): a cold 15-property schema costs ~30-50 ms, a cached one nothing (research note:
../shared/reference/structured-output.md). xgrammar's own cache is off: its default is unbounded.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from deepinfer.constraints.kinds import (
    THINK_END_TOKEN_ID,
    THINK_START_TOKEN_ID,
    ConstraintError,
    check_constraint_kind,
)
from deepinfer.constraints.matcher import Matcher

if TYPE_CHECKING:
    import torch
    import xgrammar

logger = logging.getLogger(__name__)

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: " and "Check failed: ...:".
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")

# The builtin DeepSeek-V4 DSML tool-call formats of xgrammar, by the checkpoint's model_type.
_STRUCTURAL_TAG_MODELS = {"deepseek_v4": "deepseek_v4", "deepseek_v41": "deepseek_v4_1"}

CompileKey = tuple[str, str]


class GrammarCompiler:
    """Compiles constraints for one tokenizer (``tokenizer.json``, ``vocab_size`` logits columns,
    EOS as the only stop token). Thread-safe."""

    def __init__(
        self,
        tokenizer_path: str | Path,
        vocab_size: int,
        eos_token_id: int,
        *,
        model_type: str = "deepseek_v4",
        max_cached: int = 256,
        max_threads: int = 4,
        timeout_s: float = 30.0,
        json_any_whitespace: bool = False,
    ) -> None:
        if model_type not in _STRUCTURAL_TAG_MODELS:
            raise ValueError(
                f"model_type {model_type!r} has no DSML tool-call format; "
                f"expected one of {sorted(_STRUCTURAL_TAG_MODELS)}"
            )
        self.tokenizer_path = Path(tokenizer_path)
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.model_type = model_type
        self.max_cached = max_cached
        self.timeout_s = timeout_s
        # False: JSON separators are exactly ", " and ": " (no newlines/indents). Free whitespace
        # is the classic loop of constrained decoding: a model that keeps choosing "\n" never
        # closes the object (the random test model does just that).
        self.json_any_whitespace = json_any_whitespace
        self._lock = threading.Lock()
        self._filter_lock = threading.Lock()
        self._dsml_filter: torch.Tensor | None = None
        self._cache: OrderedDict[CompileKey, concurrent.futures.Future] = OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_threads, thread_name_prefix="grammar"
        )
        # Built on first use, in a pool thread: loading the tokenizer takes ~0.5-1 s.
        self._xgr_compiler: xgrammar.GrammarCompiler | None = None
        self._max_threads = max_threads

    # -- public ------------------------------------------------------------------------------------

    def compile_async(self, kind: str, schema: str) -> concurrent.futures.Future:
        """A Future of the Compiled constraint; its exception is a ConstraintError for an invalid
        constraint. Equal (kind, schema) pairs share one compile and one cache entry."""
        check_constraint_kind(kind)
        key = (kind, schema)
        with self._lock:
            future = self._cache.get(key)
            # A failed compile may still be here if its done-callback has not run yet.
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, kind, schema)
            self._cache[key] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_failed(key, f))
        return future

    def compile(self, kind: str, schema: str, timeout_s: float | None = None) -> Compiled:
        """Compile (or fetch) synchronously. Raises ConstraintError, also on timeout."""
        future = self.compile_async(kind, schema)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise ConstraintError(
                f"compiling the {kind} grammar took longer than {timeout:g} s"
            ) from None

    def matcher(self, compiled: Compiled, prompt_token_ids: list[int]) -> Matcher:
        """A fresh Matcher, inactive until ``</think>`` if the prompt leaves a ``<think>`` open."""
        return Matcher(
            compiled.grammar,
            wait_for_think_end=leaves_think_open(prompt_token_ids),
            token_filter=compiled.token_filter,
        )

    def num_cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- compile (pool threads) --------------------------------------------------------------------

    def _forget_failed(self, key: CompileKey, future: concurrent.futures.Future) -> None:
        """Failed or cancelled compiles leave the cache, so that a retry compiles again."""
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._xgr_compiler is None:
                self._xgr_compiler = self._new_xgr_compiler()
            return self._xgr_compiler

    def _new_xgr_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        start = time.perf_counter()
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(self.tokenizer_path))
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=[self.eos_token_id]
        )
        self._decoded_vocab: list[bytes] = info.decoded_vocab
        self._added_token_ids = frozenset(tokenizer.added_tokens_decoder)
        logger.info(
            "grammar compiler: xgrammar %s, %s, vocab %d, ready in %.2f s",
            xgr.__version__ if hasattr(xgr, "__version__") else "?",
            self.tokenizer_path,
            self.vocab_size,
            time.perf_counter() - start,
        )
        return xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)

    def _compile(self, kind: str, schema: str) -> Compiled:
        compiler = self._compiler()
        start = time.perf_counter()
        try:
            compiled = self._compile_kind(compiler, kind, schema)
        except ConstraintError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse/convert errors
            message = _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e) else repr(e))
            raise ConstraintError(f"invalid {_WHAT[kind]}: {message}") from e
        logger.debug("compiled a %s grammar in %.1f ms", kind, 1e3 * (time.perf_counter() - start))
        is_dsml = kind in ("tool_call_required", "tool_call")
        return Compiled(compiled, self._dsml_token_filter() if is_dsml else None)

    def _dsml_token_filter(self) -> torch.Tensor:
        """Packed int32 [ceil(V/32)]: the tokens a DSML tool call may use.

        The recipe parses tool calls token by token: a marker is the special token ``｜DSML｜``
        right after the token ``<`` or ``</``. The grammar matches bytes, so it would also take
        ``｜DSML｜`` spelled in byte pieces, or ``\r</`` as one token before the marker, and the
        recipe would read those as argument text. Banned: ordinary tokens holding the bytes of
        ``｜`` or ending in a prefix of them, and tokens ending in a merged ``<``. Every text stays
        reachable (``<`` and ``</`` exist alone) except ``｜`` outside the special tokens and the
        rare characters written only with a lone 0xEF byte token.
        """
        import torch

        with self._filter_lock:
            if self._dsml_filter is None:
                self._compiler()  # the tokenizer info
                allowed = torch.ones(-(-self.vocab_size // 32) * 32, dtype=torch.bool)
                for token_id, text in enumerate(self._decoded_vocab):
                    if token_id not in self._added_token_ids and not _is_dsml_safe(text):
                        allowed[token_id] = False
                self._dsml_filter = _pack(allowed)
            return self._dsml_filter

    def _compile_kind(
        self, compiler: xgrammar.GrammarCompiler, kind: str, schema: str
    ) -> xgrammar.CompiledGrammar:
        if kind == "json":
            # "{}" is any JSON value (xgrammar's builtin JSON grammar allows objects/arrays only).
            text = _json_text(schema, "JSON schema") if schema else "{}"
            return compiler.compile_json_schema(text, any_whitespace=self.json_any_whitespace)
        if kind == "json_object":
            if schema:
                raise ConstraintError("a json_object constraint takes no schema (use json)")
            return compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=self.json_any_whitespace
            )
        if kind == "regex":
            return compiler.compile_regex(schema)
        if kind == "ebnf":
            return compiler.compile_grammar(schema)
        assert kind in ("tool_call_required", "tool_call"), f"kind {kind!r} has no grammar"
        return compiler.compile_structural_tag(self._tool_call_tag(schema, kind == "tool_call"))

    def _tool_call_tag(self, schema: str, auto: bool) -> xgrammar.StructuralTag:
        """xgrammar's builtin DSML format for the declared tools.

        Auto (``tool_call``): free text until ``<｜DSML｜tool_calls>`` opens a block, then invokes
        of the declared tools and the block's end. Required: the same block without its leading
        ``\n\n<｜DSML｜tool_calls>\n``, which the recipe's prompt for a required tool call
        already ends with, so the answer starts at the first ``<｜DSML｜invoke``."""
        import xgrammar as xgr

        tools = json.loads(_json_text(schema, "tool list"))
        if not isinstance(tools, list) or not tools:
            raise ConstraintError("invalid tool list: expected a non-empty JSON array of tools")
        tag = xgr.get_model_structural_tag(
            _STRUCTURAL_TAG_MODELS[self.model_type],
            tools=tools,
            tool_choice="auto" if auto else "required",
            reasoning="disabled",
            max_whitespace_cnt=None if self.json_any_whitespace else 1,
        )
        if auto:
            return tag
        elements = tag.format.elements
        assert elements[0].type == "const_string" and "tool_calls>" in elements[0].value, (
            f"unexpected DSML tag layout from xgrammar: {elements[0]!r}"
        )
        tag.format.elements = elements[1:]
        return tag


_BAR = "｜".encode()  # the marker's delimiter, U+FF5C


def _is_dsml_safe(text: bytes) -> bool:
    """An ordinary token (bytes) that cannot spell part of a ``｜DSML｜`` marker or glue ``<`` /
    ``</`` to other bytes before one (see GrammarCompiler._dsml_token_filter)."""
    if _BAR in text or text.endswith((_BAR[:1], _BAR[:2])):
        return False
    return not text.endswith((b"<", b"</")) or text in (b"<", b"</")


@dataclass(frozen=True)
class Compiled:
    """A compiled constraint: the grammar, and for DSML tool calls the token filter that keeps
    the recipe's token-level parser reading what the grammar allowed (packed like a bitmask)."""

    grammar: xgrammar.CompiledGrammar
    token_filter: torch.Tensor | None


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [32 * W] -> int32 [W], bit b of word w = token 32 * w + b (xgrammar's layout)."""
    import torch

    words = (allowed.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON schema",
    "regex": "regex",
    "ebnf": "EBNF grammar",
    "tool_call_required": "tool list",
    "tool_call": "tool list",
}


def _json_text(text: str, what: str) -> str:
    """``text`` if it parses as JSON, else a ConstraintError naming the position."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise ConstraintError(f"invalid {what}: not JSON ({e})") from None
    return text


def leaves_think_open(prompt_token_ids: list[int]) -> bool:
    """True when the prompt's last reasoning marker is ``<think>`` (thinking mode): the answer
    (and the grammar) begins after the model's ``</think>``."""
    for token_id in reversed(prompt_token_ids):
        if token_id == THINK_END_TOKEN_ID:
            return False
        if token_id == THINK_START_TOKEN_ID:
            return True
    return False
