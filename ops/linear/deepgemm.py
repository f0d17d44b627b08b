"""FP8 block-scaled linears on DeepSeek's DeepGEMM (``deep_gemm.fp8_gemm_nt``, SM90 and later).

DeepGEMM ships as the sdist ``deepinfer-gemm`` (module ``deep_gemm``); ``scripts/build_deepgemm.sh``
builds it on a GPU machine. Its kernels are compiled by nvcc at the first call of each shape
(cached under ``DG_JIT_CACHE_DIR``). Two facts decide whether it may run in a process:

- its JIT parses ``nvcc --version`` with ``std::regex``, which segfaults unless the process
  starts with the system C++ runtime preloaded (``LD_PRELOAD=.../libstdc++.so.6``): a crash,
  not an exception. ``deploy/`` units and ``scripts/gpu_env.sh`` set it;
- so ``is_available`` never calls it in the serving process: a child process with the same
  environment runs one GEMM against torch, and only its exit status and answer come back
  (``probe``; a segfault there is ``(False, "... SIGSEGV ...")``). The answer is kept per
  process.

Data flow of ``fp8_linear`` (torch_ref's semantics; 128 x 128 weight blocks only):

    x [M, K] --ops.linear.triton.quantize_activations--> q [M, K] e4m3, x_scale [M, K/128] fp32
    (q, x_scale), (w [N, K] e4m3, w_scale [N/128, K/128] fp32) --deep_gemm.fp8_gemm_nt--> y [M, N]
"""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
import subprocess
import sys

import torch

from deepinfer.ops.linear.torch_ref import FP8_BLOCK, dense_linear
from deepinfer.ops.registry import Backend

PRELOAD = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"
PROBE_TIMEOUT_S = 600.0  # the first call compiles a kernel with nvcc: seconds, more when cold

# One GEMM in a child process: exit 0 and print "ok <rel err>" when it matches torch.
_PROBE = """
import torch, deep_gemm
gen = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(64, 4, 128, generator=gen, device="cuda")
w = torch.randn(2, 128, 4, 128, generator=gen, device="cuda") * 0.05
xs = x.abs().amax(-1).clamp(min=1e-10) / 448  # per token per 128: [64, 4]
ws = w.abs().amax((1, 3)).clamp(min=1e-10) / 448  # per 128 x 128 block: [2, 4]
xq = (x / xs[..., None]).to(torch.float8_e4m3fn)
wq = (w / ws[:, None, :, None]).to(torch.float8_e4m3fn)
out = torch.empty(64, 256, dtype=torch.bfloat16, device="cuda")
deep_gemm.fp8_gemm_nt((xq.view(64, 512), xs), (wq.view(256, 512), ws), out)
x_values = (xq.float() * xs[..., None]).view(64, 512)
ref = x_values @ (wq.float() * ws[:, None, :, None]).view(256, 512).T
err = ((out.float() - ref).norm() / ref.norm()).item()
assert err < 1e-2, f"relative error {err:.3e} against torch on the same FP8 values"
print(f"ok, relative error {err:.2e} against torch")
"""


def is_available(device: torch.device) -> tuple[bool, str]:
    """DeepGEMM for ``device``: CUDA of compute capability 9+, ``deep_gemm`` importable, the C++
    runtime preloaded, and one GEMM right in a child process (module docstring)."""
    if device.type != "cuda":
        return False, f"DeepGEMM runs on CUDA devices, not {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        name = torch.cuda.get_device_name(device)
        return False, f"DeepGEMM needs SM90 or later; {name} is SM{major}{minor}"
    if importlib.util.find_spec("deep_gemm") is None:
        return False, "deep_gemm is not installed (scripts/build_deepgemm.sh builds it)"
    if "libstdc++" not in os.environ.get("LD_PRELOAD", ""):
        return False, (
            f"deep_gemm needs LD_PRELOAD={PRELOAD} in the process environment (its JIT "
            "crashes without it); deploy/ units and scripts/gpu_env.sh set it"
        )
    return _probe_once(device.index or 0)


@functools.cache
def _probe_once(device_index: int) -> tuple[bool, str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(device_index)}
    return probe(_PROBE, env, PROBE_TIMEOUT_S)


def probe(code: str, env: dict[str, str], timeout_s: float) -> tuple[bool, str]:
    """Run ``code`` in a fresh Python with ``env``: (True, its last output line) when it exits
    0, else (False, why: the signal that killed it, its exit status and last error line, or the
    timeout). The calling process survives whatever the child does."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False, f"DeepGEMM probe did not finish in {timeout_s:.0f} s"
    lines = (done.stdout.strip() or done.stderr.strip() or "no output").splitlines()
    if done.returncode == 0:
        return True, f"DeepGEMM probe: {lines[-1]}"
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        return False, f"DeepGEMM probe was killed by {name}: {done.stderr.strip()[-200:]}"
    return False, f"DeepGEMM probe failed (exit {done.returncode}): {lines[-1][:300]}"


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    *,
    swiglu: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """As torch_ref.fp8_linear, with x quantized per token per 128 (the Triton quantizer, which
    applies ``swiglu`` too) and DeepGEMM's FP8 GEMM: x [M, K] bf16 (other dtypes are cast),
    weight [N, K] e4m3, weight_scale [ceil(N/128), ceil(K/128)] fp32. Returns [M, N] in x's
    dtype. Other weight blocks (V4.1's 32 x 32) and shapes off DeepGEMM's tiles (toy models)
    run the Triton GEMM."""
    import deep_gemm

    from deepinfer.ops.linear import triton

    m, k = x.shape
    n = weight.shape[0]
    # DeepGEMM's SM90 recipe (1 x 128 and 128 x 128 scales) at the shapes it was checked on:
    # whole 128-wide K blocks and N a multiple of 64 (every V4-Flash linear).
    if tuple(block) != (128, 128) or k % 128 or n % 64:
        return triton.fp8_linear(x, weight, weight_scale, block, swiglu=swiglu)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0:
        return out.to(x.dtype)
    q, scale = triton.quantize_activations(x, 128, swiglu=swiglu)
    deep_gemm.fp8_gemm_nt((q, scale), (weight, weight_scale), out)
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
) -> torch.Tensor:
    """As torch_ref.fp8_grouped_linear: from ``triton.GROUPED_SPLIT_ROWS`` rows DeepGEMM's GEMM a
    group, below them the Triton kernel's one launch for all groups."""
    from deepinfer.ops.linear import triton

    m, groups, _ = x.shape
    if triton.split_groups(m, weight.shape[0] // groups, block):
        return triton.fp8_linear_per_group(fp8_linear, x, weight, weight_scale, block)
    return triton.fp8_grouped_linear(x, weight, weight_scale, block)


class DeepGEMMLinearBackend(Backend):
    """DeepGEMM's FP8 GEMM on one CUDA device; it keeps nothing (DeepGEMM caches its kernels)."""

    fp8_linear = staticmethod(fp8_linear)
    fp8_grouped_linear = staticmethod(fp8_grouped_linear)
    dense_linear = staticmethod(dense_linear)  # cuBLAS's (torch_ref's)
