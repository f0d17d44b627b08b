"""Command-line flags generated from the config dataclasses: every config key is a flag.

    config sections (deepinfer/config.py) ──add_config_flags(parser, uses)──▶ argparse flags
    parsed Namespace ──overrides(ns)──▶ {section: {key: value}} ──▶ Config.load(..., overrides)

A subcommand names what it reads (``uses``): whole sections (``"cache"``) or single keys
(``"node.node_id"``), so a key added to a section is a flag of every subcommand that reads the
section. A key becomes ``--key-name``; a key that two sections of one subcommand share (``host``
of ``[server]`` and ``[node]`` in `deepinfer config`) becomes ``--section-key-name``.
``_NAMES`` names the few keys whose bare name reads badly (``model.path`` is ``--model``) and
keeps older flags (``--threads``, ``--api-key``) as aliases. The help text is the comment next
to the field in config.py (above it, or on its line) and the default is shown. Flags not given
are absent from the Namespace, so only given ones override the file and the environment.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import json
import textwrap
import tokenize
import typing
from collections.abc import Sequence
from typing import Any

from deepinfer.config import SECTIONS, env_var, parse_value

# What the engine reads: `generate`, and with more, `node` and `serve` (server/node.py, serve.py).
ENGINE_USES = ("model", "cache", "scheduler", "kernel", "speculative", "parallel", "log")

_NAMES: dict[str, tuple[str, ...]] = {
    "model.path": ("--model",),
    "kernel.num_threads": ("--num-threads", "--threads"),
    "server.api_keys": ("--api-keys", "--api-key"),
    "log.level": ("--log-level",),
    "log.format": ("--log-format",),
    "speculative.method": ("--speculative-method",),
    "routing.policy": ("--routing-policy",),
    "kv_transfer.path": ("--kv-transfer-path",),
}
# The Namespace entry of --speculative-config (vLLM's JSON form of the [speculative] keys).
SPECULATIVE_JSON = "speculative_config_json"


def add_config_flags(
    parser: argparse.ArgumentParser, uses: Sequence[str], *, config_file: bool = True
) -> None:
    """Add ``--config`` (unless ``config_file`` is False) and a flag per key of ``uses``, in one
    argument group per section."""
    if config_file:
        parser.add_argument(
            "--config",
            default=None,
            help="config.toml (default: ./config.toml when there is one)",
        )
    keys = _selected_keys(uses)
    counts: dict[str, int] = {}
    for _, key in keys:
        counts[key] = counts.get(key, 0) + 1
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section, key in keys:
        if section not in groups:
            doc = (inspect.getdoc(SECTIONS[section]) or "").splitlines()[0].rstrip(".")
            groups[section] = parser.add_argument_group(f"[{section}] {doc}")
        is_shared = counts[key] > 1
        _add_flag(groups[section], section, key, is_shared)
    if "speculative" in groups:
        groups["speculative"].add_argument(
            "--speculative-config",
            dest=SPECULATIVE_JSON,
            type=_speculative_json,
            default=argparse.SUPPRESS,
            metavar="JSON",
            help='vLLM\'s form of the [speculative] keys, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 3}\'; the single-key flags override it',
        )


def overrides(ns: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The config keys given as flags, ``{section: {key: value}}``."""
    out: dict[str, dict[str, Any]] = {}
    if hasattr(ns, SPECULATIVE_JSON):
        out["speculative"] = dict(getattr(ns, SPECULATIVE_JSON))
    for dest, value in vars(ns).items():
        section, dot, key = dest.partition(".")
        if dot and section in SECTIONS:
            out.setdefault(section, {})[key] = value
    return out


def speculative_keys(value: Any, source: str) -> dict[str, Any]:
    """A ``speculative_config`` dict (vLLM's form: the [speculative] keys), checked: a dict
    whose keys are [speculative]'s; ``source`` names where it came from in errors."""
    if not isinstance(value, dict):
        raise ValueError(f"{source} must be a JSON object / dict, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(SECTIONS["speculative"])}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; known: {sorted(known)}")
    return value


def _speculative_json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from error
    try:
        return speculative_keys(value, "--speculative-config")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def flag_names(section: str, key: str, is_shared: bool = False) -> tuple[str, ...]:
    """The flags of ``section.key``: the first is the one help shows first."""
    named = _NAMES.get(f"{section}.{key}")
    if named is not None:
        return named
    name = key.replace("_", "-")
    return (f"--{section}-{name}",) if is_shared else (f"--{name}",)


def _selected_keys(uses: Sequence[str]) -> list[tuple[str, str]]:
    keys: list[tuple[str, str]] = []
    for use in uses:
        section, _, key = use.partition(".")
        if section not in SECTIONS:
            raise ValueError(f"unknown config section {section!r} in {use!r}")
        names = [f.name for f in dataclasses.fields(SECTIONS[section])]
        if key and key not in names:
            raise ValueError(f"unknown config key {use!r}")
        keys += [(section, k) for k in ([key] if key else names)]
    return keys


def _add_flag(group: argparse._ArgumentGroup, section: str, key: str, is_shared: bool) -> None:
    section_cls = SECTIONS[section]
    hint = typing.get_type_hints(section_cls)[key]
    default = next(f for f in dataclasses.fields(section_cls) if f.name == key).default
    help_text = f"{_comments(section_cls).get(key, '')} (default: {_shown(default)}; env "
    help_text += f"{env_var(section, key)})"
    kwargs: dict[str, Any] = {
        "dest": f"{section}.{key}",
        "default": argparse.SUPPRESS,
        "help": help_text.lstrip().replace("%", "%%"),
    }
    if hint is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = _parser(flag_names(section, key, is_shared)[0], hint)
        kwargs["metavar"] = key.upper()
        if typing.get_origin(hint) is tuple:
            # Repeatable and comma-separated: --api-key a --api-key b, or --api-keys a,b.
            kwargs["action"] = "extend"
    group.add_argument(*flag_names(section, key, is_shared), **kwargs)


def _parser(flag: str, hint: Any) -> typing.Callable[[str], Any]:
    def parse(raw: str) -> Any:
        if raw == "":
            # A flag cannot unset a key (None values are "not given"); DEEPINFER_..= can.
            raise argparse.ArgumentTypeError(f"{flag} needs a value")
        try:
            return parse_value(flag, raw, hint)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _shown(default: Any) -> str:
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, tuple):
        return ",".join(default) or "none"
    return str(default)


@functools.cache
def _comments(section_cls: type) -> dict[str, str]:
    """Each field's comment in the class source: the comment lines right above it, then the
    one on its line. Empty when the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(section_cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.add(token.start[0])
    out = {}
    class_def = ast.parse(source).body[0]
    assert isinstance(class_def, ast.ClassDef), section_cls
    for node in class_def.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above = []
            line = node.lineno - 1
            while line in comments and line not in code_lines:
                above.insert(0, comments[line])
                line -= 1
            own = [comments[node.end_lineno]] if node.end_lineno in comments else []
            out[node.target.id] = " ".join(above + own)
    return out
