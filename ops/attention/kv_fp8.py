"""DeepSeek-V4's FP8 KV rows, the layout FlashMLA's sparse kernels read: the cache's packed parts.

A KV row of head_dim channels is ``[nope | rope]``: the NoPE channels are stored as e4m3 with a
power-of-two (ue8m0) scale per tile of up to 64 channels, the RoPE channels stay bf16. For
V4-Flash (head_dim 512, rope 64) a row is 584 bytes instead of 1,024::

    data, 576 bytes:   448 x e4m3 (NoPE 0..447), then 64 x bf16 little-endian (RoPE 448..511)
    scales, 8 bytes:   7 x ue8m0, tile i = NoPE 64i..64i+63 scaled by 2^(byte - 127), then 0

    a block (or slot) of r rows, r * 584 bytes:  | data 0 | ... | data r-1 | scales 0 | ... |

which is FlashMLA's V4 layout (ops/attention/flashmla.py) with the block stride r * 584. A tile's
scale is 2^ceil(log2(max(amax / 448, 1e-4))), so its largest value maps to at most 448. Packing
rounds the row to bf16 first; unpacking gives exactly the values a kernel computes with (an e4m3
value times a power of two is exact in bf16), so attention over packed rows equals attention over
``unpack(pack(kv))``.

``Fp8Rows`` is a packed cache part as the attention ops take a key source: ``gather`` rows by
flat index (block * r + row, as for a dense part flattened), ``store`` rows at flat indices.
Producer: the model (``kv_rows`` on a packed part, deepseek_v4/cache.py). Consumers: the
attention backends and the model's cache writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # the largest finite e4m3
MIN_SCALE = 1e-4  # a tile's scale is at least 2^ceil(log2(1e-4)) = 2^-13
MAX_TILE = 64  # NoPE channels per scale (fewer when the NoPE part is narrower)
SCALE_ALIGN = 8  # scale bytes a row, rounded up to this
_UE8M0_BIAS = 127


@dataclass(frozen=True)
class Fp8Layout:
    """The byte layout of one row for ``head_dim`` channels of which ``rope_dim`` RoPE."""

    head_dim: int
    rope_dim: int

    def __post_init__(self) -> None:
        assert 0 <= self.rope_dim < self.head_dim, f"rope {self.rope_dim} of {self.head_dim}"
        assert self.nope_dim % self.tile == 0, f"NoPE {self.nope_dim} in tiles of {self.tile}"

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def tile(self) -> int:
        return min(MAX_TILE, self.nope_dim)

    @property
    def num_tiles(self) -> int:
        return self.nope_dim // self.tile

    @property
    def data_bytes(self) -> int:
        return self.nope_dim + 2 * self.rope_dim

    @property
    def scale_bytes(self) -> int:
        return -(-self.num_tiles // SCALE_ALIGN) * SCALE_ALIGN

    @property
    def row_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes

    @property
    def name(self) -> str:
        """What the cache spec calls these rows (its salt names them)."""
        return f"fp8_e4m3_ue8m0x{self.tile}_bf16rope{self.rope_dim}_hd{self.head_dim}"

    def pack(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [M, head_dim] (any float dtype) -> (data [M, data_bytes], scales [M,
        scale_bytes]) uint8."""
        rows = values.shape[0]
        assert values.shape == (rows, self.head_dim), f"rows {tuple(values.shape)}"
        v = values.to(torch.bfloat16)
        nope = v[:, : self.nope_dim].float().view(rows, self.num_tiles, self.tile)
        scale = (nope.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # [M, tiles]
        mantissa, exponent = torch.frexp(scale)
        exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # ceil(log2): exact
        scaled = nope / torch.exp2(exponent.float()).unsqueeze(-1)  # exact: powers of two
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8).view(rows, self.nope_dim)
        rope = v[:, self.nope_dim :].contiguous().view(torch.uint8)  # [M, 2 rope] little-endian
        data = torch.cat([codes, rope], dim=1)
        scales = torch.zeros(rows, self.scale_bytes, dtype=torch.uint8, device=values.device)
        scales[:, : self.num_tiles] = (exponent + _UE8M0_BIAS).to(torch.uint8)
        return data, scales

    def unpack(self, data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """(data [..., data_bytes], scales [..., scale_bytes]) uint8 -> rows [..., head_dim]
        bf16, the exact values a kernel computes with."""
        lead = data.shape[:-1]
        exponent = scales[..., : self.num_tiles].int() - _UE8M0_BIAS
        codes = data[..., : self.nope_dim].contiguous().view(torch.float8_e4m3fn).float()
        nope = (
            codes.view(*lead, self.num_tiles, self.tile) * torch.exp2(exponent.float())[..., None]
        )
        rope = data[..., self.nope_dim :].contiguous().view(torch.bfloat16)
        return torch.cat([nope.flatten(-2).to(torch.bfloat16), rope], dim=-1)

    def roundtrip(self, values: torch.Tensor) -> torch.Tensor:
        """``unpack(pack(values))`` in values' dtype: what a packed cache gives back."""
        return self.unpack(*self.pack(values)).to(values.dtype)


@dataclass(frozen=True)
class Fp8Rows:
    """A packed cache part [groups, r, row_bytes] uint8 (groups: blocks or slots) seen as flat
    rows: row n = group n // r, row n % r, its data and scales where the module docstring lays
    them out."""

    layout: Fp8Layout
    data: torch.Tensor  # [groups, r, data_bytes] (a view of the part)
    scales: torch.Tensor  # [groups, r, scale_bytes] (a view of the part)

    @classmethod
    def of(cls, part: torch.Tensor, layout: Fp8Layout) -> Fp8Rows:
        groups, rows, row_bytes = part.shape
        assert part.dtype == torch.uint8 and row_bytes == layout.row_bytes, (
            f"part {tuple(part.shape)} {part.dtype} for {layout.row_bytes}-byte rows"
        )
        flat = part.view(groups, rows * row_bytes)
        data = flat[:, : rows * layout.data_bytes].view(groups, rows, layout.data_bytes)
        scales = flat[:, rows * layout.data_bytes :].view(groups, rows, layout.scale_bytes)
        return cls(layout, data, scales)

    @property
    def num_rows(self) -> int:
        return self.data.shape[0] * self.data.shape[1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    def _where(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.data.shape[1]
        index = index.long()
        return index // rows, index % rows

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """Rows at flat indices (any shape, each in [0, num_rows)) -> [..., head_dim] bf16."""
        group, row = self._where(index)
        return self.layout.unpack(self.data[group, row], self.scales[group, row])

    def store(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Pack ``values`` [M, head_dim] into the rows at flat indices ``index`` [M]."""
        group, row = self._where(index)
        data, scales = self.layout.pack(values)
        self.data[group, row] = data
        self.scales[group, row] = scales


KVSource = torch.Tensor | Fp8Rows  # a key source of sparse_attention: dense rows or packed


def store_rows(
    target: KVSource, index: torch.Tensor, values: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """``values`` [M, head_dim] (or, given ``rows`` [M], values[rows]) into the rows ``index``
    [M] of a dense [N, head_dim] tensor (cast to its dtype) or a packed part."""
    if rows is not None:
        values = values[rows]
    if isinstance(target, Fp8Rows):
        target.store(index, values)
    else:
        target[index] = values.to(target.dtype)


def gather_rows(source: KVSource, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a key source at valid indices ``index`` (any shape) -> [..., head_dim]: dense
    rows as stored, packed rows unpacked (exact) in ``dtype``."""
    if isinstance(source, Fp8Rows):
        return source.gather(index).to(dtype)
    return source[index]


def as_stored(target: KVSource, values: torch.Tensor) -> torch.Tensor:
    """What ``target`` would give back for ``values``: themselves for a dense tensor, the
    FP8 round trip for a packed part (so that a step's own keys are read as stored)."""
    if isinstance(target, Fp8Rows):
        return target.layout.roundtrip(values)
    return values
