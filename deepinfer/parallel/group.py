"""One rank's place in the group: the process group, its device and its share of the experts.

    config [parallel] + this rank --RankGroup.join--> torch.distributed process group
        data group:    nccl (CUDA) | hccl (Ascend) | gloo (CPU): the MoE layers' all-to-alls
        control group: gloo, on the host: the per-step agreement (lockstep.py)
        device:        cuda:<local rank> / npu:<local rank> / cpu

Every collective of either group fails after ``collective_timeout_s`` (gloo's default would be
30 minutes); a peer that dies mid-collective fails it sooner (gloo: its connection closes).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import socket

import torch
import torch.distributed as dist

from deepinfer.config import ParallelConfig
from deepinfer.ops.registry import ParallelContext

logger = logging.getLogger(__name__)


class RankGroupError(RuntimeError):
    """The group ended: a peer failed, died or stopped answering; every open request fails.

    ``failed``: request id -> why, for each request the group left unfinished; ``finished``:
    what did finish (RequestOutputs) before it ended."""

    def __init__(
        self, message: str, failed: dict[str, str] | None = None, finished: list | None = None
    ) -> None:
        super().__init__(message)
        self.failed = failed or {}
        self.finished = finished or []


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (for a rendezvous every rank of which runs here)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def with_rendezvous_port(config: ParallelConfig) -> ParallelConfig:
    """``config`` with a concrete rendezvous port: port 0 becomes a free one on this host."""
    if config.data_parallel_master_port:
        return config
    if config.num_local_ranks != config.data_parallel_size:
        raise ValueError(
            "parallel.data_parallel_master_port = 0 picks a port on this host, which ranks on "
            "other hosts cannot know: set it when data_parallel_size_local < data_parallel_size"
        )
    port = free_port(config.data_parallel_address)
    return dataclasses.replace(config, data_parallel_master_port=port)


def backend_for(config: ParallelConfig, device_type: str) -> str:
    if config.backend != "auto":
        return config.backend
    return {"cuda": "nccl", "npu": "hccl"}.get(device_type, "gloo")


class RankGroup:
    """This process's rank in the group. Producer: ``join`` (once per rank process). Consumers:
    the model runner (device, expert share, the MoE backend's context) and the engine's
    lock-step agreement (``control``)."""

    def __init__(
        self,
        config: ParallelConfig,
        rank: int,
        device: torch.device,
        data: dist.ProcessGroup,
        control: dist.ProcessGroup,
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = config.data_parallel_size
        self.device = device
        self.data = data
        self.control = control

    @classmethod
    def join(cls, config: ParallelConfig, device_type: str) -> RankGroup:
        """Join as rank ``config.data_parallel_rank`` (a rank process's config names its own
        rank); blocks until every rank has joined or the timeout passes."""
        assert config.data_parallel_master_port, "with_rendezvous_port picks the port first"
        rank, world = config.data_parallel_rank, config.data_parallel_size
        local_rank = rank % config.num_local_ranks
        device = torch.device("cpu")
        if device_type in ("cuda", "npu"):
            accelerators = getattr(torch, device_type)
            # One device visible (a unit per device): it is this rank's; else its local rank's.
            index = local_rank if accelerators.device_count() > 1 else 0
            device = torch.device(device_type, index)
            accelerators.set_device(device)
        backend = backend_for(config, device.type)
        timeout = datetime.timedelta(seconds=config.collective_timeout_s)
        address = f"tcp://{config.data_parallel_address}:{config.data_parallel_master_port}"
        logger.info(
            "rank %d of %d: joining %s at %s (%s, collective timeout %.0f s)",
            rank,
            world,
            backend,
            address,
            device,
            config.collective_timeout_s,
        )
        try:
            dist.init_process_group(
                backend, init_method=address, rank=rank, world_size=world, timeout=timeout
            )
            data = dist.group.WORLD
            control = data if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        except (RuntimeError, ValueError) as error:
            raise RankGroupError(
                f"rank {rank} could not join the group at {address}: {error}"
            ) from error
        assert data is not None
        return cls(config, rank, device, data, control)

    @property
    def expert_parallel(self) -> bool:
        return self.config.enable_expert_parallel

    def moe_context(self) -> ParallelContext:
        """The MoE backend's ranks: the whole group with expert parallelism, else this rank
        alone (every rank holds every expert and exchanges no tokens)."""
        if not self.expert_parallel:
            return ParallelContext()
        return ParallelContext(self.world_size, self.rank, self.data)

    def experts(self, num_experts: int) -> range:
        """The routed experts this rank holds: a contiguous 1/N of them with expert parallelism,
        all of them without."""
        return self.moe_context().shard(num_experts)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
