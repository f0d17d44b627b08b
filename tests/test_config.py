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


def test_torch_free_imports() -> None:
    code = (
        "import sys, deepinfer, deepinfer.config, deepinfer.sampling_params, deepinfer.scheduler, "
        "deepinfer.scheduler.scheduler, deepinfer.model.config, deepinfer.model.weights, "
        "deepinfer.tokenizer; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
