#!/usr/bin/env bash
# The MPI backend's test suite (`cargo xtask test-mpi`; `cargo xtask ci` runs it when
# mpirun exists). Builds the MPI test programs with `--features mpi` and runs them
# under mpirun with -np 4 and -np 8 on simulated nodes (ZEROPP_LOCAL_SIZE), plus the
# fault and topology-consistency tests. Every mpirun runs under `timeout`, so nothing
# can hang CI. Ends with a plain `N passed, M failed` line; exits non-zero on failure.
set -uo pipefail
cd "$(dirname "$0")/.."

# mpirun refuses root unless told; small CI machines need oversubscription.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
# Quiet the "help" banners OpenMPI prints on aborts (the tests print what matters).
export OMPI_MCA_orte_base_help_aggregate=1

TIMEOUT="${ZEROPP_MPI_TEST_TIMEOUT:-120}"   # seconds per mpirun
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
EXAMPLES="$TARGET_DIR/debug/examples"
LOG_DIR="$TARGET_DIR/mpi-tests"
mkdir -p "$LOG_DIR"

passed=0
failed=0
failures=()

pass() { passed=$((passed + 1)); echo "ok   $1"; }
fail() { failed=$((failed + 1)); failures+=("$1"); echo "FAIL $1"; }

echo "==> building the MPI test programs (cargo build --features mpi)"
if ! cargo build -p zeropp-comm --features mpi --example mpi_conformance --example mpi_fault; then
  echo "0 passed, 1 failed (build)"
  exit 1
fi

echo "==> unit tests of the MPI backend (no mpirun needed)"
if cargo test -p zeropp-comm --features mpi --lib -- mpi:: >"$LOG_DIR/unit.log" 2>&1; then
  pass "unit tests (mpi::)"
else
  tail -30 "$LOG_DIR/unit.log"
  fail "unit tests (mpi::)"
fi

# run NAME EXPECT(ok|fail) PATTERN -- mpirun args...
# Runs mpirun under the timeout; EXPECT=ok wants exit 0 and PATTERN in the output,
# EXPECT=fail wants a non-zero exit that is not the timeout's, and PATTERN.
run() {
  local name="$1" expect="$2" pattern="$3"
  shift 4
  local log="$LOG_DIR/${name//[^A-Za-z0-9_.-]/_}.log"
  local start=$SECONDS
  timeout -k 10 "$TIMEOUT" mpirun "$@" >"$log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  local why=""
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    why="timed out after ${TIMEOUT}s (hang)"
  elif [ "$expect" = ok ] && [ $rc -ne 0 ]; then
    why="exit status $rc"
  elif [ "$expect" = fail ] && [ $rc -eq 0 ]; then
    why="exit status 0, a failure was expected"
  elif ! grep -q -- "$pattern" "$log"; then
    why="output lacks \"$pattern\""
  fi
  if [ -z "$why" ]; then
    pass "$name (${took}s, exit $rc)"
    grep -h -- "$pattern" "$log" | head -1 | sed 's/^/       /'
  else
    echo "----- $log (last 25 lines)"
    tail -25 "$log"
    echo "-----"
    fail "$name: $why"
  fi
}

conf="$EXAMPLES/mpi_conformance"
fault="$EXAMPLES/mpi_fault"

echo "==> conformance suite under mpirun"
run "conformance np4 2x2" ok "checks passed" -- -np 4 -x ZEROPP_LOCAL_SIZE=2 "$conf"
run "conformance np4 shared-memory node" ok "checks passed" -- -np 4 -x ZEROPP_LOCAL_SIZE= "$conf"
run "conformance np8 2x4" ok "checks passed" -- -np 8 -x ZEROPP_LOCAL_SIZE=4 "$conf"
run "conformance np8 4x2" ok "checks passed" -- -np 8 -x ZEROPP_LOCAL_SIZE=2 "$conf"

echo "==> faults: one rank fails mid-run, the job must end non-zero without hanging"
run "fault control (no fault)" ok "completed" -- -np 4 "$fault" ok
run "fault: rank returns an error" fail "injected fault" -- -np 4 "$fault" error
run "fault: rank panics" fail "injected panic" -- -np 4 "$fault" panic
run "fault: rank exits(3) without MPI_Abort" fail "exit" -- -np 4 "$fault" exit
run "fault np8: rank returns an error" fail "injected fault" -- -np 8 "$fault" error

echo "==> topology consistency at start-up"
run "topology: node sizes differ between ranks" fail "inconsistent MPI topology" -- \
  -np 2 -x ZEROPP_LOCAL_SIZE=2 "$fault" topology : -np 2 -x ZEROPP_LOCAL_SIZE=4 "$fault" topology
run "topology: override set on some ranks only" fail "some ranks set the node size" -- \
  -np 2 -x ZEROPP_LOCAL_SIZE=2 "$fault" topology : -np 2 -x ZEROPP_LOCAL_SIZE= "$fault" topology
run "topology: node size does not divide the world" fail "does not divide" -- \
  -np 4 -x ZEROPP_LOCAL_SIZE=3 "$fault" topology

echo
for f in "${failures[@]+"${failures[@]}"}"; do echo "failed: $f"; done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
