"""Backend selection: auto picks the first available backend and says why; bad names fail."""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer.config import KernelConfig
from deepinfer.ops import select_kernels
from deepinfer.ops.attention import torch_ref as attention_ref
from deepinfer.ops.registry import OpRegistry

CPU = torch.device("cpu")


def _registry() -> OpRegistry:
    reg = OpRegistry("attention")
    reg.register("fast", "deepinfer.ops.moe.torch_ref", lambda d: (False, f"needs cuda, got {d}"))
    reg.register("torch_ref", "deepinfer.ops.attention.torch_ref")
    return reg


def test_auto_skips_unavailable_and_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="deepinfer.ops.registry"):
        chosen = _registry().select("auto", CPU)
    assert chosen is attention_ref
    assert (
        "attention backend: torch_ref (auto: reference backend, runs on cpu; fast skipped: "
        "needs cuda, got cpu)" in caplog.text
    )


def test_named_backend_errors() -> None:
    reg = _registry()
    with pytest.raises(ValueError, match=r"'nope' is not a backend; known: \['auto', 'fast'"):
        reg.select("nope", CPU)
    with pytest.raises(ValueError, match="'fast' is not available: needs cuda"):
        reg.select("fast", CPU)


def test_default_selection_is_the_reference_on_cpu() -> None:
    kernels = select_kernels(KernelConfig(), CPU)
    assert kernels.attention.__name__ == "deepinfer.ops.attention.torch_ref"
    assert kernels.moe.__name__ == "deepinfer.ops.moe.torch_ref"
    assert kernels.sampling.__name__ == "deepinfer.ops.sampling.torch_ref"
