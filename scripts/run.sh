#!/usr/bin/env bash
# Set up (first time) and run the deepinfer CLI: bash scripts/run.sh generate "Hello"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh" ""
cd "$ROOT"
exec deepinfer "$@"
