"""Triton backend modules, interpreted (CPU tests) or compiled (GPU tests), in one session.

Triton decides between its interpreter and compiled kernels when a kernel is decorated, i.e.
when the backend module is imported; the CPU and GPU tests of one session each reload the
module in the mode they need. ``Launches`` and ``no_sm_lookup`` check what a backend object
launches with, ``contract_mismatches`` that it provides its family's ops.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any


def _reload(name: str) -> ModuleType:
    """Module ``name`` reloaded after the kernel modules it imports (``KERNEL_MODULES``)."""
    for dependency in KERNEL_MODULES.get(name, ()):
        importlib.reload(importlib.import_module(dependency))
    return importlib.reload(importlib.import_module(name))


# Backend modules whose kernels live partly in other modules, which must be reloaded first.
KERNEL_MODULES = {
    "deepinfer.ops.moe.triton": (
        "deepinfer.ops.moe.triton_gemv",
        "deepinfer.ops.moe.triton_router",
    ),
    "deepinfer.ops.norm.triton": ("deepinfer.ops.norm.triton_pool",),
}


def interpreted(name: str, interpret_before: str | None) -> Iterator[ModuleType]:
    """Yield module ``name`` reloaded with TRITON_INTERPRET=1; afterwards put TRITON_INTERPRET
    back to ``interpret_before`` (its value when the test module was collected)."""
    from deepinfer.ops.triton_interpret import patch_interpreter

    os.environ["TRITON_INTERPRET"] = "1"
    patch_interpreter()
    yield _reload(name)
    if interpret_before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = interpret_before


def compiled(name: str) -> ModuleType:
    """Module ``name`` reloaded with compiled kernels (a CPU test may have set TRITON_INTERPRET
    when it was collected)."""
    os.environ.pop("TRITON_INTERPRET", None)
    return _reload(name)


class Launches:
    """Stands in for a Triton kernel of a backend module: records the grid and the keyword
    arguments (constexprs, launch options) of every launch, then launches the kernel. Install
    with ``monkeypatch.setattr(module, name, Launches(...))``."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.grids: list[tuple[int, ...]] = []
        self.keywords: list[dict[str, Any]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.grids.append(tuple(grid))
        launch = self.kernel[grid]

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.keywords.append(kwargs)
            return launch(*args, **kwargs)

        return recorded


def no_sm_lookup(device: object) -> int:
    """In place of a module's ``_num_sms``: fails if a launcher asks for the SM count itself."""
    raise AssertionError(f"the launcher looked up the SMs of {device}")


def contract_mismatches(backend: object, interface: type) -> list[str]:
    """The ops of ``interface`` (a family's Protocol) that ``backend`` lacks or provides with
    another signature (names, defaults, annotations; ``self`` aside)."""
    ops = [
        name
        for name, value in vars(interface).items()
        if inspect.isfunction(value) and not name.startswith("_")
    ]
    assert ops, f"{interface.__name__} declares no ops"
    mismatches = []
    for name in ops:
        declared = inspect.signature(getattr(interface, name))
        declared = declared.replace(parameters=list(declared.parameters.values())[1:])
        op = getattr(backend, name, None)
        if op is None or inspect.signature(op) != declared:
            mismatches.append(name)
    return mismatches
