#!/usr/bin/env bash
# Issue 24's FP8 GEMM figures in one device call (carry .whl):
#   bash scripts/gpu_fp8_sweeps.sh [STEP...]      (default: rotate wo_a mid)
#   cold     every shape, L2 cleared before each call (--cold), the engine's path against bf16;
#   rotate   the decode linears back to back, each call on its own weight copy (--rotate);
#   wo_a     the grouped wo_a from 1 to 512 rows, the engine's tiles and the candidates below;
#   few      the plain linears at 2-16 rows, the swapped tiles against narrower ones (warm);
#   mid      the decode linears at 48-64 rows, the swapped tiles' stages and programs an SM.
# Logs and JSON: $OUT/fp8_STEP.{log,json}. FP8_SWEEP_LIMIT: seconds a step may take (default
# 130; four steps fit one call).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
limit="${FP8_SWEEP_LIMIT:-130}"
# block_m,block_n,group_m,warps,stages,quantize_in_gemm,max_split_k,programs_per_sm,swap_ab
SWAPPED="64,64,1,4,4,0,16,2,1;128,64,1,4,4,0,16,2,1;64,128,1,4,4,0,16,2,1;64,128,1,8,4,0,16,2,1"
SWAPPED+=";64,64,1,4,4,0,16,1,1;64,64,1,4,4,0,16,4,1;128,128,1,8,3,0,16,2,1"
PLAIN="64,128,8,4,4,0,4,1,0;128,64,8,4,4,0,4,1,0"
FEW="16,64,1,4,4,0,16,2,1;16,64,1,4,4,1,16,2,1;16,64,1,4,4,1,16,4,1;32,64,1,4,4,0,16,2,1"
FEW+=";16,64,1,4,4,1,16,4,0"
MID="64,64,1,4,4,0,16,2,1;64,64,1,4,4,0,16,4,1;64,64,1,4,3,0,16,2,1;64,64,1,4,6,0,16,2,1"
MID+=";32,64,1,4,4,0,16,2,1;64,128,1,4,4,0,16,2,1;64,64,1,4,4,1,16,2,1"
step() {
  local log="$1"
  shift
  echo "== python3 -P benchmarks/fp8_linear.py $*"
  timeout --signal=INT "$limit" python3 -P benchmarks/fp8_linear.py "$@" 2>&1 \
    | grep -v "Loading weights" | tee "$OUT/$log"
}
DECODE=x_proj_csa,wq_b_csa,wq_b,wo_b,shared_w13,shared_w2,wo_a
steps=("$@")
((${#steps[@]})) || steps=(rotate wo_a mid)
for name in "${steps[@]}"; do
  case "$name" in
    cold) step fp8_cold.log --cold --tokens 1,2,8,32,64,128,4096 --json "$OUT/fp8_cold.json" ;;
    rotate) step fp8_rotate.log --rotate --shapes "$DECODE" --tokens 1,2,8,32,64,128 \
      --json "$OUT/fp8_rotate.json" ;;
    wo_a) step fp8_wo_a.log --shapes wo_a --tokens 1,2,32,64,96,128,256,512 \
      --tiles "$SWAPPED;$PLAIN" --json "$OUT/fp8_wo_a.json" ;;
    few) step fp8_few_rows.log --shapes wq_a,wo_b,shared_w2,shared_w13,x_proj_csa \
      --tokens 2,4,8,12,16 --tiles "$FEW" --json "$OUT/fp8_few_rows.json" ;;
    mid) step fp8_mid_rows.log --shapes x_proj_csa,shared_w13,shared_w2,wo_b --tokens 48,64 \
      --tiles "$MID" --json "$OUT/fp8_mid_rows.json" ;;
    *) echo "gpu_fp8_sweeps: unknown step $name (cold, rotate, wo_a, few, mid)" >&2; exit 2 ;;
  esac
done
