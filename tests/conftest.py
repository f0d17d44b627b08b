"""Session fixtures shared by the test suite, and the skip of ``gpu`` tests without CUDA.

The oracle checkpoints are built once per test session (transformers imported lazily, so that
torch-free tests do not pay for it).
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` (tests/gpu) are skipped, with the reason, where torch sees no CUDA."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    reason = (
        f"needs a CUDA device: torch {torch.__version__} (CUDA build: {torch.version.cuda}) "
        "sees none"
    )
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=reason))


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


@pytest.fixture(scope="session")
def tiny_v41_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny DeepSeek-V4.1 checkpoint (``make-tiny-model --model-type
    deepseek_v41``)."""
    from deepinfer.model.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_v41"), model_type="deepseek_v41")
