#!/usr/bin/env bash
# Create .venv (once) and install DeepInfer into it. Sourced by run.sh and test.sh.
#
# torch: the right build depends on the machine, so it is installed here, not resolved by pip
# from pyproject. DEEPINFER_TORCH_SPEC picks it (default "torch==2.13.0", which on our CPU
# machines resolves to a local CPU build). Elsewhere install torch into .venv yourself first
# (README, "Choosing torch", has the lines for CPU, CUDA 12 and CUDA 13): an importable torch is
# kept as it is. pip shows its progress: the first setup downloads a few hundred MB.
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
  echo "setup: installing ${DEEPINFER_TORCH_SPEC:-torch==2.13.0} (once; a few minutes)" >&2
  pip install --progress-bar on "${DEEPINFER_TORCH_SPEC:-torch==2.13.0}"
fi
STAMP="$VENV/.deepinfer-installed${EXTRAS:+-$EXTRAS}"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ]; then
  echo "setup: installing deepinfer${EXTRAS:+[$EXTRAS]} (editable)" >&2
  pip install --progress-bar on -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  touch "$STAMP"
fi
