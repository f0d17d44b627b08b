"""Device and dtype resolution ("auto" -> what this machine has)."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """ "auto": CUDA if present, then Ascend NPU, else CPU. An explicit device must exist."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _npu_available():
            return torch.device("npu")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    if name == "npu" and not _npu_available():
        raise ValueError("device 'npu' was asked for but torch_npu is not installed or sees no NPU")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto": bfloat16 on accelerators, float32 on the CPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def use_ieee_float32(device: torch.device, dtype: torch.dtype) -> bool:
    """float32 on CUDA means IEEE float32 (TF32 matmuls would move logits by ~1e-3): turns
    TF32 off for matmuls and cuDNN there; True if it did."""
    if device.type != "cuda" or dtype != torch.float32:
        return False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return True


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``. CUDA: through pinned memory and without waiting, so a step
    being prepared never waits for the steps already queued on the device (a plain copy from
    pageable memory synchronizes the stream)."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(torch.npu.is_available())
