#!/usr/bin/env bash
# Create .venv (once) and install DeepInfer into it. Sourced by run.sh and test.sh.
#
# torch: the right build depends on the machine, so it is installed here, not resolved by pip
# from pyproject. DEEPINFER_TORCH_SPEC picks it (default "torch==2.13.0", which on our CPU
# machines resolves to a local CPU build). On a GPU machine use e.g.
#   DEEPINFER_TORCH_SPEC="torch==2.11.0" with PIP_INDEX_URL pointing at the CUDA wheel index,
# or install torch into .venv yourself first: an importable torch is kept as it is.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DEEPINFER_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
if ! python -c "import torch" 2>/dev/null; then
  echo "setup: installing ${DEEPINFER_TORCH_SPEC:-torch==2.13.0}" >&2
  pip install --quiet "${DEEPINFER_TORCH_SPEC:-torch==2.13.0}"
fi
STAMP="$VENV/.deepinfer-installed${EXTRAS:+-$EXTRAS}"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  echo "setup: installing deepinfer${EXTRAS:+[$EXTRAS]} (editable)" >&2
  pip install --quiet -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  touch "$STAMP"
fi
