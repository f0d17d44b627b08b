#!/usr/bin/env bash
# FlashMLA as the engine's attention, in one device call (carry .whl and .flashmla;
# `bash scripts/fetch_flashmla.sh` here first; or .flashmla-built/flashmla-site.tgz, which an
# earlier call sent back, instead of .flashmla):  bash scripts/gpu_flashmla.sh
#   1. build FlashMLA for sm_90a (scripts/build_flashmla.sh, ~130 s; resumes a stopped build);
#   2. the GPU tests of its adapter and of the backend in a V4-Flash-shaped model (SUITE: the
#      test files, default test_gpu_flashmla_backend.py test_gpu_flashmla.py):
#      $OUT/flashmla_suite.log;
#   3. over an FP8 cache (cache.block_size BLOCK_SIZE, 256: FlashMLA takes HCA's entries too),
#      attention=triton then attention=flashmla, graphed: an 8K prompt's prefill of a CSA
#      layer ($OUT/flashmla_prefill.BACKEND.log), the decode step of a CSA and an HCA layer at
#      batch DECODE_BATCH (64,128), 4K context ($OUT/flashmla_decode.BACKEND.log).
# Time limits: SUITE_S (150), BENCH_S (60 a run; 0: no timings).
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
# The built package comes back (if under the 16 MiB a file): in .flashmla-built/ here it spares
# the next call the build (scripts/build_flashmla.sh uses it).
[ -f .flashmla-built/flashmla-site.tgz ] || tar -czf "$OUT/flashmla-site.tgz" -C /tmp/flashmla-site .
export PYTHONPATH="/tmp/flashmla-site:${PYTHONPATH:-}"
# shellcheck disable=SC2086
(
  cd tests/gpu && timeout --signal=INT "${SUITE_S:-150}" \
    python3 -P -m pytest -q -p no:cacheprovider -m gpu \
    ${SUITE:-test_gpu_flashmla_backend.py test_gpu_flashmla.py} --durations=5
) >"$OUT/flashmla_suite.log" 2>&1
grep -E "passed|failed|^E |^FAILED" "$OUT/flashmla_suite.log" | tail -20
bench() {
  local name="$1" backend="$2"
  shift 2
  echo "== $name attention=$backend"
  timeout --signal=INT "${BENCH_S:-60}" python3 -P "benchmarks/v4_flash_$name.py" \
    --backend "attention=$backend" "$@" 2>&1 | grep -v "Loading weights" \
    >"$OUT/flashmla_$name.$backend.log"
  grep -E "^\| (csa|hca|swa|outer|plans|fp4-fp8-kv8) \||^\|.*(csa|hca) .*\||MFU" \
    "$OUT/flashmla_$name.$backend.log" | tail -12
}
if (("${BENCH_S:-60}" > 0)); then
  for backend in triton flashmla; do
    bench prefill "$backend" --layers csa --experts fp4-fp8 --kv fp8 --prompt 8192 \
      --block-size "${BLOCK_SIZE:-256}"
  done
  for backend in triton flashmla; do
    bench decode "$backend" --layers csa,hca --experts fp4-fp8-kv8 \
      --batch "${DECODE_BATCH:-64,128}" --context 4096 --graph \
      --block-size "${BLOCK_SIZE:-256}"
  done
fi
# Then, with SERVE_S > 0 (seconds a server, default 0: the steps above fill a call), `deepinfer
# serve` on a 4-layer V4-Flash-shaped model with packed weights and an FP8 cache under `deepinfer
# bench serve` at concurrency 64 and 128, attention=triton then flashmla:
# $OUT/flashmla_serve.BACKEND.log.
if (("${SERVE_S:-0}" > 0)); then
  for backend in triton flashmla; do
    echo "== serve attention=$backend"
    DEEPINFER_KERNEL_ATTENTION="$backend" timeout --signal=INT "$SERVE_S" python3 -P \
      benchmarks/serve_graphs.py --weights fp4-fp8-kv8 --concurrency 64,128 \
      --out "$OUT/serve_$backend" >"$OUT/flashmla_serve.$backend.log" 2>&1
    grep -E "^\|" "$OUT/flashmla_serve.$backend.log" | tail -8
  done
fi
