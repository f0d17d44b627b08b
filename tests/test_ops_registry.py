"""Backend selection: auto picks the first available backend and says why; bad names fail; the
chosen backend is an object made for the device and the parallel context."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from triton_modules import contract_mismatches

from deepinfer.config import KernelConfig
from deepinfer.ops import Kernels, reference_kernels, select_kernels
from deepinfer.ops.attention import AttentionBackend
from deepinfer.ops.attention import torch_ref as attention_ref
from deepinfer.ops.linear import LinearBackend
from deepinfer.ops.moe import MoEBackend
from deepinfer.ops.norm import NormBackend
from deepinfer.ops.registry import OpRegistry, ParallelContext
from deepinfer.ops.sampling import SamplingBackend

CPU = torch.device("cpu")
FAMILIES = {
    "attention": AttentionBackend,
    "linear": LinearBackend,
    "moe": MoEBackend,
    "norm": NormBackend,
    "sampling": SamplingBackend,
}


def _registry() -> OpRegistry:
    reg = OpRegistry("attention", AttentionBackend)
    reg.register(
        "fast",
        "deepinfer.ops.moe.torch_ref:TorchRefMoEBackend",
        lambda d: (False, f"needs cuda, got {d}"),
    )
    reg.register("torch_ref", "deepinfer.ops.attention.torch_ref:TorchRefAttentionBackend")
    return reg


def test_auto_skips_unavailable_and_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="deepinfer.ops.registry"):
        chosen = _registry().select("auto", CPU)
    assert type(chosen) is attention_ref.TorchRefAttentionBackend
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


def test_select_makes_the_backend_for_the_device_and_parallel_context() -> None:
    reg = _registry()
    parallel = ParallelContext(world_size=2, rank=1)
    chosen = reg.select("torch_ref", CPU, parallel)
    assert chosen.device == CPU and chosen.parallel is parallel
    again = reg.select("torch_ref", CPU)
    assert again is not chosen  # one object per select: each engine owns its backends' state
    assert again.parallel == ParallelContext(world_size=1, rank=0, group=None)


def test_a_factory_that_makes_another_familys_backend_fails() -> None:
    reg = OpRegistry("attention", AttentionBackend)
    reg.register("moe_by_mistake", "deepinfer.ops.moe.torch_ref:TorchRefMoEBackend")
    with pytest.raises(
        AssertionError, match="made a TorchRefMoEBackend, which lacks AttentionBackend's ops"
    ):
        reg.select("moe_by_mistake", CPU)
    with pytest.raises(
        AssertionError, match=r"'deepinfer\.ops\.moe\.torch_ref' is not module:Class"
    ):
        reg.register("module_only", "deepinfer.ops.moe.torch_ref")


def test_parallel_context_checks_the_rank() -> None:
    with pytest.raises(AssertionError, match="rank 2 of world size 2"):
        ParallelContext(world_size=2, rank=2)


def test_default_selection_is_the_reference_on_cpu() -> None:
    kernels = select_kernels(KernelConfig(), CPU)
    assert type(kernels.attention).__module__ == "deepinfer.ops.attention.torch_ref"
    assert type(kernels.moe).__module__ == "deepinfer.ops.moe.torch_ref"
    assert type(kernels.sampling).__module__ == "deepinfer.ops.sampling.torch_ref"


def test_kernel_launch_pdl_sets_the_process_launches() -> None:
    """kernel.launch_pdl reaches the Triton launches through select_kernels; on the CPU (the
    interpreter) the launch keywords are off either way."""
    from deepinfer.ops import triton_utils

    try:
        select_kernels(KernelConfig(launch_pdl=False), CPU)
        assert triton_utils.LAUNCH_PDL is False
        select_kernels(KernelConfig(), CPU)
        assert triton_utils.LAUNCH_PDL is True
        pytest.importorskip("triton")
        from deepinfer.ops.triton_pdl import pdl

        assert pdl(CPU) == {"PDL": False, "launch_pdl": False}
    finally:
        triton_utils.LAUNCH_PDL = True


@pytest.mark.parametrize(
    "make",
    [lambda: select_kernels(KernelConfig(), CPU), reference_kernels],
    ids=["select_kernels", "reference_kernels"],
)
def test_kernels_hold_one_reference_backend_object_per_family(
    make: Callable[[], Kernels],
) -> None:
    kernels = make()
    for family, interface in FAMILIES.items():
        backend = getattr(kernels, family)
        assert isinstance(backend, interface), family
        assert contract_mismatches(backend, interface) == [], family
        assert type(backend).__name__ == f"TorchRef{interface.__name__}", family
        assert type(backend).__module__ == f"deepinfer.ops.{family}.torch_ref", family


def test_deepgemm_probe_survives_a_crashing_child_and_auto_skips_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepGEMM is only ever tried in a child process: a segfault there is a reason, not a
    crash of the caller; without CUDA (or the preload its JIT needs) auto passes it by."""
    import os

    from deepinfer.ops.linear import BACKENDS as LINEAR
    from deepinfer.ops.linear import deepgemm

    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    assert deepgemm.probe(crash, dict(os.environ), 60) == (
        False,
        "DeepGEMM probe was killed by SIGSEGV: ",
    )
    ok, why = deepgemm.probe("raise SystemExit('no sm90 kernel')", dict(os.environ), 60)
    assert not ok and why.endswith("(exit 1): no sm90 kernel")
    assert deepgemm.probe("print('ok, 1e-3')", dict(os.environ), 60) == (
        True,
        "DeepGEMM probe: ok, 1e-3",
    )
    assert deepgemm.is_available(torch.device("cpu"))[0] is False
    assert LINEAR.names[0] == "deepgemm"
    assert type(LINEAR.select("auto", torch.device("cpu"))).__name__ == "TorchRefLinearBackend"


def test_side_stream_is_off_and_in_place_on_the_cpu() -> None:
    """kernel.side_stream is a CUDA feature: a CPU selection turns it off, and ``beside`` runs
    the work at once, in order, with nothing to join (``ready`` passes tensors through)."""
    from deepinfer.ops.streams import beside, ready

    assert select_kernels(KernelConfig(side_stream=True), CPU).side_stream is False
    order: list[str] = []

    def work(x: torch.Tensor) -> torch.Tensor:
        order.append("work")
        return x + 1

    pending = beside(True, CPU, work, torch.zeros(2))
    order.append("after")
    assert order == ["work", "after"] and pending.stream is None
    assert torch.equal(ready(pending), torch.ones(2))
    tensor = torch.zeros(1)
    assert ready(tensor) is tensor and ready(None) is None
