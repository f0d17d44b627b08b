"""The Triton attention kernels against torch_ref (the oracle), on the CPU through Triton's
interpreter, in fp32 (the interpreter's bf16 dots are not meaningful).

Shapes are tiny (the interpreter runs every program in numpy) but reach every path: 1 to 3 key
sources, -1 holes anywhere (whole tiles of them too), a query with no keys, one split and many
(split-KV decode, whose splits cross source boundaries), head counts that leave a block part
empty, and indexer entries past num_visible that hold garbage rows.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Triton decides interpreted or compiled when it decorates a kernel (its own tl helpers at
# import), and the choice sticks for the process: interpret only where nothing runs compiled.
if torch.cuda.is_available():
    pytest.skip(
        "CUDA is present: tests/gpu/test_gpu_triton_attention.py runs these kernels compiled "
        "(TRITON_INTERPRET would make every later kernel of this process interpreted)",
        allow_module_level=True,
    )
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "triton was imported compiled earlier in this process; run this file on its own",
        allow_module_level=True,
    )
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on numpy, on the CPU

pytest.importorskip("triton")

from deepinfer.ops.attention import BACKENDS, AttentionBackend
from deepinfer.ops.attention import torch_ref as ref
from deepinfer.ops.triton_interpret import patch_interpreter

patch_interpreter()

from triton_modules import Launches, contract_mismatches, no_sm_lookup  # noqa: E402

from deepinfer.ops.attention import triton as kernels  # noqa: E402

SEEDS = [0, 1]


def _rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out - expected).norm() / expected.norm()).item()


def _index_lists(
    gen: torch.Generator, num_q: int, length: int, num_rows: int, dtype: torch.dtype
) -> torch.Tensor:
    """[num_q, length] rows of a kv of num_rows, ~20% of them -1 holes at random places."""
    idx = torch.randint(0, num_rows, (num_q, length), generator=gen)
    holes = torch.rand(num_q, length, generator=gen) < 0.2
    return idx.masked_fill(holes, -1).to(dtype)


def _sources(
    gen: torch.Generator, num_q: int, lengths: tuple[int, ...], dim: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (kv, idx) per length; idx alternates int32 and int64, as the model may pass both."""
    sources = []
    for i, length in enumerate(lengths):
        num_rows = length + 7
        kv = torch.randn(num_rows, dim, generator=gen)
        dtype = torch.int32 if i % 2 == 0 else torch.int64
        sources.append((kv, _index_lists(gen, num_q, length, num_rows, dtype)))
    return sources


# fp32 throughout: only the summation order differs from the reference (observed ~4e-7).
ATTENTION_REL_TOL = 1e-5
ATTENTION_ABS_TOL = 1e-5

# V4's 64 heads in one block of 64 (the bf16 tiles on the GPU), here with fp32 IEEE dots.
WIDE = kernels.AttentionConfig(block_h=64, block_n=32, num_warps=8)

# (name, T, H, D, key count per source, SMs assumed, tiles or None for attention_config's):
# 132 SMs is an H200's; 1 forces one split.
ATTENTION_CASES = [
    ("one_source", 3, 4, 32, (37,), 132, None),
    ("two_sources", 3, 4, 32, (5, 41), 132, None),
    ("three_sources", 3, 4, 32, (3, 20, 45), 132, None),
    ("three_sources_one_split", 3, 4, 32, (3, 20, 45), 1, None),
    ("decode", 1, 8, 64, (1, 64, 200), 132, None),
    ("prefill", 40, 4, 32, (8, 16, 24), 132, None),
    ("prefill_one_split", 40, 4, 32, (8, 16, 24), 1, None),
    ("two_head_blocks", 5, 20, 32, (4, 30), 132, None),
    ("wide_head_block", 3, 64, 16, (7, 40, 70), 132, WIDE),
]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("name", "num_q", "num_heads", "dim", "lengths", "num_sms", "tiles"),
    ATTENTION_CASES,
    ids=[case[0] for case in ATTENTION_CASES],
)
def test_sparse_attention_matches_reference(
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    name: str,
    num_q: int,
    num_heads: int,
    dim: int,
    lengths: tuple[int, ...],
    num_sms: int,
    tiles: kernels.AttentionConfig | None,
) -> None:
    monkeypatch.setattr(kernels, "_num_sms", lambda device: num_sms)
    gen = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(num_q, num_heads, dim, generator=gen)  # peaked softmax rows
    sources = _sources(gen, num_q, lengths, dim)
    if num_q > 1:
        for _, idx in sources:
            idx[-1] = -1  # the last query sees no key: the sink takes all the weight, output 0
    last_idx = sources[-1][1]
    last_idx[0, : last_idx.shape[1] // 2] = -1  # whole tiles of holes before valid keys
    sinks = torch.randn(num_heads, generator=gen)
    scale = dim**-0.5

    config = tiles or kernels.attention_config(q.dtype, num_heads, num_q)
    num_head_blocks = -(-num_heads // config.block_h)
    num_splits, _ = kernels._split_keys(
        num_q, num_head_blocks, sum(lengths), config.block_n, num_sms
    )
    assert (num_splits > 1) == (num_sms > 1), f"{name}: {num_splits} splits"

    out = kernels.sparse_attention(q, sources, sinks, scale, config=tiles)
    expected = ref.sparse_attention(q, sources, sinks, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert num_q == 1 or not out[-1].any()
    assert _rel_err(out, expected) < ATTENTION_REL_TOL
    assert (out - expected).abs().max().item() < ATTENTION_ABS_TOL


@pytest.mark.parametrize("unpack_first", [False, True], ids=["in_kernel", "unpacked"])
@pytest.mark.parametrize("num_sms", [132, 1])
@pytest.mark.parametrize(("head_dim", "rope_dim"), [(64, 16), (256, 64)])
def test_packed_fp8_sources_are_read_as_their_values(
    monkeypatch: pytest.MonkeyPatch, num_sms: int, head_dim: int, rope_dim: int, unpack_first: bool
) -> None:
    """cache.kv_dtype = "fp8": the kernel reads packed rows (one group of 8 rows, two of 3: the
    ring's and the entries' shapes) as their exact values, beside dense sources: torch_ref's
    result over the same packed rows. From UNPACK_MIN_TOKENS query tokens the rows are unpacked
    first (the distinct rows named, holes kept), with the same result."""
    from deepinfer.ops.attention.kv_fp8 import Fp8Layout, Fp8Rows

    monkeypatch.setattr(kernels, "_num_sms", lambda device: num_sms)
    monkeypatch.setattr(kernels, "UNPACK_MIN_TOKENS", 1 if unpack_first else 10**9)
    launches = Launches(kernels._sparse_attention_kernel)
    monkeypatch.setattr(kernels, "_sparse_attention_kernel", launches)
    gen = torch.Generator().manual_seed(3)
    layout, num_q, heads = Fp8Layout(head_dim, rope_dim), 5, 4
    ring = Fp8Rows.of(torch.zeros(3, 8, layout.row_bytes, dtype=torch.uint8), layout)
    ring.store(torch.arange(24), torch.randn(24, head_dim, generator=gen))
    entries = Fp8Rows.of(torch.zeros(4, 3, layout.row_bytes, dtype=torch.uint8), layout)
    entries.store(torch.arange(12), torch.randn(12, head_dim, generator=gen))
    step = (torch.randn(num_q, head_dim, generator=gen), torch.arange(num_q).view(-1, 1))
    sources = [
        step,
        (ring, _index_lists(gen, num_q, 9, 24, torch.int64)),
        (entries, _index_lists(gen, num_q, 7, 12, torch.int64)),
    ]
    q = torch.randn(num_q, heads, head_dim, generator=gen)
    sinks = torch.randn(heads, generator=gen)
    out = kernels.sparse_attention(q, sources, sinks, head_dim**-0.5)
    expected = ref.sparse_attention(q, sources, sinks, head_dim**-0.5)
    assert _rel_err(out, expected) < ATTENTION_REL_TOL
    assert (out - expected).abs().max().item() < ATTENTION_ABS_TOL
    assert [launch["PACKED"] for launch in launches.keywords] == [not unpack_first]


@pytest.mark.parametrize(("head_dim", "rope_dim"), [(64, 16), (256, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_kernel_writes_the_bytes_of_fp8_layout_pack(
    head_dim: int, rope_dim: int, dtype: torch.dtype
) -> None:
    """The backend's cache writes: ``store_rows`` into a packed part gives the bytes of
    ``Fp8Layout.pack`` (scales included, the rows it does not name untouched), ``as_stored``
    the values of ``Fp8Layout.roundtrip``, bit for bit. The rows span many binades, zeros, a
    tile whose amax is exactly 448 x 2^k (scale 2^k, not 2^(k+1)) and tiny values (the 1e-4
    floor on the scale)."""
    from deepinfer.ops.attention.kv_fp8 import Fp8Layout, Fp8Rows

    gen = torch.Generator().manual_seed(5)
    layout = Fp8Layout(head_dim, rope_dim)
    values = torch.randn(9, head_dim, generator=gen) * torch.logspace(-6, 3, 9).unsqueeze(1)
    values[1] = 0.0
    values[2, :] = 0.5
    values[2, 0] = 448.0 * 4
    values[3, : layout.tile] *= 1e-9
    values = values.to(dtype)
    backend = kernels.TritonAttentionBackend(torch.device("cpu"))
    before = torch.randint(0, 256, (4, 3, layout.row_bytes), generator=gen, dtype=torch.uint8)
    part = before.clone()
    index = torch.tensor([11, 0, 4, 5, 9, 1, 2, 7, 6])
    backend.store_rows(Fp8Rows.of(part, layout), index, values)
    expected = before.clone()
    Fp8Rows.of(expected, layout).store(index, values)
    assert torch.equal(part, expected)
    untouched = torch.tensor([3, 8, 10])
    for name in ("data", "scales"):
        now, then = (getattr(Fp8Rows.of(p, layout), name).flatten(0, 1) for p in (part, before))
        assert torch.equal(now[untouched], then[untouched])
    stored = backend.as_stored(Fp8Rows.of(part, layout), values)
    assert stored.dtype == dtype and torch.equal(stored, layout.roundtrip(values))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_rows_gathers_its_rows_in_the_launch(dtype: torch.dtype) -> None:
    """``store_rows(target, index, values, rows)``: values[rows] into target's rows at index in
    one launch, dense (cast to the target's dtype) and packed, bit for bit torch_ref's gather
    then store; the rows it does not name untouched."""
    from deepinfer.ops.attention.kv_fp8 import Fp8Layout, Fp8Rows
    from deepinfer.ops.attention.kv_fp8 import store_rows as reference

    gen = torch.Generator().manual_seed(6)
    layout = Fp8Layout(128, 64)
    values = (torch.randn(7, 128, generator=gen) * 3).to(dtype)
    rows, index = torch.tensor([6, 0, 3, 3]), torch.tensor([9, 2, 5, 0])
    dense = torch.randn(10, 128, generator=gen).to(torch.bfloat16)
    packed = torch.randint(0, 256, (4, 3, layout.row_bytes), generator=gen, dtype=torch.uint8)
    for target, view in ((dense, lambda t: t), (packed, lambda t: Fp8Rows.of(t, layout))):
        expected = target.clone()
        reference(view(expected), index, values[rows])
        kernels.store_rows(view(target), index, values, rows)
        assert torch.equal(target, expected)
    before = dense.clone()
    kernels.store_rows(dense, index[:2], values[:2])  # no rows: values in order
    assert torch.equal(dense[index[:2]], values[:2].to(dense.dtype))
    assert torch.equal(dense[[1, 3, 4]], before[[1, 3, 4]])


def test_backend_object_launches_with_its_sm_count_and_tiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TritonAttentionBackend keeps the SM count of the device it was made for (the
    interpreter's stand-in, an H200's 132) and its tile override, and launches by them, never
    asking the module again. 68 keys in tiles of 32 for 3 tokens: 132 SMs cut 3 splits (one
    tile each), one SM none."""
    tiles = kernels.AttentionConfig(block_h=16, block_n=32, num_warps=4)
    backend = kernels.TritonAttentionBackend(torch.device("cpu"), config=tiles)
    assert backend.num_sms == 132 and backend.config is tiles
    assert contract_mismatches(backend, AttentionBackend) == []
    monkeypatch.setattr(kernels, "_num_sms", no_sm_lookup)
    monkeypatch.setattr(
        kernels,
        "attention_config",
        lambda *args, **kwargs: pytest.fail("the tile override was ignored"),
    )
    launches = Launches(kernels._sparse_attention_kernel)
    monkeypatch.setattr(kernels, "_sparse_attention_kernel", launches)
    gen = torch.Generator().manual_seed(5)
    q = 2 * torch.randn(3, 4, 32, generator=gen)
    sources = _sources(gen, 3, (3, 20, 45), 32)
    sinks = torch.randn(4, generator=gen)
    expected = ref.sparse_attention(q, sources, sinks, 32**-0.5)
    for num_sms in (132, 1):
        backend.num_sms = num_sms
        out = backend.sparse_attention(q, sources, sinks, 32**-0.5)
        assert _rel_err(out, expected) < ATTENTION_REL_TOL
    assert launches.grids == [(3, 1, 3), (3, 1, 1)]
    assert backend.indexer_scores is kernels.indexer_scores


@pytest.mark.parametrize("num_sms", [132, 1], ids=["split", "one_split"])
@pytest.mark.parametrize(("num_q", "dim", "rope_dim"), [(1, 64, 16), (3, 256, 256)])
def test_out_rope_rotates_the_output_in_its_store(
    monkeypatch: pytest.MonkeyPatch, num_sms: int, num_q: int, dim: int, rope_dim: int
) -> None:
    """sparse_attention(..., out_rope=(cos, -sin)) is bitwise apply_rope on the output (fp32:
    the same products and sums as torch_ref's), in the attention kernel's store and in the
    combine's; D = 256 with every channel RoPE puts pairs in both of the combine's 128-channel
    blocks. torch_ref's out_rope is its apply_rope after."""
    from deepinfer.ops.norm import rope_cos_sin
    from deepinfer.ops.norm.torch_ref import apply_rope

    monkeypatch.setattr(kernels, "_num_sms", lambda device: num_sms)
    gen = torch.Generator().manual_seed(dim + num_q)
    q = 2 * torch.randn(num_q, 4, dim, generator=gen)
    sources = _sources(gen, num_q, (1, 20, 45), dim)
    sinks = torch.randn(4, generator=gen)
    positions = torch.randint(0, 100_000, (num_q,), generator=gen)
    cos, sin = rope_cos_sin(positions, 1.0 / 10000.0 ** (torch.arange(0, rope_dim, 2) / rope_dim))
    back = (cos, -sin)
    combines = Launches(kernels._combine_splits_kernel)
    monkeypatch.setattr(kernels, "_combine_splits_kernel", combines)
    plain = kernels.sparse_attention(q, sources, sinks, dim**-0.5)
    fused = kernels.sparse_attention(q, sources, sinks, dim**-0.5, out_rope=back)
    assert len(combines.grids) == (2 if num_sms > 1 else 0)
    assert torch.equal(fused, apply_rope(plain, *back))
    assert torch.equal(fused[..., : dim - rope_dim], plain[..., : dim - rope_dim])
    expected = ref.sparse_attention(q, sources, sinks, dim**-0.5, out_rope=back)
    assert torch.equal(
        expected, apply_rope(ref.sparse_attention(q, sources, sinks, dim**-0.5), *back)
    )
    assert _rel_err(fused, expected) < ATTENTION_REL_TOL


def test_sparse_attention_without_queries() -> None:
    q, kv = torch.randn(0, 4, 32), torch.randn(5, 32)
    out = kernels.sparse_attention(
        q, [(kv, torch.zeros(0, 3, dtype=torch.int64))], torch.zeros(4), 1.0
    )
    assert out.shape == (0, 4, 32)


# fp32: summation order only (observed ~1.5e-7), relative to the visible scores.
INDEXER_REL_TOL = 1e-5

# Tokens of two requests: num_visible 0, partial, full (= N) and past N (all visible).
TOKEN_REQ = [0, 0, 0, 1, 1, 1, 0]
NUM_VISIBLE = [0, 10, 133, 150, 1, 70, 97]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("num_heads", [4, 6])
def test_indexer_scores_matches_reference(seed: int, num_heads: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_entries, dim, num_keys = 150, 32, 400
    num_q = len(TOKEN_REQ)
    q = torch.randn(num_q, num_heads, dim, generator=gen)
    weights = torch.randn(num_q, num_heads, generator=gen) * num_heads**-0.5
    keys = torch.randn(num_keys, dim, generator=gen)
    entry_rows = torch.randint(0, num_keys, (2, num_entries), generator=gen)
    # Request 0's tokens see at most 133 entries: the rest are garbage rows out of the pool
    # (a load of one would fault or read junk), as in a partly filled block table.
    entry_rows[0, 133:] = torch.randint(num_keys + 10**6, num_keys + 2 * 10**6, (17,))
    entry_rows[0, 140:] = -(10**6)
    token_req = torch.tensor(TOKEN_REQ)
    num_visible = torch.tensor(NUM_VISIBLE, dtype=torch.int32)

    out = kernels.indexer_scores(q, weights, keys, entry_rows, token_req, num_visible)
    expected = ref.indexer_scores(q, weights, keys, entry_rows, token_req, num_visible)
    assert out.shape == (num_q, num_entries) and out.dtype == torch.float32
    visible = torch.arange(num_entries) < num_visible.unsqueeze(1)
    assert torch.equal(out == float("-inf"), ~visible)
    assert torch.isfinite(out[visible]).all()
    assert _rel_err(out[visible], expected[visible]) < INDEXER_REL_TOL
    # The model's weights: the projection's output (bf16 on the GPU) and V4's Hi^-0.5, scaled
    # in the kernel: bitwise the scores of weights.float() * scale made beforehand.
    raw = (weights * num_heads**0.5).to(torch.bfloat16)
    scale = num_heads**-0.5
    args = (keys, entry_rows, token_req, num_visible)
    for ops in (kernels, ref):
        scaled = ops.indexer_scores(q, raw, *args, weight_scale=scale)
        assert torch.equal(scaled, ops.indexer_scores(q, raw.float() * scale, *args))
    scale = expected[visible].abs().max().item()
    assert (out[visible] - expected[visible]).abs().max().item() < INDEXER_REL_TOL * scale
    # q_rope: q's trailing 16 channels rotated in the kernel, bitwise the scores of q roped
    # beforehand (fp32: the same products and sums as torch_ref's apply_rope here).
    from deepinfer.ops.norm import rope_cos_sin
    from deepinfer.ops.norm.torch_ref import apply_rope

    positions = torch.randint(0, 100_000, (num_q,), generator=gen)
    rope = rope_cos_sin(positions, 1.0 / 10000.0 ** (torch.arange(0, 16, 2) / 16))
    roped = apply_rope(q, *rope)
    fused = kernels.indexer_scores(q, weights, *args, q_rope=rope)
    assert torch.equal(fused, kernels.indexer_scores(roped, weights, *args))
    expected = ref.indexer_scores(q, weights, *args, q_rope=rope)
    assert torch.equal(expected, ref.indexer_scores(roped, weights, *args))
    assert _rel_err(fused[visible], expected[visible]) < INDEXER_REL_TOL


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("num_entries", "k"), [(150, 8), (150, 64), (5, 8), (1, 1)])
def test_indexer_topk_picks_the_references_entries(seed: int, num_entries: int, k: int) -> None:
    """The same set of rows as torch_ref (ties to the lower column, -1 for -inf) at every
    width, with many exact ties (0, where every head's ReLU is) and negative scores."""
    gen = torch.Generator().manual_seed(seed)
    num_q = len(TOKEN_REQ)
    scores = torch.randn(num_q, num_entries, generator=gen)
    scores[torch.rand(num_q, num_entries, generator=gen) < 0.4] = 0.0
    scores[1, : num_entries // 2] = -scores[1, : num_entries // 2].abs()  # all <= 0
    visible = torch.arange(num_entries) < torch.tensor(NUM_VISIBLE).unsqueeze(1)
    scores = scores.masked_fill(~visible, float("-inf"))
    entry_rows = torch.randperm(2 * num_entries, generator=gen).view(2, num_entries)
    token_req = torch.tensor(TOKEN_REQ)

    out = kernels.indexer_topk(scores, entry_rows, token_req, k)
    expected = ref.indexer_topk(scores, entry_rows, token_req, k)
    assert out.shape == expected.shape == (num_q, min(k, num_entries))
    assert out.dtype == entry_rows.dtype
    assert torch.equal(out.sort(dim=1).values, expected.sort(dim=1).values)
    real = out >= 0
    assert torch.equal(real.sum(1), visible.sum(1).clamp(max=min(k, num_entries)))


@pytest.mark.parametrize(("num_entries", "k"), [(150, 8), (150, 200), (40, 16)])
def test_indexer_select_is_the_scores_then_the_topk(
    num_entries: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """indexer_select: the top-k in the scores' launch (a token's last program of 3 or 1), the
    rows of indexer_topk(indexer_scores(...)) bit for bit, q roped in it; tokens seeing none
    get -1s; the ticket counters reset; past SELECT_MAX_ENTRIES the two launches alike; and
    torch_ref's select is its own composition."""
    gen = torch.Generator().manual_seed(num_entries + k)
    num_q, num_heads, dim, num_keys = len(TOKEN_REQ), 4, 32, 400
    q = torch.randn(num_q, num_heads, dim, generator=gen)
    weights = torch.randn(num_q, num_heads, generator=gen)
    keys = torch.randn(num_keys, dim, generator=gen)
    entry_rows = torch.randint(0, num_keys, (2, num_entries), generator=gen)
    token_req = torch.tensor(TOKEN_REQ)
    num_visible = torch.tensor(NUM_VISIBLE, dtype=torch.int32).clamp(max=num_entries)
    rope = (torch.rand(num_q, 8, generator=gen), torch.rand(num_q, 8, generator=gen))
    args = (q, weights, keys, entry_rows, token_req, num_visible)
    picked = {}
    for ops in (kernels, ref):
        scores = ops.indexer_scores(*args, 0.5, rope)
        expected = ops.indexer_topk(scores, entry_rows, token_req, k)
        out = picked[ops] = ops.indexer_select(*args, k, 0.5, rope)
        assert out.dtype == entry_rows.dtype and torch.equal(out, expected), ops.__name__
        assert (out[0] == -1).all()  # token 0 sees no entry
    assert not kernels.ticket_counters(q.device).any()
    monkeypatch.setattr(kernels, "SELECT_MAX_ENTRIES", num_entries - 1)
    assert torch.equal(kernels.indexer_select(*args, k, 0.5, rope), picked[kernels])


def test_flashmla_then_triton_are_preferred_but_need_cuda() -> None:
    assert BACKENDS.names == ["flashmla", "triton", "torch_ref"]
    assert type(BACKENDS.select("auto", torch.device("cpu"))) is ref.TorchRefAttentionBackend
    with pytest.raises(ValueError, match="triton kernels run on CUDA devices, not cpu"):
        BACKENDS.select("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="FlashMLA runs on CUDA devices, not cpu"):
        BACKENDS.select("flashmla", torch.device("cpu"))
