#!/usr/bin/env bash
# On the device machine, after stage b of ../shared/device/README.md has unpacked vLLM into /tmp/site:
#   bash tests/on_gpu/device.sh PYTEST_ARGS...                      one pytest run (logs and results go to $OUT)
#   bash tests/on_gpu/device.sh --parallel 'NAME:PYTEST ARGS' ...    several pytest runs side by side, one log each
#        ($OUT/NAME.log): the engines of the GPU tests start side by side on one GPU (explicit KV cache sizes)
set -o pipefail
export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export MARLIN_PACK_TEST_ATTN=${MARLIN_PACK_TEST_ATTN:-TRITON_ATTN}
# MLA models (DeepSeek): no flash-attn binaries there, so no FLASH_ATTN MLA prefill (see tests/on_gpu/_harness.py)
export MARLIN_PACK_TEST_MLA_ATTN=${MARLIN_PACK_TEST_MLA_ATTN:-TRITON_MLA} MARLIN_PACK_TEST_MLA_PREFILL=${MARLIN_PACK_TEST_MLA_PREFILL:-CPU}
python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null 2>&1 || python3 -m pip install --no-deps --no-build-isolation --no-index .
out="${OUT:-/tmp/out}"
mkdir -p "$out"
# vLLM's model-info cache written on the CPU machine (tests/on_gpu/modelinfo_cache.py), when this call carries it:
# no ~25 s model-class inspection before the first engine of each architecture
if [ -d .device-carry/mi/modelinfos ]; then
  # keep files already there; coreutils 9.5 warns about -n, older ones lack --update=none
  cache="${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}"
  mkdir -p "$cache" && { cp -r --update=none .device-carry/mi/modelinfos "$cache/" 2>/dev/null || cp -rn .device-carry/mi/modelinfos "$cache/"; }
fi
KEEP="PASSED|FAILED|ERROR|bit-identical|marlin-pack:|Model loading took|ordinary|prepacked|passed|failed|Error|error|^[0-9.]+s (setup|call) "
run_pytest() {  # LOG PYTEST_ARGS...
  local log=$1 name
  shift
  name=$(basename "$log" .log)
  python3 -m pytest -m gpu -v -rA -s -p no:cacheprovider --basetemp="/tmp/pt-$name" --durations=0 --durations-min=5 "$@" \
    >"$log" 2>&1
}
pack_logs() {  # LOGS...: those logs and the engines' and daemons' own (folders under $OUT) in one archive, because a
  # device call brings back at most 8 files from $OUT; other files there (a golden file) come back as they are
  local dirs
  dirs=$(cd "$out" && find . -mindepth 1 -maxdepth 1 -type d -printf '%P\n')
  [ -n "$dirs$*" ] || return 0
  # shellcheck disable=SC2086
  (cd "$out" && tar czf "gpu-logs-$(date +%H%M%S).tgz" $dirs "$@" && rm -rf $dirs "$@")
}
if [ "${1:-}" != "--parallel" ]; then
  run_pytest "$out/pytest.log" "$@"
  rc=$?
  grep -E "$KEEP" "$out/pytest.log" | cut -c1-400
  pack_logs
  exit $rc
fi
shift
pids=() names=()
for group in "$@"; do
  name=${group%%:*}
  # the group's pytest arguments as a shell would split them (quotes kept: -k 'a or b')
  eval "run_pytest \"\$out/\$name.log\" ${group#*:}" &
  pids+=($!) names+=("$name")
done
rc=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"
  code=$?
  [ $code -eq 0 ] || rc=1
  echo "== ${names[$i]}: exit $code, $(grep -E '^=+ .*(passed|failed|error).* =+$' "$out/${names[$i]}.log" | tail -1)"
done
for name in "${names[@]}"; do
  grep -E "FAILED|ERROR" "$out/$name.log" | grep -v "^E " | head -5 | sed "s/^/$name: /" | cut -c1-300
  # the first assertion lines of its failures (the whole log is in the archive)
  grep -E "^E  +[A-Za-z]*(Error|assert)" "$out/$name.log" | grep -v "\[rank" | head -6 | sed "s/^/$name: /" | cut -c1-300
done
pack_logs "${names[@]/%/.log}"
exit $rc
