#!/usr/bin/env bash
# A benchmark on the device machine, after tests/on_gpu/use_release.sh stage/switch unpacked vLLM into /tmp/site, in
# the environment tests/on_gpu/device.sh gives the GPU tests; its output on stdout and in $OUT/NAME.log:
#   bash benchmarks/on_device.sh [--wheels DIR]... SCRIPT [ARGS...]
#   --wheels DIR: the wheels carried in DIR installed into /tmp/site first, all folders in one pip call (the s3 package
#        of runai-model-streamer puts its library into runai_model_streamer's own folder, which a later call would replace)
# e.g. bash benchmarks/on_device.sh --wheels .device-carry-s3 benchmarks/bench_remote.py --preset llama-70b --layers 40
set -o pipefail
wheels=()
while [ "${1:-}" = --wheels ]; do
  [ -d "${2:-}" ] || { echo "on_device.sh: no folder ${2:-} (carry it in the call)" >&2; exit 2; }
  wheels+=("$2"/*.whl)
  shift 2
done
[ $# -ge 1 ] || { echo "usage: bash benchmarks/on_device.sh [--wheels DIR]... SCRIPT [ARGS...]" >&2; exit 2; }
# the vLLM in /tmp/site (MARLIN_PACK_DEVICE_SITE) one release, whole, or nothing runs (tests/on_gpu/site_check.py)
site=${MARLIN_PACK_DEVICE_SITE:-/tmp/site}
python3 "$(dirname "${BASH_SOURCE[0]}")/../tests/on_gpu/site_check.py" "$site" || exit 3
export PYTHONPATH=$site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export MARLIN_PACK_TEST_ATTN=${MARLIN_PACK_TEST_ATTN:-TRITON_ATTN}
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" || exit 3
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null 2>&1 \
  || python3 -m pip install --no-deps --no-build-isolation --no-index . || exit 3
# As tests/on_gpu/device.sh: vLLM 0.34's MiniMax-M3 warm-up imports CuTe DSL (`cutlass`, not carried) in every CUDA
# engine; where it is missing, the carried copy gets a no-op module (it returns at once for other models anyway).
warmup=$site/vllm/model_executor/warmup/minimax_m3_msa_warmup.py
if [ -f "$warmup" ] && ! python3 -c "import cutlass" 2>/dev/null; then
  printf 'def minimax_m3_msa_warmup(worker):\n    return None  # placeholder: CuTe DSL not carried (benchmarks/on_device.sh)\n' >"$warmup"
fi
# vLLM's model-info cache (tests/on_gpu/modelinfo_cache.py), when this call carries it: no ~25 s inspection
if [ -d .device-carry/mi/modelinfos ]; then
  cache="${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}"
  mkdir -p "$cache" && { cp -r --update=none .device-carry/mi/modelinfos "$cache/" 2>/dev/null || cp -rn .device-carry/mi/modelinfos "$cache/"; }
fi
out="${OUT:-/tmp/out}"
mkdir -p "$out"
# The benchmark in the background, this script waiting: a SIGTERM or SIGINT that reaches this script alone (a call's
# timeout) is passed on, so the benchmark's clean-up runs (engines ended, its workdir removed: the next call's disk)
python3 "$@" > >(tee "$out/$(basename "$1" .py).log") 2>&1 &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null' TERM INT
wait "$pid"
rc=$?
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done  # interrupted by the trap: its own exit status
wait  # tee's last lines
exit "$rc"
