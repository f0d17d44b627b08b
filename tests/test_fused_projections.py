"""One GEMM for the dense projections that read the same input (``FusedLinears``): which
linears join, that their weights become views of one tensor, and that each module's block of the
fused output is its own output; and that the loader fuses every V4 attention's input projections
(the oracle tests check the fused model against transformers)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from deepinfer.config import ModelConfig
from deepinfer.engine.weights_loading import load_model
from deepinfer.model.deepseek_v4.args import CSA
from deepinfer.model.deepseek_v4.model import Attention
from deepinfer.model.families import load_family
from deepinfer.model.layers import FusedLinears, project
from deepinfer.ops import reference_kernels


def test_the_dense_linears_of_one_dtype_join_as_views() -> None:
    torch.manual_seed(0)
    a, b, c = (nn.Linear(16, n, bias=False) for n in (8, 4, 6))
    other_dtype = nn.Linear(16, 5, bias=False).double()
    biased = nn.Linear(16, 3)
    x = torch.randn(7, 16)
    expected = {m: m(x) for m in (a, b, c)}
    params_before = sum(p.numel() for m in (a, b, c) for p in m.parameters())

    fused = FusedLinears([a, other_dtype, b, biased, c])
    assert fused.modules == (a, b, c) and fused.weight is not None
    storage = fused.weight.untyped_storage().data_ptr()
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
    attentions = [m for m in loaded.model.modules() if isinstance(m, Attention)]
    assert attentions
    for attn in attentions:
        joined = 2 + (2 if attn.ratio else 0) + (3 if attn.layer_type == CSA else 0)
        assert len(attn.fused.modules) == joined, (attn.layer_id, attn.layer_type)
        x = torch.randn(3, args.hidden_size)
        out = attn.fused.outputs(x)
        for module in attn.fused.modules:
            torch.testing.assert_close(out[module], module(x), rtol=1e-5, atol=1e-5)
