#!/usr/bin/env bash
# FlashMLA as the engine's attention, in one device call (carry .whl and .flashmla;
# `bash scripts/fetch_flashmla.sh` here first):  bash scripts/gpu_flashmla.sh
#   1. build FlashMLA for sm_90a (scripts/build_flashmla.sh, ~90 s; resumes a stopped build);
#   2. the GPU tests of its adapter, the backend in a V4-Flash-shaped model and the FP8 cache
#      on the Triton kernels: $OUT/flashmla_suite.log;
#   3. the decode step over an FP8 cache (fp4-fp8-kv8), attention=triton then attention=flashmla,
#      a CSA and an HCA layer at batch 1, 64 and 128, 4K context, graphed, cache.block_size
#      BLOCK_SIZE (256: FlashMLA takes HCA's entries too): $OUT/flashmla_decode.{triton,flashmla}.log.
# Time limits: SUITE_S (180), DECODE_S (110 a backend).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/gpu_env.sh >/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
start=$SECONDS
bash scripts/build_flashmla.sh >"$OUT/flashmla_build.out" 2>&1 || {
  tail -30 "$OUT/flashmla_build.out" "$OUT/flashmla_build.log"
  exit 1
}
echo "FlashMLA built in $((SECONDS - start)) s"
export PYTHONPATH="/tmp/flashmla-site:${PYTHONPATH:-}"
(
  cd tests/gpu && timeout --signal=INT "${SUITE_S:-180}" \
    python3 -P -m pytest -q -p no:cacheprovider -m gpu test_gpu_flashmla_backend.py \
    test_gpu_flashmla.py test_gpu_kv_fp8.py --durations=5
) >"$OUT/flashmla_suite.log" 2>&1
tail -20 "$OUT/flashmla_suite.log"
for backend in triton flashmla; do
  echo "== attention=$backend"
  timeout --signal=INT "${DECODE_S:-110}" python3 -P benchmarks/v4_flash_decode.py \
    --layers csa,hca --experts fp4-fp8-kv8 --batch 1,64,128 --context 4096 --graph \
    --block-size "${BLOCK_SIZE:-256}" --backend "attention=$backend" 2>&1 \
    | grep -v "Loading weights" >"$OUT/flashmla_decode.$backend.log"
  grep -E "^\| (csa|hca|swa|outer|plans|fp4-fp8-kv8) \||attention=" \
    "$OUT/flashmla_decode.$backend.log" | tail -20
done
# Then, while time is left (EXTRA_S, 0 to skip): the engine-level tests the model's attention
# change reaches on Triton (MTP layers, V4.1, the parity run): $OUT/extra_suite.log.
if (("${EXTRA_S:-150}" > 0)); then
  (
    cd tests/gpu && timeout --signal=INT "${EXTRA_S:-150}" \
      python3 -P -m pytest -q -p no:cacheprovider -m gpu test_gpu_speculative.py \
      test_gpu_v41.py test_gpu_parity.py --durations=5
  ) >"$OUT/extra_suite.log" 2>&1
  tail -12 "$OUT/extra_suite.log"
fi
