#!/usr/bin/env bash
# A benchmark on the device machine: bash scripts/gpu_bench.sh benchmarks/NAME.py [args...]
# (carry .whl). Output goes to stdout and $OUT/NAME.log.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
name="$(basename "$1" .py)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -P "$@" 2>&1 | grep -v "Loading weights" | tee "$OUT/$name.log"
exit "${PIPESTATUS[0]}"
