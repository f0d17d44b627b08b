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

Two ends on one GPU (two node processes sharing it: ``ipc_device`` given on both sides, and the
same GPU behind it, as told through the pair's store when it is joined) move CUDA parts through
CUDA IPC instead: the sender packs them into one buffer on the device and names it in the
manifest (its allocation's IPC handle and an event after the packing); the receiver maps it,
copies it into memory of its own and acknowledges, and only then may the sender free it:

    [manifest length] -> manifest (with the shared buffer) -> receiver: [ack] -> [checksums]

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
import math
from collections.abc import Callable, Sequence
from pathlib import Path

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


class _Shared(msgspec.Struct):
    """A sender's buffer on the GPU both ends share: what the receiver's torch needs to map it
    (``UntypedStorage._share_cuda_``'s fields but the device, which each side numbers its own
    way)."""

    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class _Manifest(msgspec.Struct):
    header: bytes
    parts: list[tuple[str, list[int]]]  # (dtype name, shape) per part
    checksum: bool
    chunk_bytes: int  # the sender's: the receiver posts exactly the messages it sends
    shared: _Shared | None = None  # the parts in one buffer on the GPU both ends share


def gpu_identity(device: torch.device | None) -> str:
    """Which physical GPU ``device`` is, across processes ("" for none): the machine's boot id
    and the GPU's UUID (each process may number its GPUs differently)."""
    if device is None or device.type != "cuda":
        return ""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""  # not Linux: no way to tell two processes' GPUs apart, so no sharing
    return f"{boot}/{torch.cuda.get_device_properties(device).uuid}"


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """A position-weighted sum of a tensor's bytes (int64, on its device): a part that was not
    sent, or came back in another order, changes it."""
    data = tensor.contiguous().view(torch.uint8).flatten().to(torch.int64)
    weights = torch.arange(1, data.numel() + 1, device=data.device, dtype=torch.int64) % 251
    return (data * (weights + 1)).sum()


def _packed(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The parts' bytes back to back in one uint8 tensor on ``device``."""
    flat = [p.to(device).view(torch.uint8).flatten() for p in parts]
    return torch.cat(flat) if flat else torch.zeros(0, dtype=torch.uint8, device=device)


def _unpacked(
    data: torch.Tensor, layout: list[tuple[torch.dtype, list[int]]]
) -> list[torch.Tensor]:
    """``_packed``'s inverse: each part a view of ``data`` where its offset suits its dtype,
    else a copy."""
    parts, offset = [], 0
    for dtype, shape in layout:
        size = math.prod(shape) * dtype.itemsize
        piece = data[offset : offset + size]
        if offset % dtype.itemsize:
            piece = piece.clone()
        parts.append(piece.view(dtype).view(shape))
        offset += size
    return parts


def _share(buffer: torch.Tensor) -> _Shared:
    """``buffer`` (a whole CUDA allocation of torch's) named for another process on its GPU;
    its event is recorded on the current stream, after whatever wrote the buffer."""
    (_, handle, size, offset, counter, counter_offset, event, sync) = (
        buffer.untyped_storage()._share_cuda_()
    )
    return _Shared(handle, size, offset, counter, counter_offset, event, sync)


def _drop_receivers_reference(shared: _Shared, gpu: torch.device, reason: str) -> None:
    """A transfer through IPC failed before the receiver's ack. The receiver holds a reference
    to the buffer (torch counts it in a shared-memory file and the receiver decrements it when
    it lets go of its mapping); a receiver that went away ("peer": its process died, and its
    mapping with it) never will, so drop the reference for it, else the buffer is never freed.
    A receiver that stalled ("timeout") may still be copying: its reference stays, and the
    buffer is freed when it lets go (or when this process exits)."""
    if reason != "peer":
        logger.warning("a stalled receiver still maps %d bytes of ours", shared.storage_size)
        return
    counter = Path("/dev/shm") / shared.ref_counter_handle.decode().lstrip("/")
    try:
        with counter.open("rb") as f:
            f.seek(8 * shared.ref_counter_offset)
            count = int.from_bytes(f.read(8), "little", signed=True)
    except OSError:
        logger.warning("cannot read the shared buffer's reference count", exc_info=True)
        return
    if count > 0:  # (0: it let go before it died, its ack lost)
        torch.UntypedStorage._release_ipc_counter(
            shared.ref_counter_handle, shared.ref_counter_offset, device=gpu
        )


class PairTransport:
    """One end of a pair's process group. ``device``: where parts travel (CPU for gloo).
    ``shared_gpu``: the CUDA device both ends share (CUDA parts then move through IPC), or
    None."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        device: torch.device,
        chunk_bytes: int = 64 << 20,
        shared_gpu: torch.device | None = None,
    ) -> None:
        self.group = group
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.shared_gpu = shared_gpu
        self.on_chunk: Callable[[int], None] | None = None  # test hook (see the module)
        self.on_shared: Callable[[], None] | None = None  # test hook: after a shared manifest
        self._copy_stream: torch.cuda.Stream | None = None  # receiving through IPC

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
        ipc_device: torch.device | None = None,
    ) -> PairTransport:
        """Join the pair at ``address:port`` (rank 0 listens there). Blocks until both ends are
        in, or raises TransferError after ``timeout_s``."""
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(address, port, 2, is_master=rank == 0, timeout=timeout)
        except (RuntimeError, ValueError) as error:
            message = f"cannot join the pair at {address}:{port}: {error}"
            raise TransferError(message, "join") from error
        kwargs = {"device": device, "chunk_bytes": chunk_bytes, "ipc_device": ipc_device}
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
        ipc_device: torch.device | None = None,
    ) -> PairTransport:
        """Join the pair named ``key`` on ``store`` (the other end joins with the same key and
        the other rank). Blocks until both are in, or raises TransferError after ``timeout_s``.
        Every operation of the pair then fails after ``timeout_s`` without progress.
        ``ipc_device``: this end's CUDA device, offered for CUDA IPC; the pair uses it when the
        other end offers the same GPU."""
        device = device or torch.device("cpu")
        if ipc_device is not None and ipc_device.index is None:  # "cuda": the current one
            ipc_device = torch.device("cuda", torch.cuda.current_device())
        timeout = datetime.timedelta(seconds=timeout_s)
        if key:
            store = dist.PrefixStore(f"pair/{key}", store)
        try:
            if device.type == "cuda":
                group: dist.ProcessGroup = dist.ProcessGroupNCCL(store, rank, 2)
            else:
                group = dist.ProcessGroupGloo(store, rank, 2, timeout)
            # Each end says which GPU it offers (after the group: both ends are in by then).
            store.set(f"gpu/{rank}", gpu_identity(ipc_device))
            peer_gpu = store.get(f"gpu/{1 - rank}").decode()
        except (RuntimeError, ValueError) as error:
            raise TransferError(f"cannot join pair {key!r}: {error}", "join") from error
        same = peer_gpu != "" and peer_gpu == gpu_identity(ipc_device)
        return cls(group, rank, device, chunk_bytes, ipc_device if same else None)

    def send(
        self,
        transfer_id: int,
        header: bytes,
        tensors: Sequence[torch.Tensor],
        *,
        checksum_parts: bool = False,
    ) -> str:
        """Send one transfer; returns its path: "ipc" (through the GPU both ends share) or
        "host" (its bytes over the group)."""
        parts = [t.contiguous() for t in tensors]
        layout = [(str(t.dtype).removeprefix("torch."), list(t.shape)) for t in parts]
        chunk = self.chunk_bytes
        gpu = self.shared_gpu
        on_gpu = gpu is not None and bool(parts) and all(p.device == gpu for p in parts)
        shared, acked = None, False
        try:
            buffer = _packed(parts, gpu if on_gpu else self.device)
            shared = _share(buffer) if on_gpu else None
            manifest = msgspec.msgpack.encode(
                _Manifest(header, layout, checksum_parts, chunk, shared)
            )
            data = torch.frombuffer(bytearray(manifest), dtype=torch.uint8).to(self.device)
            self._send(torch.tensor([len(manifest)], device=self.device), transfer_id)
            self._send(data, transfer_id)
            if shared is None:
                for i, start in enumerate(range(0, buffer.numel(), chunk)):
                    self._send(buffer[start : start + chunk], transfer_id)
                    if self.on_chunk is not None:
                        self.on_chunk(i)
            else:  # the buffer is ours again once the receiver has copied it
                if self.on_shared is not None:
                    self.on_shared()
                self._recv(torch.zeros(1, dtype=torch.int64, device=self.device), transfer_id)
                acked = True
            if checksum_parts:
                sums = torch.stack([checksum(p) for p in parts]) if parts else torch.zeros(0)
                self._send(sums.to(torch.int64).to(self.device), transfer_id)
        except RuntimeError as error:
            failure = error if isinstance(error, TransferError) else None
            failure = failure or _failure(f"transfer {transfer_id}: sending failed", error)
            if shared is not None and not acked:
                _drop_receivers_reference(shared, gpu, failure.reason)
            if failure is error:
                raise
            raise failure from error
        finally:
            if on_gpu:
                buffer = None
                torch.cuda.ipc_collect()  # frees what the receiver has let go of
        return "host" if shared is None else "ipc"

    def recv(self, transfer_id: int) -> tuple[bytes, list[torch.Tensor]]:
        try:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._recv(length, transfer_id)
            data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
            self._recv(data, transfer_id)
            manifest = msgspec.msgpack.decode(data.cpu().numpy().tobytes(), type=_Manifest)
            layout = [(getattr(torch, name), shape) for name, shape in manifest.parts]
            num_bytes = sum(math.prod(shape) * dtype.itemsize for dtype, shape in layout)
            if manifest.shared is None:
                data = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
                chunk = manifest.chunk_bytes
                for start in range(0, data.numel(), chunk):
                    self._recv(data[start : start + chunk], transfer_id)
            else:
                data = self._copy_shared(manifest.shared, num_bytes)
                self._send(torch.ones(1, dtype=torch.int64, device=self.device), transfer_id)
            parts = _unpacked(data, layout)
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

    def _copy_shared(self, shared: _Shared, num_bytes: int) -> torch.Tensor:
        """The sender's buffer, mapped from its process and copied into memory of our own (on
        the GPU both share); the mapping is let go before this returns. The copy runs on a
        stream of its own, not queued behind this process's steps on the default stream."""
        if self.shared_gpu is None:
            raise TransferError("the peer shared a GPU buffer with an end that shares none")
        gpu = self.shared_gpu
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(gpu)
        with torch.cuda.stream(self._copy_stream):
            storage = torch.UntypedStorage._new_shared_cuda(
                gpu.index,
                shared.handle,
                shared.storage_size,
                shared.storage_offset,
                shared.ref_counter_handle,
                shared.ref_counter_offset,
                shared.event_handle,
                shared.event_sync_required,
            )  # the copy stream waits for the sender's packing (its event)
            try:
                mapped = torch.empty(0, dtype=torch.uint8, device=gpu).set_(storage)
                data = mapped[:num_bytes].clone()
                self._copy_stream.synchronize()  # copied before the sender may free it
            finally:
                mapped = storage = None  # let go of the mapping (before the ack, or on failure)
        # The caller's steps use it on the default stream: its memory waits for them when freed.
        data.record_stream(torch.cuda.default_stream(gpu))
        return data

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
