#!/usr/bin/env bash
# Put FlashMLA's source at a pinned commit, with the CUTLASS headers it includes, into .flashmla/
# (git-ignored through .git/info/exclude), for scripts/build_flashmla.sh to build on the device
# machine, which cannot fetch anything. Run here, from anywhere in the repo:
#
#   bash scripts/fetch_flashmla.sh          then the device tool's carry: [".flashmla"]
#
# Sources, in this order: $FLASHMLA_GIT / $CUTLASS_GIT (a git directory or URL) when set, else a
# local mirror under /work/.mirror when one exists, else github.com. FlashMLA's csrc/cutlass is a
# submodule; only its include/ and tools/util/include/ are used (setup.py's include_dirs), and of
# those only the headers that FlashMLA's sources can reach through #include (every branch of every
# #if counted, so the set is a superset of what any build configuration reads): ~30 MiB of
# headers become a few MiB, which matters as the carried tree must stay under 64 MiB in all.
#
#   .flashmla/VERSION                        the two commits
#   .flashmla/FlashMLA/                      the source tree (setup.py, csrc/, flash_mla/, tests/)
#   .flashmla/FlashMLA/csrc/cutlass/         include/, tools/util/include/ (pruned), LICENSE.txt
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"

FLASHMLA_COMMIT=9241ae3ef9bac614dd25e45e507e089f888280e0  # 2026-04-29, main
CUTLASS_COMMIT=147f5673d0c1c3dcf66f78d677fd647e4a020219   # FlashMLA's csrc/cutlass at that commit

DEST="$ROOT/.flashmla"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# source_of OWNER/REPO OVERRIDE: the git directory or URL to read OWNER/REPO from.
source_of() {
  local override="$2" mirror="/work/.mirror/${1/\//+}/repo"
  if [ -n "$override" ]; then
    echo "$override"
  elif [ -d "$mirror" ]; then
    echo "$mirror"
  else
    echo "https://github.com/$1.git"
  fi
}

# git_dir SOURCE COMMIT NAME: a git directory holding COMMIT (SOURCE itself, or a shallow fetch).
git_dir() {
  local source="$1" commit="$2" gitdir="$WORK/$3.git"
  if git --git-dir="$source" cat-file -e "$commit^{commit}" 2>/dev/null; then
    echo "$source"
    return
  fi
  git init -q --bare "$gitdir"
  if ! git --git-dir="$gitdir" fetch -q --depth 1 "$source" "$commit" >&2; then
    echo "fetch_flashmla: cannot fetch $commit from $source" >&2
    return 1
  fi
  echo "$gitdir"
}

flashmla_src="$(source_of deepseek-ai/FlashMLA "${FLASHMLA_GIT:-}")"
cutlass_src="$(source_of NVIDIA/cutlass "${CUTLASS_GIT:-}")"
echo "FlashMLA $FLASHMLA_COMMIT from $flashmla_src"
echo "CUTLASS  $CUTLASS_COMMIT from $cutlass_src"
flashmla_git="$(git_dir "$flashmla_src" "$FLASHMLA_COMMIT" FlashMLA)"
cutlass_git="$(git_dir "$cutlass_src" "$CUTLASS_COMMIT" cutlass)"

# The submodule pointer in FlashMLA's tree must be the commit pinned here.
gitlink="$(git --git-dir="$flashmla_git" rev-parse "$FLASHMLA_COMMIT:csrc/cutlass")"
if [ "$gitlink" != "$CUTLASS_COMMIT" ]; then
  echo "fetch_flashmla: FlashMLA pins cutlass $gitlink, this script $CUTLASS_COMMIT" >&2
  exit 1
fi
mkdir -p "$WORK/FlashMLA" "$WORK/cutlass"
git --git-dir="$flashmla_git" archive "$FLASHMLA_COMMIT" | tar -x -C "$WORK/FlashMLA"
# A mirror may lack large blobs outside these paths (media/); git names them while archiving.
git --git-dir="$cutlass_git" archive "$CUTLASS_COMMIT" include tools/util/include LICENSE.txt \
  2> >(grep -v "^error: invalid object .* for 'media/" >&2) | tar -x -C "$WORK/cutlass"

python3 - "$WORK/FlashMLA/csrc" "$WORK/cutlass" <<'EOF'
"""Copy into csrc/cutlass the CUTLASS headers that FlashMLA's sources reach through #include.

Quoted includes resolve against the including file's folder first, then (as do <> includes)
against setup.py's include_dirs. Every #include line counts, whatever #if it sits under; the ones
that resolve nowhere here (CUDA, torch, the C++ library) are left to the compiler.
"""
import re
import shutil
import sys
from pathlib import Path

csrc, cutlass = Path(sys.argv[1]), Path(sys.argv[2])
roots = [
    csrc,
    csrc / "kerutils" / "include",
    csrc / "sm90",
    cutlass / "include",
    cutlass / "tools" / "util" / "include",
]
include = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)
suffixes = {".h", ".hpp", ".cuh", ".cu", ".cpp", ".inl"}
todo = [p for p in csrc.rglob("*") if p.suffix in suffixes and p.is_file()]
seen = {p.resolve() for p in todo}
while todo:
    path = todo.pop()
    for kind, name in include.findall(path.read_text(errors="replace")):
        folders = ([path.parent] if kind == '"' else []) + roots
        for folder in folders:
            found = folder / name
            if found.is_file():
                found = found.resolve()
                if found not in seen:
                    seen.add(found)
                    todo.append(found)
                break
kept = sorted(p for p in seen if p.is_relative_to(cutlass.resolve()))
total = sum(p.stat().st_size for p in kept)
for path in kept:
    target = csrc / "cutlass" / path.relative_to(cutlass.resolve())
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, target)
shutil.copy2(cutlass / "LICENSE.txt", csrc / "cutlass" / "LICENSE.txt")
print(f"CUTLASS headers kept: {len(kept)} files, {total / 2**20:.1f} MiB")
EOF

printf 'flashmla %s\ncutlass %s\n' "$FLASHMLA_COMMIT" "$CUTLASS_COMMIT" >"$WORK/VERSION"
rm -rf "$DEST"
mkdir -p "$DEST"
mv "$WORK/FlashMLA" "$WORK/VERSION" "$DEST/"

EXCLUDE="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.flashmla/' "$EXCLUDE" 2>/dev/null || echo '/.flashmla/' >>"$EXCLUDE"

for f in setup.py flash_mla/flash_mla_interface.py csrc/cutlass/include/cute/tensor.hpp \
  csrc/cutlass/include/cutlass/cutlass.h csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh; do
  [ -f "$DEST/FlashMLA/$f" ] || { echo "fetch_flashmla: $f missing" >&2; exit 1; }
done
size_kib="$(du -sk --apparent-size "$DEST" | cut -f1)"
echo ".flashmla: $(find "$DEST" -type f | wc -l) files, $((size_kib / 1024)) MiB" \
  "($(du -sh "$DEST" | cut -f1) on disk)"
if [ "$size_kib" -ge $((40 * 1024)) ]; then
  echo "fetch_flashmla: .flashmla is over 40 MiB; it would not travel with .whl" >&2
  exit 1
fi
