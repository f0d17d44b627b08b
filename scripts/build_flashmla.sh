#!/usr/bin/env bash
# Build FlashMLA's CUDA extension (flash_mla.cuda) for SM90 only, offline, on the device machine
# (one H200, Python 3.12, torch 2.11 cu130, nvcc 13.0, ninja). Prepare here with
# `bash scripts/fetch_flashmla.sh`, then run there from the repo root with .flashmla carried:
#
#   bash scripts/build_flashmla.sh && export PYTHONPATH=/tmp/flashmla-site:$PYTHONPATH
#
#   1. .flashmla/FlashMLA is copied to $FLASHMLA_BUILD (/tmp/flashmla-build/src) unless a copy of
#      the same commits is there: its build/ keeps ninja's objects, so a build stopped by the
#      device tool's 600 s limit resumes where it stopped when this script runs again;
#   2. `python3 setup.py build_ext --inplace` with FLASH_MLA_DISABLE_SM100=1 (setup.py then passes
#      nvcc only -gencode arch=compute_90a,code=sm_90a; the SM100 sources still compile, to empty
#      kernels, because api.cpp links their entry points) and MAX_JOBS=16 ninja jobs. setup.py
#      runs `git submodule update --init csrc/cutlass` (and dies if there is no git at all) and
#      `git rev-parse --short HEAD` for its version: a stand-in git first on PATH answers the
#      second with the pinned commit and fails the first, so nothing is fetched (csrc/cutlass
#      already holds the headers);
#   3. the package (flash_mla/*.py and cuda*.so) goes to $FLASHMLA_SITE (/tmp/flashmla-site), and
#      `import flash_mla` is tried from there.
#
# The build log goes to ${OUT:-/tmp}/flashmla_build.log. Exit status: non-zero if any step failed.
# A site already built from the same commits is kept (delete it, or FLASHMLA_REBUILD=1, to redo).
# Environment: MAX_JOBS (16), PYTHON (python3), FLASHMLA_BUILD, FLASHMLA_SITE, FLASHMLA_REBUILD.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD="${FLASHMLA_BUILD:-/tmp/flashmla-build}"
SITE="${FLASHMLA_SITE:-/tmp/flashmla-site}"
LOG="${OUT:-/tmp}/flashmla_build.log"
PYTHON="${PYTHON:-python3}"
mkdir -p "$(dirname "$LOG")"

fail() {
  echo "build_flashmla: $*" >&2
  exit 1
}

# A package an earlier call built (scripts/gpu_flashmla.sh sends it back as flashmla-site.tgz;
# put it in .flashmla-built/ here and carry that instead of .flashmla): unpacked into $SITE and
# used if it imports, no source needed.
PREBUILT="${FLASHMLA_PREBUILT:-.flashmla-built/flashmla-site.tgz}"
if [ "${FLASHMLA_REBUILD:-0}" != 1 ] && [ -f "$PREBUILT" ]; then
  rm -rf "$SITE" && mkdir -p "$SITE" && tar -xzf "$PREBUILT" -C "$SITE" &&
    (cd / && PYTHONPATH="$SITE" "$PYTHON" -c "import flash_mla") && {
    echo "build_flashmla: $SITE from $PREBUILT: $(tr '\n' ' ' <"$SITE/flash_mla/VERSION")"
    exit 0
  }
  echo "build_flashmla: $PREBUILT does not import here; building from .flashmla" >&2
fi

[ -f .flashmla/VERSION ] && [ -f .flashmla/FlashMLA/setup.py ] ||
  fail "no .flashmla/ here: run scripts/fetch_flashmla.sh where there is a network, carry .flashmla"

if [ "${FLASHMLA_REBUILD:-0}" != 1 ] && cmp -s .flashmla/VERSION "$SITE/flash_mla/VERSION" &&
  compgen -G "$SITE/flash_mla/cuda*.so" >/dev/null; then
  echo "build_flashmla: $SITE already holds $(tr '\n' ' ' <.flashmla/VERSION)"
  exit 0
fi

# Python.h, a CUDA torch, nvcc, ninja, and the CUDA library headers that torch's and CUTLASS's
# headers include: from $CUDA_HOME/include, else from the nvidia-* wheels torch was installed
# with (their include/ folders then go on CPATH, as does CUDA 13's include/cccl). Messages on
# stderr, the CPATH folders on stdout.
extra_include="$("$PYTHON" - <<'EOF'
import glob
import os
import sys
import sysconfig

import setuptools  # noqa: F401 (torch.utils.cpp_extension builds through it)
import torch
from torch.utils import cpp_extension

include = sysconfig.get_paths()["include"]
assert os.path.isfile(os.path.join(include, "Python.h")), f"no Python.h in {include}"
assert torch.version.cuda, f"torch {torch.__version__} is not a CUDA build"
# CUDA_HOME, else the folder above the nvcc on PATH, else /usr/local/cuda (torch's search).
home = cpp_extension.CUDA_HOME
assert home and os.path.isfile(os.path.join(home, "bin", "nvcc")), f"no nvcc (CUDA_HOME {home})"
if not cpp_extension.is_ninja_available():
    print("build_flashmla: WARNING: no ninja; the sources compile one at a time", file=sys.stderr)
try:
    import nvidia

    wheels = list(nvidia.__path__)
except ImportError:
    wheels = []
folders = [os.path.join(home, "include"), os.path.join(home, "targets", "x86_64-linux", "include")]
extra = []
# CUDA 13 moved libcu++/CUB/Thrust to include/cccl: nvcc looks there, the host compiler that
# builds api.cpp (through CUTLASS's <cuda/std/utility>) only if told to.
for folder in folders:
    if os.path.isdir(os.path.join(folder, "cccl", "cuda", "std")):
        extra.append(os.path.join(folder, "cccl"))
        break
for header in ("cuda_runtime.h", "cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h",
               "curand_kernel.h"):
    if any(os.path.isfile(os.path.join(f, header)) for f in folders + extra):
        continue
    found = [p for w in wheels for p in glob.glob(f"{w}/**/include/{header}", recursive=True)]
    assert found, f"{header} is neither in {home}/include nor in an nvidia-* wheel"
    extra.append(os.path.dirname(found[0]))
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA_HOME {home}", file=sys.stderr)
if extra:
    print(f"CPATH += {extra}", file=sys.stderr)
print(":".join(extra))
EOF
)" || fail "$PYTHON cannot build a torch CUDA extension here (see above)"
if [ -n "$extra_include" ]; then
  export CPATH="$extra_include${CPATH:+:$CPATH}"
fi

export FLASH_MLA_DISABLE_SM100=1
export MAX_JOBS="${MAX_JOBS:-16}"
# One arch per file: nvcc's --threads (setup.py's default 32) has nothing to run in parallel.
export NVCC_THREADS="${NVCC_THREADS:-1}"
export TORCH_CUDA_ARCH_LIST="9.0a"

if ! cmp -s .flashmla/VERSION "$BUILD/VERSION"; then
  rm -rf "$BUILD"
  mkdir -p "$BUILD"
  cp -a .flashmla/FlashMLA "$BUILD/src" || fail "cannot copy the source to $BUILD"
  cp .flashmla/VERSION "$BUILD/VERSION"
fi
mkdir -p "$BUILD/bin"
commit="$(awk '$1 == "flashmla" {print substr($2, 1, 7)}' .flashmla/VERSION)"
cat >"$BUILD/bin/git" <<EOF
#!/usr/bin/env bash
# Stand-in for git while FlashMLA's setup.py runs (scripts/build_flashmla.sh): no network.
if [ "\$*" = "rev-parse --short HEAD" ]; then echo $commit; exit 0; fi
echo "build_flashmla: 'git \$*' skipped (offline build; csrc/cutlass is in place)" >&2
exit 1
EOF
chmod +x "$BUILD/bin/git"

echo "== build_flashmla $(date -u '+%Y-%m-%d %H:%M:%S') UTC: $(tr '\n' ' ' <.flashmla/VERSION)" |
  tee "$LOG"
echo "MAX_JOBS=$MAX_JOBS on $(nproc) CPUs" | tee -a "$LOG"
started=$SECONDS
(cd "$BUILD/src" && PATH="$BUILD/bin:$PATH" "$PYTHON" setup.py build_ext --inplace) 2>&1 |
  tee -a "$LOG" | grep -E --line-buffered "^\[[0-9]+/[0-9]+\]|error|Error|Compiling using" |
  sed -E 's|^(\[[0-9]+/[0-9]+\]) .* -c ([^ ]+) .*|\1 \2|' | cut -c1-300
rc="${PIPESTATUS[0]}"
seconds=$((SECONDS - started))
echo "build_flashmla: setup.py build_ext exit $rc after ${seconds} s (log: $LOG)" | tee -a "$LOG"
[ "$rc" -eq 0 ] || fail "build failed; the last lines of $LOG:$(echo; tail -30 "$LOG")"

rm -rf "$SITE/flash_mla"
mkdir -p "$SITE/flash_mla"
cp "$BUILD"/src/flash_mla/*.py "$BUILD"/src/flash_mla/cuda*.so "$SITE/flash_mla/" ||
  fail "no flash_mla/cuda*.so after the build"
(cd / && PYTHONPATH="$SITE" "$PYTHON" -c "
import flash_mla, torch
print('flash_mla from', flash_mla.__file__, '| torch', torch.__version__)") ||
  fail "import flash_mla from $SITE failed"
cp .flashmla/VERSION "$SITE/flash_mla/VERSION"
echo "build_flashmla: done in ${seconds} s; use it with: export PYTHONPATH=$SITE:\$PYTHONPATH"
