#!/usr/bin/env bash
# Set up (first time) and run the lint and the CPU test suite: bash scripts/test.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh" test
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# Threads that wait sleep instead of spinning: with two workers and their node processes on
# two cores, OpenMP's spinning waits took most of the CPU (two engine test files on two
# workers: 522 s spinning, 88 s passive).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
ruff check .
ruff format --check .
# Two workers (DEEPINFER_TEST_WORKERS; 0: none), each test file on one, so that its module
# fixtures (engines, servers) are built once.
exec python -m pytest -q -n "${DEEPINFER_TEST_WORKERS:-2}" --dist loadfile "$@"
