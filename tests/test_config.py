"""Config loading: file, environment, overrides, validation messages; the shipped config.toml."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from deepinfer.cli import build_parser, main
from deepinfer.config import SECTIONS, Config, env_var, to_toml
from deepinfer.flags import overrides

ROOT = Path(__file__).resolve().parent.parent


def test_to_toml_reads_back_equal(tmp_path: Path) -> None:
    """What `serve --data-parallel-size N` hands its rank nodes: every set key, secrets and
    lists included, unset keys left out."""
    config = Config.load(
        overrides={
            "server": {"api_keys": ("k1", 'k"2'), "node_token": "t0ken", "port": 9001},
            "parallel": {"data_parallel_size": 2, "data_parallel_master_port": 29500},
            "cache": {"num_blocks": 64, "host_tier_gib": 0.5},
            "node": {"instance_id": "v4-a"},
        },
        environ={},
    )
    path = tmp_path / "rank.toml"
    path.write_text(to_toml(config))
    assert Config.load(path, environ={}) == config
    assert "# " not in path.read_text() and "tokenizer" not in path.read_text()  # unset: absent


def test_shipped_config_toml_equals_the_defaults() -> None:
    assert Config.load(ROOT / "config.toml", environ={}) == Config()


def test_precedence_file_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[scheduler]\nmax_num_seqs = 8\nmax_num_batched_tokens = 100\n")
    env = {"DEEPINFER_SCHEDULER_MAX_NUM_BATCHED_TOKENS": "200", "DEEPINFER_CACHE_NUM_BLOCKS": "7"}
    config = Config.load(path, overrides={"scheduler": {"max_num_seqs": 3}}, environ=env)
    assert config.scheduler.max_num_seqs == 3
    assert config.scheduler.max_num_batched_tokens == 200
    assert config.cache.num_blocks == 7
    assert (
        Config.load(
            path, overrides={"scheduler": {"max_num_seqs": None}}, environ={}
        ).scheduler.max_num_seqs
        == 8
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[cache]\nblock_size = 0\n", "cache.block_size must be >= 1, got 0"),
        ("[model]\ndtype = 'fp16'\n", "model.dtype must be one of"),
        (
            "[scheduler]\nmax_num_sequences = 4\n",
            r"unknown config key \[scheduler\].max_num_sequences",
        ),
        ("[nope]\nx = 1\n", r"unknown config section \[nope\]"),
        ("[node]\nauth_token = 't'\n", r"\[node\].auth_token was renamed to server.node_token"),
        (
            "[node]\ncoordinator_url = 'http://c'\n",
            r"\[node\].coordinator_url was renamed to node.coordinator_internal_url",
        ),
        (
            "[server]\ninternal_host = '0.0.0.0'\n",
            r"server.internal_host = '0.0.0.0' is not a loopback address: set server.node_token",
        ),
        ("[server]\ninternal_port = 8000\n", r"server.internal_port must differ from server.port"),
        ("[server]\nmax_queued_requests = 0\n", "server.max_queued_requests must be >= 1, got 0"),
    ],
)
def test_bad_values_are_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        Config.load(path, environ={})


def test_bad_environment_value_is_named() -> None:
    with pytest.raises(ValueError, match="DEEPINFER_SCHEDULER_MAX_NUM_SEQS='many'"):
        Config.load(environ={"DEEPINFER_SCHEDULER_MAX_NUM_SEQS": "many"})


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("DEEPINFER_NODE_AUTH_TOKEN", "DEEPINFER_SERVER_NODE_TOKEN"),
        ("DEEPINFER_NODE_COORDINATOR_URL", "DEEPINFER_NODE_COORDINATOR_INTERNAL_URL"),
    ],
)
def test_renamed_environment_variable_is_an_error(old: str, new: str) -> None:
    """Ignoring an old token variable would leave a node's API open: refuse to start."""
    with pytest.raises(ValueError, match=f"^{old} was renamed to {new}$"):
        Config.load(environ={old: "x"})


def test_internal_listener_beyond_loopback_needs_the_node_token() -> None:
    for host in ("localhost", "127.0.0.2", "::1", "[::1]"):
        env = {"DEEPINFER_SERVER_INTERNAL_HOST": host}
        assert Config.load(environ=env).server.internal_host == host
    env = {"DEEPINFER_SERVER_INTERNAL_HOST": "10.0.0.5", "DEEPINFER_SERVER_NODE_TOKEN": "t"}
    assert Config.load(environ=env).server.node_token == "t"
    for host in ("10.0.0.5", "0.0.0.0", "::", "coordinator.internal"):
        with pytest.raises(ValueError, match="is not a loopback address"):
            Config.load(environ={"DEEPINFER_SERVER_INTERNAL_HOST": host})


def test_torch_free_imports() -> None:
    code = (
        "import sys, deepinfer, deepinfer.config, deepinfer.sampling_params, deepinfer.scheduler, "
        "deepinfer.scheduler.scheduler, deepinfer.model.deepseek_v4.args, "
        "deepinfer.model.deepseek_v4.weights, deepinfer.model.families, "
        "deepinfer.tokenizer; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---- every key a flag (deepinfer/flags.py) ----------------------------------------------------

# Valid non-default values of keys whose values the config checks against a list.
_OTHER_VALUES = {
    "model.device": "cpu",
    "model.dtype": "float32",
    "model.yoco_truncation": "compact",
    "node.role": "decode",
    "log.level": "DEBUG",
    "log.format": "json",
    "parallel.data_parallel_size": 4,  # rank 1 + 3 local ranks fit
    "parallel.backend": "gloo",
    "speculative.method": "dspark",
    "speculative.verify_schedule": "confidence",  # with dspark: its confidence head
    "speculative.verify_cost_curve": ("1:20", "6:40.5"),  # "tokens:ms" points
    "cache.max_draft_tokens": 5,  # >= speculative.num_speculative_tokens' other value, 4
    "cache.kv_dtype": "fp8",
    "routing.policy": "least_loaded",
    "routing.balance_ratio": 3.0,
    "routing.host_hit_cost": 0.5,
    "kv_transfer.path": "host",
}


def _subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _config_flags(parser: argparse.ArgumentParser) -> dict[tuple[str, str], argparse.Action]:
    """(section, key) -> the flag's action, for every config key the parser has."""
    out = {}
    for action in parser._actions:
        section, _, key = action.dest.partition(".")
        if key and section in SECTIONS:
            out[section, key] = action
    return out


def _other_value(section: str, key: str) -> Any:
    """A valid value of ``section.key`` other than its default."""
    if f"{section}.{key}" in _OTHER_VALUES:
        return _OTHER_VALUES[f"{section}.{key}"]
    default = getattr(SECTIONS[section](), key)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default / 2
    if isinstance(default, tuple):
        return ("k1", "k2")
    hint = typing.get_type_hints(SECTIONS[section])[key]
    return 3 if int in typing.get_args(hint) else "x"


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return ",".join(value) if isinstance(value, tuple) else str(value)


def _argv(flags: dict[tuple[str, str], argparse.Action], values: dict) -> list[str]:
    argv = []
    for (section, key), value in values.items():
        name = flags[section, key].option_strings[0]
        if isinstance(value, bool):
            argv.append(name if value else "--no-" + name.removeprefix("--"))
        else:
            argv += [name, _as_text(value)]
    return argv


def _toml(values: dict) -> str:
    sections: dict[str, list[str]] = {}
    for (section, key), value in values.items():
        if isinstance(value, str):
            text = json.dumps(value)
        elif isinstance(value, tuple):
            text = json.dumps(list(value))
        else:
            text = _as_text(value)
        sections.setdefault(section, []).append(f"{key} = {text}")
    return "".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in sections.items())


def test_every_key_is_a_flag_of_a_subcommand_that_reads_it() -> None:
    parsers = _subcommand_parsers()
    every_key = {(s, f.name) for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    running = ("serve", "node", "coordinator", "generate")
    assert set().union(*(_config_flags(parsers[name]) for name in running)) == every_key
    assert set(_config_flags(parsers["config"])) == every_key
    # Each subcommand has exactly the keys it reads (its module's *_USES).
    assert set(_config_flags(parsers["node"])) >= {("node", k) for s, k in every_key if s == "node"}
    assert {k for s, k in _config_flags(parsers["serve"]) if s == "node"} == {
        "node_id",
        "max_step_s",
    }
    assert {s for s, _ in _config_flags(parsers["coordinator"])} == {
        "server",
        "routing",
        "metrics",
        "log",
        "model",
        "scheduler",  # max_num_seqs: what a static --node runs at once (derived limits)
    }
    assert {s for s, _ in _config_flags(parsers["generate"])} == {
        "model", "cache", "scheduler", "kernel", "speculative", "parallel", "log"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("command", "flag", "dest"),
    [
        ("serve", "--gpu-memory-utilization", "cache.gpu_memory_utilization"),
        ("serve", "--enable-prefix-caching", "cache.enable_prefix_caching"),
        ("serve", "--block-size", "cache.block_size"),
        ("serve", "--tokenizer", "model.tokenizer"),
        ("serve", "--default-thinking-mode", "server.default_thinking_mode"),
        ("serve", "--host", "server.host"),
        ("serve", "--api-key", "server.api_keys"),  # today's flags stay, as aliases
        ("serve", "--threads", "kernel.num_threads"),
        ("serve", "--model", "model.path"),
        ("serve", "--export-vllm-names", "metrics.export_vllm_names"),
        ("node", "--host", "node.host"),
        ("node", "--coordinator-internal-url", "node.coordinator_internal_url"),
        ("node", "--served-model-name", "server.served_model_name"),
        ("coordinator", "--tokenizer", "model.tokenizer"),
        ("coordinator", "--max-model-len", "model.max_model_len"),
        ("config", "--server-host", "server.host"),  # shared by two sections: prefixed
        ("config", "--node-drain-timeout-s", "node.drain_timeout_s"),
        ("bench", "--log-level", "log.level"),
        ("make-tiny-model", "--log-format", "log.format"),
    ],
)
def test_flag_names(command: str, flag: str, dest: str) -> None:
    parser = _subcommand_parsers()[command]
    if command == "bench":
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = parser.choices["serve"]
    assert parser._option_string_actions[flag].dest == dest


def test_help_text_is_the_fields_comment_with_the_default() -> None:
    flags = _config_flags(_subcommand_parsers()["serve"])
    assert flags["scheduler", "max_num_seqs"].help == (
        "running requests per step (default: 64; env DEEPINFER_SCHEDULER_MAX_NUM_SEQS)"
    )
    assert flags["model", "path"].help.startswith("Local Hugging Face-style checkpoint folder")
    assert flags["server", "api_keys"].help.endswith(
        "(default: none; env DEEPINFER_SERVER_API_KEYS)"
    )
    for (section, key), action in _config_flags(_subcommand_parsers()["config"]).items():
        assert action.help and not action.help.startswith("(default"), f"{section}.{key}: no help"


@pytest.mark.parametrize("command", ["serve", "node", "coordinator", "generate", "config"])
@pytest.mark.parametrize("flag_gives", ["other", "default"])
def test_flags_override_the_file_and_the_environment(
    tmp_path: Path, command: str, flag_gives: str
) -> None:
    """Every key at once: the flag's value wins over a different one in the file and the env."""
    flags = _config_flags(_subcommand_parsers()[command])
    other = {(s, k): _other_value(s, k) for s, k in flags}
    default = {(s, k): getattr(SECTIONS[s](), k) for s, k in flags}
    # A flag cannot unset a key (None) nor give an empty list.
    default = {sk: v for sk, v in default.items() if v not in (None, ())}
    given, elsewhere = (other, default) if flag_gives == "other" else (default, other)
    path = tmp_path / "c.toml"
    path.write_text(_toml({sk: v for sk, v in elsewhere.items() if sk in given}))
    env = {env_var(s, k): _as_text(v) for (s, k), v in elsewhere.items() if (s, k) in given}
    positional = ["hello"] if command == "generate" else []
    ns = build_parser().parse_args([command, *positional, *_argv(flags, given)])
    config = Config.load(path, overrides=overrides(ns), environ=env)
    got = {(s, k): getattr(getattr(config, s), k) for s, k in given}
    assert got == {sk: (v.upper() if sk == ("log", "level") else v) for sk, v in given.items()}


def test_misspelt_environment_variable_is_named() -> None:
    with pytest.raises(ValueError, match=re.escape(
        "environment variable DEEPINFER_SCHEDULER_MAX_NUM_SEQ names no key of [scheduler]; "
        "did you mean DEEPINFER_SCHEDULER_MAX_NUM_SEQS?"
    )):  # fmt: skip
        Config.load(environ={"DEEPINFER_SCHEDULER_MAX_NUM_SEQ": "8"})
    # The scripts' own variables are not config keys.
    env = {"DEEPINFER_TORCH_SPEC": "torch", "DEEPINFER_VENV": "/v", "DEEPINFER_LOG_LEVEL": "debug"}
    assert Config.load(environ=env).log.level == "DEBUG"


def test_cli_reports_a_misspelt_variable_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DEEPINFER_CACHE_NUM_BLOKS", "8")
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "deepinfer config: error: environment variable DEEPINFER_CACHE_NUM_BLOKS names no key "
        "of [cache]; did you mean DEEPINFER_CACHE_NUM_BLOCKS?\n"
    )


def test_config_subcommand_shows_flags_and_hides_secrets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["config", "--server-port", "9000", "--node-port", "9100", "--api-key", "a,b"]
    assert main([*argv, "--no-enable-prefix-caching"]) == 0
    out = capsys.readouterr().out
    assert '[server]\nhost = "127.0.0.1"\nport = 9000\n' in out
    assert '[node]\nhost = "127.0.0.1"\nport = 9100\n' in out
    assert "enable_prefix_caching = false\n" in out
    assert "# api_keys = (set, not shown)\n" in out


def test_speculative_config_json_flag_is_vllms_form() -> None:
    """--speculative-config takes vLLM's JSON; a single-key flag overrides it; bad JSON or an
    unknown key is an argparse error naming it."""
    import argparse

    from deepinfer.flags import add_config_flags, overrides

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_config_flags(parser, ("cache", "speculative"), config_file=False)
    ns = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
         "--prompt-lookup-max", "6"]
    )  # fmt: skip
    config = Config.load(overrides=overrides(ns))
    assert config.speculative.method == "ngram"
    assert (config.speculative.num_speculative_tokens, config.speculative.prompt_lookup_max) == (
        4,
        6,
    )
    assert config.cache.max_draft_tokens == 4
    for bad, message in (("{not json", "not JSON"), ('{"k": 1}', "unknown key")):
        with pytest.raises(argparse.ArgumentError, match=message):
            parser.parse_args(["--speculative-config", bad])
