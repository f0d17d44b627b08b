#!/usr/bin/env bash
# What the last session built and could not run on a GPU, in one device call (carry .whl and
# .ab):  bash scripts/gpu_pending.sh BEFORE_DIR
# BEFORE_DIR: the tree before it (`git archive REV | tar -x -C .ab/NAME`), for the A/Bs.
#   1. the engine-level GPU tests the FP8 GEMM's tiles and the cuBLAS rule touch, and V4.1 and
#      speculative decoding (the side stream, the derived window lists): $OUT/suite.log;
#   2. cuBLAS's blockwise FP8 against our kernel on every tiny-model linear
#      (benchmarks/cublas_shapes.py), then the prefill's host plans, before and after (the outer
#      model alone, 8K and 32K prompts);
#   3. the decode step at batch 4 (16-row swapped tiles) and 128 (wo_a's 128-row swapped tiles).
# Each step has a time limit that keeps the call inside the device tool's 600 s (SUITE_S,
# PREFILL_S, DECODE_S: 270, 110 and 170 by default).
set -uo pipefail
before="$(cd "$1" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh >/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
(
  cd tests/gpu && timeout --signal=INT "${SUITE_S:-270}" \
    python3 -P -m pytest -q -p no:cacheprovider -m gpu \
    test_gpu_linear_fp8.py test_gpu_parity.py test_gpu_deterministic.py \
    test_gpu_speculative.py test_gpu_v41.py --durations=8
) >"$OUT/suite.log" 2>&1
tail -25 "$OUT/suite.log"
grep -h "top-1 agreement" "$OUT/gpu_results.txt" | cut -c1-220
timeout 60 python3 -P benchmarks/cublas_shapes.py 2>&1 | grep "^|" | tee "$OUT/cublas_shapes.log"
AB_ROUNDS=1 timeout "${PREFILL_S:-110}" bash scripts/gpu_ab.sh "$before" benchmarks/v4_flash_prefill.py \
  --layers "" --prompt 8192,32768 >"$OUT/prefill_ab.log" 2>&1
grep -E "^\| plans|^== " "$OUT/prefill_ab.log"
AB_ROUNDS=1 timeout "${DECODE_S:-170}" bash scripts/gpu_ab.sh "$before" benchmarks/v4_flash_decode.py \
  --layers csa,hca --experts fp4-fp8 --batch 4,128 --context 4096 --graph --depth 2 \
  >"$OUT/decode_ab.log" 2>&1
grep -E "^== |^\| (csa|hca|outer|plans|fp4-fp8) \|" "$OUT/decode_ab.log" | tail -40
