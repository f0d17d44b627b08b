"""Checkpoint loading: a Hugging Face-style folder -> our state dict (names from ``weights.py``).

Data flow, one shard at a time (safetensors ``safe_open``, memory-mapped on the CPU):

    read tensor (+ its block scale, possibly from another shard) -> move to ``device``
      -> dequantize FP8 / FP4 to fp32 -> map the name -> check dtype kind and shape
      -> cast to ``dtype`` -> place: copy | one slot of a stacked expert tensor | split gate_up

Everything comes back dequantized, except with ``keep_fp8``: then the FP8 e4m3 weights of the
linears that ``Fp8Linear`` can run (``weights.is_fp8_linear``) stay e4m3, next to their block
scales in fp32 (``layers.0.attn.wq_a.scale``); and with ``keep_fp4``: FP4 routed experts stay
packed, stacked as uint8 [E, N, K/2] next to their ue8m0 scale bytes [E, N, K/32]
(``layers.0.ffn.experts.w1_scales``), the layout ``ops.moe.Mxfp4Weight`` reads.
``mtp.*`` tensors are skipped unless the model serves its MTP layers. With ``experts`` (expert
parallelism: the routed experts one rank holds) only those experts' tensors are read: other
experts' per-expert tensors are skipped unread, stacked ones are read as a slice of rows.

One file of ~410 lines: reading, dequantizing and placing a tensor are one pass over the shards,
with the checks that name the offending tensor.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from deepinfer.model.deepseek_v4.args import ModelArgs
from deepinfer.model.deepseek_v4.weights import (
    TensorTarget,
    expected_shapes,
    find_scales,
    fp8_scale_name,
    is_fp8_linear,
    is_fp32_param,
    is_integer_param,
    is_stacked_experts,
    map_checkpoint_name,
    mxfp4_scale_name,
    skips_unserved_mtp,
)
from deepinfer.ops.linear.torch_ref import FP8_BLOCK, dequantize_fp8, scale_to_float
from deepinfer.ops.moe.torch_ref import MXFP4_BLOCK, dequantize_mxfp4

logger = logging.getLogger(__name__)

_FP4_X2 = getattr(torch, "float4_e2m1fn_x2", torch.int8)
_FP4_DTYPES = (torch.int8, torch.uint8, _FP4_X2)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Dtypes that only ever hold quantized weights (uint8 is not listed: it also holds ue8m0 scales).
_QUANTIZED_DTYPES = (*_FP8_DTYPES, torch.int8, _FP4_X2)


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: missing, unexpected or mis-shaped tensors."""


def _same_block(name: str, block: tuple[int, int]) -> tuple[int, int]:
    return block


def _skips_nothing(name: str, args: Any) -> bool:
    return False


@dataclass(frozen=True)
class WeightNaming:
    """What the loader knows of a family's parameters (``weights.py``'s functions, DeepSeek-V4's
    by default): the expected table, the name map, and the name rules that decide dtypes and
    what stays quantized."""

    expected_shapes: Callable[[Any, int | None], dict[str, tuple[int, ...]]] = expected_shapes
    map_name: Callable[[str], TensorTarget | None] = map_checkpoint_name
    is_fp8_linear: Callable[[str], bool] = is_fp8_linear
    is_fp32_param: Callable[[str], bool] = is_fp32_param
    is_integer_param: Callable[[str], bool] = is_integer_param
    is_stacked_experts: Callable[[str], bool] = is_stacked_experts
    # The FP8 block of one weight (our name, the config's block): DeepSeek-V4.1's engram tables
    # are scaled per row and 32 columns.
    fp8_block_of: Callable[[str, tuple[int, int]], tuple[int, int]] = _same_block
    # Checkpoint tensors the model does not hold (read as ignored, not as unexpected).
    skip: Callable[[str, Any], bool] = _skips_nothing


V4_NAMING = WeightNaming(skip=skips_unserved_mtp)


def load_model_args(folder: str | Path) -> ModelArgs:
    """The architecture from ``folder/config.json``."""
    return ModelArgs.from_file(Path(folder) / "config.json")


def load_checkpoint(
    folder: str | Path,
    args: ModelArgs,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    show_progress: bool = True,
    keep_fp8: bool = False,
    keep_fp4: bool = False,
    experts: range | None = None,
    naming: WeightNaming = V4_NAMING,
    only: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Read ``model.safetensors`` or the shards of ``model.safetensors.index.json``.

    Returns our names -> tensors on ``device``: floating ones in ``dtype`` (FP8 / FP4 weights
    dequantized) except the few kept in fp32 (``is_fp32_param``), ``tid2eid`` in int64. Shapes
    are ``expected_shapes(args)``. ``keep_fp8``: a float8_e4m3fn weight of an ``is_fp8_linear``
    name stays float8_e4m3fn, followed by its block scales [ceil(N/bn), ceil(K/bk)] fp32 under
    ``fp8_scale_name`` (bn, bk: ``fp8_block(args)``). ``keep_fp4``: FP4 routed experts stay
    packed (module docstring), their scales under ``mxfp4_scale_name``. ``experts``: the
    routed experts to hold (None: all), stacked in that order from slot 0. ``naming``: the
    family's parameters (DeepSeek-V4's by default). ``only``: of our names, those to read
    (None: all; e.g. an encoder node's vision tower). Raises ``CheckpointError`` on a missing,
    unexpected, duplicated or mis-shaped tensor.
    """
    experts = experts if experts is not None else range(args.num_experts)
    folder = Path(folder)
    t0 = time.perf_counter()
    files = _tensor_files(folder)
    scales = find_scales(files)
    scale_names = set(scales.values())
    by_file: dict[Path, list[str]] = {}
    for key in sorted(files):
        if key not in scale_names:
            by_file.setdefault(files[key], []).append(key)
    logger.info(
        "loading %s: %d tensors (%d block-quantized) in %d file(s)",
        folder,
        len(files) - len(scale_names),
        len(scales),
        len(by_file),
    )
    block = fp8_block(args)
    expected = naming.expected_shapes(args, len(experts))
    if only is not None:
        expected = {name: shape for name, shape in expected.items() if only(name)}
    state = _StateBuilder(expected, device, dtype, experts.start, naming)
    num_ignored = num_kept = num_elsewhere = 0
    with ExitStack() as stack:
        reader = _ShardReader(files, stack)
        progress = tqdm(
            total=sum(map(len, by_file.values())),
            desc="Loading weights",
            unit="tensor",
            disable=not show_progress,
        )
        with progress:
            for keys in by_file.values():
                for key in keys:
                    progress.update()
                    target = None if naming.skip(key, args) else naming.map_name(key)
                    if target is None or (only is not None and not only(target.names[0])):
                        num_ignored += 1
                        continue
                    if target.kind == "expert" and _held_elsewhere(target, experts, args):
                        num_elsewhere += 1
                        continue
                    rows = experts if _is_stacked(target, naming) else None
                    tensor = reader.get(key, rows).to(device)
                    if key in scales:
                        scale = reader.get(scales[key], rows).to(device)
                        if keep_fp8 and _stays_fp8(target, tensor, naming):
                            state.place_fp8(key, target.names[0], tensor, scale, block)
                            num_kept += 1
                            continue
                        if keep_fp4 and _stays_fp4(target, tensor, naming):
                            state.place_mxfp4(key, target, tensor, scale)
                            num_kept += 1
                            continue
                        tensor = _dequantize(
                            key, tensor, scale, naming.fp8_block_of(target.names[0], block)
                        )
                    elif tensor.dtype in _QUANTIZED_DTYPES:
                        raise CheckpointError(
                            f"tensor {key!r} is {tensor.dtype} but the checkpoint has no scale "
                            f"for it ({key.removesuffix('.weight')}.scale or {key}_scale_inv)"
                        )
                    state.place(key, target, tensor)
    out = state.finish(folder)
    num_bytes = sum(t.numel() * t.element_size() for t in out.values())
    logger.info(
        "loaded %d tensors (%.3f GiB, %s on %s) from %s in %.2f s; dequantized %d, kept FP8 %d, "
        "ignored %d, other ranks' experts %d",
        len(out),
        num_bytes / 2**30,
        dtype,
        device,
        folder,
        time.perf_counter() - t0,
        len(scales) - num_kept,
        num_kept,
        num_ignored,
        num_elsewhere,
    )
    return out


def _held_elsewhere(target: TensorTarget, experts: range, args: ModelArgs) -> bool:
    """A per-expert tensor of a (valid) expert another rank holds."""
    return target.expert not in experts and 0 <= target.expert < args.num_experts


def _is_stacked(target: TensorTarget, naming: WeightNaming) -> bool:
    """transformers' stacked experts ([E, ...] in one tensor): read only this rank's rows."""
    return target.kind == "gate_up" or (
        target.kind == "copy" and naming.is_stacked_experts(target.names[0])
    )


def _dequantize(
    key: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    try:
        if weight.dtype in _FP8_DTYPES:
            return dequantize_fp8(weight, scale, block)
        if weight.dtype in _FP4_DTYPES:
            return dequantize_mxfp4(weight, scale)
    except ValueError as e:
        raise CheckpointError(f"tensor {key!r}: {e}") from e
    raise CheckpointError(f"tensor {key!r} has a block scale but dtype {weight.dtype}")


def fp8_block(args: ModelArgs) -> tuple[int, int]:
    """(bn, bk): rows and columns of a weight that share one FP8 scale (config.json's
    ``quantization_config.weight_block_size``; 128 x 128 without one)."""
    block = (args.quantization or {}).get("weight_block_size") or FP8_BLOCK
    return int(block[0]), int(block[1])


def _stays_fp8(target: TensorTarget, tensor: torch.Tensor, naming: WeightNaming) -> bool:
    return (
        target.kind == "copy"
        and tensor.dtype == torch.float8_e4m3fn
        and naming.is_fp8_linear(target.names[0])
    )


def _stays_fp4(target: TensorTarget, tensor: torch.Tensor, naming: WeightNaming) -> bool:
    return tensor.dtype in _FP4_DTYPES and (
        target.kind in ("expert", "gate_up") or naming.is_stacked_experts(target.names[0])
    )


def _scale_bytes(key: str, scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales as their raw biased-exponent bytes (uint8); fp32 scales must be powers of
    two."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scale.view(torch.uint8)
    mantissa, exponent = torch.frexp(scale.float())
    if not (mantissa == 0.5).all() or not ((exponent >= -126) & (exponent <= 128)).all():
        raise CheckpointError(
            f"tensor {key!r}: its scale is not a power of two within ue8m0's range; FP4 "
            "experts stay packed (model.fp4_experts) only with ue8m0 scales"
        )
    return (exponent + 126).to(torch.uint8)


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = {key: folder / name for key, name in weight_map.items()}
        absent = sorted({str(p) for p in files.values() if not p.exists()})
        if absent:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {absent}")
        return files
    single = folder / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {folder}")
    with safe_open(single, framework="pt", device="cpu") as f:
        return dict.fromkeys(f.keys(), single)


class _ShardReader:
    """Safetensors files opened on first use; a weight and its scale may sit in different shards."""

    def __init__(self, files: dict[str, Path], stack: ExitStack) -> None:
        self.files = files
        self.stack = stack
        self.handles: dict[Path, Any] = {}

    def get(self, key: str, rows: range | None = None) -> torch.Tensor:
        """The tensor, or only its first-dimension ``rows`` (read as a slice)."""
        path = self.files[key]
        if path not in self.handles:
            handle = safe_open(path, framework="pt", device="cpu")
            self.handles[path] = self.stack.enter_context(handle)
        try:
            if rows is not None:
                return self.handles[path].get_slice(key)[rows.start : rows.stop]
            return self.handles[path].get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for absent keys
            raise CheckpointError(f"cannot read tensor {key!r} from {path}: {e}") from e


class _StateBuilder:
    """Collects checkpoint tensors into our state dict, checking each against the expected table."""

    def __init__(
        self,
        expected: dict[str, tuple[int, ...]],
        device: str | torch.device,
        dtype: torch.dtype,
        first_expert: int = 0,
        naming: WeightNaming = V4_NAMING,
    ) -> None:
        self.expected = expected
        self.naming = naming
        self.device = device
        self.dtype = dtype
        self.first_expert = first_expert  # the checkpoint's number of stacked slot 0
        self.out: dict[str, torch.Tensor] = {}
        self.source: dict[str, str] = {}
        self.filled: dict[str, set[int]] = {}  # stacked expert tensor -> expert slots written
        self.fp8_scales: dict[str, torch.Tensor] = {}  # FP8 weight kept -> its fp32 block scales
        self.mxfp4_scales: dict[str, torch.Tensor] = {}  # packed experts -> their scale bytes

    def place(self, key: str, target: TensorTarget, tensor: torch.Tensor) -> None:
        if target.kind == "copy":
            name = target.names[0]
            self._check(key, name, tensor, self._expected(key, name))
            self._claim(key, name)
            self.out[name] = self._cast(key, name, tensor)
        elif target.kind == "expert":
            name = target.names[0]
            shape = self._expected(key, name)
            self._check(key, name, tensor, shape[1:])
            slot = self._expert_slot(key, name, target.expert)
            self._stacked(key, name, shape)[slot] = self._cast(key, name, tensor)
        else:
            w1, w3 = target.names
            e, i, d = self._expected(key, w1)
            self._check(key, f"{w1} + {w3}", tensor, (e, 2 * i, d))
            for name, part in ((w1, tensor[:, :i]), (w3, tensor[:, i:])):
                self._claim(key, name)
                self.out[name] = self._cast(key, name, part).contiguous()

    def place_fp8(
        self,
        key: str,
        name: str,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block: tuple[int, int],
    ) -> None:
        """An FP8 weight kept as it is, with its block scales as fp32."""
        self._check(key, name, weight, self._expected(key, name))
        (n, k), (bn, bk) = weight.shape, block
        grid = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) != grid:
            raise CheckpointError(
                f"tensor {key!r}: scale shape {tuple(scale.shape)} does not match weight shape "
                f"{(n, k)} with {bn}x{bk} blocks (expected {grid})"
            )
        self._claim(key, name)
        self.out[name] = weight
        self.fp8_scales[name] = scale_to_float(scale)

    def place_mxfp4(
        self, key: str, target: TensorTarget, packed: torch.Tensor, scale: torch.Tensor
    ) -> None:
        """FP4 routed experts kept packed: one expert's [N, K/2] into its slot, or a stacked
        [E, N, K/2] (transformers' gate_up rows split into w1 and w3), with the scale bytes."""
        packed, scale = packed.view(torch.uint8), _scale_bytes(key, scale)
        if target.kind == "expert":
            name = target.names[0]
            slot = self._expert_slot(key, name, target.expert)
            dest, dest_scale = self._stacked_mxfp4(key, name)
            self._check(key, name, packed, dest.shape[1:])
            self._check(key, mxfp4_scale_name(name), scale, dest_scale.shape[1:])
            dest[slot], dest_scale[slot] = packed, scale
            return
        parts = [(target.names[0], packed, scale)]
        if target.kind == "gate_up":
            i = self._expected(key, target.names[0])[1]
            parts = [
                (n, packed[:, r], scale[:, r])
                for n, r in zip(target.names, (slice(0, i), slice(i, None)), strict=True)
            ]
        for name, part, part_scale in parts:
            e, n, k = self._expected(key, name)
            self._check(key, name, part, (e, n, k // 2))
            self._check(key, mxfp4_scale_name(name), part_scale, (e, n, -(-k // MXFP4_BLOCK)))
            self._claim(key, name)
            self.out[name] = part.contiguous()
            self.mxfp4_scales[name] = part_scale.contiguous()

    def finish(self, folder: Path) -> dict[str, torch.Tensor]:
        missing = [n for n in self.expected if n not in self.out and n not in self.filled]
        for name, slots in self.filled.items():
            base, proj = name.rsplit(".", 1)
            missing += [
                f"{base}.{e + self.first_expert}.{proj}.weight"
                for e in range(self.expected[name][0])
                if e not in slots
            ]
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" * (len(missing) > 8))
            raise CheckpointError(f"checkpoint {folder} is missing tensor(s): {shown}")
        out = {}
        for name in self.expected:
            out[name] = self.out[name]
            if name in self.fp8_scales:
                out[fp8_scale_name(name)] = self.fp8_scales[name]
            if name in self.mxfp4_scales:
                out[mxfp4_scale_name(name)] = self.mxfp4_scales[name]
        return out

    def _expected(self, key: str, name: str) -> tuple[int, ...]:
        shape = self.expected.get(name)
        if shape is None:
            raise CheckpointError(f"unexpected tensor {key!r} (our name {name!r}) in checkpoint")
        return shape

    def _check(self, key: str, name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {key!r} (our name {name!r}) has shape {tuple(tensor.shape)}, "
                f"expected {tuple(shape)}"
            )

    def _claim(self, key: str, name: str) -> None:
        if name in self.source or name in self.filled:
            raise CheckpointError(
                f"tensor {name!r} is given twice: by {self.source[name]!r} and {key!r}"
            )
        self.source[name] = key

    def _cast(self, key: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.naming.is_integer_param(name):
            if tensor.is_floating_point() or tensor.is_complex():
                raise CheckpointError(
                    f"tensor {key!r} must be an integer tensor, got {tensor.dtype}"
                )
            return tensor.to(torch.int64)
        if not tensor.is_floating_point():
            raise CheckpointError(f"tensor {key!r} must be floating point, got {tensor.dtype}")
        return tensor.to(torch.float32 if self.naming.is_fp32_param(name) else self.dtype)

    def _expert_slot(self, key: str, name: str, expert: int) -> int:
        """The stacked slot of one expert's tensor, claimed (each expert is given once)."""
        num_slots = self._expected(key, name)[0]
        slot = expert - self.first_expert
        if not 0 <= slot < num_slots:
            raise CheckpointError(
                f"unexpected tensor {key!r}: expert {expert} but the model holds "
                f"experts {self.first_expert}..{self.first_expert + num_slots - 1}"
            )
        slots = self.filled.setdefault(name, set())
        if slot in slots or name in self.source:
            raise CheckpointError(f"tensor {name!r} expert {expert} is given twice")
        slots.add(slot)
        return slot

    def _stacked(self, key: str, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name in self.mxfp4_scales:
            raise CheckpointError(
                f"tensor {key!r} is not FP4 but other experts of {name!r} are: the experts of "
                "a layer are either all packed FP4 or none"
            )
        if name not in self.out:
            self.out[name] = torch.empty(shape, dtype=self.dtype, device=self.device)
        return self.out[name]

    def _stacked_mxfp4(self, key: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        e, n, k = self._expected(key, name)
        if name in self.out and name not in self.mxfp4_scales:
            raise CheckpointError(
                f"tensor {key!r} is FP4 but other experts of {name!r} are not: the experts of "
                "a layer are either all packed FP4 or none"
            )
        if name not in self.out:
            self.out[name] = torch.empty(e, n, k // 2, dtype=torch.uint8, device=self.device)
            self.mxfp4_scales[name] = torch.empty(
                e, n, -(-k // MXFP4_BLOCK), dtype=torch.uint8, device=self.device
            )
        return self.out[name], self.mxfp4_scales[name]
