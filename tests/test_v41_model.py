"""DeepSeek-V4.1's blocks and cache on the built-in tiny checkpoint, by exact identities (no
public V4.1 implementation runs on a CPU):

- the config's sharing maps and their checks; the cache spec (consumers own no compressed-KV or
  index-key bytes, C1 keeps no compressor state);
- cross-layer sharing: consumers reading their source's parts by key give the logits that
  reading an explicit copy of them gives, bit for bit;
- shifted hyper-connections against a reference written here from DeepSeek's description (each
  sub-layer's input collapses the streams with the previous sub-layer's mix; the first reads
  stream 0; the last mix feeds the head), within fp32 rounding;
- candidate blocks and top-k ties on hand-made scores; the engram's n-gram windows as the plan
  builds them against windows over the whole sequence;
- the loader: the release's names and FP8 32x32 / FP4 formats, errors that name the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch, SeqSpan
from deepinfer.model.deepseek_v4.checkpoint import CheckpointError
from deepinfer.model.deepseek_v41.args import ModelArgs
from deepinfer.model.deepseek_v41.engram import ngram_windows
from deepinfer.model.deepseek_v41.model import (
    CrossLayer,
    DeepseekV41,
    candidate_entries,
    top_entries,
)
from deepinfer.model.deepseek_v41.step_plan import build_metadata, engram_plan
from deepinfer.model.deepseek_v41.tiny import TINY_CONFIG, tiny_config
from deepinfer.model.families import load_family
from deepinfer.model.layers import step_rope
from deepinfer.ops import reference_kernels

FAMILY = load_family("deepseek_v41")
CPU = torch.device("cpu")
HC_TOL = 1e-5  # relative, logits of the reference loop (other op order) against the model's


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return ModelArgs.from_dict(TINY_CONFIG)


def random_model(args: ModelArgs) -> DeepseekV41:
    """The tiny V4.1 with random fp32 weights (seed 0), on the CPU, reference kernels."""
    torch.set_num_threads(2)
    weights = FAMILY.random_weights(args, 0, CPU, torch.float32, fp8_block=None)
    with torch.device("meta"):
        built = FAMILY.build_model(args, reference_kernels())
    built.load_state_dict(weights, strict=True, assign=True)
    FAMILY.init_buffers(built, CPU)
    return built.eval()


@pytest.fixture(scope="module")
def model(args: ModelArgs) -> DeepseekV41:
    return random_model(args)


def _cache(args: ModelArgs) -> KVCache:
    spec = FAMILY.cache_spec(args, block_size=16, ring_margin=2, max_draft=0)
    return KVCache(spec, num_blocks=8, num_slots=2, dtype=torch.float32, device=CPU)


def _batch(num_tokens: int = 40, seed: int = 1) -> ForwardBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 120000, (num_tokens,), generator=gen)
    span = SeqSpan(0, num_tokens, 0, 0, list(range(-(-num_tokens // 16))))
    return ForwardBatch(
        input_ids=ids,
        positions=torch.arange(num_tokens),
        seqs=[span],
        logits_indices=torch.arange(num_tokens),
    )


# --- Config and cache spec --------------------------------------------------------------------


def test_the_tiny_config_has_every_block_kind(args: ModelArgs) -> None:
    assert args.compress_ratios == (0, 2, 2, 2, 1, 1, 1, 1) and args.n_prefill_layer == 4
    assert [args.kv_source(i) for i in range(8)] == [0, 1, 1, 1, 4, 4, 4, 4]
    assert [args.index_k_source(i) for i in range(8)] == [0, 1, 1, 1, 4, 4, 4, 4]
    assert [args.index_source(i) for i in range(8)] == [0, 1, 1, 3, 4, 5, 5, 7]
    assert [args.candidate_source(i) for i in range(8)] == [None] * 5 + [4, 4, 4]
    assert args.engram is not None and args.engram.layer_ids == (0, 2)
    assert args.dspark is not None and args.num_mtp_layers == 2


def _text(**changes: object) -> dict:
    return {**TINY_CONFIG, "text_config": {**TINY_CONFIG["text_config"], **changes}}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kv_source_layer_ids": [1]}, r"layer 4 \(ratio 1\) would read layer 1 \(ratio 2\)"),
        ({"kv_source_layer_ids": [1, 5], "index_source_layer_ids": [1, 5]}, "ratio 1"),
        ({"index_source_layer_ids": [1, 2, 4], "index_k_source_layer_ids": [1, 3, 4]}, "index"),
        ({"candidate_topk_blocks": 1}, "is below index_topk=6"),
        ({"candidate_source_layer_id": 6}, "must be one of index_source_layer_ids"),
        ({"compress_ratios": [0, 4, 2, 2, 1, 1, 1, 1, 0, 0]}, "must be 0, 1 or 2"),
        ({"hc_shifted": False}, "hc_shifted=False is not supported"),
        ({"dspark_target_layer_ids": [3, 6]}, "one side of the YoCo boundary"),
    ],
)
def test_bad_configs_name_the_key(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_dict(_text(**changes))


def test_consumers_own_no_compressed_bytes(args: ModelArgs) -> None:
    spec = FAMILY.cache_spec(args, block_size=16, ring_margin=2, max_draft=0)
    paged = {p.key: (p.rows, p.row) for p in spec.paged}
    assert paged == {
        (1, "entries"): (8, 64),
        (4, "entries"): (16, 64),
        (1, "index_keys"): (8, 32),
        (4, "index_keys"): (16, 32),
    }
    state = {p.key: p.rows for p in spec.state}
    # Every layer's window ring (8 + 2 rows); the C2 KV source's buffer ring (ratio - 1 rows).
    assert state == {
        **{(i, "ring"): 10 for i in range(8)},
        (1, "comp.buf_kv"): 1,
        (1, "comp.buf_gate"): 1,
    }
    assert spec.bytes_per_block(torch.float32) == 4 * (8 * 64 + 16 * 64 + 8 * 32 + 16 * 32)
    with pytest.raises(ValueError, match="multiple of every compression ratio"):
        FAMILY.cache_spec(args, block_size=15, ring_margin=2, max_draft=0)


# --- Sharing, shifted hyper-connections --------------------------------------------------------


def test_aliased_sources_read_like_an_explicit_copy(model: DeepseekV41, args: ModelArgs) -> None:
    """Each consumer reads its own copy of its source's entries and keys, made right after the
    source wrote them: the logits are the aliased run's, bit for bit."""
    batch = _batch()
    aliased = model(batch, _cache(args))
    cache = _cache(args)
    consumers = [i for i in range(8) if args.ratio(i) and args.kv_source(i) != i]
    hooks = []
    for source in sorted({args.kv_source(i) for i in consumers}):

        def copy(module: torch.nn.Module, inputs: object, output: object, source=source) -> None:
            for consumer in (i for i in consumers if args.kv_source(i) == source):
                for part in ("entries", "index_keys"):
                    cache.tensors[consumer, part] = cache.tensors[source, part].clone()

        hooks.append(model.layers[source].attn.register_forward_hook(copy))
    saved = {}
    for i in consumers:
        attn = model.layers[i].attn
        saved[i] = attn.kv_layer
        attn.kv_layer = i
        if hasattr(attn, "indexer"):
            attn.indexer.keys_layer = i
    try:
        copied = model(_batch(), cache)
    finally:
        for hook in hooks:
            hook.remove()
        for i, layer in saved.items():
            model.layers[i].attn.kv_layer = layer
            if hasattr(model.layers[i].attn, "indexer"):
                model.layers[i].attn.indexer.keys_layer = layer
    assert torch.equal(aliased, copied)
    assert not torch.equal(aliased, model(_batch(seed=2), _cache(args)))


def _reference_mixes(x: torch.Tensor, fn, scale, base, a: ModelArgs):
    """pre, post, comb of one sub-layer: sigmoid gates and a Sinkhorn-normalised softmax over
    the RMS-normalised flat streams."""
    hc = x.shape[1]
    flat = x.flatten(1)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + a.rms_norm_eps)
    mix = flat @ fn.T
    pre = torch.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + a.hc_eps
    post = 2 * torch.sigmoid(mix[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = F.softmax(mix[:, 2 * hc :].view(-1, hc, hc) * scale[2] + base[2 * hc :].view(hc, hc), -1)
    comb = comb + a.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + a.hc_eps)
    for _ in range(a.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + a.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + a.hc_eps)
    return pre, post, comb


def test_shifted_hyper_connections_match_a_reference(model: DeepseekV41, args: ModelArgs) -> None:
    batch = _batch()
    expected = model(batch, _cache(args))
    cache, batch = _cache(args), _batch()
    batch.metadata = build_metadata(batch, cache, args)
    batch.metadata.derive_lists()
    batch.rope = step_rope(
        batch.positions, {kind: getattr(model, f"{kind}_inv_freq") for kind in ("main", "compress")}
    )
    rows = model._engram_rows(batch, batch.metadata)
    x = model.embed(batch.input_ids).unsqueeze(1).repeat(1, args.hc_mult, 1)  # [T, hc, D]
    pre = F.one_hot(torch.zeros(x.shape[0], dtype=torch.long), args.hc_mult).float()
    cross = CrossLayer()
    with torch.inference_mode():
        for i, layer in enumerate(model.layers):
            if i in rows:
                x = layer.engram(x, rows[i])
            for site in ("attn", "ffn"):
                params = [getattr(layer, f"hc_{site}_{p}") for p in ("fn", "scale", "base")]
                new_pre, post, comb = _reference_mixes(x, *params, args)
                h = getattr(layer, f"{site}_norm")((pre.unsqueeze(-1) * x).sum(1))  # previous mix
                if site == "attn" and layer.attn.is_yoco_boundary:
                    cross.shared_hidden = h  # the consumer half's KV sources compress it
                if site == "attn":
                    out = layer.attn(h, batch, cache, cross, model.compress_inv_freq)
                else:
                    out = layer.ffn(h, batch.input_ids)
                x = post.unsqueeze(-1) * out.unsqueeze(1) + comb.transpose(1, 2) @ x
                pre = new_pre
        logits = model.head(model.norm((pre.unsqueeze(-1) * x).sum(1))).float()
    rel = (logits - expected).abs().max() / expected.abs().max()
    assert rel < HC_TOL, f"relative difference {rel:.2e}"


# --- Candidate blocks, ties, engram windows ---------------------------------------------------


def test_candidate_blocks_keep_the_best_and_the_last_visible() -> None:
    inf = float("inf")
    scores = torch.tensor(
        [
            [0.1, 0.9, 0.2, 0.3, 0.0, 0.05, 0.8, -inf],  # 7 visible, blocks of 2
            [0.5, 0.1, -inf, -inf, -inf, -inf, -inf, -inf],  # 2 visible: one block
        ]
    )
    keep = candidate_entries(scores, torch.tensor([7, 2]), block_size=2, num_blocks=2)
    # Row 0: block 3 (the last visible, entry 6) always, then block 0 (0.9) over block 1 (0.3).
    assert keep[0].tolist() == [True, True, False, False, False, False, True, True]
    assert keep[1].tolist()[:2] == [True, True]


def test_ties_go_to_the_lower_entry_whatever_the_width() -> None:
    narrow = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0]])
    wide = torch.cat([narrow, torch.full((1, 30), float("-inf"))], dim=1)
    for scores in (narrow, wide):
        values, indices = top_entries(scores, 3)
        assert indices.tolist() == [[4, 1, 0]] and values.tolist() == [[2.0, 1.0, 0.0]]


def test_engram_windows_of_chunks_are_the_sequence_windows(args: ModelArgs) -> None:
    """Chunks of a sequence, their history from SeqSpan.history: the same windows (ids newest
    first, padding before position 0) as over the whole sequence."""
    ids = torch.arange(100, 123)
    whole = ngram_windows(ids, torch.arange(23), 3, -1)
    for cut in ((0, 1), (0, 2), (0, 5), (5, 23), (22, 23), (1, 23)):
        start, end = cut
        span = SeqSpan(
            0, end - start, start, 0, [0], history=ids[max(0, start - 2) : start].tolist()
        )
        plan = engram_plan([span], 3)
        src = torch.cat([torch.from_numpy(plan["engram_history"]), ids[start:end]])
        got = src[torch.from_numpy(plan["engram_src"])]
        assert torch.equal(got, whole[start:end]), cut


# --- Loader -----------------------------------------------------------------------------------


def test_the_release_layout_loads(tmp_path: Path, args: ModelArgs, model: DeepseekV41) -> None:
    """The tiny checkpoint in the release's layout: text_config, per-expert tensors, the
    drafter under mtp.*, FP8 32x32 and FP4 when quantized; each loads with every parameter."""
    from deepinfer.model.tiny import make_tiny_model

    plain = make_tiny_model(tmp_path / "plain", model_type="deepseek_v41")
    config = json.loads((plain / "config.json").read_text())
    assert config["text_config"]["engram_compressed_vocab_size"] > 0
    tensors = load_file(plain / "model.safetensors")
    assert (
        "layers.1.ffn.experts.7.w1.weight" in tensors
        and "mtp.1.markov_head.embed.weight" in tensors
    )
    assert "layers.2.attn.compressor.wkv.weight" not in tensors  # a KV consumer
    assert "layers.3.attn.indexer.wq_b.weight" in tensors  # own top-k ...
    assert "layers.3.attn.indexer.wk.weight" not in tensors  # ... over layer 1's keys
    state = FAMILY.load_weights(plain, args, device=CPU, dtype=torch.float32, keep_fp8=False)
    assert set(state) == set(model.state_dict())
    quantized = make_tiny_model(tmp_path / "fp8", model_type="deepseek_v41", quantized=True)
    qargs = FAMILY.parse_args(json.loads((quantized / "config.json").read_text()))
    assert FAMILY.fp8_block(qargs) == (32, 32) and FAMILY.fp4_experts(qargs)
    kept = FAMILY.load_weights(
        quantized, qargs, device=CPU, dtype=torch.float32, keep_fp8=True, keep_fp4=True
    )
    assert kept["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert kept["layers.0.attn.wq_a.scale"].shape == (32 // 32, 64 // 32)
    assert kept["mtp.0.ffn.experts.w1"].dtype == torch.uint8
    # The engram tables: FP8 per row and 32 columns in the file, dequantized on loading.
    stored = load_file(quantized / "model.safetensors")
    table = "layers.2.engram.embed.weight"
    assert stored[table].dtype == torch.float8_e4m3fn
    assert stored[table.replace("weight", "scale")].shape == (stored[table].shape[0], 1)
    err = (kept[table] - state[table]).abs().max() / state[table].abs().max()
    assert kept[table].dtype == torch.float32 and err < 2**-3, f"{err:.3f}"


def test_loader_errors_name_the_tensor(tmp_path: Path, args: ModelArgs) -> None:
    from deepinfer.model.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "tiny", model_type="deepseek_v41")
    tensors = load_file(folder / "model.safetensors")
    k_norm = tensors.pop("layers.4.attn.indexer.k_norm.weight")
    tensors["layers.5.attn.compressor.wkv.weight"] = torch.zeros(64, 64)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.5\.attn\.compressor\.wkv\.weight"):
        FAMILY.load_weights(folder, args, device=CPU, dtype=torch.float32, keep_fp8=False)
    del tensors["layers.5.attn.compressor.wkv.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.4\.attn\.indexer\.k_norm\.weight"):
        FAMILY.load_weights(folder, args, device=CPU, dtype=torch.float32, keep_fp8=False)
    tensors["layers.4.attn.indexer.k_norm.weight"] = k_norm
    save_file(tensors, folder / "model.safetensors")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="needs the checkpoint's tokenizer"):
        FAMILY.load_weights(folder, args, device=CPU, dtype=torch.float32, keep_fp8=False)


def test_the_compressed_vocabulary_count_is_checked(tmp_path: Path) -> None:
    config = tiny_config()
    count = config["text_config"]["engram_compressed_vocab_size"]
    wrong = ModelArgs.from_dict(
        {**config, "text_config": {**config["text_config"], "engram_compressed_vocab_size": 7}}
    )
    from deepinfer.model.deepseek_v41.tiny import write_tokenizer

    write_tokenizer(tmp_path)
    from deepinfer.model.deepseek_v41.family import _engram_vocab

    with pytest.raises(CheckpointError, match=f"compresses to {count} ids"):
        _engram_vocab(tmp_path, wrong)
