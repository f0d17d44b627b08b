#!/usr/bin/env bash
# Sourced by scripts/gpu_tests.sh and scripts/gpu_bench.sh on the device machine: the carried
# wheels (.whl/) go into /tmp/site, and deepinfer becomes importable without installing it
# (/tmp/deepinfer-src/deepinfer: links laid out as pyproject's package-dir says). Run python
# with -P so that the repo root, whose deepinfer/ lacks scheduler/ops/server, does not shadow it.
set -uo pipefail
# DEEPINFER_ROOT / DEEPINFER_TREE: another tree of the repo and its link tree (scripts/gpu_ab.sh).
cd "${DEEPINFER_ROOT:-$(dirname "${BASH_SOURCE[0]}")/..}"
ROOT="$PWD"
OUT="${OUT:-/tmp/gpu_out}"
export OUT
mkdir -p "$OUT"
LOG="$OUT/gpu_tests.log"
SITE=/tmp/site
TREE="${DEEPINFER_TREE:-/tmp/deepinfer-src}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export XDG_CACHE_HOME=/tmp/cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || exit 1
else
  echo "gpu_tests: no .whl/ (run scripts/fetch_gpu_wheels.sh here and carry .whl)" >&2
fi

python3 - "$ROOT" "$TREE" <<'EOF' || exit 1
"""Link the package tree that pyproject's package-dir describes."""
import shutil
import sys
import tomllib
from pathlib import Path

root, tree = Path(sys.argv[1]), Path(sys.argv[2])
package_dir = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
    "package-dir"
]
shutil.rmtree(tree, ignore_errors=True)
top = tree / "deepinfer"
top.mkdir(parents=True)
for entry in (root / package_dir["deepinfer"]).iterdir():
    (top / entry.name).symlink_to(entry)
for name, folder in package_dir.items():
    if name != "deepinfer":
        link = tree / name.replace(".", "/")
        assert not link.exists(), f"{name} is both in deepinfer/ and package-dir"
        link.symlink_to(root / folder)
EOF
export PYTHONPATH="$SITE:$TREE"
# DeepGEMM, when scripts/build_deepgemm.sh built it: its module, the C++ runtime its JIT needs
# preloaded, a cache for the kernels it compiles.
if [ -d /tmp/deepgemm-site/deep_gemm ]; then
  export PYTHONPATH="/tmp/deepgemm-site:$PYTHONPATH" DG_JIT_CACHE_DIR=/tmp/deepgemm-cache
  export LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libstdc++.so.6${LD_PRELOAD:+:$LD_PRELOAD}"
fi
