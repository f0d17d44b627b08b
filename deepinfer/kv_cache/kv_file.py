"""The self-describing file that holds one payload of the disk KV tier.

One file per (kind, key), all integers little-endian:

    offset
    0      +-------------------------------+
           | magic        8 B  "DIKVTIER"  |  no magic: a foreign file, never deleted
    8      | version      u16              |  other version: kept (another build may own it)
    10     | header_len   u32              |  = offset of tensor 0's data, a multiple of 64
    14     | salt_len u16 | salt           |  model/weights/cache-format fingerprint;
           | kind_len u8  | kind (ascii)   |    other salt: a foreign model's file, kept
           | key_len  u8  | key            |  kind and key must match the file's path
           | num_tensors  u32              |
           | per tensor:                   |
           |   dtype_len u8 | dtype name   |  "bfloat16", "float32", "int64", ...
           |   ndim u8 | shape ndim x u64  |
           |   nbytes u64                  |  = numel * itemsize
           | zero padding to 64            |
    header_len +-------------------------------+
           | tensor 0 raw bytes            |  the tensor's memory, contiguous, as is
           | zero padding to 64            |  (every tensor starts 64-aligned: zero-copy views)
           | tensor 1 raw bytes ...        |
           +-------------------------------+
           | crc32        u32              |  zlib.crc32 of every byte before it
           +-------------------------------+

A file with our magic that fails the checksum, does not parse, has the wrong length, or names
another kind/key than its path is broken (``BrokenFile``) and the reader removes it. A file without
the magic, of another version or of another salt is foreign (``ForeignFile``) and is left alone.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

import numpy as np
import torch

MAGIC = b"DIKVTIER"
VERSION = 1
ALIGN = 64

_PRELUDE = struct.Struct("<8sHI")  # magic, version, header_len
_U8, _U16, _U32, _U64 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<Q"))


class KVFileError(Exception):
    """A file that cannot be read as the asked-for payload; ``remove`` says whether it is ours."""

    remove = False


class ForeignFile(KVFileError):
    """No magic, another format version or another salt: someone else's file, left in place."""


class BrokenFile(KVFileError):
    """Our magic and version but corrupt, truncated or misplaced: removed by the reader."""

    remove = True


def _pad(n: int) -> int:
    return -n % ALIGN


def _raw(t: torch.Tensor) -> np.ndarray:
    """[numel * itemsize] uint8 host view of a tensor's data, for any dtype (bf16, fp8 included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def encode_header(salt: bytes, kind: str, key: bytes, payload: list[torch.Tensor]) -> bytes:
    """Everything before tensor 0's data, padding included."""
    kind_b = kind.encode("ascii")
    parts = [_U16.pack(len(salt)), salt, _U8.pack(len(kind_b)), kind_b, _U8.pack(len(key)), key]
    parts.append(_U32.pack(len(payload)))
    for t in payload:
        name = str(t.dtype).removeprefix("torch.").encode("ascii")
        parts += [_U8.pack(len(name)), name, _U8.pack(t.dim())]
        parts += [_U64.pack(d) for d in t.shape]
        parts.append(_U64.pack(t.numel() * t.element_size()))
    body = b"".join(parts)
    header_len = _PRELUDE.size + len(body)
    header_len += _pad(header_len)
    prelude = _PRELUDE.pack(MAGIC, VERSION, header_len)
    return (prelude + body).ljust(header_len, b"\0")


def encode_chunks(
    salt: bytes, kind: str, key: bytes, payload: list[torch.Tensor]
) -> Iterator[bytes | np.ndarray]:
    """The file as a sequence of buffers (header, data, padding, crc), so a writer streams it
    without joining the tensors into one bytes object. Tensors on a device are copied to host."""
    header = encode_header(salt, kind, key, payload)
    crc = zlib.crc32(header)
    yield header
    pos = len(header)
    for t in payload:
        if pad := b"\0" * _pad(pos):
            crc = zlib.crc32(pad, crc)
            yield pad
        data = _raw(t)
        crc = zlib.crc32(data, crc)
        yield data
        pos += len(pad) + data.nbytes
    yield _U32.pack(crc)


class _Reader:
    """Bounds-checked cursor over the header; any overrun is a ``BrokenFile``."""

    def __init__(self, buf: memoryview, pos: int, end: int) -> None:
        self.buf, self.pos, self.end = buf, pos, end

    def take(self, n: int) -> bytes:
        if self.pos + n > self.end:
            raise BrokenFile(f"header overruns its declared length at byte {self.pos}")
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return out

    def unpack(self, s: struct.Struct) -> int:
        return s.unpack(self.take(s.size))[0]


def decode(buf: bytearray, *, salt: bytes, kind: str, key: bytes) -> list[torch.Tensor]:
    """Parse and verify a whole file read into ``buf``; raise ``ForeignFile`` or ``BrokenFile``.

    The returned CPU tensors are zero-copy views into ``buf`` (which they keep alive), with the
    dtypes and shapes recorded in the header.
    """
    view = memoryview(buf)
    if len(buf) < _PRELUDE.size:
        if len(buf) and MAGIC.startswith(bytes(view[: len(MAGIC)])):
            raise BrokenFile(f"truncated to {len(buf)} bytes")
        raise ForeignFile("no DeepInfer KV magic")
    magic, version, header_len = _PRELUDE.unpack_from(view)
    if magic != MAGIC:
        raise ForeignFile("no DeepInfer KV magic")
    if version != VERSION:
        raise ForeignFile(f"format version {version}, this build reads {VERSION}")
    if len(buf) < header_len + _U32.size:
        raise BrokenFile(f"truncated: {len(buf)} bytes, header alone declares {header_len}")
    (stored_crc,) = _U32.unpack_from(view, len(buf) - _U32.size)
    if zlib.crc32(view[: len(buf) - _U32.size]) != stored_crc:
        raise BrokenFile("checksum mismatch (corrupt or truncated)")

    r = _Reader(view, _PRELUDE.size, header_len)
    file_salt = r.take(r.unpack(_U16))
    file_kind = r.take(r.unpack(_U8))
    file_key = r.take(r.unpack(_U8))
    if file_salt != salt:
        raise ForeignFile(f"salt {file_salt.hex()[:16]}.. is not ours ({salt.hex()[:16]}..)")
    if file_kind != kind.encode("ascii") or file_key != key:
        raise BrokenFile(f"holds {file_kind!r}/{file_key.hex()[:16]}.., not its path's entry")

    specs = []
    for _ in range(r.unpack(_U32)):
        name = r.take(r.unpack(_U8)).decode("ascii", errors="replace")
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise BrokenFile(f"unknown dtype {name!r}")
        shape = tuple(r.unpack(_U64) for _ in range(r.unpack(_U8)))
        nbytes = r.unpack(_U64)
        numel = 1
        for d in shape:
            numel *= d
        if numel * dtype.itemsize != nbytes:
            raise BrokenFile(f"{name}{list(shape)} declares {nbytes} bytes")
        specs.append((dtype, shape, nbytes))

    payload, pos = [], header_len
    for dtype, shape, nbytes in specs:
        pos += _pad(pos)
        if pos + nbytes > len(buf) - _U32.size:
            raise BrokenFile("tensor data runs past the end of the file")
        if nbytes:
            raw = torch.frombuffer(buf, dtype=torch.uint8, offset=pos, count=nbytes)
            payload.append(raw.view(dtype).reshape(shape))
        else:
            payload.append(torch.empty(shape, dtype=dtype))
        pos += nbytes
    if pos != len(buf) - _U32.size:
        raise BrokenFile(f"{len(buf) - _U32.size - pos} stray bytes after the last tensor")
    return payload
