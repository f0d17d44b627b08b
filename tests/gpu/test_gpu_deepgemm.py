"""DeepSeek's DeepGEMM as the linear backend, on CUDA, at DeepSeek-V4-Flash shapes.

Runs where scripts/build_deepgemm.sh built deep_gemm and the process has what it needs (gpu_env.sh
sets LD_PRELOAD and the JIT cache); elsewhere the backend's own availability check says why and
the tests skip with it. Errors are ||y - ref|| / ||ref|| against the same two fp32 references
as test_gpu_linear_fp8.py (its tolerances): the W8A8 arithmetic in torch and torch_ref.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_gpu_linear_fp8 import (
    EMULATED_TOL,
    NUM_TOKENS,
    SHAPES,
    W8A8_TOL,
    _emulated,
    _rel_err,
    _weight,
    _x,
)

from deepinfer.ops.linear import BACKENDS, deepgemm, torch_ref

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def available() -> None:
    ok, why = deepgemm.is_available(torch.device("cuda"))
    if not ok:
        pytest.skip(why)


def test_auto_selects_deepgemm_where_its_probe_passes() -> None:
    backend = BACKENDS.select("auto", torch.device("cuda"))
    assert type(backend).__name__ == "DeepGEMMLinearBackend"


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_the_references(
    shape: str, num_tokens: int, ieee_fp32: None, record_figure: Callable[[str], None]
) -> None:
    n, k = SHAPES[shape]
    weight, scale = _weight(n, k, seed=n + k)
    x = _x(num_tokens, k, seed=num_tokens)
    out = deepgemm.fp8_linear(x, weight, scale)
    assert out.shape == (num_tokens, n) and out.dtype == torch.bfloat16
    emulated = _rel_err(out, _emulated(x, weight, scale))
    exact = _rel_err(out, torch_ref.fp8_linear(x.float(), weight, scale))
    if num_tokens in (1, 4096):
        record_figure(
            f"deepgemm fp8_linear {shape} M={num_tokens}: rel err {emulated:.2e} vs W8A8, "
            f"{exact:.2e} vs torch_ref"
        )
    assert emulated < EMULATED_TOL and exact < W8A8_TOL
