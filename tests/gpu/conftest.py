"""Shared by the GPU tests (each module is marked ``gpu``; tests/conftest.py skips them where
torch sees no CUDA device): the figures they report go to one results file."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch


def results_path() -> Path:
    """``$OUT/gpu_results.txt`` where the device machine sets OUT, else /tmp/gpu_results.txt."""
    return Path(os.environ.get("OUT") or "/tmp") / "gpu_results.txt"


@pytest.fixture(scope="session")
def record_figure() -> Callable[[str], None]:
    """Print a figure and append it, stamped with the date, device and torch, to results_path()."""

    def record(line: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        text = f"{stamp} | {device} | torch {torch.__version__} | {line}"
        print(text)
        with open(results_path(), "a") as f:
            f.write(text + "\n")

    return record


@pytest.fixture
def ieee_fp32() -> Iterator[None]:
    """fp32 matmuls in IEEE fp32 (no TF32) for the duration of a test, as the engine's fp32."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before
