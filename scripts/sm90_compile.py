"""Compile decode's Triton kernels (MoE, hc_post, the fused stores) for sm_90 on any machine.

    python scripts/sm90_compile.py            # V4-Flash shapes, the engine's tiles and passes
    python scripts/sm90_compile.py --loops    # and the grouped MoE's K loops, scaled dot vs bits

Triton's front end and its bundled ptxas build each kernel for Hopper (CUDA 9.0) as the device
would; cuobjdump then reads the registers a thread and the stack and local memory (spills) from
the cubin. A kernel that fails to compile (a construct the interpreter accepts and the compiler
does not) or spills exits non-zero, so a CPU test catches it before a GPU run does.

--loops: the grouped MoE kernels (ops/moe/triton.py) on their decode and prefill tiles, with
the scaled dot's upcast and with TileConfig.bits_upcast, and the SASS instructions of each K
loop (the longest backward branch of ``cuobjdump -sass``), a thread's work per K step.
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
from triton.experimental.gluon._runtime import GluonASTSource

from deepinfer.ops.attention import triton as attention_triton
from deepinfer.ops.linear import triton as linear_triton
from deepinfer.ops.moe import gluon as moe_gluon
from deepinfer.ops.moe import triton as moe_triton
from deepinfer.ops.moe import triton_gemv
from deepinfer.ops.norm import triton as norm_triton
from deepinfer.ops.norm import triton_pool

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

HC_POST_TYPES = {
    "out_ptr": "*bf16", "x_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32",
    "new_ptr": "*bf16", "fn_ptr": "*fp32", "partials_ptr": "*fp32", "sumsq_ptr": "*fp32",
}  # fmt: skip
HC_POST = {"HC": 4, "HC_PAD": 4, "MIX_SIZE": 24, "M_PAD": 32, "PDL": True}

# The shared expert's w2 at decode with its SwiGLU in the quantization (16-row tiles, split K).
# The unit strides as the JIT specialises them (x's and the weight's along K, out's along N):
# without them the loads are not known to be contiguous, and Triton neither vectorises them
# nor pipelines them into shared memory (the registers reported were then 254, not 96).
FP8_GEMM_TYPES = {
    "a_ptr": "*bf16", "up_ptr": "*bf16", "a_s_ptr": "*fp32", "b_ptr": "*fp8e4nv",
    "b_s_ptr": "*fp32", "c_ptr": "*fp32", "out_ptr": "*bf16", "counters_ptr": "*i32",
    "limit": "fp32",
}  # fmt: skip
SHARED_W2 = {"K": 2048, "BLOCKS_PER_SPLIT": 4, "SCALE_BLOCK_N": 128, "BLOCK_M": 16,
             "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "QUANTIZE_A": True, "ONE_SCALE": True,
             "SWIGLU": True, "SPLIT_K": 4, "DENSE": False, "SWAP_AB": False,
             "DOT_PRECISION": "tf32", "PDL": True, "stride_ak": 1, "stride_bk": 1,
             "stride_cn": 1}  # fmt: skip
# From 2 to 32 rows: x quantized by its own launch (its SwiGLU there), the weight's 64 rows on
# the MMA's M side and x's 32 on its N side.
SWAPPED_W2 = {**SHARED_W2, "BLOCK_M": 32, "QUANTIZE_A": False, "SWIGLU": False, "SPLIT_K": 2,
              "BLOCKS_PER_SPLIT": 8, "ONE_ROW": False, "SWAP_AB": True,
              "stride_asm": 1}  # fmt: skip
QUANTIZED_TYPES = {**FP8_GEMM_TYPES, "a_ptr": "*fp8e4nv", "up_ptr": "*fp8e4nv"}
# A dense (bf16) projection at decode through the same GEMM: a CSA layer's x projections.
DENSE_TYPES = {**FP8_GEMM_TYPES, "b_ptr": "*bf16", "b_s_ptr": "*bf16"}
DENSE_X_PROJ = {**SHARED_W2, "K": 4096, "BLOCKS_PER_SPLIT": 8, "BLOCK_K": 64,
                "QUANTIZE_A": False, "SWIGLU": False, "SPLIT_K": 8, "DENSE": True}  # fmt: skip
# The queries' and keys' norm and RoPE, the keys' with the ring's store; a CSA compressor's
# pooling with the entries'.
NORM_ROPE_TYPES = {
    "x_ptr": "*bf16", "x_weight_ptr": "*bf16", "x_out_ptr": "*bf16", "k_ptr": "*bf16",
    "k_weight_ptr": "*fp32", "k_out_ptr": "*bf16", "target_ptr": "*bf16",
    "target_rows_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "eps": "fp32",
}  # fmt: skip
# hc_pre's collapse with the block norm at one token: eight programs of a 512-channel slice
# (the last by ticket normalises the row) and the Sinkhorn's program beside them.
COLLAPSE_TYPES = {
    "x_ptr": "*bf16", "partials_ptr": "*fp32", "sumsq_ptr": "*fp32", "scale_ptr": "*fp32",
    "base_ptr": "*fp32", "post_ptr": "*fp32", "comb_ptr": "*fp32", "collapsed_ptr": "*bf16",
    "prev_pre_ptr": "*fp32", "pre_out_ptr": "*fp32", "norm_w_ptr": "*fp32",
    "row_sumsq_ptr": "*fp32", "counters_ptr": "*i32", "hc_eps": "fp32", "norm_eps": "fp32",
    "block_eps": "fp32",
}  # fmt: skip
COLLAPSE = {"SHIFTED": False, "HEAD": False, "NORM": True, "APART": True, "D_PROGRAMS": 8,
            "D_PROGRAMS_PAD": 8, "D_ROW": 4096, "HC": 4, "HC_PAD": 4, "M_PAD": 32,
            "SPLIT_K": 32, "SPLIT_PAD": 32, "SINKHORN_ITERS": 20, "PRECISE_DIV": False,
            "BLOCK_D": 512, "D_PER_PROGRAM": 512, "PDL": True}  # fmt: skip
# The indexer's scores with its top-k (a CSA layer at decode: 64 heads of 128, up to 2,048
# entries).
SELECT_TYPES = {
    "q_ptr": "*bf16", "weights_ptr": "*bf16", "keys_ptr": "*bf16", "entry_rows_ptr": "*i32",
    "token_req_ptr": "*i64", "num_visible_ptr": "*i32", "out_ptr": "*fp32", "cos_ptr": "*fp32",
    "sin_ptr": "*fp32", "weight_scale": "fp32", "score_scale": "fp32", "counters_ptr": "*i32",
    "top_ptr": "*i32",
}  # fmt: skip
POOL_TYPES = {
    "kv_ptr": "*bf16", "gate_ptr": "*bf16", "buf_kv_ptr": "*bf16", "buf_gate_ptr": "*bf16",
    "buf_rows_ptr": "*i64", "window_rows_ptr": "*i64", "ring_kv_ptr": "*bf16",
    "ring_gate_ptr": "*bf16", "prev_slots_ptr": "*i64", "prev_src_ptr": "*i64",
    "has_prev_ptr": "*i64", "ape_ptr": "*fp32", "weight_ptr": "*fp32", "out_ptr": "*bf16",
    "eps": "fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "entries_ptr": "*bf16",
    "entry_dst_ptr": "*i64", "left_src_ptr": "*i64", "left_dst_ptr": "*i64",
    "prev_dst_ptr": "*i64",
}  # fmt: skip

# The grouped MoE's Gluon kernels (ops/moe/gluon.py): their one tile, V4-Flash's shapes.
GLUON_TYPES = {
    "x_ptr": "*bf16", "w1_ptr": "*i32", "w3_ptr": "*i32", "s1_ptr": "*u8", "s3_ptr": "*u8",
    "h_ptr": "*bf16", "w2_ptr": "*i32", "s2_ptr": "*u8", "pair_out_ptr": "*bf16",
    "topk_weights_ptr": "*fp32", "sorted_pair_ids_ptr": "*i32", "block_expert_ptr": "*i32",
    "limit": "fp32",
}  # fmt: skip
# With a ring (TileConfig.ring) the kernels read the scale bytes as int32 words of four.
GLUON_RING_TYPES = {**GLUON_TYPES, "s1_ptr": "*i32", "s3_ptr": "*i32", "s2_ptr": "*i32"}

# (name, kernel, argument types, constexprs, num_warps[, aligned]): the engine's program-a-pair
# tiles (ops/moe/triton.py's _MXFP4_GEMV), the grouped Gluon kernels (with a ring: built as the
# JIT sees the engine's tensors, 16-byte aligned, since cp.async copies 16 bytes), hc_post with
# and without the
# next entry's mix, hc_pre's collapse, and the kernels that took a neighbour's launch in
# (SwiGLU, the ring's and the entries' stores, the indexer's top-k), and the GEMM's dense mode.
KERNELS = [
    ("grouped gate/up, Gluon 16x64x128 w4", moe_gluon._gate_up_kernel, GLUON_TYPES,
     {"N": 2048, "K": 4096, "TOP_K": 6, "BLOCK_M": 16, "BLOCK_N": 64, "RING": 0}, 4),
    ("grouped down, Gluon 16x64x128 w4", moe_gluon._down_kernel, GLUON_TYPES,
     {"N": 4096, "K": 2048, "BLOCK_M": 16, "BLOCK_N": 64, "RING": 0}, 4),
    ("grouped gate/up, Gluon 16x64x128 w4 ring 3", moe_gluon._gate_up_kernel, GLUON_RING_TYPES,
     {"N": 2048, "K": 4096, "TOP_K": 6, "BLOCK_M": 16, "BLOCK_N": 64, "RING": 3}, 4, True),
    ("grouped down, Gluon 16x64x128 w4 ring 3", moe_gluon._down_kernel, GLUON_RING_TYPES,
     {"N": 4096, "K": 2048, "BLOCK_M": 16, "BLOCK_N": 64, "RING": 3}, 4, True),
    ("grouped gate/up, Gluon 128x128x128 w8 ring 3 (prefill)", moe_gluon._gate_up_kernel,
     GLUON_RING_TYPES, {"N": 2048, "K": 4096, "TOP_K": 6, "BLOCK_M": 128, "BLOCK_N": 128,
                        "RING": 3}, 8, True),
    ("grouped down, Gluon 128x128x128 w8 ring 3 (prefill)", moe_gluon._down_kernel,
     GLUON_RING_TYPES, {"N": 4096, "K": 2048, "BLOCK_M": 128, "BLOCK_N": 128, "RING": 3}, 8,
     True),
    ("gate/up a pair 32x256 w4", triton_gemv._gate_up_kernel, GATE_TYPES,
     {**GATE, "BLOCK_N": 32, "BLOCK_K": 256}, 4),
    ("down a slot 16x2048 w8", triton_gemv._down_kernel, DOWN_TYPES,
     {**DOWN, "BLOCK_N": 16, "BLOCK_K": 2048, "SPLIT_SLOTS": True, "RESIDUAL": True}, 8),
    ("hc_post and the next mix d128 w8", norm_triton._hc_post_kernel, HC_POST_TYPES,
     {**HC_POST, "BLOCK_D": 128, "D_PER_PROGRAM": 128, "MIX": True}, 8),
    ("hc_post d512 w4", norm_triton._hc_post_kernel, HC_POST_TYPES,
     {**HC_POST, "BLOCK_D": 512, "D_PER_PROGRAM": 512, "MIX": False}, 4),
    ("hc_pre's collapse, the Sinkhorn apart, d512 w1", norm_triton._hc_sinkhorn_collapse_kernel,
     COLLAPSE_TYPES, COLLAPSE, 1),
    ("shared w2 with its SwiGLU, one row w4", linear_triton._gemm_kernel, FP8_GEMM_TYPES,
     {**SHARED_W2, "ONE_ROW": True}, 4, True),
    ("shared w2, 32 rows on swapped tiles w4", linear_triton._gemm_kernel, QUANTIZED_TYPES,
     SWAPPED_W2, 4, True),
    ("shared w2, 8 rows on 16-row swapped tiles w4", linear_triton._gemm_kernel,
     QUANTIZED_TYPES, {**SWAPPED_W2, "BLOCK_M": 16}, 4, True),
    ("shared w2, 128 rows on 128-row swapped tiles w4", linear_triton._gemm_kernel,
     QUANTIZED_TYPES, {**SWAPPED_W2, "BLOCK_M": 128}, 4, True),
    ("dense x projection, one row w4", linear_triton._gemm_kernel, DENSE_TYPES,
     {**DENSE_X_PROJ, "ONE_ROW": True}, 4, True),
    ("dense x projection, 16 rows w4", linear_triton._gemm_kernel, DENSE_TYPES,
     {**DENSE_X_PROJ, "ONE_ROW": False}, 4, True),
    ("q and kv norm + RoPE, kv into the ring d512 w8", norm_triton._rms_norm_rope_pair_kernel,
     NORM_ROPE_TYPES, {"N": 512, "NOPE": 448, "X_WEIGHT": False, "K_WEIGHT": True,
                       "STORE": True, "BLOCK_X": 4, "BLOCK_K": 1, "BLOCK_N": 512, "PDL": True}, 8),
    ("the indexer's scores and top-k, 2,048 entries w4", attention_triton._indexer_scores_kernel,
     SELECT_TYPES, {"D": 128, "NOPE": 64, "ROPE": True, "BLOCK_H": 64, "BLOCK_N": 64,
                    "DOT_PRECISION": "tf32", "TOPK": True, "TOPK_BLOCK": 2048, "PDL": True}, 4),
    ("CSA pool into the entries, and the keeps d512 w8", triton_pool._compress_pool_kernel,
     POOL_TYPES, {"M": 4, "OVERLAP": True, "HAS_APE": True, "SPLIT": False, "BLOCK_S": 8,
                  "BLOCK_D": 512, "ROPE_HALF": 32, "STORE_ENTRY": True, "KEEP": True,
                  "BLOCK_W": 1024, "PDL": True}, 8),
    ("HCA pool's channels, and the keeps d64 w4", triton_pool._compress_pool_kernel,
     POOL_TYPES, {"M": 128, "OVERLAP": False, "HAS_APE": True, "SPLIT": True, "BLOCK_S": 32,
                  "BLOCK_D": 64, "ROPE_HALF": 32, "STORE_ENTRY": False, "KEEP": True,
                  "BLOCK_W": 512, "PDL": True}, 4),
]  # fmt: skip


# The grouped kernels' arguments: pointers (others i32), and the unit strides the engine's
# tensors have, which Triton's JIT specialises on (as it assumes 16-byte aligned pointers and
# strides divisible by 16: the attributes given to every other pointer and stride).
GROUPED_TYPES = {
    "x_ptr": "*bf16", "w1_ptr": "*u8", "w3_ptr": "*u8", "s1_ptr": "*u8", "s3_ptr": "*u8",
    "h_ptr": "*bf16", "w2_ptr": "*u8", "s2_ptr": "*u8", "pair_out_ptr": "*bf16",
    "topk_weights_ptr": "*fp32", "sorted_pair_ids_ptr": "*i32", "block_expert_ptr": "*i32",
    "limit": "fp32",
}  # fmt: skip
UNIT_STRIDES = {"stride_xk": 1, "stride_wk": 1, "stride_sk": 1, "stride_hn": 1, "stride_hk": 1,
                "stride_on": 1}  # fmt: skip
GROUPED = {"TOP_K": 6, "GROUP_M": 1, "DOT_PRECISION": "tf32", "W_FP4": True, "A_FORMAT": "bf16",
           "FAST_MATH": True, "PDL": True}  # fmt: skip
# (name, kernel, N, K, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)): the engine's tiles
LOOPS = [
    ("gate/up decode", moe_triton._gate_up_kernel, 2048, 4096, (16, 64, 128, 4, 3)),
    ("gate/up prefill", moe_triton._gate_up_kernel, 2048, 4096, (128, 64, 64, 4, 4)),
    ("down decode", moe_triton._down_kernel, 4096, 2048, (16, 64, 128, 4, 3)),
]  # fmt: skip


def compile_sm90(
    kernel,
    types: dict[str, str],
    constexprs: dict,
    num_warps: int,
    num_stages: int = 3,
    aligned: bool = False,
) -> tuple[dict, str]:
    """The kernel built for sm_90; returns its resource usage (REG, STACK, LOCAL, SHARED) and
    its SASS. aligned: pointers and strides marked divisible by 16, as the JIT finds them."""
    signature = {
        name: "constexpr" if name in constexprs else types.get(name, "i32")
        for name in kernel.arg_names
    }
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if aligned
        and name not in constexprs
        and (name.endswith("_ptr") or name.startswith("stride"))
    }
    source = (GluonASTSource if kernel.is_gluon() else ASTSource)(
        kernel, signature, constexprs, aligned
    )
    options = {"num_warps": num_warps, "num_stages": num_stages}
    compiled = triton.compile(source, target=TARGET, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        dump, sass = (
            subprocess.run(
                [str(CUOBJDUMP), flag, cubin.name], capture_output=True, text=True, check=True
            ).stdout
            for flag in ("--dump-resource-usage", "-sass")
        )
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", dump))
    return {key: int(value) for key, value in usage.items()}, sass


def loop_instructions(sass: str) -> int:
    """Instructions inside the longest backward branch (the K loop) of a kernel's SASS."""
    addresses = [int(a, 16) for a in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/", sass, re.M)]
    loops = [
        (int(target, 16), int(at, 16))
        for at, target in re.findall(r"/\*([0-9a-f]{4,})\*/[^\n]*BRA (0x[0-9a-f]+)", sass)
        if int(target, 16) < int(at, 16)
    ]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return sum(start <= a <= end for a in addresses)


# The Gluon kernels at the decode tile, beside the Triton ones.
GLUON_LOOPS = {
    "gate/up decode": (moe_gluon._gate_up_kernel, {"N": 2048, "K": 4096, "TOP_K": 6}),
    "down decode": (moe_gluon._down_kernel, {"N": 4096, "K": 2048}),
}
GLUON_RINGS = (0, 3, 4)


def grouped_loops() -> None:
    """--loops: the grouped kernels' K loops, the scaled dot's upcast against the bits one (and,
    at the decode tile, Gluon's)."""
    rings = " / ".join(f"Gluon ring {ring}" if ring else "Gluon" for ring in GLUON_RINGS)
    print(f"grouped MoE, instructions a thread per K step (scaled dot / bits upcast / {rings}):")
    for name, kernel, n, k, (bm, bn, bk, warps, stages) in LOOPS:
        counts = []
        for bits in (False, True):
            types = dict(GROUPED_TYPES)
            if bits:  # the packed weights read as int32 words
                types.update({"w1_ptr": "*i32", "w3_ptr": "*i32", "w2_ptr": "*i32"})
            tiles = {"N": n, "K": k, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
            constexprs = {**GROUPED, **UNIT_STRIDES, **tiles, "SCALED_DOT": not bits, "BITS": bits}
            constexprs = {c: v for c, v in constexprs.items() if c in kernel.arg_names}
            _, sass = compile_sm90(kernel, types, constexprs, warps, stages, aligned=True)
            counts.append(loop_instructions(sass))
        gluon = GLUON_LOOPS.get(name)
        if gluon is not None and (bm, bn, bk, warps) in moe_gluon.TILES:
            kernel, constexprs = gluon
            for ring in GLUON_RINGS:
                types = GLUON_RING_TYPES if ring else GLUON_TYPES
                constexprs = {**constexprs, "BLOCK_M": bm, "BLOCK_N": bn, "RING": ring}
                _, sass = compile_sm90(kernel, types, constexprs, warps, aligned=True)
                counts.append(loop_instructions(sass))
        weights = (2 if "gate" in name else 1) * bn * bk // (warps * 32)
        per_weight = " / ".join(f"{c / weights:.1f}" for c in counts)
        print(f"  {name} {bm}x{bn}x{bk} w{warps}: {' / '.join(map(str, counts))} for {weights} "
              f"weights a thread ({per_weight} a weight)")  # fmt: skip


def main() -> int:
    failed = 0
    for name, kernel, types, constexprs, num_warps, *aligned in KERNELS:
        try:
            usage, _ = compile_sm90(kernel, types, constexprs, num_warps, aligned=bool(aligned))
        except Exception as error:  # a compile error: reported, then the exit status
            print(f"{name}: FAILED to compile: {str(error).splitlines()[-1][:200]}")
            failed += 1
            continue
        spills = usage.get("STACK", 0) + usage.get("LOCAL", 0)
        print(f"{name}: {usage.get('REG')} registers, stack {usage.get('STACK')}, "
              f"local {usage.get('LOCAL')}" + (" (spills)" if spills else ""))  # fmt: skip
        failed += bool(spills)
    if "--loops" in sys.argv[1:]:
        grouped_loops()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
