#!/usr/bin/env bash
# The V4-Flash engine figures on the device machine in one call (carry .whl, as for gpu_bench.sh):
#   bash scripts/gpu_bench_v4.sh [BACKEND]        BACKEND: auto (default) | torch_ref | attention=X,...
# Runs, in sequence, each under a time limit so that the three fit one 600 s call:
#   benchmarks/v4_flash_decode.py   decode step per layer type vs the HBM bound (eager and graph)
#   benchmarks/v4_flash_prefill.py  prefill per layer type vs the GEMM bound (MFU)
#   benchmarks/v4_flash_hf.py       transformers' eager model on the same layers; ours / theirs
#   benchmarks/decode_idle.py       device idle time between decode steps through the engine
# Logs and JSON go to $OUT/v4_flash_*.{log,json}; a script stopped at its limit leaves the JSON of
# what it measured, and the transformers run compares against whatever the JSON holds.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
backend="${1:-auto}"
budget="${BENCH_BUDGET_S:-560}"  # seconds from here, for the three runs together
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
start=$SECONDS
status=0

# run LIMIT_S NAME ARGS...: at most LIMIT_S seconds, and never past the budget.
run() {
  local limit="$1" name="$2"
  shift 2
  local left=$((budget - (SECONDS - start) - 5))
  ((left < limit)) && limit=$left
  if ((limit < 30)); then
    echo "== $name: skipped, ${left} s of the budget left" | tee "$OUT/$name.log"
    status=1
    return
  fi
  echo "== $name (limit ${limit} s): python3 -P benchmarks/$name.py $* --json $OUT/$name.json"
  timeout -k 10 "$limit" python3 -P "benchmarks/$name.py" "$@" --json "$OUT/$name.json" 2>&1 |
    grep -v "Loading weights" | tee "$OUT/$name.log"
  local rc="${PIPESTATUS[0]}"
  if ((rc == 124 || rc == 137)); then
    echo "== $name: stopped at its ${limit} s limit; $OUT/$name.json holds what it measured"
  fi
  ((rc != 0)) && status=$rc
}

run 200 v4_flash_decode --backend "$backend" --layers csa,hca,swa --batch 1,8,32,128,256 \
  --context 4096,32768 --graph
run 170 v4_flash_prefill --backend "$backend" --layers csa,hca,swa --prompt 1024,8192,32768 \
  --chunk 8192
run 200 v4_flash_hf --layers csa,hca,swa --batch 1,32 --context 4096 --prompt 1024,8192 \
  --ours "$OUT/v4_flash_decode.json" "$OUT/v4_flash_prefill.json"
left=$((budget - (SECONDS - start) - 5))
if ((left >= 60)); then
  echo "== decode_idle (limit ${left} s): python3 -P benchmarks/decode_idle.py --batch 1,32,128"
  timeout -k 10 "$left" python3 -P benchmarks/decode_idle.py --batch 1,32,128 2>&1 |
    grep -v "Loading weights" | tee "$OUT/decode_idle.log"
  rc="${PIPESTATUS[0]}"
  ((rc != 0)) && status=$rc
fi
exit "$status"
