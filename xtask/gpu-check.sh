#!/usr/bin/env bash
# The device side of `cargo xtask gpu check`: runs the prepared GPU checks from
# this folder (no cargo needed) and writes one markdown report.
#
#   bash run.sh [REPORT.md]
#
# The report goes to REPORT.md, else $OUT/gpu-check-report.md when $OUT is set
# (the device tool brings $OUT back), else next to this script. Steps, in this
# order, within ZEROPP_CHECK_BUDGET_S seconds (default 480):
#   1. the GPU kernel tests (bit-exact against the CPU kernels)
#   2. the device collectives on CudaDevice (bitwise against the thread backend)
#   3. NcclComm at world 1
#   4. bench gpu (kernels against a device-to-device memcpy on the same stream)
#   5. bench gpu-comm (device collectives against bf16 baselines)
#
# The verdict:
# - the machine SHOWS a device when `nvidia-smi -L` lists a GPU or the device
#   node exists (ZEROPP_CHECK_DEVICE_NODE, default /dev/nvidia0). Then every step
#   runs with ZEROPP_REQUIRE_GPU=1 and ZEROPP_REQUIRE_NCCL=1, and a step that
#   skips, fails, times out or is missing makes the verdict FAIL: a broken
#   driver, the stub libcuda found first, a failed context or module load is a
#   failure, never "no device".
# - NO DEVICE only when the machine shows none AND the kernel tests skip.
# - PASS when every step passed.
# Exit status: 0 for PASS or NO DEVICE, 1 for FAIL. `cargo xtask gpu verdict`
# (run by `cargo xtask ci`) holds the script to this on a machine without a GPU.
set -u
here=$(cd "$(dirname "$0")" && pwd)
report=${1:-${OUT:-$here}/gpu-check-report.md}
mkdir -p "$(dirname "$report")"
budget=${ZEROPP_CHECK_BUDGET_S:-480}
deadline=$((SECONDS + budget))
logs=$(mktemp -d "${TMPDIR:-/tmp}/zeropp-gpu-check.XXXXXX")
trap 'rm -rf "$logs"' EXIT

# The binaries were linked against a stub libcuda; the driver's real one must be found.
export RUST_BACKTRACE=1
rows=()
first_failure=""
verdict=PASS

# run NAME LIMIT_S CMD...: runs CMD with at most LIMIT_S seconds (less if the
# budget is short), output in $logs/NAME.out; appends a table row.
run() {
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - SECONDS))
    if [ "$left" -le 5 ]; then
        rows+=("| $name | not run: the ${budget} s budget is spent | 0 |")
        verdict=FAIL
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS rc
    timeout --kill-after=5 "$limit" "$@" >"$logs/$name.out" 2>&1
    rc=$?
    local dt=$((SECONDS - t0)) result
    if [ ! -x "$1" ]; then
        result="**FAIL**: $1 is not in the pack"
    elif [ $rc -eq 0 ]; then
        if grep -q "tests skipped" "$logs/$name.out"; then
            local why
            why=$(grep -m1 -o 'tests skipped: .*' "$logs/$name.out" | cut -c16- | sed 's/|/\//g')
            if [ -n "$shown" ]; then
                result="**FAIL**: skipped on a machine that shows a device: $why"
            else
                result="skipped: $why"
            fi
        else
            result="pass"
        fi
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        result="**FAIL**: timed out after ${limit} s"
    else
        result="**FAIL** (exit $rc)"
    fi
    rows+=("| $name | $result | $dt |")
    if [[ $result == *FAIL* ]]; then
        verdict=FAIL
        if [ -z "$first_failure" ]; then
            first_failure=$name
        fi
        return 1
    fi
    return 0
}

device_line=$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>/dev/null | head -4)
[ -n "$device_line" ] || device_line="nvidia-smi: not available"

# Does the machine show a device? Decided before any test runs, so no test's
# output can turn a failure into "no device".
device_node=${ZEROPP_CHECK_DEVICE_NODE:-/dev/nvidia0}
shown=""
listed=$(nvidia-smi -L 2>/dev/null | grep -m1 -E '^GPU [0-9]+' || true)
if [ -n "$listed" ]; then
    shown="nvidia-smi -L lists $listed"
elif [ -e "$device_node" ]; then
    shown="$device_node exists"
fi
# Which libcuda the kernels' binary loads (the pack links the stub; a real
# driver must come first at run time).
libcuda=$(ldd "$here/bin/quant-it" 2>/dev/null | grep -m1 -o 'libcuda.so.1 => [^ ]*' | cut -c17- || true)
[ -n "$libcuda" ] || libcuda="not found by ldd"
case $libcuda in *cuda-stub*) libcuda="$libcuda (the link-time STUB, not a driver)" ;; esac

all_steps() {
    export ZEROPP_REQUIRE_GPU=1 ZEROPP_REQUIRE_NCCL=1
    run "1. kernel tests" 100 "$here/bin/quant-it" gpu::suite --exact --test-threads=1
    run "2. device collectives (CudaDevice)" 120 "$here/bin/comm-it" device_gpu:: --test-threads=1
    run "3. NcclComm at world 1" 45 "$here/bin/comm-it" device_nccl:: --test-threads=1
    ZEROPP_GPU_BENCH_OUT="$logs/bench-gpu.md" run "4. bench gpu" 90 "$here/bin/bench-gpu" --bench
    ZEROPP_GPU_COMM_BENCH_OUT="$logs/bench-gpu-comm.md" run "5. bench gpu-comm" 120 "$here/bin/bench-gpu-comm" --bench
}

if [ -n "$shown" ]; then
    all_steps
else
    # No device shown: the kernel tests (not required) decide between NO DEVICE
    # (they skip) and a device the machine does not show (they pass: run all).
    run probe 60 "$here/bin/quant-it" gpu::suite --exact --test-threads=1
    if [ "$verdict" = PASS ] && grep -q "tests skipped" "$logs/probe.out"; then
        verdict="NO DEVICE"
        rows=("| kernel tests | skipped: $(grep -m1 -o 'tests skipped: .*' "$logs/probe.out" | cut -c16- | sed 's/|/\//g') | 0 |")
    elif [ "$verdict" = PASS ]; then
        rows=()
        all_steps
    fi
fi

{
    echo "# zeropp GPU check"
    echo
    echo "**Verdict: $verdict**"
    echo
    echo "- Built from: $(cat "$here/BUILD" 2>/dev/null || echo unknown)"
    echo "- Ran on: $(hostname) at $(date -u +%Y-%m-%dT%H:%M:%SZ), ${SECONDS} s of a ${budget} s budget"
    echo "- Device (name, driver, memory, compute capability): $device_line"
    echo "- Device shown by the machine: ${shown:-none (no GPU in nvidia-smi -L, no $device_node)}"
    echo "- libcuda loaded by the kernel tests: $libcuda"
    banner=$(cat "$logs"/*.out 2>/dev/null | grep -m2 -E "^gpu: (one-GPU|kernels|[A-Z])" | tr '\n' ';')
    [ -n "$banner" ] && echo "- Test banners: $banner"
    echo
    echo "| step | result | seconds |"
    echo "|---|---|---|"
    printf '%s\n' "${rows[@]}"
    echo
    for f in "$logs"/*.out; do
        name=$(basename "$f" .out)
        checks=$(grep -E "^gpu: " "$f" | grep -v "tests skipped" || true)
        if [ -n "$checks" ]; then
            echo "Checks of \`$name\` (a failure stops a suite at the check it names last):"
            echo
            echo "$checks" | sed 's/^gpu: /- /'
            echo
        fi
    done
    if [ -n "$first_failure" ]; then
        f="$logs/$first_failure.out"
        echo "## First failure: $first_failure"
        echo
        cuda=$(grep -o -E "CUDA_ERROR_[A-Z_]+|NCCL[A-Za-z_ ]*error[^\"]*" "$f" | sort -u | tr '\n' ' ')
        [ -n "$cuda" ] && echo "CUDA/NCCL errors named: $cuda" && echo
        call=$(grep -m1 -o -E "CUDA [A-Za-z]+ \([^)]*\) failed|CUDA cuInit failed" "$f" || true)
        [ -n "$call" ] && echo "Failed driver call: $call" && echo
        echo '```'
        (grep -m1 -A12 -E "panicked|error:|Error" "$f" || tail -n 30 "$f") | cut -c1-300
        echo '```'
        echo
    fi
    for b in bench-gpu bench-gpu-comm; do
        if [ -s "$logs/$b.md" ]; then
            echo "## ${b#bench-} bench"
            echo
            sed 's/^# /### /' "$logs/$b.md"
            echo
        fi
    done
    echo "## Output tails"
    echo
    for f in "$logs"/*.out; do
        echo "<details><summary>$(basename "$f" .out)</summary>"
        echo
        echo '```'
        tail -n 25 "$f" | cut -c1-300
        echo '```'
        echo "</details>"
        echo
    done
} >"$report"

echo "gpu check: $verdict; report: $report"
[ "$verdict" != FAIL ]
