"""The output-constraint vocabulary shared by the API, the engine and the grammar compiler
(torch-free).

Kinds (``SamplingParams.constraint = (kind, schema)``):

    json                a JSON schema (text); "" = any JSON value (deepseek-recipe sends "" for
                        OpenAI's ``json_object``, and the recipe's prompt asks for an object)
    json_object         any JSON object (schema must be "")
    regex               the whole output matches the regex
    ebnf                an EBNF grammar (xgrammar/GBNF dialect, root rule ``root``), for raw
                        completions
    tool_call_required  a JSON array of Chat-Completions tools: the output is one or more DSML
                        invokes of those tools and closes the ``<｜DSML｜tool_calls>`` block that
                        the recipe's prompt already opened
    tool_call           auto tool choice, the same tool list: free text until the output opens
                        a ``<｜DSML｜tool_calls>`` block, then invokes of the declared tools
"""

from __future__ import annotations

CONSTRAINT_KINDS = ("json", "json_object", "regex", "ebnf", "tool_call_required", "tool_call")

# DeepSeek-V4 reasoning markers. A prompt that leaves a ``<think>`` open (thinking mode) starts
# with free reasoning: the grammar applies from the token after ``</think>``.
THINK_START_TOKEN_ID = 128821
THINK_END_TOKEN_ID = 128822


class ConstraintError(ValueError):
    """An output constraint that cannot be enforced: unknown kind, invalid schema/regex/grammar,
    or a compile that timed out. A ValueError, so the API answers 400 with this message."""


def check_constraint_kind(kind: str) -> None:
    if kind not in CONSTRAINT_KINDS:
        expected = ", ".join(CONSTRAINT_KINDS)
        raise ConstraintError(
            f"unknown output constraint kind {kind!r}; expected one of {expected}"
        )
