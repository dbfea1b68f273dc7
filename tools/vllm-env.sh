#!/usr/bin/env bash
# tools/vllm-env.sh VERSION DIR: make (or bring up to date) the venv DIR with vLLM==VERSION, torch as that release pins it
# (the registry's CUDA build), marlin-pack installed editable from this checkout (--no-deps -e), pytest>=8,
# tokenizers>=0.19 and nvidia-cutlass>=3.5 (its pycute runs the Machete layout's CuTe derivation in the tests).
# One environment per release: the release-dependent tests (tools/release-tests.txt) run in each.
#
# It installs with uv (pip cannot apply an override; uv reads no pip.conf, so no local CPU-only torch is preferred).
# tools/overrides/vllm-VERSION.txt holds the release's overrides (uv --override), each with its reason; a release
# without that file is refused (add one, comments only when the release needs none).
#
# Environment:
#   UV                 the uv to use (else `uv` on PATH, else one pip-installed into MARLIN_PACK_UV_TOOL)
#   MARLIN_PACK_UV_TOOL  where that uv's venv goes (default ~/.cache/marlin-pack/uv-tool)
#   UV_CACHE_DIR       uv's cache (default ~/.cache/uv). Venvs are hardlinked from it (UV_LINK_MODE=hardlink), so the
#                      venvs that share a torch pay its disk once (~9 GB a release otherwise). It must be on DIR's
#                      filesystem for that: if it is not, files are copied, with a warning.
#   PYTHON             the interpreter a new venv is made from (default python3; >= 3.10)
#   MARLIN_PACK_WHEELS  optional folder of wheels (e.g. vLLM's) offered to uv as --find-links; not needed
set -euo pipefail

usage() { echo "usage: $0 VERSION DIR   (e.g. $0 0.34.0 .venv)" >&2; exit 2; }
[ $# -eq 2 ] || usage
version=$1
dir=$2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
overrides=$root/tools/overrides/vllm-$version.txt
if [ ! -f "$overrides" ]; then
    known=$(cd "$root/tools/overrides" && ls vllm-*.txt | sed 's/^vllm-//; s/\.txt$//' | sort -rV | tr '\n' ' ')
    echo "vllm-env: no tools/overrides/vllm-$version.txt: releases with an environment recipe: $known" >&2
    exit 2
fi

say() { echo "vllm-env[$version]: $*" >&2; }

# uv: given, on PATH, or installed once with pip into a small venv of its own.
uv=${UV:-$(command -v uv || true)}
if [ -z "$uv" ]; then
    tool=${MARLIN_PACK_UV_TOOL:-${XDG_CACHE_HOME:-$HOME/.cache}/marlin-pack/uv-tool}
    if [ ! -x "$tool/bin/uv" ]; then
        say "installing uv into $tool"
        "${PYTHON:-python3}" -m venv "$tool"
        "$tool/bin/python" -m pip install -q 'uv>=0.13.9,<0.14'
    fi
    uv=$tool/bin/uv
fi

# The venv.
mkdir -p "$(dirname "$dir")"
dir=$(cd "$(dirname "$dir")" && pwd)/$(basename "$dir")
if [ ! -x "$dir/bin/python" ]; then
    say "making the venv $dir"
    "${PYTHON:-python3}" -m venv "$dir"
fi
py=$dir/bin/python

# One uv cache, on DIR's filesystem, venvs hardlinked from it.
export UV_CACHE_DIR=${UV_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/uv}
export UV_LINK_MODE=${UV_LINK_MODE:-hardlink}
mkdir -p "$UV_CACHE_DIR"
if [ "$UV_LINK_MODE" = hardlink ] && [ "$(stat -c %d "$UV_CACHE_DIR")" != "$(stat -c %d "$dir")" ]; then
    say "WARNING: uv's cache $UV_CACHE_DIR is on another filesystem than $dir: files are copied, ~9 GB a venv" \
        "(set UV_CACHE_DIR to a folder on $dir's filesystem to share them)"
    export UV_LINK_MODE=copy
fi

find_links=()
[ -n "${MARLIN_PACK_WHEELS:-}" ] && find_links=(--find-links "$MARLIN_PACK_WHEELS")

override=()
grep -qvE '^[[:space:]]*(#|$)' "$overrides" && override=(--override "$overrides")  # a file of comments only: none
say "installing vllm==$version (overrides: tools/overrides/vllm-$version.txt) into $dir"
"$uv" pip install --python "$py" "${find_links[@]}" "${override[@]}" "vllm==$version" "pytest>=8" "tokenizers>=0.19" "nvidia-cutlass>=3.5" \
    "runai-model-streamer[s3,gcs]>=0.17.1" "google-cloud-storage>=2.10" \
    "moto[server]>=5.1" "gcp-storage-emulator>=2026.7.19"  # the s3 and gcs extras; the S3 server and GCS emulator tests/remote starts
"$uv" pip install --python "$py" --no-deps -e "$root"

# --no-deps: marlin-pack's own requirements must already be there (vLLM brings them all); say so if one is not.
"$py" - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement

missing = []
for text in md.requires("marlin-pack") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        missing.append(f"{req} (not installed)")
        continue
    if not req.specifier.contains(have, prereleases=True):
        missing.append(f"{req} (have {have})")
if missing:
    raise SystemExit("vllm-env: marlin-pack's requirements not met by vLLM's: " + "; ".join(missing))
PY

"$py" - "$version" <<'PY'
import sys

import torch
import vllm

print("vllm-env:", "vllm", vllm.__version__, "torch", torch.__version__, "cuda", torch.version.cuda)
if vllm.__version__ != sys.argv[1]:
    raise SystemExit(f"vllm-env: vllm {vllm.__version__} imported, {sys.argv[1]} wanted")
PY
