"""Session fixtures shared by the test suite.

The oracle checkpoints are built once per test session (transformers imported lazily, so that
torch-free tests do not pay for it).
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def oracle_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny V4 oracle as transformers' ``save_pretrained`` writes it (+ tokenizer.json)."""
    from oracle import write_oracle_hf

    return write_oracle_hf(tmp_path_factory.mktemp("oracle_hf"))


@pytest.fixture(scope="session")
def oracle_upstream_dir(oracle_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tensors under DeepSeek's upstream names, with an upstream-style config.json."""
    from oracle import write_oracle_upstream

    return write_oracle_upstream(oracle_hf_dir, tmp_path_factory.mktemp("oracle_upstream"))
