"""Routed experts kept as the checkpoint ships them (MXFP4: e2m1 + ue8m0 per 32 inputs).

The quantizer, the tiny quantized checkpoint (``make-tiny-model --quantized``), the loader's
``keep_fp4`` in both namings and under expert parallelism, its errors, and the engine: packed
experts give the tokens and logprobs of the same weights dequantized, in a quarter of the bytes
(fp32 runs: the torch reference dequantizes each expert exactly, so equality is exact). The
Triton kernel's packed path is checked in test_triton_moe.py (interpreter) and
tests/gpu/test_gpu_triton_moe.py (bf16, CUDA graphs).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.cli import main as cli_main
from deepinfer.model.deepseek_v4.checkpoint import CheckpointError, fp8_block, load_checkpoint
from deepinfer.model.deepseek_v4.checkpoint import load_model_args as load_args
from deepinfer.model.deepseek_v4.weights import held_bytes, is_fp8_linear
from deepinfer.model.layers import dequantize_small_fp8_linears
from deepinfer.ops.linear import dequantize_fp8
from deepinfer.ops.moe import Mxfp4Weight, quantize_mxfp4
from deepinfer.ops.moe.torch_ref import E2M1_VALUES

EXPERTS = ("w1", "w2", "w3")


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "quantized"
    assert cli_main(["make-tiny-model", str(folder), "--quantized", "--seed", "2"]) == 0
    return folder


def _load(folder: Path, **kw) -> dict[str, torch.Tensor]:
    return load_checkpoint(folder, load_args(folder), show_progress=False, **kw)


def test_quantizer_picks_the_nearest_value_on_the_smallest_unclipped_scale() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 4, 96, generator=gen) * torch.rand(3, 4, 96, generator=gen) * 0.1
    weight[0, 0, :32] = 0.0  # an all-zero group
    packed = quantize_mxfp4(weight)
    values = packed.dequantize()
    scale = torch.exp2(packed.scale.float() - 127).repeat_interleave(32, -1)
    grid = torch.tensor(E2M1_VALUES)[None, None, None, :] * scale[..., None]  # [E, N, K, 16]
    assert torch.equal((values - weight).abs(), (grid - weight[..., None]).abs().amin(-1))
    amax = weight.unflatten(-1, (3, 32)).abs().amax(-1)
    group_scale = torch.exp2(packed.scale.float() - 127)
    used = amax > 0
    assert (amax[used] <= 6 * group_scale[used]).all()  # nothing clips ...
    assert (amax[used] > 3 * group_scale[used]).all()  # ... and half the scale would clip
    assert packed.scale[0, 0, 0] == 0 and (values[0, 0, :32] == 0).all()
    # Values already on the grid come back exactly.
    assert torch.equal(quantize_mxfp4(values).dequantize(), values)


def test_quantized_tiny_checkpoint_is_stored_as_v4_flash_stores_it(quantized_dir: Path) -> None:
    config = json.loads((quantized_dir / "config.json").read_text())
    assert config["expert_dtype"] == "fp4"
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    with safe_open(quantized_dir / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        w1 = f.get_tensor("layers.2.ffn.experts.5.w1.weight")
        w1_scale = f.get_tensor("layers.2.ffn.experts.5.w1.scale")
        wq_b = f.get_tensor("layers.1.attn.wq_b.weight")
        wq_b_scale = f.get_tensor("layers.1.attn.wq_b.scale")
    assert (w1.dtype, tuple(w1.shape)) == (torch.int8, (32, 32))  # [I, D/2]
    assert (w1_scale.dtype, tuple(w1_scale.shape)) == (torch.float8_e8m0fnu, (32, 2))
    assert wq_b.dtype == torch.float8_e4m3fn and wq_b_scale.dtype == torch.float8_e8m0fnu
    fp8 = [k for k in keys if k.endswith(".weight") and is_fp8_linear(k)]
    assert fp8 and all(f"{k.removesuffix('.weight')}.scale" in keys for k in fp8)


def test_loader_keeps_fp4_experts_packed_in_both_namings_and_per_rank(
    quantized_dir: Path, tmp_path: Path
) -> None:
    packed = _load(quantized_dir, keep_fp4=True)
    dense = _load(quantized_dir)
    file = load_file(quantized_dir / "model.safetensors")
    w1, scales = packed["layers.4.ffn.experts.w1"], packed["layers.4.ffn.experts.w1_scales"]
    assert (w1.dtype, tuple(w1.shape), tuple(scales.shape)) == (
        torch.uint8,
        (8, 32, 32),
        (8, 32, 2),
    )
    assert torch.equal(w1[3].view(torch.int8), file["layers.4.ffn.experts.3.w1.weight"])
    for layer in range(6):
        for proj in EXPERTS:
            name = f"layers.{layer}.ffn.experts.{proj}"
            weight = Mxfp4Weight(packed[name], packed[f"{name}_scales"])
            assert torch.equal(weight.dequantize(), dense[name]), name
    assert {n for n in packed if not n.endswith("_scales")} == set(dense)
    # Expert parallelism: a rank reads only its experts' bytes.
    share = _load(quantized_dir, keep_fp4=True, experts=range(4, 8))
    assert torch.equal(share["layers.4.ffn.experts.w2"], packed["layers.4.ffn.experts.w2"][4:])
    # transformers' stacked naming: gate_up rows split into w1 and w3, scales alongside.
    stacked = {k: v for k, v in file.items() if ".ffn.experts." not in k}
    for layer in range(6):
        p = f"layers.{layer}.ffn.experts"
        for proj in EXPERTS:
            stacked[f"{p}.{proj}"] = packed[f"{p}.{proj}"].view(torch.int8)
            stacked[f"{p}.{proj}_scales"] = packed[f"{p}.{proj}_scales"]
        hf = f"model.layers.{layer}.mlp.experts"
        stacked[f"{hf}.gate_up_proj"] = torch.cat(
            [stacked.pop(f"{p}.w1"), stacked.pop(f"{p}.w3")], 1
        )
        stacked[f"{hf}.gate_up_proj_scale_inv"] = torch.cat(
            [stacked.pop(f"{p}.w1_scales"), stacked.pop(f"{p}.w3_scales")], 1
        ).view(torch.float8_e8m0fnu)
        stacked[f"{hf}.down_proj"] = stacked.pop(f"{p}.w2")
        # fp32 power-of-two scales are ue8m0 scales too.
        stacked[f"{hf}.down_proj_scale_inv"] = torch.exp2(
            stacked.pop(f"{p}.w2_scales").float() - 127
        )
    hf_dir = _write(tmp_path / "stacked", stacked, quantized_dir)
    from_hf = _load(hf_dir, keep_fp4=True)
    assert list(from_hf) == list(packed)
    for name, tensor in packed.items():
        assert torch.equal(from_hf[name], tensor), name


def test_loader_errors_on_packed_experts_it_cannot_keep(
    quantized_dir: Path, tmp_path: Path
) -> None:
    file = load_file(quantized_dir / "model.safetensors")
    key = "layers.3.ffn.experts.6.w2"
    # A scale that is not a power of two cannot be a ue8m0 byte.
    bad = dict(file)
    bad[f"{key}.scale"] = bad[f"{key}.scale"].float() * 1.5
    message = re.escape(f"{key}.weight") + ".*scale is not a power of two"
    with pytest.raises(CheckpointError, match=message):
        _load(_write(tmp_path / "scale", bad, quantized_dir), keep_fp4=True)
    _load(tmp_path / "scale")  # dequantizing it is fine
    # One expert dense among packed ones.
    mixed = dict(file)
    scale = mixed.pop(f"{key}.scale")
    mixed[f"{key}.weight"] = Mxfp4Weight(
        mixed[f"{key}.weight"].view(torch.uint8)[None], scale.view(torch.uint8)[None]
    ).dequantize()[0]
    with pytest.raises(CheckpointError, match=re.escape(f"{key}.weight") + ".*all packed FP4"):
        _load(_write(tmp_path / "mixed", mixed, quantized_dir), keep_fp4=True)


def _write(folder: Path, tensors: dict[str, torch.Tensor], config_from: Path) -> Path:
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    shutil.copyfile(config_from / "config.json", folder / "config.json")
    return folder


def test_engine_on_packed_experts_gives_the_tokens_of_the_dequantized_weights(
    quantized_dir: Path,
) -> None:
    torch.set_num_threads(2)
    prompts = ["Hello, my name is", "1 2 3 4 5", "The capital of France is Paris, and"]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3)
    runs = {}
    for fp4 in (True, False):
        llm = LLM(model=quantized_dir, device="cpu", block_size=16, fp4_experts=fp4)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs[fp4] = (
            [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs],
            llm.engine.executor.weight_bytes,
        )
        if fp4:  # what the loader measured: each layer's largest scale byte, passed on
            for name, experts in llm.engine.executor.model.named_modules():
                if name.endswith("ffn.experts"):
                    scales = [experts.get_parameter(f"w{i}_scales") for i in (1, 2, 3)]
                    assert experts.max_scale == max(int(t.max()) for t in scales), name
                    assert {w.max_scale for w in experts.weights()} == {experts.max_scale}
    (packed_out, packed_bytes), (dense_out, dense_bytes) = runs[True], runs[False]
    assert packed_out == dense_out
    assert len({tuple(tokens) for tokens, _ in packed_out}) == len(prompts)
    # fp32 dense: 4 bytes a weight; packed: half a byte plus one scale byte per 32.
    assert packed_bytes.routed_experts * 128 == dense_bytes.routed_experts * 17
    saved = dense_bytes.routed_experts - packed_bytes.routed_experts
    assert dense_bytes.total - packed_bytes.total == saved


@pytest.mark.parametrize(("keep_fp8", "keep_fp4"), [(False, False), (True, True), (False, True)])
def test_sizing_from_shapes_is_what_the_loader_holds(
    quantized_dir: Path, keep_fp8: bool, keep_fp4: bool
) -> None:
    """``held_bytes`` (for models too big to load here) counts exactly the loaded bytes, packed
    experts and FP8 linears with their scales included."""
    args = load_args(quantized_dir)
    state = _load(quantized_dir, keep_fp8=keep_fp8, keep_fp4=keep_fp4, experts=range(2, 6))
    loaded = sum(t.numel() * t.element_size() for t in state.values())
    block = fp8_block(args) if keep_fp8 else None
    assert loaded == held_bytes(args, 4, fp8_block=block, fp4_experts=keep_fp4, num_experts=4)


def test_small_fp8_linears_are_held_dequantized_and_sized_so(quantized_dir: Path) -> None:
    """``model.fp8_min_weights``: FP8 linears of fewer weights become dense (their exact
    dequantized values, scales dropped), and the sizing from shapes counts them so."""
    args = load_args(quantized_dir)
    block = fp8_block(args)
    state = _load(quantized_dir, keep_fp8=True, keep_fp4=True)
    fp8_sizes = {n: t.numel() for n, t in state.items() if t.dtype == torch.float8_e4m3fn}
    threshold = sorted(set(fp8_sizes.values()))[1]  # the smallest size goes dense, the rest stay
    expected = {
        n: dequantize_fp8(state[n], state[n.removesuffix(".weight") + ".scale"], block)
        for n, size in fp8_sizes.items()
        if size < threshold
    }
    assert expected and len(expected) < len(fp8_sizes)
    assert dequantize_small_fp8_linears(state, threshold, block, torch.float32) == len(expected)
    for name, values in expected.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], values)
        assert name.removesuffix(".weight") + ".scale" not in state
    kept = [n for n, t in state.items() if t.dtype == torch.float8_e4m3fn]
    assert len(kept) == len(fp8_sizes) - len(expected)
    loaded = sum(t.numel() * t.element_size() for t in state.values())
    sized = held_bytes(args, 4, fp8_block=block, fp4_experts=True, fp8_min_weights=threshold)
    assert loaded == sized
