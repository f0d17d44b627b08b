#!/usr/bin/env bash
# The same benchmark on two trees in one call, alternating, so that both run on one machine:
#   bash scripts/gpu_ab.sh BEFORE_DIR benchmarks/NAME.py [args...]
# BEFORE_DIR: another tree of this repo (e.g. `git archive PARENT | tar -x -C .ab/before`, then
# carry .ab and .whl). Runs before, after, before, after (AB_ROUNDS=2 rounds; each tree's own
# benchmark script);
# the logs go to $OUT/NAME.{before,after}.{1,2}.log.
set -uo pipefail
before="$(cd "$1" && pwd)"
shift
name="$(basename "$1" .py)"
after="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$after/scripts/gpu_env.sh"  # the wheels into /tmp/site, $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
status=0
for round in $(seq 1 "${AB_ROUNDS:-2}"); do
  for side in before after; do
    tree="$before"
    [[ $side == after ]] && tree="$after"
    echo "== $side (round $round): $tree: python3 -P $*"
    (
      DEEPINFER_ROOT="$tree" DEEPINFER_TREE="/tmp/deepinfer-src-$side" \
        source "$after/scripts/gpu_env.sh" && python3 -P "$@"
    ) 2>&1 | grep -v "Loading weights" | tee "$OUT/$name.$side.$round.log"
    rc="${PIPESTATUS[0]}"
    ((rc != 0)) && status=$rc
  done
done
exit "$status"
