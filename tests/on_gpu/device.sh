#!/usr/bin/env bash
# On the device machine, after tests/on_gpu/use_release.sh stage/switch unpacked a vLLM release into /tmp/site:
#   bash tests/on_gpu/device.sh PYTEST_ARGS...                      one pytest run (logs and results go to $OUT)
#   bash tests/on_gpu/device.sh --parallel 'NAME:PYTEST ARGS' ...    several pytest runs side by side, one log each
#        ($OUT/NAME.log): the engines of the GPU tests start side by side on one GPU (explicit KV cache sizes)
#   MARLIN_PACK_GPU_JOBS (default 6): at most this many runs at once, the others start as runs end. Each run is a
#        pytest, an engine and maybe a daemon, several GiB of host memory: 16 at once exhausted a 128 GiB machine
#        (2026-12-06: pytest processes killed by the kernel, nothing reported, the machine lost).
#   MARLIN_PACK_GPU_DEADLINE_S (default none): after this many seconds the running runs are interrupted (SIGINT to
#        each run's process group: pytest reports the failures so far, its engines end), killed 20 s later, the runs
#        not started are named; summaries and logs come back either way. Set it below the device call's limit.
#   MARLIN_PACK_GPU_MIN_FREE_GB (default 12): host memory guard. A run starts only while MemAvailable is at least
#        twice this and 10 s after the previous start (its engines have grown by then); below it the newest run is
#        stopped (SIGINT to its group, killed 10 s later) and fewer run at once from then on: a test_daemon_gpu
#        selection starts four engines and daemons at once, and six such selections took a machine down (2026-12-06).
#        The lowest MemAvailable seen is printed; $OUT/memory.log has the timeline (MARLIN_PACK_MEMINFO: another file).
#   MARLIN_PACK_DEVICE_NO_INSTALL=1: use the project as installed (the script's own tests on the CPU)
# First, unless MARLIN_PACK_DEVICE_NO_INSTALL=1: the vLLM in /tmp/site (MARLIN_PACK_DEVICE_SITE) must be one release,
# whole (tests/on_gpu/site_check.py: its extensions match its RECORD), else nothing runs (exit 3): 0.31.0's extension
# under 0.34.0's Python once ran a whole sitting of tests, one failing and the others passing on that mix.
set -o pipefail
site=${MARLIN_PACK_DEVICE_SITE:-/tmp/site}
if [ "${MARLIN_PACK_DEVICE_NO_INSTALL:-}" != 1 ]; then
  python3 "$(dirname "${BASH_SOURCE[0]}")/site_check.py" "$site" || exit 3
fi
export PYTHONPATH=$site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export MARLIN_PACK_TEST_ATTN=${MARLIN_PACK_TEST_ATTN:-TRITON_ATTN}
# MLA models (DeepSeek): no flash-attn binaries there, so no FLASH_ATTN MLA prefill (see tests/on_gpu/_harness.py)
export MARLIN_PACK_TEST_MLA_ATTN=${MARLIN_PACK_TEST_MLA_ATTN:-TRITON_MLA} MARLIN_PACK_TEST_MLA_PREFILL=${MARLIN_PACK_TEST_MLA_PREFILL:-CPU}
[ "${MARLIN_PACK_DEVICE_NO_INSTALL:-}" = 1 ] || python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null 2>&1 \
  || python3 -m pip install --no-deps --no-build-isolation --no-index .
# vLLM 0.34's kernel warm-up imports MiniMax-M3's CuTe DSL kernels (the `cutlass` package, not carried) on every
# CUDA engine; that warm-up returns at once for models without MiniMax-M3 sparse attention and below SM100. Where
# `cutlass` is missing, the carried copy gets a no-op module of the same name (the GPU machine's copy only).
warmup=$site/vllm/model_executor/warmup/minimax_m3_msa_warmup.py
if [ -f "$warmup" ] && ! python3 -c "import cutlass" 2>/dev/null; then
  printf 'def minimax_m3_msa_warmup(worker):\n    return None  # placeholder: CuTe DSL not carried (tests/on_gpu/device.sh)\n' >"$warmup"
fi
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
set -m  # each run in a process group of its own: a deadline interrupts pytest with the engines it started
jobs_max=${MARLIN_PACK_GPU_JOBS:-6}
deadline=${MARLIN_PACK_GPU_DEADLINE_S:-0}
names=() groups=() pids=() codes=()
for group in "$@"; do names+=("${group%%:*}") groups+=("${group#*:}"); done
start_run() {  # INDEX: the group's pytest arguments as a shell would split them (quotes kept: -k 'a or b'); each run's
  # engines and daemons count their rendezvous ports (VLLM_PORT) from a base of its own, 2,000 ports apart, below
  # the ephemeral range
  local name=${names[$1]}
  MARLIN_PACK_TEST_PORT_BASE=$((10040 + ($1 % 11) * 2000)) eval "run_pytest \"\$out/\$name.log\" ${groups[$1]}" &
  pids[$1]=$!
}
reap() {  # records the exit code of every started run that ended; sets $running to how many still run
  local i
  running=0
  for i in "${!pids[@]}"; do
    [ -z "${codes[$i]:-}" ] || continue
    if kill -0 "${pids[$i]}" 2>/dev/null; then running=$((running + 1)); else wait "${pids[$i]}"; codes[$i]=$?; fi
  done
}
min_free=${MARLIN_PACK_GPU_MIN_FREE_GB:-12}
meminfo=${MARLIN_PACK_MEMINFO:-/proc/meminfo}
stagger=${MARLIN_PACK_GPU_STAGGER_S:-10}
mem_free_gb() { awk '/^MemAvailable:/ {print int($2 / 1048576); exit}' "$meminfo"; }
stop_newest() {  # host memory is low: the newest run still going gives way (its group interrupted, then killed)
  local i newest=
  for i in "${!pids[@]}"; do [ -n "${codes[$i]:-}" ] || newest=$i; done
  [ -n "$newest" ] || return 0
  echo "== host memory low ($1 GiB available, guard ${min_free} GiB): stopping ${names[$newest]}"
  memstop[$newest]=$1
  kill -INT -- "-${pids[$newest]}" 2>/dev/null
  for _ in $(seq 10); do kill -0 "${pids[$newest]}" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-${pids[$newest]}" 2>/dev/null
  reap
  jobs_max=$((running > 1 ? running : 1))  # fewer at once from now on
}
memstop=()
next=0 interrupted=0 lowest=999999 last_start=-999999 last_stop=-999999
while :; do
  reap
  free_gb=$(mem_free_gb)
  free_gb=${free_gb:-999999}
  [ "$free_gb" -ge "$lowest" ] || lowest=$free_gb
  echo "$SECONDS $free_gb $running" >>"$out/memory.log"
  # (a stopped run's memory takes a moment to come back: 5 s before the next run is stopped)
  if [ "$free_gb" -lt "$min_free" ] && [ "$running" -gt 0 ] && [ $((SECONDS - last_stop)) -ge 5 ]; then
    stop_newest "$free_gb"; last_stop=$SECONDS; continue
  fi
  # (with nothing running, waiting would not free memory: the next run starts and the guard watches it)
  while [ "$running" -lt "$jobs_max" ] && [ "$next" -lt "${#names[@]}" ] && [ $((SECONDS - last_start)) -ge "$stagger" ] \
    && { [ "$free_gb" -ge $((2 * min_free)) ] || [ "$running" -eq 0 ]; }; do
    start_run "$next"; next=$((next + 1)) running=$((running + 1)) last_start=$SECONDS
  done
  [ "$running" -eq 0 ] && [ "$next" -ge "${#names[@]}" ] && break
  if [ "$deadline" -gt 0 ] && [ "$SECONDS" -ge "$deadline" ]; then
    interrupted=1
    echo "== deadline of ${deadline} s: interrupting the runs still going"
    for i in "${!pids[@]}"; do [ -n "${codes[$i]:-}" ] || kill -INT -- "-${pids[$i]}" 2>/dev/null; done
    for _ in $(seq 20); do reap; [ "$running" -eq 0 ] && break; sleep 1; done
    for i in "${!pids[@]}"; do [ -n "${codes[$i]:-}" ] || kill -KILL -- "-${pids[$i]}" 2>/dev/null; done
    reap
    break
  fi
  sleep 1
done
rc=$interrupted
for i in "${!names[@]}"; do
  name=${names[$i]}
  if [ -z "${pids[$i]:-}" ]; then echo "== $name: not started (deadline)"; rc=1; continue; fi
  code=${codes[$i]:-killed}
  if [ -n "${memstop[$i]:-}" ]; then
    echo "== $name: stopped, host memory low (${memstop[$i]} GiB available): run it with fewer beside it"; rc=1; continue
  fi
  [ "$code" = 0 ] || rc=1
  summary=$(grep -E '^=+ .* in [0-9.]+s .*=+$' "$out/$name.log" | tail -1)
  grep -q '^!!*  *KeyboardInterrupt' "$out/$name.log" && summary="interrupted: $summary"
  echo "== $name: exit $code, $summary"
done
echo "== host memory: lowest available ${lowest} GiB (guard ${min_free} GiB)"
started=()
for i in "${!pids[@]}"; do started+=("${names[$i]}"); done
for name in "${started[@]}"; do
  grep -E "FAILED|ERROR" "$out/$name.log" | grep -v "^E " | head -5 | sed "s/^/$name: /" | cut -c1-300
  # the first assertion lines of its failures (the whole log is in the archive)
  grep -E "^E  +[A-Za-z]*(Error|assert)" "$out/$name.log" | grep -v "\[rank" | head -6 | sed "s/^/$name: /" | cut -c1-300
done
pack_logs "${started[@]/%/.log}" memory.log
exit $rc
