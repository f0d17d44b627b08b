"""Small building blocks shared by the model's modules."""

from __future__ import annotations

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


def step_rope(
    positions: torch.Tensor, inv_freqs: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A step's RoPE tables (``ForwardBatch.rope``): kind -> (cos, sin) of ``positions`` for each
    kind's inverse frequencies, and ``inverse(kind)`` -> (cos, -sin), the rotation back that
    attention applies to its output: one negation a step instead of one a layer."""
    rope = {}
    for kind, inv_freq in inv_freqs.items():
        cos, sin = rope_cos_sin(positions, inv_freq)
        rope[kind], rope[inverse(kind)] = (cos, sin), (cos, -sin)
    return rope


def inverse(kind: str) -> str:
    """The ``step_rope`` key of a RoPE kind's inverse rotation."""
    return f"{kind}-inverse"


def linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)


class FusedLinears:
    """The dense linears among ``modules`` that read one input, as one GEMM.

    Their weights become row blocks of one tensor: each module's weight is then a view of it, so
    no memory is added, and ``outputs(x)`` maps each module to its column block of x @ W^T.
    At decode a step's small projections are each a GEMM (plus cuBLAS's split-K reduction) of
    a few µs, far from the bytes they read; one GEMM over all of them reads the same bytes once.
    Modules of another kind (FP8) or dtype, or with a bias, stay out and run alone (``project``).
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        dense = [m for m in modules if type(m) is nn.Linear and m.bias is None]
        if dense:
            first = dense[0].weight
            dense = [
                m
                for m in dense
                if m.weight.dtype == first.dtype
                and m.weight.device == first.device
                and m.in_features == dense[0].in_features
            ]
        self.modules: tuple[nn.Linear, ...] = tuple(dense) if len(dense) > 1 else ()
        self.sizes = [m.out_features for m in self.modules]
        self.weight: torch.Tensor | None = None
        if not self.modules:
            return
        self.weight = torch.cat([m.weight.detach() for m in self.modules])
        rows = 0
        for m, size in zip(self.modules, self.sizes, strict=True):
            m.weight = nn.Parameter(self.weight[rows : rows + size], requires_grad=False)
            rows += size

    def outputs(self, x: torch.Tensor) -> dict[nn.Module, torch.Tensor]:
        """Each fused module's output for ``x`` (views of one GEMM's output); {} if none."""
        if self.weight is None:
            return {}
        blocks = F.linear(x, self.weight).split(self.sizes, dim=-1)
        return dict(zip(self.modules, blocks, strict=True))


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._fp8_linear(x.reshape(-1, self.in_features), self.weight, self.scale, self.block)
        return y.view(*x.shape[:-1], self.out_features)


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
