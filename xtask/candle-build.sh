#!/bin/bash
# `cargo xtask bench candle-build` (issue 38): what a candle Llama's build and its
# first training steps cost at real size, against the model and the engine's
# memory model, per size:
#
#   1. `CandleModel::build()` alone (the example `build_cost`, one process): wall
#      time and resident peak, against the f32 model and its largest stage;
#   2. the first 3 steps on 8 ranks (2 nodes x 4, thread backend): the process's
#      peak RSS against the memory model of its 8 ranks, build + start-up time
#      against one step (step 1; step 0 warms up);
#   3. under MPI (4 processes, 2 x 2) when `mpirun` and the `mpi` feature are
#      there: each rank's peak against its memory model; then again with every
#      process in a memory cgroup of its own limited to 1.15x its rank's model
#      (root and cgroup v1 or v2), so a run that holds the whole model fails.
#
# ZEROPP_BUILD_SIZES: "d:layers ..." (16 heads, 4 key/value heads, seq 128,
#   vocabulary 256; default "512:8 1024:8 2048:12": 22M, 88M and 530M parameters,
#   the last the largest whose 8 ranks fit a 24 GiB machine under the memory model:
#   20.5 GB; it takes about 45 minutes on 2 cores).
# ZEROPP_BUILD_BEFORE: a `target/release` of an older tree (its `zeropp`, built
#   with --features mpi, and `examples/build_cost`): the same rows for it, "before".
# ZEROPP_BUILD_MPI=0 skips step 3.
# Writes target/bench-report/candle-build.md and the raw logs beside it.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
out=$root/target/bench-report/candle-build
md=$root/target/bench-report/candle-build.md
mkdir -p "$out"
SIZES=${ZEROPP_BUILD_SIZES:-"512:8 1024:8 2048:12"}
declare -A BIN=([after]=$root/target/release)
[ -n "${ZEROPP_BUILD_BEFORE:-}" ] && BIN[before]=$ZEROPP_BUILD_BEFORE
run_id=zpp-build-$$

# The memory cgroup a limited process joins: v1 (memory/) or v2 (unified or the
# root); empty where neither can be made.
cg_root=""
if [ "$(id -u)" = 0 ]; then
  if [ -w /sys/fs/cgroup/memory ]; then cg_root=/sys/fs/cgroup/memory
  elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then cg_root=/sys/fs/cgroup
  elif [ -f /sys/fs/cgroup/unified/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/unified/cgroup.controllers; then
    cg_root=/sys/fs/cgroup/unified
  fi
fi
cleanup() { for g in "$cg_root"/"$run_id"-*; do [ -d "$g" ] && rmdir "$g" 2>/dev/null; done; }
trap cleanup EXIT

# limited BYTES CMD...: CMD in a memory cgroup of its own limited to BYTES; prints
# its maximum usage on stderr.
limited() {
  local lim=$1; shift
  local g=$cg_root/$run_id-$BASHPID
  mkdir -p "$g"
  if [ -f "$g/memory.limit_in_bytes" ]; then
    echo "$lim" > "$g/memory.limit_in_bytes"; echo 0 > "$g/memory.swappiness" 2>/dev/null
  else
    echo "$lim" > "$g/memory.max"; echo 0 > "$g/memory.swap.max" 2>/dev/null
  fi
  echo $BASHPID > "$g/cgroup.procs"
  "$@"; local rc=$?
  local peak; peak=$(cat "$g/memory.max_usage_in_bytes" 2>/dev/null || cat "$g/memory.peak" 2>/dev/null || echo 0)
  echo "limited: rc $rc, max usage $peak B of $lim" >&2
  return $rc
}
export -f limited; export cg_root run_id

have_mpi() { command -v mpirun >/dev/null && "$1/zeropp" train --help 2>/dev/null | grep -q "mpi"; }

for s in $SIZES; do
  d=${s%:*}; L=${s#*:}; tag=d${d}L${L}
  model="llama:d=$d,layers=$L,heads=16,kv_heads=4,seq=128"
  for v in "${!BIN[@]}"; do
    b=${BIN[$v]}
    echo "==> $tag $v: build"
    "$b/examples/build_cost" "$d" "$L" 16 4 128 > "$out/$tag.$v.build.json" || echo '{}' > "$out/$tag.$v.build.json"
    echo "==> $tag $v: 8 ranks on threads"
    /usr/bin/time -f "wall_s %e" "$b/zeropp" train --model "$model" --world 8 --local-size 4 --steps 3 \
      --eval-batches 0 --metrics "$out/$tag.$v.threads.jsonl" > "$out/$tag.$v.threads.log" 2>&1
    [ "${ZEROPP_BUILD_MPI:-1}" = 0 ] && continue
    have_mpi "$b" || { echo "(no mpirun or no mpi feature in $b/zeropp: MPI rows skipped)"; continue; }
    echo "==> $tag $v: MPI 2 x 2"
    timeout 3600 /usr/bin/time -f "wall_s %e" mpirun -np 4 "$b/zeropp" train --backend mpi --local-size 2 \
      --model "$model" --steps 2 --eval-batches 0 > "$out/$tag.$v.mpi.log" 2>&1
    [ -n "$cg_root" ] || { echo "(not root or no memory cgroup: the limited run skipped)"; continue; }
    mm=$(grep -o "memory model [0-9.]* MB" "$out/$tag.after.mpi.log" "$out/$tag.$v.mpi.log" 2>/dev/null | awk '{print $3}' | sort -g | tail -1)
    [ -n "$mm" ] || continue
    lim=$(python3 -c "print(int($mm * 1e6 * 1.15))")
    echo "==> $tag $v: MPI 2 x 2, each process limited to $lim B (1.15 x $mm MB)"
    timeout 3600 mpirun -np 4 bash -c 'limited "$@"' _ "$lim" "$b/zeropp" train --backend mpi --local-size 2 \
      --model "$model" --steps 2 --eval-batches 0 > "$out/$tag.$v.mpilim.log" 2>&1
    echo "rc $?" >> "$out/$tag.$v.mpilim.log"
  done
done

python3 - "$out" "$md" $SIZES <<'PY'
import json, os, re, sys, glob
out, md, sizes = sys.argv[1], sys.argv[2], sys.argv[3:]
def read(p):
    try: return open(p).read()
    except OSError: return ""
def steps(p):
    rows = [json.loads(l) for l in read(p).splitlines() if l.startswith('{"step"')]
    return [r["step_time_s"] for r in rows]
def mem(log):
    return [(float(a), float(b)) for a, b in re.findall(r"peak RSS of [^;]* ([0-9.]+) MB; memory model ([0-9.]+) MB", log)]
lines = ["# candle Llama: the build and the first steps at real size (`cargo xtask bench candle-build`)", "",
         "16 heads, 4 key/value heads, seq 128, vocabulary 256; ratios from one run per row.", "",
         "| model | version | params | build s | build / step | build peak / f32 model | build peak / largest stage (f32) | threads 2x4: peak / memory model | MPI 2x2: worst rank's peak / model | MPI limited to 1.15x: completed, worst max usage / model |",
         "|---|---|---|---|---|---|---|---|---|---|"]
for s in sizes:
    d, L = s.split(":"); tag = f"d{d}L{L}"
    for v in ("before", "after"):
        b = read(f"{out}/{tag}.{v}.build.json")
        if not b: continue
        b = json.loads(b) if b.strip().startswith("{") else {}
        st = steps(f"{out}/{tag}.{v}.threads.jsonl")
        step = st[1] if len(st) > 1 else float("nan")
        tm = mem(read(f"{out}/{tag}.{v}.threads.log"))
        mm = mem(read(f"{out}/{tag}.{v}.mpi.log"))
        lim = read(f"{out}/{tag}.{v}.mpilim.log")
        usage = [int(u) for u in re.findall(r"max usage (\d+) B", lim)]
        rc = re.findall(r"^rc (\d+)", lim, re.M)
        model_mb = max((m for _, m in mm), default=float("nan"))
        limcol = "-" if not lim else f"{'yes' if rc and rc[-1] == '0' else 'no (rc ' + (rc[-1] if rc else '?') + ')'}, {max(usage, default=0) / 1e6 / model_mb:.2f}"
        f = lambda x: "-" if x != x else f"{x:.2f}"
        lines.append(f"| {tag} | {v} | {b.get('params', 0) / 1e6:.1f}M | {b.get('build_s', float('nan')):.1f} | "
                     f"{f(b.get('build_s', float('nan')) / step)} | {f(b.get('build_peak_bytes', 0) / max(b.get('model_f32_bytes', 1), 1))} | "
                     f"{f(b.get('build_peak_bytes', 0) / max(b.get('largest_stage_f32_bytes', 1), 1))} | "
                     f"{f(max((p / m for p, m in tm), default=float('nan')))} | {f(max((p / m for p, m in mm), default=float('nan')))} | {limcol} |")
open(md, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "==> wrote $md"
