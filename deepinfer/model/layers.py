"""Small building blocks shared by the model's modules."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.ops.linear import LinearBackend, dequantize_fp8
from deepinfer.ops.norm import NormBackend, rope_cos_sin


class RMSNorm(nn.Module):
    """``norm``: the norm backend (deepinfer.ops.norm) whose ``rms_norm`` runs it."""

    def __init__(self, dim: int, eps: float, norm: NormBackend) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self._rms_norm = norm.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(x, self.weight, self.eps)

    @property
    def params(self) -> tuple[torch.Tensor, float]:
        """(weight, eps): for an op that applies this norm itself (``hc_pre``'s block_norm)."""
        return self.weight, self.eps


def step_rope(
    positions: torch.Tensor, inv_freqs: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A step's RoPE tables (``ForwardBatch.rope``): kind -> (cos, sin) of ``positions`` for each
    kind's inverse frequencies, and ``inverse(kind)`` -> (cos, -sin), the rotation back that
    attention applies to its output: one negation a step instead of one a layer. Every kind's
    table in one set of launches: column blocks of one [T, sum of halves] table (the same
    elementwise products as a table a kind)."""
    kinds = list(inv_freqs)
    widths = [inv_freqs[kind].shape[0] for kind in kinds]
    joined = torch.cat([inv_freqs[kind] for kind in kinds]) if len(kinds) > 1 else None
    cos, sin = rope_cos_sin(positions, inv_freqs[kinds[0]] if joined is None else joined)
    parts = (t.split(widths, dim=1) for t in (cos, sin, -sin))
    rope = {}
    for kind, c, s, negated in zip(kinds, *parts, strict=True):
        rope[kind], rope[inverse(kind)] = (c, s), (c, negated)
    return rope


def inverse(kind: str) -> str:
    """The ``step_rope`` key of a RoPE kind's inverse rotation."""
    return f"{kind}-inverse"


def linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)


class FusedLinears:
    """The linears among ``modules`` that read one input, one GEMM per kind.

    Plain linears (no bias) of one dtype join as one GEMM (``linear``'s ``dense_linear``, or
    F.linear without a backend); ``Fp8Linear``s of one block size and
    backend, each a whole number of block rows, as one FP8 GEMM (the input quantized once).
    Their weights (and block scales) become row blocks of one tensor: each module's are then
    views of it, so no memory is added, and ``outputs(x)`` maps each module to its column block
    of the GEMM's output. At decode a step's small projections are each a GEMM (plus a split-K
    reduction, or an activation quantization) of a few µs, far from the bytes they read; one
    GEMM over all of them reads the same bytes once. The rest run alone (``project``).
    """

    def __init__(self, modules: list[nn.Module], linear: LinearBackend | None = None) -> None:
        kinds: dict[tuple[object, ...], list[nn.Module]] = {}
        for module in modules:
            kind = _join_kind(module)
            if kind is not None:
                kinds.setdefault(kind, []).append(module)
        dense = F.linear if linear is None else linear.dense_linear
        self.groups = [_Joined(group, dense) for group in kinds.values() if len(group) > 1]
        self.modules: tuple[nn.Module, ...] = tuple(m for g in self.groups for m in g.modules)

    def outputs(self, x: torch.Tensor) -> dict[nn.Module, torch.Tensor]:
        """Each fused module's output for ``x`` (views of its GEMM's output); {} if none."""
        return {module: y for group in self.groups for module, y in group.outputs(x).items()}


def _join_kind(module: nn.Module) -> tuple[object, ...] | None:
    """What a linear must share with others to join their GEMM; None: it runs alone."""
    if type(module) is nn.Linear and module.bias is None:
        weight = module.weight
        return ("dense", weight.dtype, weight.device, module.in_features)
    if isinstance(module, Fp8Linear) and module.out_features % module.block[0] == 0:
        weight = module.weight
        return ("fp8", module.block, module._fp8_linear, weight.device, module.in_features)
    return None


class _Joined:
    """One group of ``FusedLinears``: its modules' weights (and FP8 block scales) as row
    blocks of one tensor, the modules' parameters views of it."""

    def __init__(
        self, modules: list[nn.Module], dense: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> None:
        self.modules = tuple(modules)
        self.dense = dense
        self.sizes = [m.out_features for m in self.modules]
        self.weight = self._join("weight")
        self.scale = self._join("scale") if isinstance(self.modules[0], Fp8Linear) else None

    def _join(self, name: str) -> torch.Tensor:
        joined = torch.cat([getattr(m, name).detach() for m in self.modules])
        rows = 0
        for module in self.modules:
            size = getattr(module, name).shape[0]
            setattr(module, name, nn.Parameter(joined[rows : rows + size], requires_grad=False))
            rows += size
        return joined

    def outputs(self, x: torch.Tensor) -> dict[nn.Module, torch.Tensor]:
        rows = x.reshape(-1, x.shape[-1])
        if self.scale is None:
            y = self.dense(rows, self.weight)
        else:
            first = self.modules[0]
            assert isinstance(first, Fp8Linear)
            y = first._fp8_linear(rows, self.weight, self.scale, first.block)
        y = y.view(*x.shape[:-1], self.weight.shape[0])
        return dict(zip(self.modules, y.split(self.sizes, dim=-1), strict=True))


def project(
    module: nn.Module, x: torch.Tensor, outputs: dict[nn.Module, torch.Tensor] | None
) -> torch.Tensor:
    """``module(x)``, or its block of a fused GEMM's output (``FusedLinears.outputs``)."""
    out = None if outputs is None else outputs.get(module)
    return module(x) if out is None else out


class Fp8Linear(nn.Module):
    """A linear layer without bias on a block-scaled FP8 weight, as the checkpoint stores it.

    ``weight`` [out, in] float8_e4m3fn, ``scale`` [ceil(out/bn), ceil(in/bk)] fp32 (the
    dequantization multiplier of each block; ``block`` = (bn, bk)); ``linear``: the linear
    backend (deepinfer.ops.linear) whose ``fp8_linear`` runs it. x [..., in] -> [..., out] in
    x's dtype.
    """

    def __init__(
        self, in_features: int, out_features: int, block: tuple[int, int], linear: LinearBackend
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        bn, bk = block
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), requires_grad=False
        )
        self.scale = nn.Parameter(
            torch.empty(-(-out_features // bn), -(-in_features // bk), dtype=torch.float32),
            requires_grad=False,
        )
        self._fp8_linear = linear.fp8_linear
        self._fp8_grouped_linear = linear.fp8_grouped_linear

    def forward(
        self, x: torch.Tensor, swiglu: tuple[torch.Tensor, float] | None = None
    ) -> torch.Tensor:
        """``swiglu`` (up, limit): of the SwiGLU of the gate x and up, which the backend
        computes where it quantizes its input (``LinearBackend.fp8_linear``)."""
        rows = x.reshape(-1, self.in_features)
        if swiglu is not None:
            up, limit = swiglu
            swiglu = (up.reshape(-1, self.in_features), limit)
        y = self._fp8_linear(rows, self.weight, self.scale, self.block, swiglu=swiglu)
        return y.view(*x.shape[:-1], self.out_features)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """The weight as G stacked row blocks, block g on x's g-th slice: x [T, G, in] ->
        [T, G, out / G] (the backend's ``fp8_grouped_linear``)."""
        return self._fp8_grouped_linear(x, self.weight, self.scale, self.block)


def grouped_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A block-diagonal linear: x [T, G, in] through ``module`` (weight [G * out, in], group g's
    rows g * out..) -> [T, G, out]. V4's grouped output projection (wo_a)."""
    if isinstance(module, Fp8Linear):
        return module.grouped(x)
    w = module.weight.view(x.shape[1], -1, x.shape[2])  # [G, out, in]
    return torch.einsum("tgi,goi->tgo", x, w)


def use_fp8_linears(
    model: nn.Module, state: dict[str, torch.Tensor], block: tuple[int, int], linear: LinearBackend
) -> int:
    """Replace each ``nn.Linear`` whose weight in ``state`` is float8_e4m3fn with an
    ``Fp8Linear`` of the same shape, so that ``model.load_state_dict(state)`` fits; returns how
    many. Call it where the model was built (e.g. under ``torch.device("meta")``)."""
    count = 0
    for name, tensor in state.items():
        if tensor.dtype != torch.float8_e4m3fn:
            continue
        path = name.removesuffix(".weight")
        assert f"{path}.scale" in state, f"FP8 weight {name!r} without its scales"
        parent, _, attr = path.rpartition(".")
        old = model.get_submodule(path)
        assert isinstance(old, nn.Linear), f"{path} is a {type(old).__name__}, not nn.Linear"
        new = Fp8Linear(old.in_features, old.out_features, block, linear)
        setattr(model.get_submodule(parent), attr, new)
        count += 1
    return count


def dequantize_small_fp8_linears(
    state: dict[str, torch.Tensor], min_weights: int, block: tuple[int, int], dtype: torch.dtype
) -> int:
    """Replace in ``state`` each FP8 linear weight of fewer than ``min_weights`` values by its
    dequantized values in ``dtype``, dropping its ``.scale``, so that ``use_fp8_linears`` leaves
    that layer an ``nn.Linear`` (``model.fp8_min_weights``); returns how many."""
    count = 0
    for name in [n for n, t in state.items() if t.dtype == torch.float8_e4m3fn]:
        if state[name].numel() >= min_weights:
            continue
        scale = state.pop(name.removesuffix(".weight") + ".scale")
        state[name] = dequantize_fp8(state[name], scale, block).to(dtype)
        count += 1
    return count


def use_mxfp4_experts(model: nn.Module, state: dict[str, torch.Tensor]) -> int:
    """Make packed each routed-experts module whose ``w1`` in ``state`` is packed MXFP4 (uint8,
    beside ``w1_scales``): the module's ``to_mxfp4``, so that ``model.load_state_dict(state)``
    fits; returns how many. Call it where the model was built (e.g. on the meta device)."""
    count = 0
    for name in state:
        path, _, leaf = name.rpartition(".")
        if leaf == "w1_scales":
            assert state[f"{path}.w1"].dtype == torch.uint8, f"{path}.w1 is not packed"
            model.get_submodule(path).to_mxfp4()
            count += 1
    return count
