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

# One cargo invocation for every MPI program, so the features unify once: built one
# package at a time, each build resolved other features for the crates below it
# (zeropp-quant's `tools` for the CLI, the candle example's dev-dependencies) and
# recompiled the whole stack three times (13 of this script's 14 minutes in CI).
# xtask/src/cluster/mod.rs (`build_zeropp`) runs the same command, so the cluster
# test reuses these binaries.
# `--workspace` resolves the features as `cargo test --workspace --features ...` does,
# and ZEROPP_MPI_PROFILE=test (set by `cargo xtask ci`, whose tests build with the mpi
# feature) builds in the tests' profile: then nothing here compiles again. Both
# profiles write to target/debug.
PROFILE="${ZEROPP_MPI_PROFILE:-dev}"
echo "==> building the MPI programs: conformance and fault examples, the CLI, the candle example (profile $PROFILE)"
if ! cargo build --locked --workspace --profile "$PROFILE" \
  --features zeropp-comm/mpi,zeropp/mpi,zeropp-candle/mpi \
  --example mpi_conformance --example mpi_fault --example train_your_model --bin zeropp; then
  echo "0 passed, 1 failed (build)"
  exit 1
fi

echo "==> unit tests of the MPI backend (no mpirun needed)"
if [ "${ZEROPP_MPI_UNIT_TESTS_RAN:-0}" = 1 ]; then
  pass "unit tests (mpi::): ran in this job's workspace tests, built with the mpi feature"
elif cargo test -p zeropp-comm --features mpi --lib -- mpi:: >"$LOG_DIR/unit.log" 2>&1; then
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

# ---- end to end: `zeropp train --backend mpi` against `--backend threads` ----
zeropp="$TARGET_DIR/debug/zeropp"
E2E_DIR="$LOG_DIR/e2e"
rm -rf "$E2E_DIR"
mkdir -p "$E2E_DIR"
# A small run: 8 ranks as 2 nodes x 4, the tiny GPT, 20 steps (a few seconds).
TRAIN_ARGS=(--model gpt-tiny --steps 20 --seed 1 --eval-batches 1)

# same_jsonl NAME A B: the per-step losses, gradient norms, skip flags and byte
# counters (total and per operation) of two metrics files must be equal.
same_jsonl() {
  local name="$1" a="$2" b="$3" out
  if out=$(python3 - "$a" "$b" <<'PY' 2>&1
import json, sys
def load(path):
    steps, summary = [], None
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if "step" in rec and "loss" in rec:
                    steps.append(rec)
                else:
                    summary = rec
    return steps, summary
(sa, ua), (sb, ub) = load(sys.argv[1]), load(sys.argv[2])
if not sa or len(sa) != len(sb):
    sys.exit(f"step counts differ or are zero: {len(sa)} vs {len(sb)}")
keys = ["step", "loss", "grad_norm", "skipped", "intra_node_bytes", "inter_node_bytes", "bytes_by_op"]
worst = 0.0
for x, y in zip(sa, sb):
    for k in keys:
        if x.get(k) != y.get(k):
            if k in ("loss", "grad_norm") and isinstance(x.get(k), float) and isinstance(y.get(k), float):
                rel = abs(x[k] - y[k]) / max(abs(y[k]), 1e-30)
                worst = max(worst, rel)
                if rel <= 1e-6:
                    continue
            sys.exit(f"step {x.get('step')}: {k} differs: {x.get(k)} vs {y.get(k)}")
for k in ("final_loss", "val_loss", "bytes_per_step", "bytes_by_op"):
    if (ua or {}).get(k) != (ub or {}).get(k):
        sys.exit(f"summary {k} differs: {(ua or {}).get(k)} vs {(ub or {}).get(k)}")
print(f"{len(sa)} steps identical (losses {'bitwise' if worst == 0 else f'within {worst:.1e} rel'}, bytes equal), final loss {sa[-1]['loss']}")
PY
  ); then
    pass "$name"
    echo "       $out"
  else
    fail "$name: $out"
  fi
}

echo "==> end to end: zeropp train --backend mpi equals --backend threads"
# zeropp's run names --backend mpi; zero3's names none: the engine's launch must
# detect mpirun itself (the plan line says "MPI ranks ... under OpenMPI"; a
# process that fell back to threads would print "ranks" and no launcher).
# zeropp-delta (qwZ-delta's exchange, two-level Hadamard qgZ) refreshes its hpZ
# copies at steps 0, 7 and 14, so both kinds of step are compared.
for mode in zeropp zero3 zeropp-delta; do
  a="$E2E_DIR/mpi-$mode.jsonl" b="$E2E_DIR/threads-$mode.jsonl"
  extra=()
  if [ "$mode" = zero3 ]; then
    backend=() label="(no --backend: detected)" expect="on 8 MPI ranks = 2 nodes x 4 under OpenMPI"
  else
    backend=(--backend mpi) label="(mpi)" expect="metrics written"
  fi
  [ "$mode" = zeropp-delta ] && extra=(--qwz-delta-refresh 7)
  run "train np8 2x4 $mode $label" ok "$expect" -- -np 8 "$zeropp" train "${backend[@]}" \
    --local-size 4 --mode "$mode" "${extra[@]}" "${TRAIN_ARGS[@]}" --metrics "$a"
  if timeout -k 10 "$TIMEOUT" "$zeropp" train --backend threads --world 8 --local-size 4 --mode "$mode" \
    "${extra[@]}" "${TRAIN_ARGS[@]}" --metrics "$b" >"$E2E_DIR/threads-$mode.log" 2>&1; then
    same_jsonl "train $mode: mpi == threads (losses, bytes)" "$a" "$b"
  else
    tail -20 "$E2E_DIR/threads-$mode.log"
    fail "train $mode (threads reference run)"
  fi
done

echo "==> end to end: the candle example under mpirun (zeropp_engine::launch takes the job's topology)"
run "example train_your_model np4 2x2" ok "^on 4 ranks = 2 nodes x 2" -- -np 4 -x ZEROPP_LOCAL_SIZE=2 \
  "$EXAMPLES/train_your_model"

echo "==> end to end: the candle Llama (zeropp-candle) under mpi equals threads"
LLAMA_ARGS=(--model llama:d=32,layers=2,heads=4,kv_heads=2,seq=16 --steps 8 --seed 2 --eval-batches 1)
a="$E2E_DIR/mpi-llama.jsonl" b="$E2E_DIR/threads-llama.jsonl"
run "train np4 2x2 llama (mpi)" ok "metrics written" -- -np 4 "$zeropp" train --backend mpi \
  --local-size 2 "${LLAMA_ARGS[@]}" --metrics "$a"
if timeout -k 10 "$TIMEOUT" "$zeropp" train --backend threads --world 4 --local-size 2 \
  "${LLAMA_ARGS[@]}" --metrics "$b" >"$E2E_DIR/threads-llama.log" 2>&1; then
  same_jsonl "train llama: mpi == threads (losses, bytes)" "$a" "$b"
else
  tail -20 "$E2E_DIR/threads-llama.log"
  fail "train llama (threads reference run)"
fi

echo "==> end to end: --world must match mpirun -np"
run "train: --world differs from the MPI world" fail "does not match the MPI world" -- \
  -np 4 "$zeropp" train --backend mpi --world 8 --local-size 2 "${TRAIN_ARGS[@]}"

echo "==> end to end: a rank failing mid-run ends the job (ZEROPP_FAULT)"
run "train: rank 5 fails at step 2" fail "rank 5 of 8: fatal: .*injected failure" -- \
  -np 8 -x ZEROPP_FAULT=fail:5:2 "$zeropp" train --backend mpi --local-size 4 "${TRAIN_ARGS[@]}"

echo "==> end to end: a NaN in one rank's local gradient is skipped by every rank (ZEROPP_FAULT=nan)"
for extra in "--mode zero3" "--mode zero3 --qgz" "--mode zeropp"; do
  # shellcheck disable=SC2086 # $extra is a list of flags
  run "train ($extra): NaN on rank 5 at step 2 skips that step" ok "(skipped 1)" -- \
    -np 8 -x ZEROPP_FAULT=nan:5:2 "$zeropp" train --backend mpi --local-size 4 $extra "${TRAIN_ARGS[@]}"
done

echo "==> end to end: checkpoints move between backends"
full="$E2E_DIR/threads-zeropp.jsonl"   # the uninterrupted 20-step run above
half=(--model gpt-tiny --steps 10 --seed 1 --eval-batches 1)
# Joins the per-step losses of a saved run ($2) and of its resumption ($3),
# then the resumption's final line, into $4, and compares that with the
# uninterrupted run under the label $1.
resumed_matches() {
  cat "$2" "$3" | grep '"loss"' | grep -v final_loss >"$4"
  tail -1 "$3" >>"$4"
  same_jsonl "$1" "$4" "$full"
}
run "train: save under mpi (10 steps)" ok "metrics written" -- -np 8 "$zeropp" train --backend mpi \
  --local-size 4 "${half[@]}" --save "$E2E_DIR/ckpt-mpi" --metrics "$E2E_DIR/save-mpi.jsonl"
if timeout -k 10 "$TIMEOUT" "$zeropp" train --backend threads --world 8 --local-size 4 "${TRAIN_ARGS[@]}" \
  --resume "$E2E_DIR/ckpt-mpi" --metrics "$E2E_DIR/resume-threads.jsonl" >"$E2E_DIR/resume-threads.log" 2>&1; then
  resumed_matches "checkpoint: mpi save -> threads resume == uninterrupted" \
    "$E2E_DIR/save-mpi.jsonl" "$E2E_DIR/resume-threads.jsonl" "$E2E_DIR/mpi-then-threads.jsonl"
else
  tail -20 "$E2E_DIR/resume-threads.log"
  fail "checkpoint: threads resume of an mpi checkpoint"
fi
if timeout -k 10 "$TIMEOUT" "$zeropp" train --backend threads --world 8 --local-size 4 "${half[@]}" \
  --save "$E2E_DIR/ckpt-threads" --metrics "$E2E_DIR/save-threads.jsonl" >"$E2E_DIR/save-threads.log" 2>&1; then
  run "train: resume under mpi (steps 10..20)" ok "metrics written" -- -np 8 "$zeropp" train --backend mpi \
    --local-size 4 "${TRAIN_ARGS[@]}" --resume "$E2E_DIR/ckpt-threads" --metrics "$E2E_DIR/resume-mpi.jsonl"
  resumed_matches "checkpoint: threads save -> mpi resume == uninterrupted" \
    "$E2E_DIR/save-threads.jsonl" "$E2E_DIR/resume-mpi.jsonl" "$E2E_DIR/threads-then-mpi.jsonl"
else
  tail -20 "$E2E_DIR/save-threads.log"
  fail "checkpoint: threads save"
fi
# Each rank reads only the shard files its state overlaps: a corrupt one fails every
# rank anyway (they agree on the outcome), the ones that read it naming the file.
if [ -d "$E2E_DIR/ckpt-threads" ]; then
  rm -rf "$E2E_DIR/ckpt-corrupt"
  cp -r "$E2E_DIR/ckpt-threads" "$E2E_DIR/ckpt-corrupt"
  shard="$E2E_DIR/ckpt-corrupt/$(cat "$E2E_DIR/ckpt-corrupt/LATEST")/rank-00005-of-00008.safetensors"
  python3 -c 'import sys; p = sys.argv[1]; b = bytearray(open(p, "rb").read()); b[-3] ^= 1; open(p, "wb").write(b)' "$shard"
  run "checkpoint: a corrupt shard fails every mpi rank" fail "rank 5 could not load its checkpoint state" -- \
    -np 8 "$zeropp" train --backend mpi --local-size 4 "${TRAIN_ARGS[@]}" --resume "$E2E_DIR/ckpt-corrupt"
fi

echo
for f in "${failures[@]+"${failures[@]}"}"; do echo "failed: $f"; done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
