#!/usr/bin/env bash
# Run the test suite several times in a row with two CPU-burning processes beside it
# (the "tests that don't flake" check of issue #15) and report each run.
#
#   bench/stress_suite.sh [RUNS] [pytest args...]     # default: 5 runs of the whole suite
#   bench/stress_suite.sh 5 tests/transport            # only the socket tests
#
# Exit status: 0 if every run passed. The burners are this script's own children and are
# killed (by PID) when it ends, however it ends.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RUNS=${1:-5}
shift || true
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(tests)

BURNERS=()
RUNNING=""
LOG=$(mktemp)
cleanup() {
    [ -n "$RUNNING" ] && kill "$RUNNING" 2>/dev/null
    for pid in "${BURNERS[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${BURNERS[@]}" $RUNNING; do wait "$pid" 2>/dev/null; done
    rm -f "$LOG"
}
trap 'cleanup; exit 130' INT TERM
trap cleanup EXIT
for _ in 1 2; do
    "$PY" -c "while True: pass" &
    BURNERS+=($!)
done
echo "burners: ${BURNERS[*]}; $RUNS run(s) of: pytest ${ARGS[*]}"

failed=0
for i in $(seq 1 "$RUNS"); do
    start=$(date +%s)
    # In the background and waited for, so that a signal reaches the trap at once. A
    # background command of a shell without job control starts with SIGINT and SIGQUIT
    # ignored, and every process the tests start would inherit that (a test's Ctrl-C to a
    # command would never arrive): `trap -` gives them back their default first.
    ( trap - INT QUIT; exec "$PY" -m pytest -p no:cacheprovider "${ARGS[@]}" ) > "$LOG" 2>&1 &
    RUNNING=$!
    wait "$RUNNING"
    rc=$?
    RUNNING=""
    out=$(cat "$LOG")
    secs=$(( $(date +%s) - start ))
    summary=$(printf '%s\n' "$out" | grep -E '(passed|failed|error)' | tail -n 1)
    if [ $rc -eq 0 ]; then
        echo "run $i: PASS (${secs}s) $summary"
    else
        failed=$((failed + 1))
        echo "run $i: FAIL (${secs}s) $summary"
        printf '%s\n' "$out" | grep -E '^(FAILED|ERROR) ' | sed 's/^/    /'
        kept="${TMPDIR:-/tmp}/stress_suite_run${i}_$(date +%Y%m%d-%H%M%S).log"
        cp "$LOG" "$kept" && echo "    the whole log of run $i: $kept"
    fi
done
echo "$((RUNS - failed))/$RUNS runs passed"
[ $failed -eq 0 ]
