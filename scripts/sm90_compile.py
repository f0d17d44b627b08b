"""Compile the decode MoE's Triton kernels for sm_90 on any machine, no GPU needed.

    python scripts/sm90_compile.py            # V4-Flash shapes, the engine's tiles and passes

Triton's front end and its bundled ptxas build each kernel for Hopper (CUDA 9.0) as the device
would; cuobjdump then reads the registers a thread and the stack and local memory (spills) from
the cubin. A kernel that fails to compile (a construct the interpreter accepts and the compiler
does not) or spills exits non-zero, so a CPU test catches it before a GPU run does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from deepinfer.ops.moe import triton_gemv

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"

GATE_TYPES = {
    "x_ptr": "*bf16", "w1_ptr": "*i32", "w3_ptr": "*i32", "s1_ptr": "*u8", "s3_ptr": "*u8",
    "h_ptr": "*fp32", "topk_ids_ptr": "*i64", "limit": "fp32",
}  # fmt: skip
DOWN_TYPES = {
    "h_ptr": "*fp32", "w2_ptr": "*i32", "s2_ptr": "*u8", "out_ptr": "*bf16",
    "residual_ptr": "*bf16", "part_ptr": "*fp32",
    "counters_ptr": "*i32", "topk_ids_ptr": "*i64", "topk_weights_ptr": "*fp32",
}  # fmt: skip
V4_FLASH = {"TOP_K": 6, "W_FP4": True, "PDL": True}
GATE = {**V4_FLASH, "N": 2048, "K": 4096, "X_NIBBLE_MAJOR": True}
DOWN = {**V4_FLASH, "N": 4096, "K": 2048}

# (name, kernel, argument types, constexprs, num_warps): the engine's program-a-pair tiles
# (ops/moe/triton.py's _MXFP4_GEMV).
KERNELS = [
    ("gate/up a pair 32x256 w4", triton_gemv._gate_up_kernel, GATE_TYPES,
     {**GATE, "BLOCK_N": 32, "BLOCK_K": 256}, 4),
    ("down a slot 16x2048 w8", triton_gemv._down_kernel, DOWN_TYPES,
     {**DOWN, "BLOCK_N": 16, "BLOCK_K": 2048, "SPLIT_SLOTS": True, "RESIDUAL": True}, 8),
]  # fmt: skip


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, num_warps: int) -> dict:
    """The kernel built for sm_90; returns its resource usage (REG, STACK, LOCAL, SHARED)."""
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32")
        for name in kernel.arg_names
    }
    source = ASTSource(kernel, signature, constexprs)
    compiled = triton.compile(source, target=TARGET, options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        dump = subprocess.run(
            [str(CUOBJDUMP), "--dump-resource-usage", cubin.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", dump))
    return {key: int(value) for key, value in usage.items()}


def main() -> int:
    failed = 0
    for name, kernel, types, constexprs, num_warps in KERNELS:
        try:
            usage = compile_sm90(kernel, types, constexprs, num_warps)
        except Exception as error:  # a compile error: reported, then the exit status
            print(f"{name}: FAILED to compile: {str(error).splitlines()[-1][:200]}")
            failed += 1
            continue
        spills = usage.get("STACK", 0) + usage.get("LOCAL", 0)
        print(f"{name}: {usage.get('REG')} registers, stack {usage.get('STACK')}, "
              f"local {usage.get('LOCAL')}" + (" (spills)" if spills else ""))  # fmt: skip
        failed += bool(spills)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
