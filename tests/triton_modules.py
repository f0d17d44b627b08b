"""Triton backend modules, interpreted (CPU tests) or compiled (GPU tests), in one session.

Triton decides between its interpreter and compiled kernels when a kernel is decorated, i.e.
when the backend module is imported; the CPU and GPU tests of one session each reload the
module in the mode they need.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from types import ModuleType


def interpreted(name: str, interpret_before: str | None) -> Iterator[ModuleType]:
    """Yield module ``name`` reloaded with TRITON_INTERPRET=1; afterwards put TRITON_INTERPRET
    back to ``interpret_before`` (its value when the test module was collected)."""
    os.environ["TRITON_INTERPRET"] = "1"
    yield importlib.reload(importlib.import_module(name))
    if interpret_before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = interpret_before


def compiled(name: str) -> ModuleType:
    """Module ``name`` reloaded with compiled kernels (a CPU test may have set TRITON_INTERPRET
    when it was collected)."""
    os.environ.pop("TRITON_INTERPRET", None)
    return importlib.reload(importlib.import_module(name))
