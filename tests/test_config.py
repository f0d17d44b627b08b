"""Config loading: file, environment, overrides, validation messages; the shipped config.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.config import Config

ROOT = Path(__file__).resolve().parent.parent


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
        "deepinfer.scheduler.scheduler, deepinfer.model.config, deepinfer.model.weights, "
        "deepinfer.tokenizer; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
