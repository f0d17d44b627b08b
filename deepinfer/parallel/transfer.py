"""Moving tensors between two nodes: one process group per pair, on a store of its own.

    PairTransport.connect(address, port, rank, ...)   rank 0 hosts the pair's TCPStore
    PairTransport.join(store, key, rank, ...)         a pair on a store shared by several
                                                      (a decode node's: one key per pair)
      -> ProcessGroupGloo (CPU) | ProcessGroupNCCL (CUDA) over that store, world size 2: never
         the default group, which a node that is also an expert-parallel rank already owns
    sender: send(transfer_id, header, tensors)
    receiver: recv(transfer_id) -> (header, tensors)

One transfer on the wire, every message tagged with its transfer id (so that several transfers
of one pair can be in flight at once, each in its own thread):

    [manifest length] int64 [1] -> manifest: header bytes + (dtype, shape) per part, msgpack
    -> the parts' bytes back to back, in chunks of the sender's ``chunk_bytes`` (named in the
       manifest; a hand-off has thousands of small parts: a message each would cost more)
    -> [checksums] int64 [n], one per part (``checksum_parts=True``)

The receiver allocates every part from the manifest and hands nothing back until the last part
(and its checksum) arrived: a transfer is applied whole or not at all. Any failure (a peer that
died, the group's timeout, a checksum that differs) is a TransferError: a peer whose process
dies fails the other side's transfer at once (its connection closes); one that stops sending
but lives fails it at the pair's ``timeout_s``. The calls block: callers
run them off the engine's step thread. ``on_chunk`` is a test hook: it runs after each chunk is
sent (it may sleep, or raise to cut a transfer short).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Sequence

import msgspec
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class TransferError(RuntimeError):
    """A transfer did not complete; nothing of it was applied. ``reason`` (a metrics label):
    "peer" (the other side failed or went away), "timeout" (it stalled past the pair's
    timeout), "checksum", "join" (the pair could not be set up), or the raiser's own."""

    def __init__(self, message: str, reason: str = "peer") -> None:
        super().__init__(message)
        self.reason = reason


def _failure(what: str, error: Exception) -> TransferError:
    reason = "timeout" if "timed out" in str(error).lower() else "peer"
    return TransferError(f"{what}: {error}", reason)


class _Manifest(msgspec.Struct):
    header: bytes
    parts: list[tuple[str, list[int]]]  # (dtype name, shape) per part
    checksum: bool
    chunk_bytes: int  # the sender's: the receiver posts exactly the messages it sends


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of a tensor's bytes (int64, on its device): a part that was not
    sent, or came back in another order, changes it."""
    data = tensor.contiguous().view(torch.uint8).flatten().to(torch.int64)
    weights = torch.arange(1, data.numel() + 1, device=data.device, dtype=torch.int64) % 251
    return (data * (weights + 1)).sum()


class PairTransport:
    """One end of a pair's process group. ``device``: where parts travel (CPU for gloo)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        device: torch.device,
        chunk_bytes: int = 64 << 20,
    ) -> None:
        self.group = group
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.on_chunk: Callable[[int], None] | None = None  # test hook (see the module)

    @classmethod
    def connect(
        cls,
        address: str,
        port: int,
        rank: int,
        *,
        timeout_s: float,
        device: torch.device | None = None,
        chunk_bytes: int = 64 << 20,
    ) -> PairTransport:
        """Join the pair at ``address:port`` (rank 0 listens there). Blocks until both ends are
        in, or raises TransferError after ``timeout_s``."""
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(address, port, 2, is_master=rank == 0, timeout=timeout)
        except (RuntimeError, ValueError) as error:
            message = f"cannot join the pair at {address}:{port}: {error}"
            raise TransferError(message, "join") from error
        kwargs = {"device": device, "chunk_bytes": chunk_bytes}
        return cls.join(store, "", rank, timeout_s=timeout_s, **kwargs)

    @classmethod
    def join(
        cls,
        store: dist.Store,
        key: str,
        rank: int,
        *,
        timeout_s: float,
        device: torch.device | None = None,
        chunk_bytes: int = 64 << 20,
    ) -> PairTransport:
        """Join the pair named ``key`` on ``store`` (the other end joins with the same key and
        the other rank). Blocks until both are in, or raises TransferError after ``timeout_s``.
        Every operation of the pair then fails after ``timeout_s`` without progress."""
        device = device or torch.device("cpu")
        timeout = datetime.timedelta(seconds=timeout_s)
        if key:
            store = dist.PrefixStore(f"pair/{key}", store)
        try:
            if device.type == "cuda":
                group: dist.ProcessGroup = dist.ProcessGroupNCCL(store, rank, 2)
            else:
                group = dist.ProcessGroupGloo(store, rank, 2, timeout)
        except (RuntimeError, ValueError) as error:
            raise TransferError(f"cannot join pair {key!r}: {error}", "join") from error
        return cls(group, rank, device, chunk_bytes)

    def send(
        self,
        transfer_id: int,
        header: bytes,
        tensors: Sequence[torch.Tensor],
        *,
        checksum_parts: bool = False,
    ) -> None:
        parts = [t.contiguous() for t in tensors]
        layout = [(str(t.dtype).removeprefix("torch."), list(t.shape)) for t in parts]
        chunk = self.chunk_bytes
        manifest = msgspec.msgpack.encode(_Manifest(header, layout, checksum_parts, chunk))
        try:
            data = torch.frombuffer(bytearray(manifest), dtype=torch.uint8).to(self.device)
            self._send(torch.tensor([len(manifest)], device=self.device), transfer_id)
            self._send(data, transfer_id)
            flat = [p.to(self.device).view(torch.uint8).flatten() for p in parts]
            data = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.uint8)
            for i, start in enumerate(range(0, data.numel(), chunk)):
                self._send(data[start : start + chunk], transfer_id)
                if self.on_chunk is not None:
                    self.on_chunk(i)
            if checksum_parts:
                sums = torch.stack([checksum(p) for p in parts]) if parts else torch.zeros(0)
                self._send(sums.to(torch.int64).to(self.device), transfer_id)
        except RuntimeError as error:
            if isinstance(error, TransferError):
                raise
            raise _failure(f"transfer {transfer_id}: sending failed", error) from error

    def recv(self, transfer_id: int) -> tuple[bytes, list[torch.Tensor]]:
        try:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._recv(length, transfer_id)
            data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
            self._recv(data, transfer_id)
            manifest = msgspec.msgpack.decode(data.cpu().numpy().tobytes(), type=_Manifest)
            parts = [
                torch.empty(shape, dtype=getattr(torch, dtype_name), device=self.device)
                for dtype_name, shape in manifest.parts
            ]
            sizes = [p.numel() * p.element_size() for p in parts]
            data = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            chunk = manifest.chunk_bytes
            for start in range(0, data.numel(), chunk):
                self._recv(data[start : start + chunk], transfer_id)
            offset = 0
            for part, size in zip(parts, sizes, strict=True):
                part.view(torch.uint8).view(-1).copy_(data[offset : offset + size])
                offset += size
            if manifest.checksum:
                sums = torch.zeros(len(parts), dtype=torch.int64, device=self.device)
                self._recv(sums, transfer_id)
                ours = [int(checksum(p)) for p in parts]
                if ours != sums.tolist():
                    bad = [
                        i
                        for i, (a, b) in enumerate(zip(ours, sums.tolist(), strict=True))
                        if a != b
                    ]
                    raise TransferError(
                        f"transfer {transfer_id}: parts {bad} differ from sent", "checksum"
                    )
        except (RuntimeError, msgspec.DecodeError) as error:
            if isinstance(error, TransferError):
                raise
            raise _failure(f"transfer {transfer_id}: receiving failed", error) from error
        return manifest.header, parts

    def _send(self, tensor: torch.Tensor, tag: int) -> None:
        self.group.send([tensor], self.peer, tag).wait()

    def _recv(self, tensor: torch.Tensor, tag: int) -> None:
        self.group.recv([tensor], self.peer, tag).wait()

    def close(self) -> None:
        """Leave the pair (an error on the peer's pending calls)."""
        try:
            self.group.shutdown()
        except (RuntimeError, AttributeError):
            logger.debug("pair group shutdown failed", exc_info=True)
