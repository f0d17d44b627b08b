"""Structured output asked for in the names that clients other than OpenAI's use.

vLLM's request fields, which neither OpenAI nor DeepSeek define, map onto our constraint kinds
(deepinfer/constraints/kinds.py); a node compiles and enforces them like the recipe's own:

    guided_json     | structured_outputs.json       -> json         a schema (object or JSON text)
    guided_regex    | structured_outputs.regex      -> regex
    guided_choice   | structured_outputs.choice     -> ebnf         root ::= "a" | "b" | ...
    guided_grammar  | structured_outputs.grammar    -> ebnf         xgrammar's EBNF dialect
                      structured_outputs.json_object -> json_object

One per request, and not with a constraint of the recipe's (``response_format``, tools): a 400
names the fields. So is any other ``structured_outputs`` key: nothing asked for is ignored. An
invalid schema, regex or grammar is the node's 400 (its compile error).

Strict JSON schemas: the recipe applies OpenAI's strict mode (every property required, no other
properties), which is defined for objects, and refuses a strict schema whose root is not
``"type": "object"``, e.g. ``{"enum": [...]}``. Such a schema is valid and the grammar enforces
it exactly, so ``accept_strict_schema`` hands it on as a plain one.
"""

from __future__ import annotations

import json
from typing import Any

from deepinfer.server.errors import bad_request
from deepinfer.server.protocol import OutputConstraint

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def read_output_constraint(
    body: dict[str, Any], recipe_constraint: OutputConstraint | None
) -> OutputConstraint | None:
    """The constraint of the body's vLLM fields, else ``recipe_constraint``. Raises ApiError
    (400) naming the field."""
    asked = {name: body[name] for name in _GUIDED if body.get(name) is not None}
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise bad_request(
                "Invalid structured_outputs: expected an object", "structured_outputs"
            )
        for key, value in outputs.items():
            if value is None or value is False:  # not asked for (vLLM's defaults)
                continue
            name = f"structured_outputs.{key}"
            if key not in _STRUCTURED_OUTPUTS_KEYS:
                raise bad_request(f"{name} is not supported by this server", name)
            asked[name] = value
    if not asked:
        return recipe_constraint
    if len(asked) > 1:
        raise bad_request(f"Give one structured output at most, got {', '.join(asked)}")
    ((name, value),) = asked.items()
    if recipe_constraint is not None:
        raise bad_request(
            f"{name} cannot be combined with the request's "
            f"{'tools' if recipe_constraint.kind.startswith('tool_call') else 'response_format'}",
            name,
        )
    return _constraint(name, _GUIDED.get(name, name.removeprefix("structured_outputs.")), value)


def _constraint(name: str, key: str, value: Any) -> OutputConstraint:
    if key == "json":
        return OutputConstraint(kind="json", schema=_schema_text(name, value))
    if key == "json_object":
        if value is not True:
            raise bad_request(f"Invalid {name}: expected a boolean", name)
        return OutputConstraint(kind="json_object")
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(f"Invalid {name}: expected a non-empty list of strings", name)
        # EBNF string literals take JSON's escapes.
        choices = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        return OutputConstraint(kind="ebnf", schema=f"root ::= {choices}")
    if not isinstance(value, str) or not value:
        raise bad_request(f"Invalid {name}: expected a non-empty string", name)
    return OutputConstraint(kind="regex" if key == "regex" else "ebnf", schema=value)


def _schema_text(name: str, value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_request(f"Invalid {name}: not JSON ({e})", name) from None
    if not isinstance(value, dict | bool):
        raise bad_request(f"Invalid {name}: expected a JSON schema (an object)", name)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def accept_strict_schema(holder: Any) -> Any:
    """``holder`` (a response format's ``{"schema", "strict", ...}``) with ``strict`` off when
    its schema's root is not an object, which strict mode is defined for; else as it is."""
    if not isinstance(holder, dict) or holder.get("strict") is not True:
        return holder
    schema = holder.get("schema")
    if not isinstance(schema, dict):
        return holder  # the recipe names what is wrong
    return holder if schema.get("type") == "object" else {**holder, "strict": False}
