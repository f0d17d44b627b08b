"""KV cache pools: the device tensors of a family's cache spec (spec.py), and their payloads.

    CacheSpec (the family) -> KVCache: one tensor per part
        paged part  [num_blocks + 1, rows, row]   block b of every request's block table
        state part  [num_slots + 1, rows, row]    slot s of a running request
        snapshots   [num_snapshots, rows, row]    per snapshot part: a block boundary's state

Payloads (what the tiers store, and what a hand-off moves) list a block's, a snapshot's or a
slot's rows of every part concerned, in the spec's order. A slot's payload holds every state
part (rings, open-window buffers, overlap state), so a request's whole state can be moved at
any position; a snapshot's only the parts a block boundary needs.

A slot needs no reset between requests: a request starting at position 0 reads none of its
state before writing it (the family's step plans guarantee it).
"""

from __future__ import annotations

import logging

import torch

from deepinfer.kv_cache.spec import CachePart, CacheSpec, PartKey

logger = logging.getLogger(__name__)


class KVCache:
    """Producer: the model runner allocates it once. Consumers: the model family's layers
    (``cache[layer, name]``) and the tiers (the payload methods). Indexing inputs are host ints.
    """

    def __init__(
        self,
        spec: CacheSpec,
        *,
        num_blocks: int,
        num_slots: int,
        num_snapshots: int = 0,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.block_size = spec.block_size
        self.dtype = dtype
        self.device = device
        count = {"paged": num_blocks + 1, "state": num_slots + 1}
        self.tensors: dict[PartKey, torch.Tensor] = {
            p.key: self._zeros(p, count[p.kind]) for p in spec.parts
        }
        self._snapshot_pool = [self._zeros(p, num_snapshots) for p in spec.snapshot]

    # One block and one slot past the scheduler's, never allocated to a request: padded requests
    # of a graphed decode step and the writes it discards land there.
    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def scratch_slot(self) -> int:
        return self.num_slots

    def __getitem__(self, key: PartKey) -> torch.Tensor:
        return self.tensors[key]

    @property
    def bytes_per_snapshot(self) -> int:
        return self.spec.bytes_per_snapshot(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes allocated: every part and the snapshot pool."""
        tensors = [*self.tensors.values(), *self._snapshot_pool]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _parts(self, parts: tuple[CachePart, ...]) -> list[torch.Tensor]:
        return [self.tensors[p.key] for p in parts]

    def save_snapshot(self, slot: int, snapshot_id: int) -> None:
        for part, pool in zip(self._parts(self.spec.snapshot), self._snapshot_pool, strict=True):
            pool[snapshot_id].copy_(part[slot])

    def restore_snapshot(self, snapshot_id: int, slot: int) -> None:
        for part, pool in zip(self._parts(self.spec.snapshot), self._snapshot_pool, strict=True):
            part[slot].copy_(pool[snapshot_id])

    def block_payload(self, block_id: int) -> list[torch.Tensor]:
        """One block's rows of every paged part (copies), in the spec's order."""
        return [pool[block_id].clone() for pool in self._parts(self.spec.paged)]

    def write_block(self, block_id: int, payload: list[torch.Tensor]) -> None:
        _write(self._parts(self.spec.paged), block_id, payload, "block")

    def blocks_payload(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Those blocks' rows of every paged part, one tensor a part ``[len(block_ids), *row]``
        (copies; one gather a part, so that many blocks cost no more calls than one)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return [_bytes(pool).index_select(0, index).view(pool.dtype) for pool in self._paged()]

    def write_blocks(self, block_ids: list[int], payload: list[torch.Tensor]) -> None:
        """``blocks_payload``'s inverse: each part's rows into those blocks."""
        pools = self._paged()
        assert len(payload) == len(pools), f"{len(payload)} paged parts != {len(pools)}"
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for pool, rows in zip(pools, payload, strict=True):
            _bytes(pool).index_copy_(0, index, _bytes(rows.to(self.device)))

    def _paged(self) -> list[torch.Tensor]:
        return self._parts(self.spec.paged)

    def snapshot_payload(self, snapshot_id: int) -> list[torch.Tensor]:
        return [pool[snapshot_id].clone() for pool in self._snapshot_pool]

    def restore_slot_from_payload(self, slot: int, payload: list[torch.Tensor]) -> None:
        """A snapshot payload into a slot's snapshot parts."""
        _write(self._parts(self.spec.snapshot), slot, payload, "snapshot")

    def slot_payload(self, slot: int) -> list[torch.Tensor]:
        """A slot's rows of every state part (copies): a request's whole state at any position."""
        return [part[slot].clone() for part in self._parts(self.spec.state)]

    def write_slot(self, slot: int, payload: list[torch.Tensor]) -> None:
        _write(self._parts(self.spec.state), slot, payload, "slot")

    def clear_slot(self, slot: int) -> None:
        """Zero a slot before a replay that starts from an empty state."""
        for part in self._parts(self.spec.state):
            part[slot].zero_()

    def _zeros(self, part: CachePart, count: int) -> torch.Tensor:
        shape = (count, *part.row_shape())
        return torch.zeros(shape, dtype=part.tensor_dtype(self.dtype), device=self.device)

    def log_sizes(self) -> None:
        spec, dtype = self.spec, self.dtype
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f KiB/block, %.1f B/token), %d state slots "
            "(%.1f KiB/slot), %d snapshots (%.1f KiB/snapshot = %.2f blocks), total %.1f MiB",
            self.num_blocks,
            self.block_size,
            spec.bytes_per_block(dtype) / 1024,
            spec.bytes_per_token(dtype),
            self.num_slots,
            spec.bytes_per_slot(dtype) / 1024,
            self.num_snapshots,
            self.bytes_per_snapshot / 1024,
            self.bytes_per_snapshot / max(spec.bytes_per_block(dtype), 1),
            self.nbytes / 2**20,
        )


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as uint8 (its last dimension times its element size): every dtype's
    gather and scatter run as uint8's (fp8 has no index_copy_ of its own on every device)."""
    return tensor.view(torch.uint8)


def _write(parts: list[torch.Tensor], index: int, payload: list[torch.Tensor], kind: str) -> None:
    assert len(payload) == len(parts), f"{kind} payload of {len(payload)} != {len(parts)} parts"
    for part, rows in zip(parts, payload, strict=True):
        part[index].copy_(rows)
