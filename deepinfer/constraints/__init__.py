"""Structured output: grammars compiled from output constraints, matched token by token.

    SamplingParams.constraint (kind, schema)
        --GrammarCompiler.compile[_async]--> Compiled          (thread pool, LRU cache, timeout)
        --GrammarCompiler.matcher--> Matcher on the Request    (one per request, CPU)
    each step: Matcher.fill_mask -> allowed_token_mask [B, V] bool (logits' device)
        -> sampler masks the logits; Scheduler.update -> Matcher.accept(sampled token)

Importing this package is cheap and torch-free: xgrammar (which imports torch and transformers) is
imported by the compiler and the matcher when first used.
"""

from __future__ import annotations

from deepinfer.constraints.kinds import (
    CONSTRAINT_KINDS,
    THINK_END_TOKEN_ID,
    THINK_START_TOKEN_ID,
    ConstraintError,
    check_constraint_kind,
)

__all__ = [
    "CONSTRAINT_KINDS",
    "THINK_END_TOKEN_ID",
    "THINK_START_TOKEN_ID",
    "ConstraintError",
    "check_constraint_kind",
]
