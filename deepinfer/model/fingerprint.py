"""The fingerprint of a checkpoint folder (torch-free): what the prefix cache's salt names."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path


def checkpoint_fingerprint(folder: str | Path) -> bytes:
    """A digest naming these weights, cheap even for a 100+ GB checkpoint.

    Covers config.json, every safetensors file's header (names, dtypes, shapes, offsets) and the
    first and last MiB of its data. Used in the prefix cache's salt, so that cached KV is never
    reused across different weights.
    """
    folder = Path(folder)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            digest.update(path.name.encode() + f.read(header_len))
            data_start = 8 + header_len
            f.seek(data_start)
            digest.update(f.read(_FINGERPRINT_BYTES))
            f.seek(max(data_start, size - _FINGERPRINT_BYTES))
            digest.update(f.read(_FINGERPRINT_BYTES))
    return digest.digest()


_FINGERPRINT_BYTES = 1 << 20
