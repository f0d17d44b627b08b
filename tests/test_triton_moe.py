"""The Triton fused MoE against the torch reference, on the CPU through Triton's interpreter.

bf16 tl.dot is broken in the interpreter, so these cases run fp32 (the kernels' IEEE dot) at tiny
shapes. D = 80 and I = 48 are not multiples of the fp32 tiles (BLOCK_N 64, BLOCK_K 32), so the
masked K loops and the partial N tiles run too. tests/gpu/test_gpu_triton_moe.py covers bf16 and
the production shapes on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import subprocess
import sys

_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on numpy, on the CPU

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from triton_modules import contract_mismatches, interpreted  # noqa: E402

from deepinfer.ops.moe import MoEBackend, torch_ref  # noqa: E402

DIM, INTER, NUM_EXPERTS, LIMIT = 80, 48, 8, 1.5  # gate and up ~N(0, 1): the clamp bites


@pytest.fixture(scope="module")
def moe_triton() -> Iterator[ModuleType]:
    """The backend with interpreted kernels (the GPU tests may have imported it compiled)."""
    yield from interpreted("deepinfer.ops.moe.triton", _INTERPRET_BEFORE)


def _weights(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w1, w2, w3 scaled so that gate, up and the output are ~N(0, 1) for x ~ N(0, 1)."""
    w1 = torch.randn(NUM_EXPERTS, INTER, DIM, generator=gen) * DIM**-0.5
    w2 = torch.randn(NUM_EXPERTS, DIM, INTER, generator=gen) * INTER**-0.5
    w3 = torch.randn(NUM_EXPERTS, INTER, DIM, generator=gen) * DIM**-0.5
    return w1, w2, w3


def _routing(kind: str, num_tokens: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """topk_ids [T, k] int64 of one load pattern."""
    distinct = torch.rand(num_tokens, NUM_EXPERTS, generator=gen).argsort(-1)[:, :top_k]
    if kind == "random":
        return distinct
    if kind == "unused_experts":  # only experts 1, 4 and 6 receive pairs, 0 and 7 among the idle
        used = torch.tensor([1, 4, 6])
        return used[torch.rand(num_tokens, 3, generator=gen).argsort(-1)[:, :top_k]]
    if kind == "one_expert_every_token":  # expert 5 in some slot of every token: T pairs
        others = torch.tensor([e for e in range(NUM_EXPERTS) if e != 5])
        ids = others[torch.rand(num_tokens, NUM_EXPERTS - 1, generator=gen).argsort(-1)[:, :top_k]]
        slot = torch.randint(0, top_k, (num_tokens,), generator=gen)
        ids[torch.arange(num_tokens), slot] = 5
        return ids
    if kind == "repeated_expert":  # one token's expert in two of its slots: both terms count
        distinct[:, 1] = distinct[:, 0]
        return distinct
    raise AssertionError(f"unknown routing {kind!r}")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm()).item()


def test_align_by_expert_matches_the_module_picture(moe_triton: ModuleType) -> None:
    topk_ids = torch.tensor([[2, 0], [2, 3], [2, 0]])
    sorted_pair_ids, block_expert = moe_triton.align_by_expert(topk_ids, 4, 4)
    s = 6  # the sentinel: T * k
    assert sorted_pair_ids.tolist() == [1, 5, s, s, 0, 2, 4, s, 3, s, s, s, s, s, s, s]
    assert block_expert.tolist() == [0, 2, 3, -1]
    assert sorted_pair_ids.dtype == block_expert.dtype == torch.int32


def test_align_by_expert_decode_launches_only_blocks_with_work(moe_triton: ModuleType) -> None:
    # DeepSeek-V4-Flash decode: one token, k = 6 of E = 256, the bf16 decode tile.
    block_m = moe_triton.pick_tile_config(6, torch.bfloat16).block_m
    assert block_m == 16
    topk_ids = torch.tensor([[200, 3, 17, 255, 0, 64]])
    sorted_pair_ids, block_expert = moe_triton.align_by_expert(topk_ids, 256, block_m)
    assert block_expert.tolist() == [0, 3, 17, 64, 200, 255]
    assert sorted_pair_ids.view(6, block_m)[:, 0].tolist() == [4, 1, 2, 5, 0, 3]
    assert (sorted_pair_ids.view(6, block_m)[:, 1:] == 6).all()
    # Two tokens on the same six experts: the bound allows 12 blocks, six are used.
    _, block_expert = moe_triton.align_by_expert(topk_ids.repeat(2, 1), 256, block_m)
    assert block_expert.tolist() == [0, 3, 17, 64, 200, 255] + [-1] * 6


@pytest.mark.parametrize("kind", ["random", "unused_experts", "one_expert_every_token"])
def test_align_by_expert_groups_every_pair_once(moe_triton: ModuleType, kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, top_k, block_m = 37, 3, 16
    topk_ids = _routing(kind, num_tokens, top_k, gen)
    num_pairs = num_tokens * top_k
    sorted_pair_ids, block_expert = moe_triton.align_by_expert(topk_ids, NUM_EXPERTS, block_m)
    rows = sorted_pair_ids.view(-1, block_m).long()  # [num_blocks, BLOCK_M]
    is_pair = rows < num_pairs
    assert sorted(rows[is_pair].tolist()) == list(range(num_pairs))
    flat_ids = topk_ids.reshape(-1)
    for block, expert in enumerate(block_expert.tolist()):
        pairs = rows[block][is_pair[block]]
        if expert < 0:
            assert pairs.numel() == 0
            continue
        assert pairs.numel() > 0 and (flat_ids[pairs] == expert).all()
        assert pairs.tolist() == sorted(pairs.tolist())
    used = block_expert[block_expert >= 0]
    assert (used.diff() >= 0).all(), f"blocks not in expert order: {used.tolist()}"
    assert (block_expert[len(used) :] == -1).all()


# fp32 throughout: the interpreter's IEEE dot (numpy matmul per tile) and the reference's BLAS
# differ only in summation order (~3e-7 here); a wrong clamp or a lost pair is > 1e-2.
FP32_TOL = 1e-5

ROUTINGS = ["random", "unused_experts", "one_expert_every_token", "repeated_expert"]


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
@pytest.mark.parametrize("kind", ROUTINGS)
def test_fused_moe_matches_reference(moe_triton: ModuleType, kind: str, num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    top_k = 2 if num_tokens == 5 else 3
    x = torch.randn(num_tokens, DIM, generator=gen)
    w1, w2, w3 = _weights(gen)
    topk_ids = _routing(kind, num_tokens, top_k, gen)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    ref = torch_ref.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT)
    out = moe_triton.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert _rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("kind", ["random", "one_expert_every_token"])
def test_fused_moe_larger_m_blocks_and_grouped_tiles(
    moe_triton: ModuleType, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # A prefill-like tile: 32-row M blocks, several N tiles swept by groups of two M blocks,
    # K loops of several full tiles (D and I are multiples of 16).
    tile = moe_triton.TileConfig(32, 16, 16, 2, 4, 2)
    monkeypatch.setattr(moe_triton, "pick_tile_config", lambda *args: tile)
    gen = torch.Generator().manual_seed(7)
    num_tokens, top_k = 37, 3
    x = torch.randn(num_tokens, DIM, generator=gen)
    w1, w2, w3 = _weights(gen)
    topk_ids = _routing(kind, num_tokens, top_k, gen)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    ref = torch_ref.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT)
    out = moe_triton.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT)
    assert _rel_err(out, ref) < FP32_TOL


def test_backend_object_launches_with_its_tiles(
    moe_triton: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TritonMoEBackend keeps its tile override and launches by it, bitwise as the module's
    launcher given the same tiles; swiglu is the module's."""
    tile = moe_triton.TileConfig(32, 16, 16, 2, 4, 2)
    backend = moe_triton.TritonMoEBackend(torch.device("cpu"), config=tile)
    assert backend.config is tile and backend.swiglu is moe_triton.swiglu
    assert contract_mismatches(backend, MoEBackend) == []
    monkeypatch.setattr(
        moe_triton, "pick_tile_config", lambda *args: pytest.fail("the tile override was ignored")
    )
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(9, DIM, generator=gen)
    w1, w2, w3 = _weights(gen)
    topk_ids = _routing("random", 9, 2, gen)
    topk_weights = torch.rand(9, 2, generator=gen)
    out = backend.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT)
    same = moe_triton.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT, config=tile)
    ref = torch_ref.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT)
    assert torch.equal(out, same) and _rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("num_tokens", [0, 1, 5])
def test_swiglu_is_the_reference_on_one_gemms_column_blocks(
    moe_triton: ModuleType, monkeypatch: pytest.MonkeyPatch, num_tokens: int
) -> None:
    """The shared expert's activation: gate and up as the column blocks of one [T, 2I] GEMM
    output (row stride 2I), values on both sides of the clamps, I = 48 over blocks of 32 (a
    partial last block); fp32 within 1e-6 of torch_ref."""
    monkeypatch.setattr(moe_triton, "SWIGLU_BLOCK", 32)
    gen = torch.Generator().manual_seed(11 + num_tokens)
    inter = 48
    projected = 8 * torch.randn(num_tokens, 2 * inter, generator=gen)  # |v| > LIMIT often
    gate, up = projected.split(inter, dim=1)
    out = moe_triton.swiglu(gate, up, LIMIT)
    ref = torch_ref.swiglu(gate, up, LIMIT)
    assert out.shape == ref.shape == (num_tokens, inter) and out.dtype == ref.dtype
    if num_tokens:
        assert (gate > LIMIT).any() and (up.abs() > LIMIT).any()  # the clamps are exercised
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_token_output_does_not_depend_on_the_batch(moe_triton: ModuleType) -> None:
    """Alone or among 36 random tokens that share its experts' blocks: the same, to fp32
    rounding here. Bitwise on the GPU (tests/gpu/test_gpu_triton_moe.py): the interpreter runs
    each tile's tl.dot as a numpy matmul, whose BLAS may sum a row in another order depending
    on where it sits in the tile (edge rows take another micro-kernel on some CPUs).

    Holds for batches that pick the same tile configuration (both T * k here are in the first
    row of the table); across rows the tile shapes, and so the GEMM summation order, change.
    """
    gen = torch.Generator().manual_seed(3)
    num_tokens, top_k, position = 37, 3, 17
    x = torch.randn(num_tokens, DIM, generator=gen)
    w1, w2, w3 = _weights(gen)
    topk_ids = _routing("random", num_tokens, top_k, gen)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    assert moe_triton.pick_tile_config(top_k, torch.float32) == moe_triton.pick_tile_config(
        num_tokens * top_k, torch.float32
    )
    batched = moe_triton.fused_moe(x, w1, w2, w3, topk_ids, topk_weights, LIMIT)
    alone = moe_triton.fused_moe(
        x[position : position + 1],
        w1,
        w2,
        w3,
        topk_ids[position : position + 1],
        topk_weights[position : position + 1],
        LIMIT,
    )
    assert _rel_err(alone[0], batched[position]) < FP32_TOL


# MXFP4 experts: D and I whole scale groups (multiples of 32), not multiples of the 64-wide K
# tile below, so the masked K tail of the packed loads runs too.
FP4_DIM, FP4_INTER = 96, 160


@pytest.mark.parametrize(
    ("num_tokens", "tile"),
    [(1, None), (37, None), (37, (16, 64, 64, 1, 4, 2)), (37, (32, 32, 128, 2, 4, 2))],
)
def test_mxfp4_experts_are_the_dense_kernel_on_dequantized_weights(
    moe_triton: ModuleType, num_tokens: int, tile: tuple[int, ...] | None
) -> None:
    """Packed experts dequantized in registers, one scale group at a time: the dense kernel on
    ``dequantize_mxfp4``'s weights and the torch reference on the packed ones, to FP32_TOL
    (the values are exact; only the summation order differs)."""
    gen = torch.Generator().manual_seed(num_tokens)
    config = moe_triton.TileConfig(*tile) if tile else None
    top_k = 3
    x = torch.randn(num_tokens, FP4_DIM, generator=gen)
    dense = (
        torch.randn(NUM_EXPERTS, FP4_INTER, FP4_DIM, generator=gen) * FP4_DIM**-0.5,
        torch.randn(NUM_EXPERTS, FP4_DIM, FP4_INTER, generator=gen) * FP4_INTER**-0.5,
        torch.randn(NUM_EXPERTS, FP4_INTER, FP4_DIM, generator=gen) * FP4_DIM**-0.5,
    )
    packed = [torch_ref.quantize_mxfp4(w) for w in dense]
    dequantized = [w.dequantize() for w in packed]
    topk_ids = _routing("unused_experts", num_tokens, top_k, gen)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    out = moe_triton.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT, config=config)
    same = moe_triton.fused_moe(x, *dequantized, topk_ids, topk_weights, LIMIT, config=config)
    ref = torch_ref.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT)
    assert _rel_err(out, same) < FP32_TOL and _rel_err(out, ref) < FP32_TOL
    # The packed weights are not their dense source: the check above is not vacuous.
    assert _rel_err(torch_ref.fused_moe(x, *dense, topk_ids, topk_weights, LIMIT), ref) > 1e-2


def test_mxfp4_tiles_decode_up_to_4096_pairs_and_taller_ones_past_16384(
    moe_triton: ModuleType,
) -> None:
    def pick(num_pairs: int, dtype: torch.dtype, packed: bool = False) -> object:
        """The tiles, the bits upcast aside (on for every packed bf16 row) and Gluon's kernels
        (on for the packed decode row, the tile they take, where the table turns them on, with
        the engine's ring; off the GPU the prefill rows are the Triton kernels')."""
        config = moe_triton.pick_tile_config(num_pairs, dtype, packed)
        assert config.bits_upcast == (packed and dtype == torch.bfloat16), (num_pairs, dtype)
        decode_row = packed and dtype == torch.bfloat16 and num_pairs <= 4096
        assert config.gluon == (decode_row and moe_triton._MXFP4_GLUON), (num_pairs, dtype)
        assert config.ring == (moe_triton._MXFP4_GLUON_RING if config.gluon else 0)
        return dataclasses.replace(config, bits_upcast=False, gluon=False, ring=0)

    decode = pick(6, torch.bfloat16)
    assert pick(3072, torch.bfloat16, packed=True) == decode != pick(3072, torch.bfloat16)
    for num_pairs in (4097, 16384):
        assert pick(num_pairs, torch.bfloat16, packed=True) == pick(num_pairs, torch.bfloat16)
    prefill = pick(16385, torch.bfloat16, packed=True)
    assert (
        (prefill.block_m, prefill.block_n)
        == (128, 64)
        != (
            pick(16385, torch.bfloat16).block_m,
            pick(16385, torch.bfloat16).block_n,
        )
    )
    # fp32 (parity) runs keep their own small tiles whatever the row.
    assert pick(49152, torch.float32, packed=True).block_k == 32


def test_gluon_down_ring_falls_back_where_its_two_step_loop_does_not_fit() -> None:
    """From 64 pairs a block the down kernel's ring loop takes two K steps of 128 (it asserts
    I % 256 == 0 at compile time): an odd count of steps runs the register prefetch instead; the
    decode tile's one-step loop and the gate/up kernel keep the ring."""
    from deepinfer.ops.moe.gluon import down_ring

    assert down_ring(3, 128, 2048) == down_ring(3, 64, 256) == 3
    assert down_ring(3, 128, 384) == down_ring(4, 64, 128) == 0
    assert down_ring(3, 16, 384) == 3 and down_ring(0, 128, 384) == 0


def test_mxfp4_tiles_past_the_decode_row_are_gluons_on_hopper(
    moe_triton: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Hopper the packed bf16 rows past the decode row take gluon.py's prefill tiles (64
    pairs a block up to 16,384 pairs, then 128 x 128 on 8 warps), each one of gluon.TILES, with
    the engine's ring; the decode row keeps its tile; fp16, fp32 and dense weights keep the
    Triton rows."""
    from deepinfer.ops.moe import gluon as moe_gluon

    elsewhere = {
        n: moe_triton.pick_tile_config(n, torch.bfloat16, True) for n in (4097, 16384, 16385)
    }
    monkeypatch.setattr(moe_triton, "_on_hopper", lambda: True)
    for num_pairs, rows in ((4097, (64, 64)), (16384, (64, 64)), (16385, (128, 128))):
        config = moe_triton.pick_tile_config(num_pairs, torch.bfloat16, True)
        assert (config.block_m, config.block_n) == rows, num_pairs
        assert config.gluon and config.bits_upcast and config.ring == moe_triton._MXFP4_GLUON_RING
        assert moe_triton._tile(config) in moe_gluon.TILES
        assert config != elsewhere[num_pairs]
    decode = moe_triton.pick_tile_config(4096, torch.bfloat16, True)
    assert (decode.block_m, decode.gluon) == (16, True)
    for dtype, packed in ((torch.float16, True), (torch.float32, True), (torch.bfloat16, False)):
        assert not moe_triton.pick_tile_config(49152, dtype, packed).gluon


def _random_mxfp4(gen: torch.Generator, rows: int, cols: int) -> torch_ref.Mxfp4Weight:
    """Every code equally likely (all 16 e2m1 values in both nibbles) and scales 2**-7..2**-2."""
    packed = torch.randint(0, 256, (NUM_EXPERTS, rows, cols // 2), generator=gen).to(torch.uint8)
    scale = torch.randint(120, 126, (NUM_EXPERTS, rows, cols // 32), generator=gen).to(torch.uint8)
    return torch_ref.Mxfp4Weight(packed, scale)


def _random_experts(
    gen: torch.Generator, packed: bool = True
) -> list[torch_ref.Mxfp4Weight] | list[torch.Tensor]:
    """w1, w2, w3 of ``_random_mxfp4`` at FP4_DIM x FP4_INTER; dequantized unless ``packed``."""
    weights = [
        _random_mxfp4(gen, FP4_INTER, FP4_DIM),
        _random_mxfp4(gen, FP4_DIM, FP4_INTER),
        _random_mxfp4(gen, FP4_INTER, FP4_DIM),
    ]
    return weights if packed else [w.dequantize() for w in weights]


@pytest.mark.parametrize(
    ("num_tokens", "kind", "tiles"),
    [(1, "random", None), (5, "repeated_expert", None), (5, "random", (64, 64, 2, 64, 64, 2))],
)
def test_decode_gemv_is_the_reference_on_packed_and_dense_experts(
    moe_triton: ModuleType, num_tokens: int, kind: str, tiles: tuple[int, ...] | None
) -> None:
    """A program a pair (triton_gemv.py), the engine's pick at these sizes or the tiles given:
    packed experts against torch_ref on the same bytes, and the same kernels on the dense
    weights (the values dequantized) against it too, to FP32_TOL. The tiles given take several K
    steps (64 divides neither D = 96 nor I = 160, so steps of 32) and partial N tiles."""
    gen = torch.Generator().manual_seed(20 + num_tokens)
    top_k = 3
    assert isinstance(moe_triton.pick_tile_config(num_tokens * top_k, torch.float32, True),
                      moe_triton.GemvConfig)  # fmt: skip
    config = moe_triton.GemvConfig(*tiles) if tiles else None
    x = torch.randn(num_tokens, FP4_DIM, generator=gen)
    packed = _random_experts(gen)
    topk_ids = _routing(kind, num_tokens, top_k, gen)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    ref = torch_ref.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT)
    out = moe_triton.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT, config=config)
    assert _rel_err(out, ref) < FP32_TOL
    gemv = config or moe_triton.pick_tile_config(num_tokens * top_k, torch.float32, True)
    dense = [w.dequantize() for w in packed]
    out = moe_triton.fused_moe(x, *dense, topk_ids, topk_weights, LIMIT, config=gemv)
    assert _rel_err(out, ref) < FP32_TOL


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "dense"])
def test_decode_gemv_down_split_over_slots_is_the_loop_bitwise(
    moe_triton: ModuleType, packed: bool
) -> None:
    """Up to down_split_tokens tokens the down kernel takes a program per (token, slot) and the
    tile's last adds the rounded products in slot order: bitwise the one-program loop's sums,
    with partial N tiles. Each tile's counter is reset, so a second call (a graph replay) sums
    again alike. A counter left over moves which program adds: the slot-1 program sums (before
    slot 2's product is in) and resets, slot 2's ticket is left behind; the other tiles hold."""
    from deepinfer.ops.triton_tickets import ticket_counters

    gen = torch.Generator().manual_seed(31)
    num_tokens, top_k = 2, 3
    x = torch.randn(num_tokens, FP4_DIM, generator=gen)
    weights = _random_experts(gen, packed)
    topk_ids = _routing("repeated_expert", num_tokens, top_k, gen)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    loop = moe_triton.GemvConfig(64, 64, 2, 64, 64, 2)
    split = moe_triton.GemvConfig(64, 64, 2, 64, 64, 2, down_split_tokens=num_tokens)
    run = functools.partial(moe_triton.fused_moe, x, *weights, topk_ids, topk_weights, LIMIT)
    first = run(config=split)
    assert torch.equal(first, run(config=loop))
    counters = ticket_counters(x.device)
    assert not counters.any(), "a tile's counter was not reset"
    assert torch.equal(run(config=split), first)
    ref = torch_ref.fused_moe(x, *weights, topk_ids, topk_weights, LIMIT)
    assert _rel_err(first, ref) < FP32_TOL
    counters[0] = 1  # token 0's first D tile: its slot-1 program takes the last ticket
    stale = run(config=split)
    left = counters.clone()
    counters.zero_()
    assert left[0] == 1 and not left[1:].any()
    assert torch.equal(stale[0, 64:], first[0, 64:]) and torch.equal(stale[1], first[1])


def test_decode_gemv_gate_up_reads_x_in_nibble_major_order_alike(moe_triton: ModuleType) -> None:
    """gate_up on x laid out as h (nibble_major: input 32g + 8w + j at 32g + 4j + w) gives
    bitwise the h of x in input order: the same products, summed alike."""
    from deepinfer.ops.moe import triton_gemv

    gen = torch.Generator().manual_seed(32)
    x = torch.randn(2, FP4_DIM, generator=gen)
    w1, w3 = (_random_mxfp4(gen, FP4_INTER, FP4_DIM) for _ in range(2))
    operands = ((w1.packed, w1.scale), (w3.packed, w3.scale))
    topk_ids = _routing("random", 2, 3, gen)
    config = moe_triton.GemvConfig(64, 64, 2, 64, 64, 2)
    h = triton_gemv.gate_up(x, *operands, topk_ids, LIMIT, config)
    reordered = triton_gemv.nibble_major(x)
    assert torch.equal(reordered[:, 32 + 4 * 5 + 2], x[:, 32 + 8 * 2 + 5])  # g 1, w 2, j 5
    assert torch.equal(triton_gemv.reorder_nibble_major(x), reordered)  # the engine's launch
    h_reordered = triton_gemv.gate_up(
        reordered, *operands, topk_ids, LIMIT, config, x_nibble_major=True
    )
    assert torch.equal(h_reordered, h)


@pytest.mark.parametrize(
    "config",
    [None, "split", "grouped"],
    ids=["gemv", "gemv-split-slots", "grouped"],
)
def test_residual_joins_the_last_launch_as_an_add_would(
    moe_triton: ModuleType, config: str | None
) -> None:
    """fused_moe(..., residual=r) (the shared expert's output, added in the down kernel's or
    the combine's store) is bitwise fused_moe(...) + r, on each path; torch_ref's alike."""
    gen = torch.Generator().manual_seed(8)
    num_tokens, top_k = 5, 3
    x = torch.randn(num_tokens, FP4_DIM, generator=gen)
    packed = _random_experts(gen)
    topk_ids = _routing("repeated_expert", num_tokens, top_k, gen)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    residual = torch.randn(num_tokens, FP4_DIM, generator=gen)
    tiles = {
        None: moe_triton.GemvConfig(64, 64, 2, 64, 64, 2),
        "split": moe_triton.GemvConfig(64, 64, 2, 64, 64, 2, down_split_tokens=num_tokens),
        "grouped": moe_triton.pick_tile_config(4096, torch.float32, packed=True),
    }[config]
    run = functools.partial(moe_triton.fused_moe, x, *packed, topk_ids, topk_weights, LIMIT)
    assert torch.equal(run(config=tiles, residual=residual), run(config=tiles) + residual)
    ref = functools.partial(torch_ref.fused_moe, x, *packed, topk_ids, topk_weights, LIMIT)
    assert torch.equal(ref(residual=residual), ref() + residual)


def test_decode_gemv_token_output_is_bitwise_the_same_alone_or_batched(
    moe_triton: ModuleType,
) -> None:
    gen = torch.Generator().manual_seed(4)
    num_tokens, top_k, position = 7, 3, 4
    x = torch.randn(num_tokens, FP4_DIM, generator=gen)
    packed = _random_experts(gen)
    topk_ids = _routing("random", num_tokens, top_k, gen)
    topk_weights = torch.rand(num_tokens, top_k, generator=gen)
    batched = moe_triton.fused_moe(x, *packed, topk_ids, topk_weights, LIMIT)
    one = slice(position, position + 1)
    alone = moe_triton.fused_moe(x[one], *packed, topk_ids[one], topk_weights[one], LIMIT)
    assert torch.equal(alone[0], batched[position])


def _run_ptx(text: str, inputs: dict[str, int]) -> dict[str, int]:
    """The integer and bf16x2 PTX of ``MXFP4_BITS_ASM`` evaluated on the CPU: registers as
    Python ints (32 bits; outputs 16), mul.rn.bf16x2 as two bf16 products rounded by torch."""

    def bf16x2(a: int, b: int) -> int:
        halves = torch.tensor([a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16], dtype=torch.int32)
        x = halves.to(torch.int16).view(torch.bfloat16).float()  # 16-bit patterns as bf16
        p = (x[:2] * x[2:]).bfloat16().view(torch.int16).int() & 0xFFFF
        return int(p[0]) | int(p[1]) << 16

    ops = {
        "add.u32": lambda a, b: a + b,
        "mul.lo.u32": lambda a, b: a * b,
        "shl.b32": lambda a, b: a << b,
        "shr.b32": lambda a, b: a >> b,
        "and.b32": lambda a, b: a & b,
        "or.b32": lambda a, b: a | b,
        "mul.rn.bf16x2": bf16x2,
    }
    regs = dict(inputs)
    value = lambda name: regs[name] if name in regs else int(name, 0)  # noqa: E731
    for statement in text.replace("{", " ").replace("}", " ").split(";"):
        op, _, args = statement.strip().partition(" ")
        if not op or op == ".reg":
            continue
        if op == "mov.b32":  # mov.b32 $lo, $hi <- a 32-bit register, split
            lo, hi, src = (a.strip() for a in args.split(","))
            regs[lo], regs[hi] = regs[src] & 0xFFFF, regs[src] >> 16
            continue
        dst, a, b = (arg.strip() for arg in args.split(","))
        regs[dst] = ops[op](value(a), value(b)) & 0xFFFFFFFF
    return regs


def test_bits_upcast_ptx_gives_the_dequantized_values(moe_triton: ModuleType) -> None:
    """TileConfig.bits_upcast's PTX (``MXFP4_BITS_ASM``, which the interpreter cannot run),
    evaluated op by op: every code of every word, at each scale byte it is exact for (0 to 128),
    gives dequantize_mxfp4's value bit for bit. The GPU test adds what this cannot see: the
    hardware's bf16 multiply on subnormal inputs."""
    gen = torch.Generator().manual_seed(9)
    scales = torch.arange(129, dtype=torch.uint8).view(1, 129, 1)  # a row per scale byte
    packed = torch.randint(0, 256, (1, 129, 16), generator=gen, dtype=torch.uint8)
    # Words 0 and 1 of each row: codes 0..15 in order (two a byte, low nibble first).
    packed[0, :, :8] = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE])
    expected = torch_ref.dequantize_mxfp4(packed, scales)[0]  # [129, 32] fp32
    words = packed.view(torch.int32)[0]  # [129, 4]: code j of word w is input 8w + j
    text = sys.modules["deepinfer.ops.moe.mxfp4_bits"].MXFP4_BITS_ASM.value
    for s in range(129):
        for w in range(4):
            factor = (s + 126) * 0x00800080  # _mxfp4_bits's, once a scale group
            regs = _run_ptx(text, {"$8": int(words[s, w]) & 0xFFFFFFFF, "$9": factor})
            got = torch.tensor([regs[f"${j}"] for j in range(8)], dtype=torch.int32)
            values = got.to(torch.int16).view(torch.bfloat16).float()
            assert torch.equal(values, expected[s, 8 * w : 8 * w + 8]), (s, w, values)


def test_bits_pair_order_is_one_order_for_weights_and_activations(moe_triton: ModuleType) -> None:
    """The bits path's pair order, three ways: ``_in_pair_order`` (the upcast's eight codes of
    each word joined as the kernels multiply them; interpreted), the activations' reorder
    launch, and torch's ``pair_order`` all put input 8w + j at 8w + 2 (j % 4) + j // 4."""
    import triton
    import triton.language as tl

    gemv = sys.modules["deepinfer.ops.moe.triton_gemv"]

    @triton.jit
    def probe(out_ptr, ROWS: tl.constexpr, W: tl.constexpr):  # interpreted: module lookups work
        rows = tl.arange(0, ROWS)[:, None]
        base = (rows * W + tl.arange(0, W)[None, :]) * 8  # code j of word w: input 8w + j
        out = sys.modules["deepinfer.ops.moe.triton"]._in_pair_order(
            base, base + 1, base + 2, base + 3, base + 4, base + 5, base + 6, base + 7
        )
        tl.store(out_ptr + rows * 8 * W + tl.arange(0, 8 * W)[None, :], out)

    inputs = torch.arange(3 * 64).reshape(3, 64)
    joined = torch.empty(4, 64, dtype=torch.int32)
    probe[(1,)](joined, ROWS=4, W=8)
    expected = gemv.pair_order(torch.arange(4 * 64).reshape(4, 64))
    assert torch.equal(joined.long(), expected)
    assert expected[0, :8].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    x = inputs.float()
    assert torch.equal(gemv.reorder_pair_order(x), gemv.pair_order(x))
    i = torch.arange(64)
    positions = (i // 8) * 8 + (i % 4) * 2 + (i % 8) // 4
    assert torch.equal(gemv.pair_order(inputs)[:, positions], inputs)


def test_bits_upcast_only_on_weights_whose_scale_bytes_were_measured_in_range(
    moe_triton: ModuleType,
) -> None:
    """The bits upcast is exact up to scale byte 128: it runs only where Mxfp4Weight.max_scale
    was measured (quantize_mxfp4; the loader) and is at most that; dense and FP8 never."""
    gen = torch.Generator().manual_seed(3)
    weight = torch_ref.quantize_mxfp4(torch.randn(2, 8, 64, generator=gen))
    assert weight.max_scale == int(weight.scale.max()) <= moe_triton.BITS_MAX_SCALE
    exact = moe_triton._bits_exact
    assert exact(weight)
    assert not exact(dataclasses.replace(weight, max_scale=None))
    assert not exact(dataclasses.replace(weight, max_scale=moe_triton.BITS_MAX_SCALE + 1))
    assert not exact(weight.dequantize())


def test_mxfp4_decode_takes_a_program_a_pair_up_to_192_pairs(moe_triton: ModuleType) -> None:
    pick = moe_triton.pick_tile_config
    for dtype in (torch.bfloat16, torch.float32):
        assert isinstance(pick(192, dtype, packed=True), moe_triton.GemvConfig)
        assert isinstance(pick(193, dtype, packed=True), moe_triton.TileConfig)
        assert isinstance(pick(6, dtype), moe_triton.TileConfig)  # dense: the grouped GEMMs


@pytest.fixture(scope="module")
def router() -> Iterator[ModuleType]:
    yield from interpreted("deepinfer.ops.moe.triton_router", _INTERPRET_BEFORE)


@pytest.mark.parametrize("hashed", [False, True], ids=["top_k", "hash"])
@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 2), (256, 6), (12, 3)])
def test_router_is_the_reference(
    router: ModuleType, moe_triton: ModuleType, num_experts: int, top_k: int, hashed: bool
) -> None:
    """The one-launch router (``route``) against torch_ref's: the same experts (as a set: the
    order is the kernel's, highest first) and weights within 1e-6, for logits from -30 to 30
    (both softplus thresholds, 20 and -16) in bf16 and fp32, and the backend object's."""
    gen = torch.Generator().manual_seed(num_experts)
    num_tokens = 9
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 4
    logits[0, :3] = torch.tensor([-30.0, 25.0, -17.0])[: min(3, num_experts)]
    bias = torch.randn(num_experts, generator=gen) * 0.1
    hash_ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(-1)[:, :top_k]
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        args = (None, hash_ids) if hashed else (bias, None)
        weights, ids = router.route(x, *args, top_k, 2.5)
        ref_weights, ref_ids = torch_ref.route(x, *args, top_k, 2.5)
        order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
        assert ids.dtype == torch.int64 and weights.dtype == torch.float32
        assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
        torch.testing.assert_close(
            weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-6, atol=1e-7
        )
        if hashed:
            assert torch.equal(ids, hash_ids)  # a hash layer's ids in their own order
        else:  # the kernel's order: highest score + bias first
            biased = torch.nn.functional.softplus(x.float()).sqrt() + bias
            assert (biased.gather(1, ids).diff(dim=-1) <= 0).all()
    backend = moe_triton.TritonMoEBackend(torch.device("cpu"))
    args = (None, hash_ids) if hashed else (bias, None)
    weights, ids = backend.route(logits, *args, top_k, 1.0)
    ref_weights, ref_ids = torch_ref.route(logits, *args, top_k, 1.0)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)


def test_decode_kernels_compile_for_hopper_without_spilling() -> None:
    """scripts/sm90_compile.py builds decode's kernels (the MoE's gate/up and down a program
    a pair, the grouped MoE's Gluon kernels with and without a ring and at the prefill tile,
    hc_post with and without the next mix, hc_pre's collapse, the shared w2 with its SwiGLU at
    one row and on the swapped tiles at 8, 32 and 128 rows, a dense projection through the same
    GEMM, the queries' and keys' norm with the ring's store, the indexer's scores with its
    top-k, the pools with the entries' store and the keeps) for sm_90 with Triton's compiler
    and bundled ptxas, no GPU needed: each compiles (the interpreter accepts code the compiler
    rejects) and spills nothing."""
    import triton

    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    script = Path(__file__).parents[1] / "scripts" / "sm90_compile.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" registers, stack 0, local 0") == 21, result.stdout


def test_gluon_mma_order_puts_each_input_where_its_weight_lands(moe_triton: ModuleType) -> None:
    """gluon.py's activation order: thread t's word 4t + i, register j = jl + 2 jh, half b holds
    input 32 t + 8 i + 4 b + 2 jh + jl (code j + 4 b of word 4 t + i), which wgmma's A operand
    puts at K = 32 i + 16 jh + 8 jl + 2 t + b; mma_order must put that input there, in every
    128-input tile, and be a permutation; the engine's one-launch copy (``reorder_mma_order``)
    writes the same."""
    from deepinfer.ops.moe import gluon as moe_gluon

    x = torch.arange(2 * 512).reshape(2, 512)
    out = moe_gluon.mma_order(x)
    for t, i, b, jh, jl in itertools.product(range(4), range(4), range(2), range(2), range(2)):
        source = 32 * t + 8 * i + 4 * b + 2 * jh + jl
        position = 32 * i + 16 * jh + 8 * jl + 2 * t + b
        for tile in range(4):
            assert out[1, 128 * tile + position] == x[1, 128 * tile + source]
    assert torch.equal(out.sort(dim=1).values, x)
    gemv = sys.modules["deepinfer.ops.moe.triton_gemv"]  # the engine's launch, interpreted
    assert torch.equal(gemv.reorder_mma_order(x.float()), out.float())
