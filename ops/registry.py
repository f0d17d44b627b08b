"""Kernel backends by op family: a tiny registry that picks one backend per family and says why.

Each family (``ops/attention``, ``ops/linear``, ``ops/moe``, ``ops/norm``, ``ops/sampling``)
registers its backends in preference order, fastest first, with the module that implements them
(imported only when chosen, so a missing vendor library fails only if it is asked for) and an
``is_available`` check. ``torch_ref`` is registered last everywhere: it runs on every device and
is the oracle.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

Availability = Callable[[torch.device], tuple[bool, str]]


def always(device: torch.device) -> tuple[bool, str]:
    return True, f"reference backend, runs on {device.type}"


@dataclass(frozen=True)
class BackendEntry:
    name: str
    module: str
    is_available: Availability


class OpRegistry:
    def __init__(self, family: str) -> None:
        self.family = family
        self._entries: dict[str, BackendEntry] = {}

    def register(self, name: str, module: str, is_available: Availability = always) -> None:
        assert name not in self._entries, f"{self.family}: backend {name!r} registered twice"
        self._entries[name] = BackendEntry(name, module, is_available)

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def select(self, requested: str, device: torch.device) -> ModuleType:
        """The backend module for ``requested`` ("auto": the first available one)."""
        if requested == "auto":
            reasons = []
            for entry in self._entries.values():
                ok, why = entry.is_available(device)
                if ok:
                    return self._load(entry, f"auto: {why}" + "".join(reasons))
                reasons.append(f"; {entry.name} skipped: {why}")
            raise RuntimeError(f"{self.family}: no backend is available on {device}")
        entry = self._entries.get(requested)
        if entry is None:
            raise ValueError(
                f"kernel.{self.family} = {requested!r} is not a backend; known: "
                f"{['auto', *self.names]}"
            )
        ok, why = entry.is_available(device)
        if not ok:
            raise ValueError(f"kernel.{self.family} = {requested!r} is not available: {why}")
        return self._load(entry, f"asked for: {why}")

    def _load(self, entry: BackendEntry, reason: str) -> ModuleType:
        logger.info("%s backend: %s (%s)", self.family, entry.name, reason)
        return importlib.import_module(entry.module)


def triton_available(device: torch.device) -> tuple[bool, str]:
    """Triton kernels: a CUDA device and an importable triton."""
    if device.type != "cuda":
        return False, f"triton kernels run on CUDA devices, not {device.type}"
    try:
        import triton
    except ImportError as error:
        return False, f"triton is not installed ({error}); pip install 'deepinfer[cuda]'"
    return True, f"triton {triton.__version__} on {torch.cuda.get_device_name(device)}"
