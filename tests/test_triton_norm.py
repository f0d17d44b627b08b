"""The Triton norm kernels against torch_ref, on the CPU through Triton's interpreter.

Triton chooses interpreted or compiled when it is imported (its own ``tl`` helpers are kernels
too), so TRITON_INTERPRET is set before anything imports it; a session that imported triton
compiled first cannot interpret, and this module then skips with that reason. bf16 tl.dot is
broken in the interpreter, so the cases run fp32 (the kernels' IEEE dot) at tiny shapes; the hc
tiles are shrunk to 16 and the SM count faked, so that D = 40 and K = 160 leave masked tails, and
the split-K (empty splits included), split-D and single-program paths all run. apply_rope has
no dot: it runs fp32 and bf16, at V4's row widths (512, 128) with few tokens and heads.
tests/gpu/test_gpu_triton_norm.py covers bf16 and the production shapes on CUDA.
"""

from __future__ import annotations

import inspect
import os
import sys

_TRITON_WAS_COMPILED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on numpy, on the CPU

from collections.abc import Iterator  # noqa: E402
from types import ModuleType  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
if _TRITON_WAS_COMPILED:
    pytest.skip(
        "triton was imported compiled earlier in this process; run this file on its own",
        allow_module_level=True,
    )

from compress_cases import CASES, ONE_TOKEN, compress_step  # noqa: E402
from triton_modules import Launches, contract_mismatches, no_sm_lookup  # noqa: E402

from deepinfer.ops.norm import BACKENDS, NormBackend, rope_cos_sin, torch_ref  # noqa: E402

# fp32 against fp32: the kernels differ from torch only in summation order and the exp/rsqrt
# approximations (the interpreter: numpy; errors seen ~1e-7).
FP32_TOL = 1e-5
HC, EPS = 4, 1e-6
# apply_rope, fp32: the same products and one add/sub per value as torch_ref (numpy, no FMA), so
# the results match to the last bit here; 1e-6 leaves room for a reordering, not for a bug.
ROPE_FP32_TOL = 1e-6
# apply_rope, bf16: the interpreter truncates fp32 -> bf16 (CUDA rounds to nearest even) where
# torch rounds, so a value may be one bf16 ulp off: below 2^-7 relative per value, hence in norm.
ROPE_BF16_TOL = 2**-7


@pytest.fixture(scope="module")
def norm_triton() -> Iterator[ModuleType]:
    """The backend module, with TRITON_INTERPRET kept set while it runs (another test module
    may restore the variable at its teardown; the interpreter checks it while kernels run)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    from deepinfer.ops.norm import triton as module

    yield module
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = before


@pytest.fixture
def small_tiles(norm_triton: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(norm_triton, "HC_BLOCK_K", 16)
    monkeypatch.setattr(norm_triton, "HC_ONE_TOKEN_BLOCK_K", 16)
    monkeypatch.setattr(norm_triton, "HC_BLOCK_D", 16)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.dtype)
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _hc_inputs(
    num_tokens: int, dim: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, fn, scale, base, none of them zero (the checkpoint's are not): fn ~ N(0, 1/K) makes
    the mix ~N(0, 1), so the sigmoids and the softmax are far from saturated."""
    mix_size, k = (2 + HC) * HC, HC * dim
    x = torch.randn(num_tokens, HC, dim, generator=gen) * 2
    fn = torch.randn(mix_size, k, generator=gen) * k**-0.5
    scale = 0.5 + torch.rand(3, generator=gen)
    base = 0.5 * torch.randn(mix_size, generator=gen)
    return x, fn, scale, base


def test_registered_before_torch_ref() -> None:
    assert BACKENDS.names == ["triton", "torch_ref"]
    assert type(BACKENDS.select("auto", torch.device("cpu"))) is torch_ref.TorchRefNormBackend


def test_backend_contract(norm_triton: ModuleType) -> None:
    """Both backends provide the ops of ops/norm's contract with the same signatures; the
    triton backend's kernels are its own, the RoPE tables torch_ref's."""
    backend = norm_triton.TritonNormBackend(torch.device("cpu"))
    names = (
        "rms_norm",
        "apply_rope",
        "hc_pre",
        "hc_pre_shifted",
        "hc_post",
        "hc_post_pre",
        "hc_head",
    )
    for name in (*names, "rope_inv_freq", "rope_cos_sin"):
        ours, ref = getattr(backend, name), getattr(torch_ref, name)
        assert inspect.signature(ours) == inspect.signature(ref), name
        assert (ours is ref) == name.startswith("rope_"), name


def test_backend_object_launches_with_its_sm_count(
    norm_triton: ModuleType, small_tiles: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TritonNormBackend keeps the SM count of the device it was made for (the interpreter's
    stand-in, 4) and launches by it, never asking the module again. hc_post over D = 40 in
    tiles of 16: one SM splits a token's D in 2 programs, 4 SMs in 3. apply_rope over 15 rows
    of 64 in tiles of 128 values: 4 SMs keep 2 rows a program (8 programs), 1000 SMs one (15)."""
    backend = norm_triton.TritonNormBackend(torch.device("cpu"))
    assert backend.num_sms == 4
    assert contract_mismatches(backend, NormBackend) == []
    monkeypatch.setattr(norm_triton, "_num_sms", no_sm_lookup)
    monkeypatch.setattr(norm_triton, "ROPE_TILE", 128)
    hc_post = Launches(norm_triton._hc_post_kernel)
    rope = Launches(norm_triton._apply_rope_kernel)
    monkeypatch.setattr(norm_triton, "_hc_post_kernel", hc_post)
    monkeypatch.setattr(norm_triton, "_apply_rope_kernel", rope)
    gen = torch.Generator().manual_seed(11)
    x, fn, scale, base = _hc_inputs(1, 40, gen)
    post, comb, collapsed = backend.hc_pre(x, fn, scale, base, 20, 1e-6, EPS)
    ref = torch_ref.hc_pre(x, fn, scale, base, 20, 1e-6, EPS)
    assert _rel_err(collapsed, ref[2]) < FP32_TOL
    q, cos, sin = _rope_inputs((5, 3, 64), 16, torch.float32, gen)
    for num_sms in (4, 1):
        backend.num_sms = num_sms
        out = backend.hc_post(collapsed, x, post, comb)
        assert _rel_err(out, torch_ref.hc_post(collapsed, x, post, comb)) < FP32_TOL
    for num_sms in (4, 1000):
        backend.num_sms = num_sms
        out = backend.apply_rope(q, cos, sin)
        assert _rel_err(out, torch_ref.apply_rope(q, cos, sin)) < ROPE_FP32_TOL
    assert hc_post.grids == [(1, 3), (1, 2)]
    assert rope.grids == [(8,), (15,)]


@pytest.mark.parametrize("shape", [(5, 48), (3, 7, 64), (1, 32), (2, 1000)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(norm_triton: ModuleType, shape: tuple[int, ...], weighted: bool) -> None:
    gen = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = torch.randn(shape, generator=gen) * 3
    weight = 1 + 0.1 * torch.randn(shape[-1], generator=gen) if weighted else None
    ref = torch_ref.rms_norm(x, weight, EPS)
    assert _rel_err(norm_triton.rms_norm(x, weight, EPS), ref) < FP32_TOL


def test_rms_norm_strided_rows(norm_triton: ModuleType) -> None:
    """A column slice: rows are not contiguous with each other, the kernel reads them strided."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 96, generator=gen)[:, 16:80]  # [6, 64], row stride 96
    weight = torch.rand(64, generator=gen) + 0.5
    out = norm_triton.rms_norm(x, weight, EPS)
    assert _rel_err(out, torch_ref.rms_norm(x, weight, EPS)) < FP32_TOL


# (T, D, SMs): T = 1 with many SMs splits K 8 ways (K = 160 fills only 5: 3 splits are empty)
# and D over 3 programs; T = 3 splits both a little; T = 17 with one SM runs one program per
# token tile, looping over K and D.
HC_CASES = [(1, 40, 1000), (3, 40, 4), (17, 32, 1)]


@pytest.mark.parametrize(("num_tokens", "dim", "num_sms"), HC_CASES)
@pytest.mark.parametrize(("hc_eps", "sinkhorn_iters"), [(1e-6, 20), (0.1, 3)])
def test_hc_pre(
    norm_triton: ModuleType,
    small_tiles: None,
    monkeypatch: pytest.MonkeyPatch,
    num_tokens: int,
    dim: int,
    num_sms: int,
    hc_eps: float,
    sinkhorn_iters: int,
) -> None:
    """hc_eps 0.1 makes a misplaced eps (softmax, row or column sums) show far above FP32_TOL."""
    monkeypatch.setattr(norm_triton, "_num_sms", lambda device: num_sms)
    gen = torch.Generator().manual_seed(num_tokens * 1000 + dim + sinkhorn_iters)
    inputs = _hc_inputs(num_tokens, dim, gen)
    ref = torch_ref.hc_pre(*inputs, sinkhorn_iters, hc_eps, EPS)
    out = norm_triton.hc_pre(*inputs, sinkhorn_iters, hc_eps, EPS)
    for name, o, r in zip(("post", "comb", "collapsed"), out, ref, strict=True):
        assert _rel_err(o, r) < FP32_TOL, name


@pytest.mark.parametrize(("num_tokens", "dim", "num_sms"), HC_CASES)
@pytest.mark.parametrize("normed", [False, True])
def test_hc_head(
    norm_triton: ModuleType,
    small_tiles: None,
    monkeypatch: pytest.MonkeyPatch,
    num_tokens: int,
    dim: int,
    num_sms: int,
    normed: bool,
) -> None:
    """A head (the model's last hc, its mix pre's alone) in hc_pre's two launches, with and
    without the final norm in the second, within FP32_TOL of torch_ref's; hc_eps 0.1 shows a
    misplaced eps. torch_ref's is hc_pre's collapse with a pre from the same formula."""
    monkeypatch.setattr(norm_triton, "_num_sms", lambda device: num_sms)
    gen = torch.Generator().manual_seed(num_tokens * 1000 + dim + 11)
    x, fn, scale, base = _hc_inputs(num_tokens, dim, gen)
    fn, scale, base = fn[:HC], scale[:1], base[:HC]
    block_norm = (1 + 0.5 * torch.randn(dim, generator=gen), 1e-5) if normed else None
    ref = torch_ref.hc_head(x, fn, scale, base, 0.1, EPS, block_norm=block_norm)
    out = norm_triton.hc_head(x, fn, scale, base, 0.1, EPS, block_norm=block_norm)
    assert _rel_err(out, ref) < FP32_TOL
    flat = torch_ref.rms_norm(x.flatten(1), None, EPS)
    pre = torch.sigmoid(flat @ fn.T * scale + base) + 0.1
    collapsed = torch_ref.hc_collapse(x, pre)
    expected = collapsed if block_norm is None else torch_ref.rms_norm(collapsed, *block_norm)
    assert torch.equal(ref, expected)


@pytest.mark.parametrize(("num_tokens", "dim", "num_sms"), HC_CASES)
def test_hc_pre_shifted(
    norm_triton: ModuleType,
    small_tiles: None,
    monkeypatch: pytest.MonkeyPatch,
    num_tokens: int,
    dim: int,
    num_sms: int,
) -> None:
    """The shifted variant collapses with the given pre (one-hot here, as the first sub-layer
    of DeepSeek-V4.1 does, and random) and returns its own: the unshifted hc_pre's mixes."""
    monkeypatch.setattr(norm_triton, "_num_sms", lambda device: num_sms)
    gen = torch.Generator().manual_seed(num_tokens * 1000 + dim + 7)
    x, fn, scale, base = _hc_inputs(num_tokens, dim, gen)
    one_hot = torch.zeros(num_tokens, HC)
    one_hot[:, 0] = 1.0
    for prev_pre in (one_hot, torch.rand(num_tokens, HC, generator=gen)):
        ref = torch_ref.hc_pre_shifted(x, prev_pre, fn, scale, base, 20, 1e-6, EPS)
        out = norm_triton.hc_pre_shifted(x, prev_pre, fn, scale, base, 20, 1e-6, EPS)
        for name, o, r in zip(("pre", "post", "comb", "collapsed"), out, ref, strict=True):
            assert _rel_err(o, r) < FP32_TOL, name
        assert torch.equal(ref[3], torch_ref.hc_collapse(x, prev_pre))
    pre, post, comb = torch_ref.hc_mixes(x, fn, scale, base, 20, 1e-6, EPS)
    unshifted = torch_ref.hc_pre(x, fn, scale, base, 20, 1e-6, EPS)
    assert torch.equal(post, unshifted[0]) and torch.equal(comb, unshifted[1])
    assert torch.equal(torch_ref.hc_collapse(x, pre), unshifted[2])
    assert torch.equal(torch_ref.hc_collapse(x, one_hot), x[:, 0])


@pytest.mark.parametrize(("num_tokens", "dim", "num_sms"), HC_CASES)
@pytest.mark.parametrize("shifted", [False, True], ids=["hc_pre", "hc_pre_shifted"])
def test_hc_pre_normalises_the_block_input_in_the_same_launch(
    norm_triton: ModuleType,
    small_tiles: None,
    monkeypatch: pytest.MonkeyPatch,
    num_tokens: int,
    dim: int,
    num_sms: int,
    shifted: bool,
) -> None:
    """block_norm: the block input through rms_norm with the sub-layer's weight and eps, as
    torch_ref composes them. The cases take each path: a token's D over 3 programs (the last
    by ticket normalises the row) and over 2, and one program a token looping over D. Every
    token's counter is reset; the mixes are those without the norm."""
    from deepinfer.ops.triton_tickets import ticket_counters

    monkeypatch.setattr(norm_triton, "_num_sms", lambda device: num_sms)
    gen = torch.Generator().manual_seed(num_tokens * 1000 + dim + 11)
    x, fn, scale, base = _hc_inputs(num_tokens, dim, gen)
    block_norm = (1 + 0.5 * torch.randn(dim, generator=gen), 1e-5)
    prev = (torch.rand(num_tokens, HC, generator=gen),) if shifted else ()
    name = "hc_pre_shifted" if shifted else "hc_pre"
    args = (x, *prev, fn, scale, base, 20, 1e-6, EPS)
    ref = getattr(torch_ref, name)(*args, block_norm=block_norm)
    out = getattr(norm_triton, name)(*args, block_norm=block_norm)
    assert not ticket_counters(x.device).any(), "a token's counter was not reset"
    assert _rel_err(out[-1], ref[-1]) < FP32_TOL
    plain = getattr(norm_triton, name)(*args)
    for o, p in zip(out[:-1], plain[:-1], strict=True):
        assert torch.equal(o, p)
    unnormed = getattr(torch_ref, name)(*args)[-1]
    assert torch.equal(ref[-1], torch_ref.rms_norm(unnormed, *block_norm))


@pytest.mark.parametrize(("num_tokens", "dim", "num_sms"), [(1, 40, 1000), (3, 40, 4)])
def test_hc_pre_sinkhorn_apart_gives_the_same_values(
    norm_triton: ModuleType,
    small_tiles: None,
    monkeypatch: pytest.MonkeyPatch,
    num_tokens: int,
    dim: int,
    num_sms: int,
) -> None:
    """The Sinkhorn in a program of its own (HC_SINKHORN_APART_MAX_TOKENS), shifted, with and
    without the block norm, and unshifted: every output bit for bit the one-launch layout's
    (the same arithmetic in other programs), and within FP32_TOL of torch_ref's."""
    monkeypatch.setattr(norm_triton, "_num_sms", lambda device: num_sms)
    gen = torch.Generator().manual_seed(num_tokens * 1000 + dim + 5)
    x, fn, scale, base = _hc_inputs(num_tokens, dim, gen)
    prev = torch.rand(num_tokens, HC, generator=gen)
    block_norm = (1 + 0.5 * torch.randn(dim, generator=gen), 1e-5)
    calls = [
        ("hc_pre_shifted", (x, prev, fn, scale, base, 20, 1e-6, EPS), None),
        ("hc_pre_shifted", (x, prev, fn, scale, base, 20, 1e-6, EPS), block_norm),
        ("hc_pre", (x, fn, scale, base, 20, 1e-6, EPS), None),
    ]
    for name, args, norm in calls:
        monkeypatch.setattr(norm_triton, "HC_SINKHORN_APART_MAX_TOKENS", 0)
        together = getattr(norm_triton, name)(*args, block_norm=norm)
        monkeypatch.setattr(norm_triton, "HC_SINKHORN_APART_MAX_TOKENS", num_tokens)
        apart = getattr(norm_triton, name)(*args, block_norm=norm)
        ref = getattr(torch_ref, name)(*args, block_norm=norm)
        for o, t, r in zip(apart, together, ref, strict=True):
            assert torch.equal(o, t), name
            assert _rel_err(o, r) < FP32_TOL, name


@pytest.mark.parametrize(("num_tokens", "dim", "num_sms"), HC_CASES)
def test_hc_post(
    norm_triton: ModuleType,
    small_tiles: None,
    monkeypatch: pytest.MonkeyPatch,
    num_tokens: int,
    dim: int,
    num_sms: int,
) -> None:
    monkeypatch.setattr(norm_triton, "_num_sms", lambda device: num_sms)
    gen = torch.Generator().manual_seed(num_tokens * 1000 + dim)
    x = torch.randn(num_tokens, HC, dim, generator=gen)
    out = torch.randn(num_tokens, dim, generator=gen)
    post = 2 * torch.rand(num_tokens, HC, generator=gen)
    comb = torch.randn(num_tokens, HC, HC, generator=gen).softmax(-1)  # not symmetric: j, k matter
    ref = torch_ref.hc_post(out, x, post, comb)
    assert _rel_err(norm_triton.hc_post(out, x, post, comb), ref) < FP32_TOL


# (T, D, SMs, HC_MAX_SPLIT_K): D = 40 in slices of 16 is 3 slices (a padded Sinkhorn split of
# 3, a masked tail), or 2 of 32 (two tiles a program); several tokens at 3, 5 and 17.
HC_POST_PRE_CASES = [
    (1, 40, 1000, 64),
    (3, 40, 4, 64),
    (1, 40, 1000, 2),
    (5, 40, 1, 2),
    (17, 32, 1, 64),
]


@pytest.mark.parametrize(("num_tokens", "dim", "num_sms", "max_split"), HC_POST_PRE_CASES)
@pytest.mark.parametrize("normed", [False, True], ids=["plain", "block_norm"])
def test_hc_post_pre_computes_the_next_mix_in_the_exit_launch(
    norm_triton: ModuleType,
    small_tiles: None,
    monkeypatch: pytest.MonkeyPatch,
    num_tokens: int,
    dim: int,
    num_sms: int,
    max_split: int,
    normed: bool,
) -> None:
    """hc_post_pre: the new x bitwise hc_post's; post, comb and the block input within FP32_TOL
    of torch_ref's hc_post then hc_pre; two launches (no _hc_mix_kernel) up to
    HC_POST_MIX_MAX_TOKENS (set to T here), three above it, with the same new x and mixes
    within FP32_TOL."""
    monkeypatch.setattr(norm_triton, "_num_sms", lambda device: num_sms)
    monkeypatch.setattr(norm_triton, "HC_POST_MIX_BLOCK_D", 16)
    monkeypatch.setattr(norm_triton, "HC_MAX_SPLIT_K", max_split)
    monkeypatch.setattr(norm_triton, "HC_POST_MIX_MAX_TOKENS", num_tokens)  # fused up to here
    mixes = Launches(norm_triton._hc_mix_kernel)
    monkeypatch.setattr(norm_triton, "_hc_mix_kernel", mixes)
    gen = torch.Generator().manual_seed(num_tokens * 1000 + dim + max_split)
    x, fn, scale, base = _hc_inputs(num_tokens, dim, gen)
    out = torch.randn(num_tokens, dim, generator=gen)
    post = 2 * torch.rand(num_tokens, HC, generator=gen)
    comb = torch.randn(num_tokens, HC, HC, generator=gen).softmax(-1)
    block_norm = (1 + 0.5 * torch.randn(dim, generator=gen), 1e-5) if normed else None
    args = (out, x, post, comb, fn, scale, base, 20, 1e-6, EPS)
    ref = torch_ref.hc_post_pre(*args, block_norm=block_norm)
    fused = norm_triton.hc_post_pre(*args, block_norm=block_norm)
    assert mixes.grids == []
    assert torch.equal(fused[0], norm_triton.hc_post(out, x, post, comb))
    for name, o, r in zip(("x", "post", "comb", "block input"), fused, ref, strict=True):
        assert _rel_err(o, r) < FP32_TOL, name
    monkeypatch.setattr(norm_triton, "HC_POST_MIX_MAX_TOKENS", num_tokens - 1)
    unfused = norm_triton.hc_post_pre(*args, block_norm=block_norm)
    assert len(mixes.grids) == 1
    assert torch.equal(unfused[0], fused[0])
    for name, o, f in zip(("post", "comb", "block input"), unfused[1:], fused[1:], strict=True):
        assert _rel_err(o, f) < FP32_TOL, name


def _rope_inputs(
    shape: tuple[int, ...], rope_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, ..., D] and cos, sin [T, rope_dim / 2] at positions spread over 0 .. 100K, so that
    every pair turns by a different, non-trivial angle."""
    x = (torch.randn(shape, generator=gen) * 2).to(dtype)
    positions = torch.randint(0, 100_000, (shape[0],), generator=gen)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    return x, *rope_cos_sin(positions, inv_freq)


# (x shape, rope_dim): 2-D and 3-D; V4's q [T, H, 512] / kv [T, 512] / indexer q [T, H, 128]
# (rope 64) with few tokens and heads; rope over the whole row (no nope); a row width that is
# not a power of two (masked columns) with an odd nope width (pairs straddle 16-byte words).
ROPE_CASES = [
    ((5, 48), 16),
    ((3, 4, 64), 16),
    ((3, 4, 512), 64),
    ((3, 512), 64),
    ((2, 8, 128), 64),
    ((2, 3, 32), 32),
    ((4, 2, 13), 6),
]


@pytest.mark.parametrize(("shape", "rope_dim"), ROPE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope(
    norm_triton: ModuleType, shape: tuple[int, ...], rope_dim: int, dtype: torch.dtype
) -> None:
    """The nope columns come back bit for bit; x itself is left as it was."""
    gen = torch.Generator().manual_seed(sum(shape) + rope_dim)
    x, cos, sin = _rope_inputs(shape, rope_dim, dtype, gen)
    before = x.clone()
    out = norm_triton.apply_rope(x, cos, sin)
    assert torch.equal(x, before)
    tol = ROPE_FP32_TOL if dtype == torch.float32 else ROPE_BF16_TOL
    assert _rel_err(out, torch_ref.apply_rope(x, cos, sin)) < tol
    nope = shape[-1] - rope_dim
    assert torch.equal(out[..., :nope], x[..., :nope])


@pytest.mark.parametrize(("shape", "rope_dim"), ROPE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_rope_is_the_two_launches_in_one(
    norm_triton: ModuleType,
    shape: tuple[int, ...],
    rope_dim: int,
    dtype: torch.dtype,
    weighted: bool,
) -> None:
    """rms_norm_rope gives apply_rope(rms_norm(x)) of this backend bit for bit (the same row
    sums, the normalised row rounded to x's dtype before the rotation, the same rotation), and
    torch_ref's within apply_rope's tolerance; odd nope widths pair their channels right."""
    gen = torch.Generator().manual_seed(sum(shape) + 3 * rope_dim)
    x, cos, sin = _rope_inputs(shape, rope_dim, dtype, gen)
    weight = torch.rand(shape[-1], generator=gen) + 0.5 if weighted else None
    fused = norm_triton.rms_norm_rope(x, weight, 1e-6, cos, sin)
    two = norm_triton.apply_rope(norm_triton.rms_norm(x, weight, 1e-6), cos, sin)
    assert fused.dtype == dtype and fused.shape == x.shape
    assert torch.equal(fused, two)
    tol = ROPE_FP32_TOL if dtype == torch.float32 else ROPE_BF16_TOL
    assert _rel_err(fused, torch_ref.rms_norm_rope(x, weight, 1e-6, cos, sin)) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rope_stores_rows_into_a_ring(norm_triton: ModuleType, dtype: torch.dtype) -> None:
    """store=(target, rows): each token's row also at target[rows[t]] from the same launch
    (bitwise the returned row), other rows untouched; torch_ref's store alike."""
    gen = torch.Generator().manual_seed(23)
    x, cos, sin = _rope_inputs((5, 40), 16, dtype, gen)
    weight = torch.rand(40, generator=gen) + 0.5
    rows = torch.tensor([7, 2, 11, 0, 5])
    for backend in (norm_triton, torch_ref):
        ring = torch.randn(12, 40, generator=gen).to(dtype)
        before = ring.clone()
        y = backend.rms_norm_rope(x, weight, 1e-6, cos, sin, store=(ring, rows))
        assert torch.equal(y, backend.rms_norm_rope(x, weight, 1e-6, cos, sin))
        assert torch.equal(ring[rows], y)
        untouched = torch.ones(12, dtype=torch.bool).index_fill_(0, rows, False)
        assert torch.equal(ring[untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "heads", "stored"), [(1, 8, True), (6, 3, False), (0, 4, True)])
def test_rms_norm_rope_pair_is_both_norms_in_one_launch(
    norm_triton: ModuleType, dtype: torch.dtype, tokens: int, heads: int, stored: bool
) -> None:
    """rms_norm_rope_pair gives each input's rms_norm_rope, k's store included, bit for bit
    (the interpreter sums a row the same in any tile), on Triton and torch_ref; x's rows from
    column-sliced heads (a fused projection's view) and k without a weight as well as with."""
    gen = torch.Generator().manual_seed(tokens * 7 + heads)
    x, cos, sin = _rope_inputs((tokens, heads, 80), 16, dtype, gen)
    x = torch.cat([x, x], dim=-1)[..., 80:]  # strided heads
    k = torch.randn(tokens, 2 * 80, generator=gen).to(dtype)[:, :80]
    rows = torch.randperm(12, generator=gen)[:tokens]
    for backend in (norm_triton, torch_ref):
        for weights in ((None, torch.rand(80, generator=gen) + 0.5), (torch.rand(80), None)):
            ring, ring_alone = (torch.zeros(12, 80, dtype=dtype) for _ in range(2))
            store = (ring, rows) if stored else None
            q_out, k_out = backend.rms_norm_rope_pair(x, k, weights, 1e-6, cos, sin, store=store)
            assert torch.equal(q_out, backend.rms_norm_rope(x, weights[0], 1e-6, cos, sin))
            alone = backend.rms_norm_rope(
                k, weights[1], 1e-6, cos, sin, store=(ring_alone, rows) if stored else None
            )
            assert torch.equal(k_out, alone) and torch.equal(ring, ring_alone)
            assert q_out.shape == x.shape and k_out.shape == k.shape and k_out.dtype == dtype
            assert stored == bool(ring.any()) or tokens == 0


@pytest.mark.parametrize(("shape", "rope_dim"), [((3, 4, 64), 16), ((5, 48), 48)])
def test_apply_rope_inverse(norm_triton: ModuleType, shape: tuple[int, ...], rope_dim: int) -> None:
    """-sin rotates back: the round trip returns x, and the inverse alone matches torch_ref's."""
    gen = torch.Generator().manual_seed(11 + rope_dim)
    x, cos, sin = _rope_inputs(shape, rope_dim, torch.float32, gen)
    rotated = norm_triton.apply_rope(x, cos, sin)
    assert _rel_err(rotated, x) > 0.1  # the rotation moved the values: the round trip is a test
    assert _rel_err(norm_triton.apply_rope(rotated, cos, -sin), x) < ROPE_FP32_TOL
    ref = torch_ref.apply_rope(rotated, cos, -sin)
    assert _rel_err(norm_triton.apply_rope(rotated, cos, -sin), ref) < ROPE_FP32_TOL


def test_apply_rope_strided(norm_triton: ModuleType) -> None:
    """Views read in place (token and head strides of their own; cos and sin column slices of
    wider tables, with different row strides) and a last dim of stride 2 (read from a contiguous
    copy) all match torch_ref."""
    gen = torch.Generator().manual_seed(13)
    x, cos, sin = _rope_inputs((4, 6, 96), 16, torch.float32, gen)
    cos = torch.cat([cos, sin], dim=-1)[:, :8]  # row stride 16
    sin = torch.cat([cos, cos, sin], dim=-1)[:, 16:]  # row stride 24
    views = [
        x[:, :, 16:80],  # [4, 6, 64], row padding
        x[:, ::2, :64],  # head stride 192
        x.transpose(0, 1).contiguous().transpose(0, 1)[..., :32],  # token stride 96 < head's
        x[:, 0, 32:],  # 2-D [4, 64] slice
        x[:, :, :64:2],  # last dim stride 2
    ]
    for view in views:
        out = norm_triton.apply_rope(view, cos, sin)
        assert out.is_contiguous() and out.shape == view.shape
        assert _rel_err(out, torch_ref.apply_rope(view, cos, sin)) < ROPE_FP32_TOL, view.stride()


@pytest.mark.parametrize("num_sms", [1, 1000])
def test_apply_rope_tiles(
    norm_triton: ModuleType, monkeypatch: pytest.MonkeyPatch, num_sms: int
) -> None:
    """Column tiles of 16 over D = 56 (nope 24: the rope slice starts inside a tile, the last is
    masked); one SM packs 8 rows per program (a masked tail of rows), 1000 SMs one row each."""
    monkeypatch.setattr(norm_triton, "ROPE_BLOCK_D", 16)
    monkeypatch.setattr(norm_triton, "ROPE_TILE", 128)
    monkeypatch.setattr(norm_triton, "_num_sms", lambda device: num_sms)
    gen = torch.Generator().manual_seed(17 + num_sms)
    x, cos, sin = _rope_inputs((5, 3, 56), 32, torch.float32, gen)
    out = norm_triton.apply_rope(x, cos, sin)
    assert _rel_err(out, torch_ref.apply_rope(x, cos, sin)) < ROPE_FP32_TOL


def test_no_tokens(norm_triton: ModuleType) -> None:
    """An empty batch launches nothing and returns empty outputs of the right shapes."""
    x, fn, scale, base = _hc_inputs(0, 32, torch.Generator().manual_seed(0))
    post, comb, collapsed = norm_triton.hc_pre(x, fn, scale, base, 20, EPS, EPS)
    assert (post.shape, comb.shape, collapsed.shape) == ((0, HC), (0, HC, HC), (0, 32))
    assert norm_triton.hc_post(collapsed, x, post, comb).shape == (0, HC, 32)
    assert norm_triton.rms_norm(collapsed, None, EPS).shape == (0, 32)
    empty_rope = torch.empty(0, 8)
    assert norm_triton.apply_rope(x, empty_rope, empty_rope).shape == (0, HC, 32)


def _pool_inputs(
    windows: int, slots: int, dim: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kv, gate logits with a few -inf (empty) slots, as the overlap's first window has, and
    a norm weight; none zero."""
    kv = torch.randn(windows, slots, dim, generator=gen)
    gate = 2 * torch.randn(windows, slots, dim, generator=gen)
    gate[0, : slots // 2] = float("-inf")  # a request's window 0: no previous window's half
    weight = 0.5 + torch.rand(dim, generator=gen)
    return kv, gate, weight


@pytest.mark.parametrize(
    ("windows", "slots", "dim", "block_s"),
    [(5, 8, 32, 8), (3, 4, 48, 8), (4, 8, 32, 2), (2, 12, 16, 4)],
    ids=["csa", "uneven_dim", "chunks_of_2", "partial_chunk"],
)
def test_gated_pool(
    norm_triton: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    windows: int,
    slots: int,
    dim: int,
    block_s: int,
) -> None:
    """Softmax over the slots online in chunks of block_s (one chunk, several, a masked tail),
    D not a power of two, and empty slots: the reference's values in fp32."""
    monkeypatch.setattr(sys.modules["deepinfer.ops.norm.triton_pool"], "POOL_BLOCK_S", block_s)
    gen = torch.Generator().manual_seed(windows * 100 + slots)
    kv, gate, weight = _pool_inputs(windows, slots, dim, gen)
    out = norm_triton.gated_pool(kv, gate, weight, EPS)
    assert _rel_err(out, torch_ref.gated_pool(kv, gate, weight, EPS)) < FP32_TOL
    assert norm_triton.gated_pool(kv[:0], gate[:0], weight, EPS).shape == (0, dim)


@pytest.mark.parametrize(("dim", "rope_dim"), [(32, 16), (48, 16), (64, 64), (64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_pool_with_rope_is_the_two_launches_in_one(
    norm_triton: ModuleType, dim: int, rope_dim: int, dtype: torch.dtype
) -> None:
    """gated_pool with cos and sin gives apply_rope(gated_pool(...)) bit for bit (the
    normalised row rounded as stored, then the same rotation), D not a power of two and a rope
    over the whole row included, and torch_ref's within tolerance."""
    gen = torch.Generator().manual_seed(dim + rope_dim)
    kv, gate, weight = _pool_inputs(5, 8, dim, gen)
    kv = kv.to(dtype)
    positions = torch.randint(0, 100_000, (5,), generator=gen)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    cos, sin = rope_cos_sin(positions, inv_freq)
    fused = norm_triton.gated_pool(kv, gate, weight, EPS, cos, sin)
    two = norm_triton.apply_rope(norm_triton.gated_pool(kv, gate, weight, EPS), cos, sin)
    assert fused.dtype == dtype and torch.equal(fused, two)
    ref = torch_ref.apply_rope(torch_ref.gated_pool(kv, gate, weight, EPS), cos, sin)
    assert _rel_err(fused, ref) < (FP32_TOL if dtype == torch.float32 else ROPE_BF16_TOL)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("bias_rope", [True, False], ids=["ape_rope", "plain"])
def test_compress_windows(
    norm_triton: ModuleType, monkeypatch: pytest.MonkeyPatch, case: str, bias_rope: bool
) -> None:
    """compress_windows (a compressor's step from the planners' real plans) in two or three
    launches, the ring copy only where the compressor overlaps: the entries (returned, and in
    the entry pool from the pooling's store) and both rings bit for bit torch_ref's gathers +
    this backend's gated_pool and apply_rope (the same values in the same order), and within
    FP32_TOL of torch_ref's entries. ``plain``: no gate bias and no rotation (DeepSeek-V4.1's
    compressor)."""
    step = compress_step(case, 16 if "csa" in case else 24, bias_rope, len(case) + bias_rope)
    args = (step.ape, step.weight, EPS, step.cos, step.sin)
    states = {name: step.fresh_state() for name in ("ref", "ours", "fast")}
    ref = torch_ref.compress_windows(step.kv, step.gate, step.rows(states["ref"]), *args)
    pool_module = sys.modules["deepinfer.ops.norm.triton_pool"]
    kernels = ("_compress_pool_kernel", "_compress_keep_kernel")
    launches = {name: Launches(getattr(pool_module, name)) for name in kernels}
    for name, launch in launches.items():
        monkeypatch.setattr(pool_module, name, launch)
    fast = norm_triton.compress_windows(step.kv, step.gate, step.rows(states["fast"]), *args)
    seen = [(name, grid) for name, launch in launches.items() for grid in launch.grids]
    monkeypatch.setattr(torch_ref, "gated_pool", norm_triton.gated_pool)
    monkeypatch.setattr(torch_ref, "apply_rope", norm_triton.apply_rope)
    ours = torch_ref.compress_windows(step.kv, step.gate, step.rows(states["ours"]), *args)

    num_windows, plan = step.num_windows, step.plan
    assert fast.shape == (num_windows, step.weight.shape[0]) and torch.equal(fast, ours)
    if num_windows:
        assert _rel_err(fast, ref) < FP32_TOL
    pool = states["fast"]["entries"]
    dst = torch.from_numpy(plan["entry_dst"])
    written = dst < (pool.shape[0] - 1) * pool.shape[1]  # not the scratch block's rows
    assert torch.equal(pool.flatten(0, 1)[dst[written]], fast[written])
    scratch = -1  # the scratch slot and block: discarded rows land there, in no set order
    for key, before in step.state.items():
        kept = states["fast"][key][:scratch]
        assert torch.equal(kept, states["ours"][key][:scratch]), key
        assert not torch.equal(kept, before[:scratch]) or not plan["last_window"].size, key
    expected = [("_compress_pool_kernel", (num_windows, 1))] if num_windows else []
    if "prev_kv" in step.state and plan["last_window"].size:
        expected.append(("_compress_keep_kernel", (plan["last_window"].size * step.ratio,)))
    expected.append(("_compress_keep_kernel", (plan["left_src"].size,)))
    assert sorted(seen) == sorted(expected)


@pytest.mark.parametrize("case", ONE_TOKEN)
@pytest.mark.parametrize("split", [False, True])
def test_compress_windows_keeps_in_the_pooling_launch(
    norm_triton: ModuleType, monkeypatch: pytest.MonkeyPatch, case: str, split: bool
) -> None:
    """A decode step (one token a request, no drafts: CompressRows.keep_in_pool): the overlap
    ring's and the buffer ring's keeps in the pooling's one launch, a program a window and one
    a kept token. The entries, the entry pool and both rings bitwise the three launches' (all
    but the scratch slot and block); ``split``: the windows over channel programs of 8 (the
    split lowered to 8 slots), each keeping its channels of the Ca half, the buffer ring's
    keeps in the first."""
    pool_module = sys.modules["deepinfer.ops.norm.triton_pool"]
    if split:
        monkeypatch.setattr(pool_module, "POOL_SPLIT_MIN_SLOTS", 8)
        monkeypatch.setattr(pool_module, "POOL_SPLIT_D", 8)
    dim = 16 if "csa" in case else 24
    step = compress_step(case, dim, True, len(case))
    args = (step.ape, step.weight, EPS, step.cos, step.sin)
    three, one = step.fresh_state(), step.fresh_state()
    expected = norm_triton.compress_windows(step.kv, step.gate, step.rows(three), *args)
    kernels = ("_compress_pool_kernel", "_compress_keep_kernel")
    launches = {name: Launches(getattr(pool_module, name)) for name in kernels}
    for name, launch in launches.items():
        monkeypatch.setattr(pool_module, name, launch)
    out = norm_triton.compress_windows(step.kv, step.gate, step.rows(one, True), *args)
    assert torch.equal(out, expected)
    for key in step.state:
        assert torch.equal(one[key][:-1], three[key][:-1]), key
    programs = step.num_windows + step.plan["left_src"].size
    channel_programs = dim // 8 if split else 1
    assert launches["_compress_pool_kernel"].grids == [(programs, channel_programs)]
    assert launches["_compress_keep_kernel"].grids == []


@pytest.mark.parametrize("case", ["hca_chunks", "hca_graphed"])
def test_compress_windows_split(
    norm_triton: ModuleType, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Windows of many slots (HCA's 128; here 8, the split lowered to them): channels in
    programs of 8 (24 = 3 programs, none masked; and 16 + a masked tail), slots in chunks of
    4, then one launch normalising and rotating each row. Bit for bit torch_ref's gathers +
    this backend's pooling (the same split), within FP32_TOL of torch_ref and of the
    one-program pool (the slots summed in other chunks); the rings bit for bit."""
    pool_module = sys.modules["deepinfer.ops.norm.triton_pool"]
    monkeypatch.setattr(pool_module, "POOL_SPLIT_MIN_SLOTS", 8)
    monkeypatch.setattr(pool_module, "POOL_SPLIT_BLOCK_S", 4)
    finish = Launches(pool_module._pool_finish_kernel)
    monkeypatch.setattr(pool_module, "_pool_finish_kernel", finish)
    for split_d, dim in ((8, 24), (16, 24)):
        monkeypatch.setattr(pool_module, "POOL_SPLIT_D", split_d)
        step = compress_step(case, dim, True, split_d)
        args = (step.ape, step.weight, EPS, step.cos, step.sin)
        fast_state, ref_state = step.fresh_state(), step.fresh_state()
        fast = norm_triton.compress_windows(step.kv, step.gate, step.rows(fast_state), *args)
        ref = torch_ref.compress_windows(step.kv, step.gate, step.rows(ref_state), *args)
        assert _rel_err(fast, ref) < FP32_TOL
        for key in step.state:  # the rings bit for bit; the entries are fast's rows
            if key != "entries":
                assert torch.equal(fast_state[key][:-1], ref_state[key][:-1]), key
        assert _rel_err(fast_state["entries"], ref_state["entries"]) < FP32_TOL
        with monkeypatch.context() as patch:  # torch_ref's gathers, this backend's pooling
            patch.setattr(torch_ref, "gated_pool", norm_triton.gated_pool)
            patch.setattr(torch_ref, "apply_rope", norm_triton.apply_rope)
            ours_rows = step.rows(step.fresh_state())
            ours = torch_ref.compress_windows(step.kv, step.gate, ours_rows, *args)
        assert torch.equal(fast, ours)
        monkeypatch.setattr(pool_module, "POOL_SPLIT_MIN_SLOTS", 1 << 20)
        whole_rows = step.rows(step.fresh_state())
        whole = norm_triton.compress_windows(step.kv, step.gate, whole_rows, *args)
        monkeypatch.setattr(pool_module, "POOL_SPLIT_MIN_SLOTS", 8)
        assert _rel_err(fast, whole) < FP32_TOL
    assert finish.grids == [(step.num_windows,)] * 4  # fast and ours, at both splits
