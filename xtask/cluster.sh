#!/usr/bin/env bash
# A real cluster on one machine (`cargo xtask cluster`, which builds the programs and
# calls this script). Needs root, iproute2 (ip, tc) and OpenMPI.
#
#   cluster.sh --nodes N --local-size L --rate RATE --delay DELAY [--loss P] [--jitter J]
#              [--queue T] [--out DIR] [--time-limit S] [--mpi-verbose] [--fault SPEC]
#              [--launcher mpirun|each-node] -- PROGRAM ARGS...
#
# - One network namespace per node (zpp-ID-nI) and one for the switch (zpp-ID-sw), which
#   holds a bridge; each node's uplink is a veth pair created straight into the two
#   namespaces, so no interface or address ever exists outside the namespaces this run
#   creates (the host's own network is not touched, and two runs cannot collide: ID is
#   unique among running runs, `ip netns add` refuses a name that exists, and the
#   subnet is private to the run's switch).
# - Each uplink is shaped in both directions: tbf at RATE (`unshaped`: none), under a
#   netem parent when DELAY or jitter is set (delay/2 each way, so a node-to-node one-way
#   delay of DELAY). The tbf queue holds T of traffic (--queue, default 100ms); what
#   overflows it is dropped, and TCP recovers by retransmission (100 ms at 10 Mbit/s
#   is 125 KB). LOSS (percent) drops packets at random on each node's egress with
#   nftables (numgen), so that it works on kernels without netem.
# - mpirun runs inside node 0's namespace; its rsh agent (written into the run directory)
#   starts OpenMPI's daemons on the other nodes through `ip netns exec`. BTLs are
#   tcp,self,vader, TCP (and OpenMPI's out-of-band channel) restricted to the subnet.
# - With --launcher each-node (for launchers with their own rendezvous, e.g. torchrun),
#   PROGRAM runs once in every node's namespace instead, with CLUSTER_NODE (0..N-1),
#   CLUSTER_NODES, CLUSTER_LOCAL_SIZE, CLUSTER_MASTER (node 0's address) and
#   GLOO_SOCKET_IFNAME (the node's uplink) set; its output goes to OUT/nodeI.log and is
#   printed when all nodes have ended; the exit status is the first non-zero one.
# - Kernel interface counters of every node's uplink are read before and after the
#   run into OUT/netdev.json.
# - The namespaces are always deleted (trap), and any process left in them killed.
#
# --fault SPEC injects a network fault while the program runs:
#   linkdown:NODE:SECONDS   set NODE's uplink down SECONDS after the start
#   killnode:NODE:SECONDS   SIGKILL every rank on NODE (not OpenMPI's daemon) after SECONDS
# The program's exit status is this script's exit status. A job that reported a failure
# (a fatal error, a dead rank) is ended ZEROPP_CLUSTER_GRACE seconds later (default 15)
# if mpirun has not ended it by then.
set -uo pipefail

nodes=2 local_size=1 rate=unshaped delay=0ms loss="" jitter="" queue=100ms out="" time_limit=600
verbose=0 fault="" launcher=mpirun
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes="$2"; shift 2 ;;
    --local-size) local_size="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --delay) delay="$2"; shift 2 ;;
    --loss) loss="$2"; shift 2 ;;
    --jitter) jitter="$2"; shift 2 ;;
    --queue) queue="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --time-limit) time_limit="$2"; shift 2 ;;
    --mpi-verbose) verbose=1; shift ;;
    --fault) fault="$2"; shift 2 ;;
    --launcher) launcher="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "cluster.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "cluster.sh: no program given after --" >&2; exit 2; }
[ -n "$out" ] || out="$(mktemp -d /tmp/zpp-cluster.XXXXXX)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# The pid (its low 20 bits) and 8 random bits, 7 hex digits. Should two live runs ever
# draw the same ID, the second stops at `ip netns add` (before touching anything).
rnd=$(od -An -N3 -tu1 /dev/urandom | tr -s ' ' | sed 's/^ //')
read -r r1 r2 r3 <<<"$rnd"
id="$(printf '%05x%02x' $(($$ % 1048576)) "$r3")"
sw="zpp-$id-sw"
# 10.(128+r1%120).r2.0/24: only meaningful inside this run's switch namespace.
subnet_prefix="10.$((128 + r1 % 120)).$r2"
subnet="$subnet_prefix.0/24"
br="zb$id"
ns_of() { echo "zpp-$id-n$1"; }
if_node() { echo "ze$id$1"; }    # the node's end of its uplink (in the node namespace)
if_sw() { echo "zv$id$1"; }      # the switch's end (in the switch namespace, on the bridge)
addr_of() { echo "$subnet_prefix.$(($1 + 1))"; }

created=()
teardown() {
  # A signal can arrive during `IFS= read` below, whose empty IFS the trap inherits.
  local ns pid IFS=$' \t\n'
  for ns in "${created[@]+"${created[@]}"}"; do
    # Processes this run started in its namespaces (ranks, OpenMPI daemons).
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
  done
  for ns in "${created[@]+"${created[@]}"}"; do ip netns del "$ns" 2>/dev/null; done
  created=()
}
trap teardown EXIT
trap 'teardown; exit 130' INT TERM HUP

die() { echo "cluster: $*" >&2; exit 3; }

# shape NS IF DELAY: netem (delay, jitter) when a delay is asked for, with a tbf child
# at $rate (`unshaped`: no tbf). Kernels without netem (CONFIG_NET_SCH_NETEM unset)
# can still shape the rate; a non-zero delay or jitter is then refused.
shape() {
  local ns="$1" dev="$2" d="$3" parent=(root)
  if [ "$d" != 0us ] || [ -n "$jitter" ]; then
    local netem=(netem limit 100000 delay "$d")
    [ -n "$jitter" ] && netem+=("$jitter" distribution normal)
    ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: "${netem[@]}" 2>/dev/null \
      || die "tc netem failed: this kernel has no netem qdisc (delay and jitter need it); use --delay 0"
    parent=(parent 1:1)
  fi
  if [ "$rate" != unshaped ]; then
    # burst: 25 ms of traffic (at least 64 KiB): one 64 KiB GSO packet always fits, and a
    # sender that the CPU scheduler held back can catch up (4 ms reached 0.68 of 1 Gbit/s);
    # latency: at most $queue of queue (100 ms unless --queue).
    local bits
    bits="$(rate_bits "$rate")"
    local burst=$((bits / 8 / 40))
    [ "$burst" -lt 65536 ] && burst=65536
    ip netns exec "$ns" tc qdisc add dev "$dev" "${parent[@]}" handle 10: tbf rate "${bits}bit" \
      burst "$burst" latency "$queue" || return 1
  fi
}

# rate_bits RATE: bits per second of a tc-style rate (100mbit, 1gbit, 12.5MB/s, 1Gbit/s).
rate_bits() {
  awk -v r="$1" 'BEGIN {
    n = r + 0; u = tolower(r); sub(/^[0-9.e+]+/, "", u); sub(/\/s$/, "", u); sub(/ps$/, "", u);
    f = -1; if (u == "bit" || u == "") f = 1; if (u == "kbit") f = 1e3; if (u == "mbit") f = 1e6
    if (u == "gbit") f = 1e9; if (u == "b") f = 8; if (u == "kb") f = 8e3; if (u == "mb") f = 8e6
    if (u == "gb") f = 8e9
    if (f < 0) exit 1; printf "%d", n * f }'
}

# loss NS IF P: drop P% of the packets leaving IF at random (nftables numgen; netem's
# `loss` needs netem, which some kernels lack).
drop_random() {
  local ns="$1" dev="$2" p="$3" per_million
  command -v nft >/dev/null || die "--loss needs nftables (apt-get install nftables)"
  per_million="$(awk -v p="$p" 'BEGIN { printf "%d", p * 10000 }')"
  ip netns exec "$ns" nft -f - <<NFT || die "nft failed in $ns"
table inet zpploss {
  chain out {
    type filter hook output priority 0; policy accept;
    oifname "$dev" numgen random mod 1000000 < $per_million counter drop
  }
}
NFT
}

[ "$rate" = unshaped ] || rate_bits "$rate" >/dev/null || die "bad --rate $rate (e.g. 100mbit, 1gbit)"

# delay/2 in each direction: A -> B crosses A's egress and the switch's egress to B.
half_delay="$(awk -v d="$delay" 'BEGIN {
  n = d + 0; u = d; sub(/^[0-9.]+/, "", u); if (u == "") u = "ms";
  us = (u == "s") ? n * 1e6 : (u == "ms") ? n * 1e3 : (u == "us") ? n : n / 1e3;
  printf "%dus", us / 2 }')"

ip netns add "$sw" || die "cannot create network namespace $sw (root and iproute2 needed)"
created+=("$sw")
ip -n "$sw" link set lo up
ip -n "$sw" link add "$br" type bridge || die "cannot create bridge $br in $sw"
ip -n "$sw" link set "$br" up

for i in $(seq 0 $((nodes - 1))); do
  ns="$(ns_of "$i")"
  ip netns add "$ns" || die "cannot create network namespace $ns"
  created+=("$ns")
  ip -n "$ns" link set lo up
  ip link add "$(if_sw "$i")" netns "$sw" type veth peer name "$(if_node "$i")" netns "$ns" \
    || die "cannot create the veth pair of node $i"
  ip -n "$sw" link set "$(if_sw "$i")" master "$br"
  ip -n "$sw" link set "$(if_sw "$i")" up
  ip -n "$ns" addr add "$(addr_of "$i")/24" dev "$(if_node "$i")"
  ip -n "$ns" link set "$(if_node "$i")" up
  shape "$ns" "$(if_node "$i")" "$half_delay" || die "tc failed on node $i"
  shape "$sw" "$(if_sw "$i")" "$half_delay" || die "tc failed on the switch port of node $i"
  [ -n "$loss" ] && drop_random "$ns" "$(if_node "$i")" "$loss"
done

# The rsh agent: OpenMPI calls `agent [options] HOST COMMAND...`; HOST is a node address.
agent="$out/rsh-agent.sh"
{
  echo '#!/usr/bin/env bash'
  echo 'while [ "${1#-}" != "$1" ]; do shift; done'
  echo 'host="$1"; shift'
  echo 'case "$host" in'
  for i in $(seq 0 $((nodes - 1))); do echo "  $(addr_of "$i")) ns=$(ns_of "$i") ;;"; done
  echo '  *) echo "rsh-agent: unknown host $host" >&2; exit 1 ;;'
  echo 'esac'
  # Its own UTS namespace and host name per node, as on real hosts: OpenMPI names its
  # session directories and shared-memory segments after the host name.
  echo 'exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname $ns && $*"'
} >"$agent"
chmod +x "$agent"
hostfile="$out/hostfile"
for i in $(seq 0 $((nodes - 1))); do echo "$(addr_of "$i") slots=$local_size"; done >"$hostfile"

counters() { # NODE -> "tx rx"
  local ns dev
  ns="$(ns_of "$1")" dev="$(if_node "$1")"
  echo "$(ip netns exec "$ns" cat "/sys/class/net/$dev/statistics/tx_bytes") \
$(ip netns exec "$ns" cat "/sys/class/net/$dev/statistics/rx_bytes")"
}
declare -a before
for i in $(seq 0 $((nodes - 1))); do before[i]="$(counters "$i")"; done

mca=(--mca btl tcp,self,vader --mca btl_tcp_if_include "$subnet" --mca oob_tcp_if_include "$subnet"
  --mca plm_rsh_agent "$agent" --mca plm_rsh_no_tree_spawn 1 --mca orte_base_help_aggregate 0
  # More ranks than cores here: waiting ranks must yield the CPU, or the TCP progress
  # of the rank they wait for starves (0.8 s instead of 0.13 s per tiny step).
  --mca mpi_yield_when_idle 1
  # Messages up to 4 MiB go eagerly. Larger ones would use ob1's rendezvous, whose
  # control messages queue behind the other direction's bulk data in the shaped FIFO:
  # MPI_Sendrecv at 10 Mbit/s then got 0.55 of the rate each way (plain TCP: 0.89;
  # with this: 0.90).
  --mca btl_tcp_eager_limit 4194304 --mca btl_tcp_rndv_eager_limit 4194304
  --mca btl_tcp_max_send_size 4194304)
[ "$verbose" = 1 ] && mca+=(--mca btl_base_verbose 100)
echo "cluster $id: $nodes nodes x $local_size ranks, subnet $subnet, rate $rate, delay $delay${loss:+, loss $loss%}${jitter:+, jitter $jitter}; out $out" >&2

fault_pid=""
if [ -n "$fault" ]; then
  IFS=: read -r fkind fnode fafter <<<"$fault"
  (
    sleep "$fafter"
    case "$fkind" in
      linkdown) ip -n "$(ns_of "$fnode")" link set "$(if_node "$fnode")" down
        echo "cluster: fault injected: node $fnode's uplink down after ${fafter}s" >&2 ;;
      killnode)
        # Only the rank processes: the namespace's processes other than OpenMPI's daemon.
        for pid in $(ip netns pids "$(ns_of "$fnode")"); do
          case "$(cat "/proc/$pid/comm" 2>/dev/null)" in orted | rsh-agent.sh | sh | mpirun) ;; *) kill -9 "$pid" ;; esac
        done
        echo "cluster: fault injected: killed every rank of node $fnode after ${fafter}s" >&2 ;;
    esac
  ) &
  fault_pid=$!
fi

start=$(date +%s.%N)
if [ "$launcher" = each-node ]; then
  echo "cluster $id: each-node launch of $1" >&2
  pids=()
  for i in $(seq 0 $((nodes - 1))); do
    cmd="$(printf '%q ' exec env CLUSTER_NODE="$i" CLUSTER_NODES="$nodes" CLUSTER_LOCAL_SIZE="$local_size" \
      CLUSTER_MASTER="$(addr_of 0)" GLOO_SOCKET_IFNAME="$(if_node "$i")" "$@")"
    timeout -k 10 "$time_limit" ip netns exec "$(ns_of "$i")" unshare --uts /bin/sh -c \
      "hostname $(ns_of "$i") && $cmd" >"$out/node$i.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do
    wait "$p"; r=$?
    [ "$rc" -eq 0 ] && rc=$r
  done
  for i in $(seq 0 $((nodes - 1))); do sed "s/^/[node $i] /" "$out/node$i.log"; done
elif [ "$launcher" != mpirun ]; then
  die "unknown --launcher $launcher (mpirun or each-node)"
else
# mpirun itself runs in node 0 (its namespace and host name), through the same agent.
launch="$(printf '%q ' exec env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  OMPI_MCA_rmaps_base_oversubscribe=1 mpirun --hostfile "$hostfile" -np $((nodes * local_size)) \
  --map-by "ppr:$local_size:node" "${mca[@]}" "$@")"
# The reaper: once the job has reported a failure (a rank's fatal error, or mpirun
# noticing a dead rank), give mpirun GRACE seconds to end it, then end it here, as a
# batch scheduler would. mpirun alone can wait forever for a daemon it cannot reach
# (a node whose link is down).
grace="${ZEROPP_CLUSTER_GRACE:-15}"
reap() {
  sleep "$grace"
  echo "cluster: the job reported a failure and was still running ${grace}s later: ending it" >&2
  local ns pid IFS=$' \t\n'
  for i in $(seq 0 $((nodes - 1))); do
    ns="$(ns_of "$i")"
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
  done
}
reaper=""
while IFS= read -r line; do
  printf '%s\n' "$line"
  case "$line" in
    *"fatal:"* | *"mpirun noticed"* | *"ORTE has lost communication"*)
      if [ -z "$reaper" ]; then reap & reaper=$!; fi ;;
  esac
done < <(timeout -k 10 "$time_limit" "$agent" "$(addr_of 0)" "$launch" 2>&1; echo "$?" >"$out/.rc")
rc="$(cat "$out/.rc" 2>/dev/null || echo 1)"
rm -f "$out/.rc"
[ -n "$reaper" ] && kill "$reaper" 2>/dev/null
fi
if [ -n "$loss" ]; then
  for i in $(seq 0 $((nodes - 1))); do
    dropped="$(ip netns exec "$(ns_of "$i")" nft list table inet zpploss 2>/dev/null | grep -o 'packets [0-9]*' | head -1)"
    echo "cluster: node $i's uplink dropped ${dropped:-? packets} at random (--loss $loss%)" >&2
  done
fi
end=$(date +%s.%N)
[ -n "$fault_pid" ] && kill "$fault_pid" 2>/dev/null

{
  echo -n '{"id":"'"$id"'","subnet":"'"$subnet"'","rate":"'"$rate"'","delay":"'"$delay"'",'
  echo -n '"loss":"'"${loss:-0}"'","exit_status":'"$rc"',"wall_s":'"$(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.3f", b-a}')"',"nodes":['
  for i in $(seq 0 $((nodes - 1))); do
    read -r tb rb <<<"${before[i]}"
    read -r ta ra <<<"$(counters "$i")"
    [ "$i" -gt 0 ] && echo -n ','
    echo -n "{\"node\":$i,\"tx_bytes_before\":$tb,\"tx_bytes_after\":$ta,\"rx_bytes_before\":$rb,\"rx_bytes_after\":$ra}"
  done
  echo ']}'
} >"$out/netdev.json"
exit "$rc"
