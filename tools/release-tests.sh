#!/usr/bin/env bash
# tools/release-tests.sh DIR [PYTEST ARGS...]: run the release-dependent tests (tools/release-tests.txt) with the
# venv DIR's python (one made by tools/vllm-env.sh VERSION DIR), from the repository root. Extra arguments go to
# pytest (e.g. -m "not slow"). Exit status: pytest's.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 DIR [PYTEST ARGS...]   (DIR: a venv made by tools/vllm-env.sh)" >&2; exit 2; }
dir=$1
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[ -x "$dir/bin/python" ] || { echo "release-tests: $dir/bin/python: no such venv (tools/vllm-env.sh VERSION $dir)" >&2; exit 2; }
mapfile -t selection < <(sed -e 's/#.*//' -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' "$root/tools/release-tests.txt" | grep -v '^$')
dir=$(cd "$dir" && pwd)
cd "$root"
echo "+ $dir/bin/python -m pytest -q ${selection[*]} $*" >&2
exec "$dir/bin/python" -m pytest -q "${selection[@]}" "$@"
