"""DeepInfer: an inference service for DeepSeek V4-family models.

The public API is exported lazily so that torch-free rooms (``deepinfer.scheduler``, the
coordinator) can be imported without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "Config", "SamplingParams"]

if TYPE_CHECKING:
    from deepinfer.config import Config
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "deepinfer.llm",
    "Config": "deepinfer.config",
    "SamplingParams": "deepinfer.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
