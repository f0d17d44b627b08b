"""DeepSeek-V4.1's vision tower on the built-in tiny checkpoint, by identities the design
guarantees (no public implementation of the tower runs here):

- the image geometry: an image deepseek-recipe preprocessed spans the tokens recipe counts for
  it (its ``image_token_adjustment``), for several sizes and aspect ratios;
- the downsample against ``F.unfold`` (exact), the rotary's relative-position identity, the
  prompt layout of the markers;
- an image encoded in a batch with others equals the image encoded alone;
- the release's names load (``vision.*``, ``aligner.*``, ``image_*``);
- the model at image positions: the embedding is the tower's, the router reads ``bias_vl``, the
  engram leaves the trunk and its n-grams stop at the image.
"""

from __future__ import annotations

import io
from pathlib import Path

import deepseek_recipe as recipe
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file
from test_v41_model import random_model

from deepinfer.model.batch import ForwardBatch, SeqSpan
from deepinfer.model.deepseek_v41.args import ModelArgs
from deepinfer.model.deepseek_v41.model import DeepseekV41
from deepinfer.model.deepseek_v41.tiny import TINY_CONFIG
from deepinfer.model.deepseek_v41.vision import ImageEncoder, _rotate, downsample
from deepinfer.model.deepseek_v41.vision_args import ImageGrid, image_ids
from deepinfer.model.families import load_family

FAMILY = load_family("deepseek_v41")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return ModelArgs.from_dict(TINY_CONFIG)


@pytest.fixture(scope="module")
def model(args: ModelArgs) -> DeepseekV41:
    return random_model(args)


def _preprocessed(width: int, height: int, seed: int) -> recipe.ImageInfo:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    options = recipe.PreprocessOptions("high", 2048, 512)
    return recipe.OpenCvImagePreprocessor().preprocess(buf.getvalue(), options)


def _pixels(info: recipe.ImageInfo) -> torch.Tensor:
    image = Image.open(io.BytesIO(info.data)).convert("RGB")
    return torch.from_numpy(np.asarray(image).copy())


@pytest.mark.parametrize("size", [(64, 64), (640, 480), (300, 700), (2000, 1000), (900, 130)])
def test_an_image_spans_the_tokens_recipe_counts(args: ModelArgs, size: tuple[int, int]) -> None:
    info = _preprocessed(*size, seed=0)
    grid = args.vision.grid(info.width, info.height)
    assert grid.num_tokens == recipe.MultiModalData([info]).image_token_adjustment() + 1
    assert tuple(_pixels(info).shape) == (grid.grid_h * 14, grid.grid_w * 14, 3)


def test_grid_errors_name_the_problem(args: ModelArgs) -> None:
    with pytest.raises(ValueError, match="whole number of 14-pixel patches"):
        args.vision.grid(100, 98)
    with pytest.raises(ValueError, match="max_image_tokens=4096"):
        args.vision.grid(14 * 300, 14 * 300)


@pytest.mark.parametrize("grid_w,grid_h", [(6, 9), (7, 5), (1, 1), (4, 3)])
def test_downsample_is_unfold_over_the_zero_padded_grid(grid_w: int, grid_h: int) -> None:
    grid, dim = ImageGrid(grid_w, grid_h, 3), 8
    features = torch.randn(grid.num_patches, dim)
    x = features.view(grid_h, grid_w, dim).permute(2, 0, 1)
    x = F.pad(x, (0, grid.tokens_w * 3 - grid_w, 0, grid.tokens_h * 3 - grid_h))
    expected = F.unfold(x[None], kernel_size=3, stride=3)[0].T
    assert torch.equal(downsample(features, grid), expected)


def test_rotary_scores_depend_on_the_offset_only(model: DeepseekV41) -> None:
    vit = model.image_encoder.vision
    grid = ImageGrid(9, 7, 3)
    cos, sin = vit.rotary([grid], CPU)
    heads, hd = vit.args.num_heads, vit.args.head_dim
    q, k = torch.randn(1, heads, hd).double(), torch.randn(1, heads, hd).double()

    def score(a: tuple[int, int], b: tuple[int, int]) -> torch.Tensor:
        i, j = a[0] * grid.grid_w + a[1], b[0] * grid.grid_w + b[1]
        qi = _rotate(q, cos[i : i + 1].double(), sin[i : i + 1].double())
        kj = _rotate(k, cos[j : j + 1].double(), sin[j : j + 1].double())
        return (qi * kj).sum(-1)

    base = score((1, 2), (3, 0))
    assert torch.allclose(score((3, 6), (5, 4)), base, atol=1e-12)  # both moved by (2, 4)
    assert not torch.allclose(score((1, 2), (3, 1)), base, atol=1e-3)  # another offset


def test_an_image_in_a_batch_equals_the_image_alone(model: DeepseekV41) -> None:
    encoder = model.image_encoder
    infos = [_preprocessed(64, 64, 1), _preprocessed(640, 480, 2), _preprocessed(300, 700, 3)]
    pixels = [_pixels(i) for i in infos]
    grids = [encoder.args.grid(i.width, i.height) for i in infos]
    together = encoder(pixels, grids)
    for p, g, out in zip(pixels, grids, together, strict=True):
        [alone] = encoder([p], [g])
        assert out.shape == (g.num_tokens, 64)
        torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-6)
    # The markers sit where the layout puts them.
    g, out = grids[1], together[1]
    assert torch.equal(out[0], encoder.image_start) and torch.equal(out[-1], encoder.image_end)
    newlines = [1 + (r + 1) * (g.tokens_w + 1) - 1 for r in range(g.tokens_h)]
    assert all(torch.equal(out[i], encoder.image_newline) for i in newlines)


def test_the_release_names_load(tmp_path: Path, args: ModelArgs, model: DeepseekV41) -> None:
    from deepinfer.model.tiny import make_tiny_model

    folder = make_tiny_model(tmp_path / "v41", model_type="deepseek_v41")
    tensors = load_file(folder / "model.safetensors")
    for name in ("vision.blocks.1.attn.wqkv.bias", "aligner.w2.weight", "image_newline"):
        assert name in tensors, name
    state = FAMILY.load_weights(folder, args, device=CPU, dtype=torch.float32, keep_fp8=False)
    assert set(state) == set(model.state_dict())
    assert torch.equal(state["image_encoder.image_end"], tensors["image_end"])
    alone = ImageEncoder(args.vision, args.hidden_size)
    alone.load_state_dict({k: tensors[k] for k in alone.state_dict()}, strict=True)


def test_image_positions_take_the_towers_embeddings_and_the_image_bias(
    model: DeepseekV41, args: ModelArgs
) -> None:
    """A prompt with an image: its positions embed the tower's rows, route by ``bias_vl`` and
    keep their trunk through the engram; the text after it reads n-grams cut at the image."""
    v, n_img = args.vocab_size, 9
    text = [0, 5000, 6000, 7000]
    ids = torch.tensor(text + image_ids(v, n_img) + [8000, 9000])
    rows = torch.arange(len(text), len(text) + n_img)
    embeds = torch.randn(n_img, args.hidden_size)
    batch = ForwardBatch(
        input_ids=ids,
        positions=torch.arange(len(ids)),
        seqs=[SeqSpan(0, len(ids), 0, 0, [0])],
        logits_indices=torch.arange(len(ids)),
        image_rows=rows,
        image_embeds=embeds,
    )
    h = model.embed_tokens(batch)
    assert torch.equal(h[rows], embeds) and torch.equal(h[:4], model.embed(ids[:4]))

    gate = model.layers[0].ffn.gate
    x = torch.randn(len(ids), args.hidden_size)
    _, chosen = gate(x, ids)
    scores = F.softplus(F.linear(x, gate.weight).float()).sqrt()
    for t in range(len(ids)):
        bias = gate.bias_vl if ids[t] >= v else gate.bias
        expected = torch.topk(scores[t] + bias, gate.topk).indices
        assert set(chosen[t].tolist()) == set(expected.tolist()), t

    from deepinfer.kv_cache.pool import KVCache
    from deepinfer.model.deepseek_v41.engram import ngram_hashes

    seen: dict[str, torch.Tensor] = {}
    layer = args.engram.layer_ids[0]
    hook = model.layers[layer].engram.register_forward_hook(
        lambda _m, inputs, _out: seen.update(rows=inputs[1])
    )
    spec = FAMILY.cache_spec(args, block_size=16, ring_margin=2, max_draft=0)
    try:
        model(batch, KVCache(spec, num_blocks=8, num_slots=2, dtype=torch.float32, device=CPU))
    finally:
        hook.remove()
    # The n-grams the engram hashed stop at the image: an image position's window is all
    # padding, and the first text after it reads padding where the image was.
    vocab, pad = model.engram_vocab, int(model.engram_vocab[args.engram.pad_token_id])

    def rows(window: list[int]) -> torch.Tensor:
        return ngram_hashes(torch.tensor([window]), model.engram_tables, layer)[0]

    after = len(text) + n_img
    assert torch.equal(seen["rows"][len(text) + 3], rows([pad, pad, pad]))
    assert torch.equal(seen["rows"][after], rows([int(vocab[8000]), pad, pad]))
    assert torch.equal(seen["rows"][after + 1], rows([int(vocab[9000]), int(vocab[8000]), pad]))
    assert torch.equal(seen["rows"][2], rows([int(vocab[6000]), int(vocab[5000]), int(vocab[0])]))
