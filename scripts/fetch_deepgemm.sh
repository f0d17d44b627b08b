#!/usr/bin/env bash
# Put DeepSeek's DeepGEMM source (the PyPI sdist deepinfer-gemm, pinned by hash) and the Debian
# headers its host code includes (libdw-dev, libelf-dev: elfutils/libdwfl.h) into .deepgemm/
# (git-ignored), for scripts/build_deepgemm.sh to build on the device machine, which cannot
# fetch anything. Run here, from anywhere in the repo:
#
#   bash scripts/fetch_deepgemm.sh          then the device tool's carry: [".whl", ".deepgemm"]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VERSION=2.8.2
SHA256=aad050965750f809b8dbb744a8db54fc4eba0eb3bc99d565fa9b41010fe25351
URL="https://files.pythonhosted.org/packages/c3/81/8211cfa3e92b0f5be337116fe15da8a6fa232161899a628fe100d8895fa0/deepinfer_gemm-$VERSION.tar.gz"
DEST=.deepgemm
mkdir -p "$DEST"
sdist="$DEST/deepinfer_gemm-$VERSION.tar.gz"
if ! echo "$SHA256  $sdist" | sha256sum -c --quiet >/dev/null 2>&1; then
  curl -fsSL -o "$sdist" "$URL"
  echo "$SHA256  $sdist" | sha256sum -c --quiet
fi
(cd "$DEST" && rm -f ./*.deb && apt-get download libdw-dev libelf-dev 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
ls "$DEST"/libdw-dev_*.deb "$DEST"/libelf-dev_*.deb >/dev/null
du -sh "$DEST"
