"""The model families, by the ``model_type`` of a checkpoint's ``config.json`` (torch-free).

Each row names what the coordinator needs without torch (the prompt encoding of deepseek-recipe,
the cache salt's format tag and ``cache_salt``, the architecture parser whose ``ModelArgs`` gives
the block-size rule, ``block_multiple``) and the
package the engine loads the rest from (``family.py``'s ``ModelFamily``: build the model, plan a
step, describe the cache). Adding a family is adding its package and a row here.

    model_type      package (torch side)                       recipe version / encoding
    deepseek_v4     deepinfer.model.deepseek_v4.family         DeepseekV4Pro / DeepseekV4Encoding
    deepseek_v41    deepinfer.model.deepseek_v41.family        DeepseekV41Flash / ...V41Encoding
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepinfer.images import ImageInput, PromptImage

if TYPE_CHECKING:
    from deepinfer.model.family import ModelFamily


@dataclass(frozen=True)
class FamilyInfo:
    """One row of the table. ``args``: the module whose ``ModelArgs.from_dict`` parses the
    config (torch-free); ``package``: the module whose ``FAMILY`` is the engine's interface
    (None: served by no engine here). ``cache_format``: the tag in the prefix cache's salt,
    bumped whenever the cached bytes' layout changes. ``images``: the module whose
    ``ImagePrompt.from_config`` says how prompts hold images (torch-free; None: no images)."""

    model_type: str
    recipe_version: str  # a deepseek-recipe ModelVersion member
    recipe_encoding: str  # a deepseek-recipe encoding class
    args: str | None
    package: str | None
    cache_format: str
    images: str | None = None


FAMILIES: dict[str, FamilyInfo] = {
    info.model_type: info
    for info in (
        FamilyInfo(
            model_type="deepseek_v4",
            recipe_version="DeepseekV4Pro",
            recipe_encoding="DeepseekV4Encoding",
            args="deepinfer.model.deepseek_v4.args",
            package="deepinfer.model.deepseek_v4.family",
            cache_format="kv-v1",
        ),
        FamilyInfo(
            model_type="deepseek_v41",
            recipe_version="DeepseekV41Flash",
            recipe_encoding="DeepseekV41Encoding",
            args="deepinfer.model.deepseek_v41.args",
            package="deepinfer.model.deepseek_v41.family",
            cache_format="kv-v41-1",
            images="deepinfer.model.deepseek_v41.vision_args",
        ),
    )
}

DEFAULT_MODEL_TYPE = "deepseek_v4"


def family_info(model_type: str) -> FamilyInfo:
    info = FAMILIES.get(model_type)
    if info is None:
        raise ValueError(f"config: model_type {model_type!r} is not supported ({_names()})")
    return info


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint folder (or the file itself)."""
    path = Path(model_dir)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json at {path}")
    return json.loads(path.read_text(encoding="utf-8"))


def model_type_of(config: dict[str, Any]) -> str:
    return str(config.get("model_type", DEFAULT_MODEL_TYPE))


def parse_args(config: dict[str, Any]) -> Any:
    """The family's architecture arguments from a parsed ``config.json`` (torch-free)."""
    info = family_info(model_type_of(config))
    if info.args is None:
        raise ValueError(f"config: model_type {info.model_type!r} is not supported by the engine")
    return importlib.import_module(info.args).ModelArgs.from_dict(config)


ExpandImages = Callable[[list[int], list[ImageInput]], tuple[list[int], list[PromptImage]]]


def image_expansion(config: dict[str, Any]) -> ExpandImages | None:
    """How a checkpoint's prompts grow each image placeholder to the image's positions, as its
    model family does (torch-free: the coordinator's routing keys use it); None when the
    checkpoint has no vision tower."""
    info = family_info(model_type_of(config))
    if info.images is None:
        return None
    prompt = importlib.import_module(info.images).ImagePrompt.from_config(config)
    return prompt.expand if prompt.vision is not None else None


def load_args(model_dir: str | Path) -> Any:
    return parse_args(read_config(model_dir))


def with_serving_options(
    args: Any,
    *,
    yoco_truncation: str,
    yoco_keep_tokens: int,
    mtp_layers: int = 0,
    dspark: bool = False,
) -> Any:
    """The architecture with the options that change what the model holds and computes: YoCo
    prefill truncation (DeepSeek-V4.1), the MTP layers built for drafting (DeepSeek-V4,
    speculative.method = "mtp"), the DSpark block drafter served (DeepSeek-V4.1,
    speculative.method = "dspark"). ValueError naming the key for a family without them."""
    if yoco_truncation != "off":
        if not hasattr(args, "yoco_mode"):
            raise ValueError(
                f"model.yoco_truncation={yoco_truncation!r}: {args.model_type} checkpoints have "
                "no YoCo layers (deepseek_v41 only)"
            )
        args = dataclasses.replace(args, yoco_mode=yoco_truncation, yoco_keep=yoco_keep_tokens)
    if mtp_layers:
        if not hasattr(args, "mtp_served"):
            raise ValueError(
                f"speculative.method='mtp' drafts with DeepSeek-V4's MTP layer; {args.model_type} "
                "checkpoints draft differently (deepseek_v4 only)"
            )
        args = dataclasses.replace(args, mtp_served=mtp_layers)
    if dspark:
        if not hasattr(args, "dspark_served"):
            raise ValueError(
                f"speculative.method='dspark' drafts with DeepSeek-V4.1's DSpark layers; "
                f"{args.model_type} checkpoints draft differently (deepseek_v41 only)"
            )
        args = dataclasses.replace(args, dspark_served=True)
    return args


def cache_salt(model_type: str, *, dtype: str, layout: str) -> str:
    """The cache format part of the prefix cache's hash salt (after the weights' fingerprint):
    the family's format tag, the cache dtype and the spec's own ``salt`` (block size, ...)."""
    return f"{family_info(model_type).cache_format}:{dtype}:{layout}"


def load_family(model_type: str) -> ModelFamily:
    """The engine's interface to ``model_type`` (imports its package, and torch)."""
    info = family_info(model_type)
    if info.package is None:
        raise ValueError(f"config: model_type {model_type!r} is not supported by the engine")
    return importlib.import_module(info.package).FAMILY


def _names() -> str:
    return ", ".join(name for name, info in FAMILIES.items() if info.package)
