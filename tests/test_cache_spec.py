"""One cache spec drives sizing, allocation and payloads (deepinfer/kv_cache/spec.py): what the
spec says a cache takes is what the pools allocate, for the built-in model and for V4-Flash
shapes on the meta device; the payloads list the same parts; a request's whole state moves
between slots at any position; and the rollback margin changes no result."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.kv_cache.pool import KVCache
from deepinfer.kv_cache.spec import CacheSpec, RowFormat
from deepinfer.model.batch import ForwardBatch, SeqSpan
from deepinfer.model.deepseek_v4.args import ModelArgs
from deepinfer.model.deepseek_v4.cache import kv_fp8_format
from deepinfer.model.deepseek_v4.tiny import TINY_CONFIG
from deepinfer.model.families import load_family
from deepinfer.ops import reference_kernels

FAMILY = load_family("deepseek_v4")
# DeepSeek's FP8 entry of 584 B: 448 e4m3 values, 64 bf16 rope values, the scales in the row.
FP8_ENTRY = RowFormat("fp8_e4m3_with_scales", 584)


def _v4_flash_args() -> ModelArgs:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "v4_flash.py"
    spec = importlib.util.spec_from_file_location("v4_flash_shapes", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return ModelArgs.from_dict({**module.V4_FLASH, "num_hidden_layers": 43})


def _spec(args: ModelArgs, **kw: object) -> CacheSpec:
    from deepinfer.model.deepseek_v4.cache import cache_spec

    return cache_spec(args, block_size=128, ring_margin=16, **kw)  # type: ignore[arg-type]


def _assert_sized_as_allocated(spec: CacheSpec, dtype: torch.dtype, device: str) -> KVCache:
    counts = {"num_blocks": 7, "num_slots": 3, "num_snapshots": 5}
    kv = KVCache(spec, **counts, dtype=dtype, device=torch.device(device))
    assert kv.nbytes == spec.total_bytes(dtype, **counts)
    for kind, per in (("paged", spec.bytes_per_block), ("state", spec.bytes_per_slot)):
        tensors = [kv[p.key] for p in spec.parts if p.kind == kind]
        assert sum(t[0].numel() * t.element_size() for t in tensors) == per(dtype)
    assert kv.bytes_per_snapshot == spec.bytes_per_snapshot(dtype)
    return kv


@pytest.mark.parametrize("max_draft", [0, 3])
def test_the_built_in_model_allocates_what_its_spec_sizes(max_draft: int) -> None:
    args = ModelArgs.from_dict(TINY_CONFIG)
    spec = _spec(args, max_draft=max_draft)
    kv = _assert_sized_as_allocated(spec, torch.float32, "cpu")
    # The payloads enumerate the same parts: a block's, a slot's, a snapshot's.
    nbytes = [sum(t.numel() * t.element_size() for t in p) for p in (
        kv.block_payload(2), kv.slot_payload(1), kv.snapshot_payload(4))]  # fmt: skip
    assert nbytes == [
        spec.bytes_per_block(torch.float32),
        spec.bytes_per_slot(torch.float32),
        spec.bytes_per_snapshot(torch.float32),
    ]
    buffers = [p for p in spec.state if p.key[1].endswith("buf_kv")]
    assert buffers and all(p.rows == args.compress_ratio(p.key[0]) - 1 + max_draft for p in buffers)


@pytest.mark.parametrize("kv_format", [None, FP8_ENTRY])
def test_v4_flash_shapes_on_the_meta_device(kv_format: RowFormat | None) -> None:
    args = _v4_flash_args()
    spec = _spec(args, kv_format=kv_format)
    kv = _assert_sized_as_allocated(spec, torch.bfloat16, "meta")
    csa = args.layer_types.index("compressed_sparse_attention")
    ring = (4, args.sliding_window + 16)
    if kv_format is None:
        assert (
            kv[csa, "entries"].shape == (8, 32, 512) and kv[csa, "entries"].dtype == torch.bfloat16
        )
        assert kv[csa, "ring"].shape == (*ring, 512)
    else:
        assert kv[csa, "entries"].shape == (8, 32, 584) and kv[csa, "entries"].dtype == torch.uint8
        assert kv[csa, "ring"].shape == (*ring, 584) and kv[csa, "ring"].dtype == torch.uint8
        assert FP8_ENTRY.nbytes == kv_fp8_format(args).nbytes


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    args = ModelArgs.from_dict(TINY_CONFIG)
    cpu = torch.device("cpu")
    weights = FAMILY.random_weights(args, 0, cpu, torch.float32, fp8_block=None)
    with torch.device("meta"):
        model = FAMILY.build_model(args, reference_kernels())
    model.load_state_dict(weights, strict=True, assign=True)
    model.init_rope(cpu)
    return model.eval()


def _reference_kernels():
    from deepinfer.ops import reference_kernels

    return reference_kernels()


def _step(
    model: torch.nn.Module, kv: KVCache, tokens: list[int], start: int, slot: int, blocks: list[int]
) -> torch.Tensor:
    n = len(tokens)
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens),
        positions=torch.arange(start, start + n),
        seqs=[SeqSpan(0, n, start, slot, blocks)],
        logits_indices=torch.tensor([n - 1]),
    )
    return model(batch, kv)[0]


def _decode(
    model: torch.nn.Module, kv: KVCache, logits: torch.Tensor, start: int, slot: int,
    blocks: list[int], steps: int,
) -> list[torch.Tensor]:  # fmt: skip
    out = []
    for i in range(steps):
        logits = _step(model, kv, [int(logits.argmax())], start + i, slot, blocks)
        out.append(logits)
    return out


def _cache(model: torch.nn.Module, max_draft: int = 0) -> KVCache:
    spec = FAMILY.cache_spec(model.args, block_size=16, ring_margin=4, max_draft=max_draft)
    return KVCache(spec, num_blocks=8, num_slots=2, dtype=torch.float32, device=torch.device("cpu"))


PROMPT = [(7 * i + 3) % 1000 for i in range(13)]  # ends inside a window of every ratio


def test_a_whole_state_moves_between_slots_mid_window(tiny_model: torch.nn.Module) -> None:
    kv = _cache(tiny_model)
    logits = _step(tiny_model, kv, PROMPT, 0, 0, [0, 1])
    # Copy slot 0 (rings, open-window buffers, overlap state) and its blocks elsewhere.
    kv.write_slot(1, kv.slot_payload(0))
    for src, dst in ((0, 2), (1, 3)):
        kv.write_block(dst, kv.block_payload(src))
    end = len(PROMPT)
    moved = _decode(tiny_model, kv, logits, end, 1, [2, 3], steps=4)
    kept = _decode(tiny_model, kv, logits, end, 0, [0, 1], steps=4)
    assert all(torch.equal(a, b) for a, b in zip(moved, kept, strict=True))
    # Without the open-window buffers the continuation differs: they are part of the state.
    for part in kv.spec.state:
        if "buf" in part.key[1]:
            kv[part.key][1].zero_()
    kept = _decode(tiny_model, kv, kept[-1], end + 4, 0, [0, 1], steps=3)
    emptied = _decode(tiny_model, kv, moved[-1], end + 4, 1, [2, 3], steps=3)
    assert not torch.equal(kept[-1], emptied[-1])


def test_the_rollback_margin_changes_no_logit(tiny_model: torch.nn.Module) -> None:
    runs = []
    for max_draft in (0, 3):
        kv = _cache(tiny_model, max_draft)
        logits = _step(tiny_model, kv, PROMPT, 0, 0, [0, 1])
        runs.append([logits, *_decode(tiny_model, kv, logits, len(PROMPT), 0, [0, 1], steps=4)])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
