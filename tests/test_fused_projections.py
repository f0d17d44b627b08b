"""One GEMM per kind for the projections that read the same input (``FusedLinears``): which
linears join (dense ones of one dtype, FP8 ones of one block size), that their weights (and
scales) become views of one tensor, and that each module's block of the fused output is its own
output; and that the loader fuses every V4 attention's input projections, its wq_b with the
indexer's, and each shared expert's w1 and w3 (the oracle tests check the fused model against
transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.engine.weights_loading import load_model
from deepinfer.model.deepseek_v4.args import CSA
from deepinfer.model.deepseek_v4.model import MLP, Attention
from deepinfer.model.families import load_family
from deepinfer.model.layers import Fp8Linear, FusedLinears, project
from deepinfer.ops import reference_kernels
from deepinfer.ops.linear import torch_ref as linear_ref


def test_the_dense_linears_of_one_dtype_join_as_views() -> None:
    torch.manual_seed(0)
    a, b, c = (nn.Linear(16, n, bias=False) for n in (8, 4, 6))
    other_dtype = nn.Linear(16, 5, bias=False).double()
    biased = nn.Linear(16, 3)
    x = torch.randn(7, 16)
    expected = {m: m(x) for m in (a, b, c)}
    params_before = sum(p.numel() for m in (a, b, c) for p in m.parameters())

    fused = FusedLinears([a, other_dtype, b, biased, c])
    assert fused.modules == (a, b, c) and len(fused.groups) == 1
    storage = fused.groups[0].weight.untyped_storage().data_ptr()
    assert all(m.weight.untyped_storage().data_ptr() == storage for m in (a, b, c))
    assert sum(p.numel() for m in (a, b, c) for p in m.parameters()) == params_before
    out = fused.outputs(x)
    assert set(out) == {a, b, c}
    for m in (a, b, c):
        torch.testing.assert_close(out[m], expected[m], rtol=1e-6, atol=1e-6)
        assert torch.equal(m(x), expected[m])  # the module reads the same values through its view
        assert project(m, x, out) is out[m]
    assert torch.equal(project(biased, x, out), biased(x))  # not fused: runs alone
    assert FusedLinears([a]).outputs(x) == {}  # one linear: nothing to join


def test_fp8_linears_of_one_block_size_join_as_one_fp8_gemm() -> None:
    """FP8 linears (whole block rows) join apart from the dense ones: their weights and block
    scales become views of one tensor each, the input is quantized once, and each block of the
    output is the module's own (the same scales and codes: equal up to summation order). One
    whose rows end inside a block, or of another block size, runs alone."""
    torch.manual_seed(1)
    block = (16, 16)
    backend = reference_kernels().linear

    def fp8(out_features: int, in_features: int = 32, blk: tuple[int, int] = block) -> Fp8Linear:
        module = Fp8Linear(in_features, out_features, blk, backend)
        weight, scale = linear_ref.quantize_fp8(torch.randn(out_features, in_features), blk)
        module.weight = nn.Parameter(weight, requires_grad=False)
        module.scale = nn.Parameter(scale, requires_grad=False)
        return module

    a, b, partial, other_block = fp8(48), fp8(32), fp8(24), fp8(32, blk=(32, 32))
    dense = [nn.Linear(32, n, bias=False) for n in (8, 4)]
    x = torch.randn(5, 32)
    expected = {m: m(x) for m in (a, b, partial, other_block, *dense)}

    fused = FusedLinears([a, dense[0], b, partial, other_block, dense[1]])
    assert fused.modules == (a, b, *dense)  # kinds in the order they first appear
    assert len(fused.groups) == 2
    [group] = [g for g in fused.groups if g.scale is not None]
    assert group.modules == (a, b) and group.weight.shape == (80, 32)
    assert group.scale is not None and group.scale.shape == (5, 2)
    for m in (a, b):
        assert m.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
        assert m.scale.untyped_storage().data_ptr() == group.scale.untyped_storage().data_ptr()
    out = fused.outputs(x)
    assert set(out) == {a, b, *dense}
    for m in (a, b, *dense):
        torch.testing.assert_close(out[m], expected[m], rtol=1e-5, atol=1e-5)
        assert torch.equal(m(x), expected[m])  # the views hold the same codes and scales
    for alone in (partial, other_block):
        assert alone not in out and torch.equal(project(alone, x, out), expected[alone])


def test_the_loader_fuses_every_attentions_input_projections(oracle_hf_dir: Path) -> None:
    family = load_family("deepseek_v4")
    args = family.parse_args(json.loads((oracle_hf_dir / "config.json").read_text()))
    loaded = load_model(
        ModelConfig(),
        family,
        oracle_hf_dir,
        args,
        reference_kernels(),
        torch.device("cpu"),
        torch.float32,
    )
    shared_experts = [m for m in loaded.model.modules() if isinstance(m, MLP)]
    assert shared_experts and all(m.fused.modules == (m.w1, m.w3) for m in shared_experts)
    attentions = [m for m in loaded.model.modules() if isinstance(m, Attention)]
    assert attentions
    for attn in attentions:
        joined = 2 + (2 if attn.ratio else 0) + (3 if attn.layer_type == CSA else 0)
        assert len(attn.fused.modules) == joined, (attn.layer_id, attn.layer_type)
        x = torch.randn(3, args.hidden_size)
        out = attn.fused.outputs(x)
        for module in attn.fused.modules:
            torch.testing.assert_close(out[module], module(x), rtol=1e-5, atol=1e-5)
        q_joined = (attn.wq_b, attn.indexer.wq_b) if attn.layer_type == CSA else ()
        assert attn.fused_q.modules == q_joined, attn.layer_id
        qr = torch.randn(3, args.q_lora_rank)
        for module, y in attn.fused_q.outputs(qr).items():
            torch.testing.assert_close(y, module(qr), rtol=1e-5, atol=1e-5)


def test_v41_fused_projections_give_the_unfused_logits() -> None:
    """V4.1 has no oracle: its fused model must give what the same weights give unfused."""
    from deepinfer.kv_cache.pool import KVCache
    from deepinfer.model.batch import ForwardBatch, SeqSpan
    from deepinfer.model.deepseek_v41.args import ModelArgs
    from deepinfer.model.deepseek_v41.model import Attention as Attention41
    from deepinfer.model.deepseek_v41.tiny import TINY_CONFIG

    family = load_family("deepseek_v41")
    args = ModelArgs.from_dict(TINY_CONFIG)
    cpu = torch.device("cpu")
    torch.set_num_threads(2)
    weights = family.random_weights(args, 0, cpu, torch.float32, fp8_block=None)
    models = []
    for fuse in (False, True):
        with torch.device("meta"):
            built = family.build_model(args, reference_kernels())
        built.load_state_dict(dict(weights), strict=True, assign=True)
        if fuse:
            family.init_buffers(built, cpu)
        else:
            built.init_buffers(cpu)
        models.append(built.eval())
    attentions = [m for m in models[1].modules() if isinstance(m, Attention41)]
    assert sum(len(a.fused.modules) for a in attentions) > 2 * len(attentions)
    for attn in attentions:  # a compressor that reads the YoCo shared state is not fused
        if hasattr(attn, "compressor"):
            assert (attn.compressor.wkv in attn.fused.modules) == (not attn.compresses_shared)

    num_tokens = 40
    ids = torch.randint(3, 120000, (num_tokens,), generator=torch.Generator().manual_seed(1))
    logits = []
    for built in models:
        spec = family.cache_spec(args, block_size=16, ring_margin=2, max_draft=0)
        cache = KVCache(spec, num_blocks=8, num_slots=2, dtype=torch.float32, device=cpu)
        batch = ForwardBatch(
            input_ids=ids,
            positions=torch.arange(num_tokens),
            seqs=[SeqSpan(0, num_tokens, 0, 0, list(range(-(-num_tokens // 16))))],
            logits_indices=torch.arange(num_tokens),
        )
        logits.append(built(batch, cache))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
