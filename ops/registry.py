"""Kernel backends by op family: a tiny registry that picks one backend per family and says why.

Each family (``ops/attention``, ``ops/linear``, ``ops/moe``, ``ops/norm``, ``ops/sampling``)
declares what a backend provides (a Protocol: ``NormBackend``, ...) and registers its backends in
preference order, fastest first, each with its factory and an ``is_available`` check. A factory
is the ``"module:Class"`` path of the backend's class, imported only when chosen (so a missing
vendor library fails only if it is asked for), and ``select`` calls it once with the device and
the parallel context::

    config.toml [kernel] norm = "auto" --OpRegistry.select(requested, device, parallel)-->
        is_available(device) per entry --first ok--> TritonNormBackend(device, parallel)
                                                     (logged once with the reason)

The object it returns is the backend: it holds what its kernels keep between calls (an SM
count, tile overrides), so per-backend state lives there, not in module globals. ``torch_ref``
is registered last everywhere: it runs on every device and is the oracle.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)

Availability = Callable[[torch.device], tuple[bool, str]]
B = TypeVar("B")


def always(device: torch.device) -> tuple[bool, str]:
    return True, f"reference backend, runs on {device.type}"


@dataclass(frozen=True)
class ParallelContext:
    """Where a backend runs among the ranks of its model-parallel group.

    Producer: the engine, when it makes its kernels (``ops.select_kernels``). Consumer: a
    backend's constructor, which may split work or set up communication by it (the MoE family:
    expert parallelism, ``ops/moe/expert_parallel.py``); ``group``: the ranks' process group
    (None: no communication, one rank).
    """

    world_size: int = 1
    rank: int = 0
    group: ProcessGroup | None = None

    def __post_init__(self) -> None:
        assert self.world_size >= 1 and 0 <= self.rank < self.world_size, (
            f"rank {self.rank} of world size {self.world_size}"
        )

    def shard(self, count: int) -> range:
        """This rank's contiguous 1/world_size of ``count`` items (routed experts); raises
        ValueError unless ``count`` divides evenly."""
        if count % self.world_size:
            raise ValueError(
                f"{count} routed experts do not split evenly over {self.world_size} ranks: "
                "expert parallelism needs num_experts % data_parallel_size == 0"
            )
        per_rank = count // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


class Backend:
    """What every backend object keeps: the device it was made for (None: any device, the
    inputs' one, as the torch reference runs) and its parallel context."""

    def __init__(
        self, device: torch.device | None = None, parallel: ParallelContext | None = None
    ) -> None:
        self.device = device
        self.parallel = parallel or ParallelContext()


@dataclass(frozen=True)
class BackendEntry:
    name: str
    factory: str  # "module:Class", called with (device, parallel)
    is_available: Availability


class OpRegistry(Generic[B]):
    """The backends of one op family; ``interface`` is the family's Protocol, which every
    backend object ``select`` makes must satisfy."""

    def __init__(self, family: str, interface: type[B]) -> None:
        self.family = family
        self.interface = interface
        self._entries: dict[str, BackendEntry] = {}

    def register(self, name: str, factory: str, is_available: Availability = always) -> None:
        assert name not in self._entries, f"{self.family}: backend {name!r} registered twice"
        assert factory.count(":") == 1, f"{self.family}: factory {factory!r} is not module:Class"
        self._entries[name] = BackendEntry(name, factory, is_available)

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def select(
        self, requested: str, device: torch.device, parallel: ParallelContext | None = None
    ) -> B:
        """The backend object for ``requested`` ("auto": the first available one), made for
        ``device`` and ``parallel`` (default: one rank)."""
        if requested == "auto":
            reasons = []
            for entry in self._entries.values():
                ok, why = entry.is_available(device)
                if ok:
                    return self._make(entry, f"auto: {why}" + "".join(reasons), device, parallel)
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
        return self._make(entry, f"asked for: {why}", device, parallel)

    def _make(
        self,
        entry: BackendEntry,
        reason: str,
        device: torch.device,
        parallel: ParallelContext | None,
    ) -> B:
        logger.info("%s backend: %s (%s)", self.family, entry.name, reason)
        module, _, name = entry.factory.partition(":")
        backend = getattr(importlib.import_module(module), name)(device, parallel)
        assert isinstance(backend, self.interface), (
            f"{self.family}: {entry.factory} made a {type(backend).__name__}, which lacks "
            f"{self.interface.__name__}'s ops"
        )
        return backend


def triton_available(device: torch.device) -> tuple[bool, str]:
    """Triton kernels: a CUDA device and an importable triton."""
    if device.type != "cuda":
        return False, f"triton kernels run on CUDA devices, not {device.type}"
    try:
        import triton
    except ImportError as error:
        return False, f"triton is not installed ({error}); pip install 'deepinfer[cuda]'"
    return True, f"triton {triton.__version__} on {torch.cuda.get_device_name(device)}"
