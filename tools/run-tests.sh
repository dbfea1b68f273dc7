#!/usr/bin/env bash
# tools/run-tests.sh [PYTEST ARGS...]: the whole suite with .venv's python (made by tools/vllm-env.sh), in one pytest
# process per core (at most 4; MARLIN_PACK_TEST_SHARDS sets the number), each running every N-th test
# (tests/conftest.py's --shard I/N) with a temporary folder of its own. Prints each process's failures and closing line,
# then the totals in pytest's words (the last line). Exit status: non-zero if any process failed.
# One process (MARLIN_PACK_TEST_SHARDS=1) is plain `pytest -q`. The suite is serial CPU work: on the 2-core CI machine two
# processes take about half the time of one.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || { echo "run-tests: $py: no such interpreter (make it: bash tools/vllm-env.sh 0.34.0 .venv)" >&2; exit 2; }
n=${MARLIN_PACK_TEST_SHARDS:-$(nproc 2>/dev/null || echo 1)}
[[ $n =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] || { echo "run-tests: MARLIN_PACK_TEST_SHARDS=$n: expected a whole number >= 1" >&2; exit 2; }
[ "$n" -gt 4 ] && n=4
[ "$n" -eq 1 ] && exec "$py" -m pytest -q "$@"
logs=$(mktemp -d "${TMPDIR:-/tmp}/marlin-pack-tests.XXXXXX")
t0=$(date +%s)
pids=()
for ((i = 0; i < n; i++)); do
    "$py" -m pytest -q --shard "$i/$n" --basetemp "$logs/tmp-$i" "$@" >"$logs/shard-$i.log" 2>&1 &
    pids+=($!)
done
echo "run-tests: $n pytest processes, logs in $logs"
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
declare -A total=()
for ((i = 0; i < n; i++)); do
    log=$logs/shard-$i.log
    last=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|errors?|deselected|xfailed)' "$log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
    echo "--- shard $i/$n: ${last:-no closing line (see $log)}"
    grep -E '^(FAILED|ERROR) ' "$log" || true
    if ! grep -qE '(^| )[0-9]+ passed' <<<"$last" || grep -qE '[0-9]+ (failed|errors?)' <<<"$last"; then
        tail -n 80 "$log"  # a failed or broken process: its end, tracebacks included
    fi
    for word in passed failed skipped xfailed xpassed error errors; do
        c=$(grep -oE "[0-9]+ $word\b" <<<"$last" | cut -d' ' -f1 || true)
        total[$word]=$(( ${total[$word]:-0} + ${c:-0} ))
    done
done
errors=$(( ${total[error]} + ${total[errors]} ))
line="${total[passed]} passed"
for word in failed skipped xfailed xpassed; do [ "${total[$word]}" -gt 0 ] && line+=", ${total[$word]} $word"; done
[ "$errors" -gt 0 ] && line+=", $errors errors"
echo "$line in $(( $(date +%s) - t0 )).00s"
exit $rc
