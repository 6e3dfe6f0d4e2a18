# shellcheck shell=bash
# tests/multihost/hosts.sh — the multi-host tests' "hosts": network namespaces, the link between
# them, tandem-run started on each, and what their output says when. Sourced by
# multihost_test.sh, which sets TANDEM_RUN, TRAINER, RELAY and WORK first.
#
# Host n is the namespace ${HOST_NS[n]} with the address 10.77.0.(n+1)/24 on its link device
# ${HOST_DEV}. The link is a veth pair (hosts_up veth) or a TUN device in each namespace joined by
# delay_relay (hosts_up relay DELAY_MS), which adds a one-way delay. Namespace names carry this
# shell's pid (tmh-<pid>-<n>), so runs side by side never meet; hosts_cleanup removes ours, and
# those of earlier runs whose shell is gone (a run killed before its trap could run).
#
# Every launcher's output is stamped line by line with the wall clock ($EPOCHREALTIME, seconds
# with microseconds) as it arrives: "1700000000.123456 [rank 1] ...". The cases read the times of
# faults and of each rank's report from these stamps.

HOST_PREFIX="tmh-$$"
HOST_DEV=""
HOST_NS=()
NODE_PID=()   # per node: the subshell running its launcher (timeout around tandem-run)
NODE_RC=()    # per node: the launcher's exit status, or "hung" when it outlived its deadline
NODE_END=()   # per node: when the launcher exited (as seen by polling every 50 ms)
RELAY_PID=""

# skip REASON: this machine cannot run the tests; CTest reports the test as skipped (exit 77).
skip() {
  echo "SKIPPED: $*"
  exit 77
}

# Skips unless this process can make namespaces: root, `ip`, and the kernel allowing it.
hosts_require() {
  [[ $(id -u) == 0 ]] || skip "the multi-host tests make network namespaces, which needs root (running as uid $(id -u))"
  command -v ip >/dev/null || skip "the multi-host tests need 'ip' (Debian's iproute2)"
  local probe="${HOST_PREFIX}-probe"
  ip netns add "$probe" 2>"$WORK/probe.err" ||
    skip "cannot create a network namespace: $(cat "$WORK/probe.err")"
  ip netns del "$probe"
}

now() { echo "$EPOCHREALTIME"; }

# elapsed FROM [TO]: seconds between two stamps (TO: now), with millisecond precision.
elapsed() { awk -v a="$1" -v b="${2:-$EPOCHREALTIME}" 'BEGIN { printf "%.3f", b - a }'; }

# hosts_up veth | relay DELAY_MS [LOSS]: two fresh hosts joined by the link.
hosts_up() {
  local kind=$1
  hosts_down
  HOST_NS=("${HOST_PREFIX}-0" "${HOST_PREFIX}-1")
  local n
  for n in 0 1; do
    ip netns add "${HOST_NS[n]}" || return 1
    ip -n "${HOST_NS[n]}" link set lo up || return 1
  done
  if [[ $kind == veth ]]; then
    HOST_DEV=veth0
    ip link add veth0 netns "${HOST_NS[0]}" type veth peer name veth0 netns "${HOST_NS[1]}" || return 1
  else
    HOST_DEV=tun0
    for n in 0 1; do ip -n "${HOST_NS[n]}" tuntap add dev tun0 mode tun || return 1; done
  fi
  for n in 0 1; do
    ip -n "${HOST_NS[n]}" addr add "10.77.0.$((n + 1))/24" dev "$HOST_DEV" || return 1
    ip -n "${HOST_NS[n]}" link set "$HOST_DEV" up || return 1
  done
  if [[ $kind == relay ]]; then
    relay_start "$2" "${3:-0}" || return 1
  fi
}

# relay_start DELAY_MS LOSS: delay_relay between the hosts' TUN devices; waits for its "ready".
relay_start() {
  "$RELAY" --netns-a "/run/netns/${HOST_NS[0]}" --netns-b "/run/netns/${HOST_NS[1]}" --delay-ms "$1" --loss "$2" \
    >"$WORK/relay.log" 2>&1 &
  RELAY_PID=$!
  local i
  for ((i = 0; i < 100; ++i)); do
    grep -q '^ready$' "$WORK/relay.log" && return 0
    kill -0 "$RELAY_PID" 2>/dev/null || break
    sleep 0.05
  done
  echo "delay_relay did not start: $(cat "$WORK/relay.log")"
  return 1
}

# Every process in our namespaces is one this run started (launchers, workers, a frozen victim).
kill_namespace_processes() {
  local ns pids
  for ns in "$@"; do
    mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null)
    ((${#pids[@]})) && kill -KILL "${pids[@]}" 2>/dev/null
  done
  return 0
}

# Stops everything of the current hosts and removes them.
hosts_down() {
  local n pid
  if [[ -n $RELAY_PID ]]; then
    kill -TERM "$RELAY_PID" 2>/dev/null
    wait "$RELAY_PID" 2>/dev/null
    RELAY_PID=""
  fi
  ((${#HOST_NS[@]})) && kill_namespace_processes "${HOST_NS[@]}"
  for pid in "${NODE_PID[@]}"; do
    [[ -n $pid ]] && { kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; }
  done
  NODE_PID=()
  for n in "${HOST_NS[@]}"; do ip netns del "$n" 2>/dev/null; done
  HOST_NS=()
  return 0
}

# The trap's work: our hosts, and namespaces left by runs whose shell no longer exists.
hosts_cleanup() {
  hosts_down
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^tmh-[0-9]+-[0-9a-z]+$'); do
    pid=${ns#tmh-}
    pid=${pid%%-*}
    if [[ $pid == "$$" ]] || ! kill -0 "$pid" 2>/dev/null; then
      kill_namespace_processes "$ns"
      ip netns del "$ns" 2>/dev/null
    fi
  done
}

# Prefixes every line read with the time it arrived (a last line without newline too).
stamp() {
  local line
  while IFS= read -r line || [[ -n $line ]]; do printf '%s %s\n' "$EPOCHREALTIME" "$line"; done
}

# node_start NODE LOG LIMIT_S [VAR=value ...] -- TANDEM_RUN_ARGS...: tandem-run on host NODE, its
# output (stdout and stderr) stamped into LOG; SIGKILLed (with its workers, through their
# PR_SET_PDEATHSIG) after LIMIT_S seconds whatever happens.
node_start() {
  local node=$1 log=$2 limit=$3
  shift 3
  # The README's two-machine command exports one secret on every node; so do the tests (a case
  # may override it with a variable of its own).
  local vars=("TANDEM_STORE_SECRET=${MH_STORE_SECRET:-multihost-test-secret-$$}")
  while [[ $1 != -- ]]; do
    vars+=("$1")
    shift
  done
  shift
  # A subshell, so that waiting for it also waits for the last stamped line; it exits with the
  # launcher's status. Its own stderr (bash's "Killed" when a case kills the launcher) is dropped.
  (
    ip netns exec "${HOST_NS[node]}" env "${vars[@]}" timeout -s KILL "$limit" "$TANDEM_RUN" "$@" 2>&1 |
      stamp >"$log"
    exit "${PIPESTATUS[0]}"
  ) 2>/dev/null &
  NODE_PID[node]=$!
  NODE_RC[node]=""
  NODE_END[node]=""
}

# nodes_wait DEADLINE_S: waits until every started launcher has exited, for DEADLINE_S seconds at
# most from now; then the hosts' remaining processes are killed and those launchers are "hung".
# Returns 0 when all exited in time.
nodes_wait() {
  local deadline
  deadline=$(awk -v t="$EPOCHREALTIME" -v d="$1" 'BEGIN { printf "%.6f", t + d }')
  local n running
  while :; do
    running=0
    for n in "${!NODE_PID[@]}"; do
      [[ -n ${NODE_END[n]} ]] && continue
      if kill -0 "${NODE_PID[n]}" 2>/dev/null; then
        running=1
      else
        NODE_END[n]=$EPOCHREALTIME
        wait "${NODE_PID[n]}"
        NODE_RC[n]=$?
      fi
    done
    ((running)) || return 0
    if awk -v t="$EPOCHREALTIME" -v d="$deadline" 'BEGIN { exit !(t > d) }'; then
      for n in "${!NODE_PID[@]}"; do
        [[ -z ${NODE_END[n]} ]] && NODE_RC[n]=hung
      done
      kill_namespace_processes "${HOST_NS[@]}"
      for n in "${!NODE_PID[@]}"; do
        [[ ${NODE_RC[n]} == hung ]] && { wait "${NODE_PID[n]}" 2>/dev/null; NODE_END[n]=$EPOCHREALTIME; }
      done
      return 1
    fi
    sleep 0.05
  done
}

# first_stamp AFTER REGEX FILE...: the stamp of the first line at or after AFTER whose text
# (the part after the stamp) matches the extended REGEX; empty when none.
first_stamp() {
  local after=$1 regex=$2
  shift 2
  cat "$@" 2>/dev/null | sort -n -k1,1 -s |
    awk -v after="$after" -v re="$regex" '$1 >= after { line = $0; sub(/^[^ ]+ /, "", line); if (line ~ re) { print $1; exit } }'
}

# first_line AFTER REGEX FILE...: that line's text, without the stamp.
first_line() {
  local after=$1 regex=$2
  shift 2
  cat "$@" 2>/dev/null | sort -n -k1,1 -s |
    awk -v after="$after" -v re="$regex" '$1 >= after { line = $0; sub(/^[^ ]+ /, "", line); if (line ~ re) { print line; exit } }'
}

# wait_for_lines FILE COUNT LIMIT_S: waits until FILE has COUNT lines; returns 1 after LIMIT_S.
wait_for_lines() {
  local i
  for ((i = 0; i < $3 * 20; ++i)); do
    [[ -f $1 ]] && (($(wc -l <"$1") >= $2)) && return 0
    sleep 0.05
  done
  return 1
}
