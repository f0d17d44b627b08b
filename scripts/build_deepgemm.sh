#!/usr/bin/env bash
# Build DeepGEMM (deep_gemm) on the device machine from what scripts/fetch_deepgemm.sh put in
# .deepgemm/ (carry [".whl", ".deepgemm"]), into /tmp/deepgemm-site, in one call (~2 minutes):
#
#   bash scripts/build_deepgemm.sh && source scripts/gpu_env.sh
#
# gpu_env.sh then puts /tmp/deepgemm-site on PYTHONPATH and sets what deep_gemm needs at run
# time: LD_PRELOAD of the system libstdc++ (its JIT's std::regex crashes without it) and a JIT
# cache folder. A build already there is kept.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SITE=/tmp/deepgemm-site
if [ -d "$SITE/deep_gemm" ]; then
  echo "build_deepgemm: $SITE already holds deep_gemm"
  exit 0
fi
sdist="$(ls .deepgemm/deepinfer_gemm-*.tar.gz)"
WORK=/tmp/deepgemm-build
rm -rf "$WORK" && mkdir -p "$WORK/deps"
for deb in .deepgemm/*.deb; do dpkg -x "$deb" "$WORK/deps"; done
tar -xzf "$sdist" -C "$WORK"
src="$(ls -d "$WORK"/deepinfer_gemm-*/)"
started=$SECONDS
(
  cd "$src"
  export CPATH="$WORK/deps/usr/include${CPATH:+:$CPATH}" DG_FORCE_BUILD=1
  python3 -m pip install -q --no-build-isolation --no-deps --no-cache-dir --target "$SITE" .
) 2>&1 | tail -20
[ -d "$SITE/deep_gemm" ] || { echo "build_deepgemm: no deep_gemm in $SITE" >&2; exit 1; }
echo "build_deepgemm: built in $((SECONDS - started)) s into $SITE"
