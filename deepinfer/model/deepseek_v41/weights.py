"""Parameter names: what our DeepSeek-V4.1 model holds, and how the release's names map onto it.

Our names are the release's (``layers.0.attn.wq_a.weight``, ``layers.3.attn.indexer.wk.weight``,
``mtp.0.main_proj.weight``), except that routed experts are stacked (``layers.{i}.ffn.experts.w1``
[E, I, D] instead of ``ffn.experts.{e}.w1.weight`` [I, D]); FP8 / FP4 block scales are
``<module>.scale``. The drafter's copies of the embedding and the LM head (``mtp.{i}.embed``,
``mtp.{i}.head``) are the backbone's: skipped. The table of expected shapes is the model's own
parameter list (built on the meta device), so the two cannot disagree.
"""

from __future__ import annotations

import re

import torch

from deepinfer.model.deepseek_v4.weights import TensorTarget
from deepinfer.model.deepseek_v41.args import ModelArgs

_LAYER_RE = re.compile(r"^((?:layers|mtp)\.\d+\.)(.+)$")
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")
_TIED_RE = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")
_STACKED_RE = re.compile(r"\.ffn\.experts\.w[123]$")
# Linears the model calls as modules whose FP8 weights may stay FP8 (``Fp8Linear``): the
# attention's (wo_a through ``grouped_linear``), the indexer's query projection, the shared
# experts and the drafter's feature projection. The compressors, the indexer's key and weight
# projections, the router and the heads are bf16 in the release.
_FP8_LINEAR_RE = re.compile(
    r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|indexer\.wq_b|shared_experts\.w[123]|main_proj)\.weight$"
)
_FP32_SUFFIXES = (
    "norm.weight",
    "attn_sink",
    "gate.bias",
    "gate.bias_vl",
    "_fn",
    "_base",
    "_scale",
    "engram.q_weight",
    "engram.k_weight",
)
# The vision tower and the image markers (``vision.*``, ``aligner.*``, ``image_start``, ...)
# live in the model's ``image_encoder``, whose own names are the release's.
VISION_MODULE = "image_encoder"
_VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
# Not a checkpoint tensor: the compressed vocabulary the loader derives from the tokenizer.
ENGRAM_VOCAB = "engram_vocab"


def map_checkpoint_name(name: str) -> TensorTarget | None:
    """Our name for a release tensor; None for the drafter's tied copies. Names we do not know
    pass through unchanged, so that the loader reports them as unexpected."""
    short = name.removeprefix("model.")
    if _TIED_RE.match(short):
        return None
    if short.startswith(_VISION_PREFIXES):
        return TensorTarget("copy", (f"{VISION_MODULE}.{short}",))
    m = _LAYER_RE.match(short)
    if m is None:
        return TensorTarget("copy", (short,))
    prefix, rest = m.group(1), m.group(2)
    e = _EXPERT_RE.match(rest)
    if e is not None:
        return TensorTarget("expert", (f"{prefix}ffn.experts.{e.group(2)}",), int(e.group(1)))
    return TensorTarget("copy", (short,))


def release_name(name: str) -> str:
    """The release's name of our parameter ``name`` (stacked experts aside)."""
    return name.removeprefix(f"{VISION_MODULE}.")


def is_fp8_linear(name: str) -> bool:
    return _FP8_LINEAR_RE.search(name) is not None


def is_fp8_table(name: str) -> bool:
    """The engram's hash tables: FP8 in the release, scaled per row and 32 columns
    (``fp8_block_of``); dequantized on loading."""
    return name.endswith(".engram.embed.weight")


def fp8_block_of(name: str, block: tuple[int, int]) -> tuple[int, int]:
    return (1, 32) if is_fp8_table(name) else block


def is_fp32_param(name: str) -> bool:
    return name.endswith(_FP32_SUFFIXES)


def is_integer_param(name: str) -> bool:
    return name == ENGRAM_VOCAB


def is_stacked_experts(name: str) -> bool:
    return _STACKED_RE.search(name) is not None


def expected_shapes(args: ModelArgs, num_experts: int | None = None) -> dict[str, tuple[int, ...]]:
    """Every checkpoint parameter of the model, in our names, with its shape (the backbone's
    routed experts stacked, their first dimension ``num_experts``: the experts one rank holds;
    None: all). Order: the model's (embed, layers, norm, head, drafter), deterministic."""
    from deepinfer.model.deepseek_v41.model import DeepseekV41

    with torch.device("meta"):
        model = DeepseekV41(args, experts=range(num_experts or args.num_experts))
    return {name: tuple(t.shape) for name, t in model.state_dict().items() if name != ENGRAM_VOCAB}
