#!/usr/bin/env bash
# tests/multihost/multihost_test.sh — multi-worker training across two "hosts" (network
# namespaces, see hosts.sh), each running tandem-run over multi_worker_trainer with the README's
# two-machine command, under real faults. Every case asserts its outcome and a time bound and adds
# rows to one table (fault, rank, detection time, bound, result) printed at the end.
#
#   multihost_test.sh --tandem-run PATH --trainer PATH --relay PATH
#                     [--suite ci|extra|soak|latency|all]... [--case NAME]... [--kills N] [--seed S]
#                     [--keep] [--list]
#
# Cases (2xP: two hosts of P workers each; T: the collective timeout, R: TANDEM_RENDEZVOUS_TIMEOUT):
#   kill-{chief,worker}-2x{1,2}   a worker SIGKILLs itself mid-training; with --max_restarts 3 and
#                                 BackupAndRestore both launchers exit 0 and every rank's final
#                                 weights file equals the uninterrupted run's byte for byte
#   freeze-{chief,worker}-2xP     a worker SIGSTOPs itself mid-training; every other rank reports
#                                 the failure naming it within T + 5 s
#   partition-2xP                 the link goes down (ip link set down) mid-training; every rank
#                                 reports it naming a rank of the other host within T + 5 s
#   partition-relay-2x1           the same, the link being delay_relay dropping every packet
#   world-size                    host 1 starts with --nnodes 3, host 0 with --nnodes 2 (torchrun's
#                                 variables, no --hosts): both fail within R + 5 s, naming both sizes
#   soak                          --kills N kills (chief and non-chief, 2x1 and 2x2 in turn, random
#                                 step and rank, seeded), each ending as kill-* must
#   latency                       2x1 over delay_relay with a 50 ms one-way delay: the time per step in
#                                 round trips, printed; asserted only below MH_MAX_ROUND_TRIPS if set
# Suites: ci = one kill of each kind, both freezes and a partition on 2x1, world-size (the CTest
# test multihost_faults); extra = the freezes and partition on 2x2 and the relay's partition; soak;
# latency; all = every one of them.
#
# Knobs (environment): MH_COLLECTIVE_TIMEOUT (T, default 5), MH_RENDEZVOUS_TIMEOUT (R, default 10),
# MH_GRACE (how long past a bound a case still waits before calling it a hang, default 10),
# MH_DELAY_MS (latency, default 50), MH_MAX_ROUND_TRIPS (latency's bound, default none).
# Exit status: 0 every case passed, 1 one failed, 77 skipped (not root, no `ip`, no namespaces), 2
# bad command line. The hosts, their processes and (unless a case failed or --keep) the work folder
# are removed on every exit, by a trap.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
source "$here/hosts.sh" || exit 2
TANDEM_RUN="" TRAINER="" RELAY=""
suites=() cases=() kills=${N:-20} seed=${MH_SEED:-$RANDOM} keep=0
T=${MH_COLLECTIVE_TIMEOUT:-5}
R=${MH_RENDEZVOUS_TIMEOUT:-10}
GRACE=${MH_GRACE:-10}
DELAY_MS=${MH_DELAY_MS:-50}
failed=0
hosts_allowed=0       # set once hosts_require passed: only then is there anything to clean up
WORK=""
SLACK=5               # the issue's bound: the configured timeout + 5 s
KILL_CASE_LIMIT=120   # a kill case that has not finished by then has hung
readonly STEPS=30     # multi_worker_trainer: 3 epochs of 10 global batches

usage() {
  sed -n '7,9p' "$0" | sed 's/^# *//' >&2
  exit 2
}

declare -A CASES=(
  [kill-chief-2x1]="case_kill 1 0 14"
  [kill-worker-2x1]="case_kill 1 1 14"
  [kill-chief-2x2]="case_kill 2 0 14"
  [kill-worker-2x2]="case_kill 2 2 14"
  [freeze-chief-2x1]="case_freeze 1 0 14"
  [freeze-worker-2x1]="case_freeze 1 1 14"
  [freeze-chief-2x2]="case_freeze 2 0 14"
  [freeze-worker-2x2]="case_freeze 2 3 14"
  [partition-2x1]="case_partition 1 veth"
  [partition-2x2]="case_partition 2 veth"
  [partition-relay-2x1]="case_partition 1 relay"
  [world-size]="case_world_size"
  [soak]="case_soak"
  [latency]="case_latency"
)
SUITE_CI=(kill-chief-2x1 kill-worker-2x1 kill-chief-2x2 kill-worker-2x2 freeze-chief-2x1 freeze-worker-2x1
  partition-2x1 world-size)
SUITE_EXTRA=(freeze-chief-2x2 freeze-worker-2x2 partition-2x2 partition-relay-2x1)

ROWS=()
# row CASE FAULT RANK DETECTION BOUND RESULT: one line of the final table.
table_line() { printf '%-20s %-30s %-5s %-9s %-7s %s' "$@"; }
row() { ROWS+=("$(table_line "$@")"); }

# worse RESULT TEXT: a row's RESULT ("ok" or "FAIL: ...") with the failure TEXT added.
worse() { if [[ $1 == ok ]]; then echo "FAIL: $2"; else echo "$1; $2"; fi; }

# fail CASE MESSAGE: the case failed; says why, with the end of every log of the case.
fail() {
  failed=1
  echo "FAIL $1: $2"
  local log
  for log in "$WORK/$1"/*.log; do
    [[ -f $log ]] && { echo "--- ${log##*/} (last 15 lines)"; tail -n 15 "$log"; }
  done
  return 1
}

# ---------------------------------------------------------------------------------------------
# A job: two hosts of NPROC workers each, started as the README's two-machine command.

# job_start DIR NPROC MAX_RESTARTS LIMIT_S TRAINER_ARGS...: host n writes to DIR/node<n>/ (its own
# folder, as on a machine of its own) and logs to DIR/node<n>.log.
job_start() {
  local dir=$1 nproc=$2 restarts=$3 limit=$4
  shift 4
  local n
  for n in 0 1; do
    mkdir -p "$dir/node$n"
    node_start "$n" "$dir/node$n.log" "$limit" TANDEM_RENDEZVOUS_TIMEOUT="$R" -- \
      --nnodes 2 --node_rank "$n" --hosts 10.77.0.1,10.77.0.2 --master_port 29500 --nproc_per_node "$nproc" \
      --max_restarts "$restarts" --stop_timeout 5 -- "$TRAINER" --out "$dir/node$n" --timeout "$T" "$@"
  done
}

node_of() { echo $(($1 / $2)); } # node_of RANK NPROC

# detection FAULT RANK NPROC DIR: when rank RANK reacted to the fault: "STAMP|HOW|LINE" for the
# earliest of its own error line, its launcher reporting its exit, or its launcher stopping its
# group because a sibling failed; empty when none yet.
detection() {
  local fault=$1 rank=$2 nproc=$3 dir=$4
  local log
  log="$dir/node$(node_of "$rank" "$nproc").log"
  local best="" how="" line="" s pattern
  s=$(first_stamp "$fault" "^\\[rank $rank\\] .*error" "$log")
  [[ -n $s ]] && best=$s how=error line=$(first_line "$fault" "^\\[rank $rank\\] .*error" "$log")
  for pattern in "^tandem-run: rank $rank \\(pid [0-9]+\\) (exited|was killed)" "^tandem-run: (restarting|failed)" \
    "^tandem-run: node [0-9]+: .*; stopping the workers of this node"; do
    s=$(first_stamp "$fault" "$pattern" "$log")
    if [[ -n $s ]] && { [[ -z $best ]] || awk -v a="$s" -v b="$best" 'BEGIN { exit !(a < b) }'; }; then
      best=$s how=launcher line=$(first_line "$fault" "$pattern" "$log")
    fi
  done
  [[ -n $best ]] && echo "$best|$how|$line"
}

# names_peer LINE PEER...: LINE (a rank's error, without its "[rank R] " prefix) names one of the
# ranks PEER ("worker 3 (10.77.0.2:29501)" under TF_CONFIG, "rank 3" under torchrun's variables).
names_peer() {
  local text=${1#\[rank * } p
  shift
  for p in "$@"; do [[ $text =~ (worker|rank)\ $p([^0-9]|$) ]] && return 0; done
  return 1
}

# ---------------------------------------------------------------------------------------------
# The uninterrupted runs the kill cases compare with, one per NPROC (made once).

declare -A REFERENCE=()
# reference NPROC: sets REFERENCE[NPROC] to the weights file of an uninterrupted 2 x NPROC run.
reference() {
  local nproc=$1
  [[ -n ${REFERENCE[$nproc]:-} ]] && return 0
  local name="reference-2x$nproc" dir="$WORK/reference-2x$nproc" n r
  hosts_up veth || { fail "$name" "cannot make the hosts"; return 1; }
  job_start "$dir" "$nproc" 0 "$KILL_CASE_LIMIT" --backup "$dir/backup" --save-freq 3
  nodes_wait "$KILL_CASE_LIMIT"
  hosts_down
  for n in 0 1; do
    [[ ${NODE_RC[n]} == 0 ]] || { fail "$name" "the uninterrupted run failed on host $n (${NODE_RC[n]})"; return 1; }
  done
  for ((r = 1; r < 2 * nproc; ++r)); do
    cmp -s "$dir/node0/weights-0.safetensors" "$dir/node$(node_of "$r" "$nproc")/weights-$r.safetensors" ||
      { fail "$name" "ranks 0 and $r of the uninterrupted run end with different weights"; return 1; }
  done
  REFERENCE[$nproc]="$dir/node0/weights-0.safetensors"
}

# ---------------------------------------------------------------------------------------------
# Cases. Each returns 0 when it passed.

# case_kill NPROC VICTIM STEP [NAME]: rank VICTIM SIGKILLs itself after STEP; --max_restarts 3 and
# BackupAndRestore must carry the job to weights equal to the uninterrupted run's, byte for byte.
case_kill() {
  local nproc=$1 victim=$2 step=$3 name=${4:-$CASE}
  reference "$nproc" || return 1
  local dir="$WORK/$name" fault_text="SIGKILL rank $victim (2x$nproc) @$step" n r
  hosts_up veth || { fail "$name" "cannot make the hosts"; return 1; }
  local start
  start=$(now)
  # Both hosts pass the same backup flags: only the chief (host 0) reads and writes its folder.
  job_start "$dir" "$nproc" 3 "$KILL_CASE_LIMIT" --backup "$dir/backup" --save-freq 3 \
    --kill-at-step "$step" --victim "$victim"
  nodes_wait "$KILL_CASE_LIMIT"
  local took
  took=$(elapsed "$start")
  hosts_down
  local fault
  fault=$(first_stamp 0 "raises SIGKILL" "$dir"/node*.log)
  if [[ -z $fault ]]; then
    row "$name" "$fault_text" "all" "" "" "FAIL: the victim never reached step $step"
    fail "$name" "no kill happened"
    return 1
  fi
  # How long each other rank took to notice (not asserted: the restart is what counts here).
  for ((r = 0; r < 2 * nproc; ++r)); do
    ((r == victim)) && continue
    local d
    d=$(detection "$fault" "$r" "$nproc" "$dir")
    if [[ -n $d ]]; then
      row "$name" "$fault_text" "$r" "$(elapsed "$fault" "${d%%|*}")" "-" "noticed ($(cut -d'|' -f2 <<<"$d"))"
    else
      row "$name" "$fault_text" "$r" "" "-" "no report"
    fi
  done
  local restarts=""
  for n in 0 1; do restarts+=" host$n:$(grep -c 'tandem-run: restarting' "$dir/node$n.log")"; done
  for n in 0 1; do
    if [[ ${NODE_RC[n]} != 0 ]]; then
      local last
      last=$(grep -E '\] .*error|tandem-run: failed' "$dir/node$n.log" | tail -n 1 | cut -d' ' -f2- | cut -c1-160)
      row "$name" "$fault_text" "all" "$took" "$KILL_CASE_LIMIT" "FAIL: host $n exit ${NODE_RC[n]} (restarts$restarts): $last"
      fail "$name" "host $n's launcher exited ${NODE_RC[n]} after $took s"
      return 1
    fi
  done
  for ((r = 0; r < 2 * nproc; ++r)); do
    local w
    w="$dir/node$(node_of "$r" "$nproc")/weights-$r.safetensors"
    if ! cmp -s "$w" "${REFERENCE[$nproc]}"; then
      row "$name" "$fault_text" "all" "$took" "$KILL_CASE_LIMIT" "FAIL: rank $r's weights differ from the uninterrupted run"
      fail "$name" "rank $r's final weights differ from the uninterrupted run's"
      return 1
    fi
  done
  row "$name" "$fault_text" "all" "$took" "$KILL_CASE_LIMIT" "ok: finished, weights bitwise equal (restarts$restarts)"
}

# ranks_react FAULT NPROC DIR DEADLINE_S RANK...: waits until each RANK has reacted to the fault
# (see detection), or DEADLINE_S seconds after the fault.
ranks_react() {
  local fault=$1 nproc=$2 dir=$3 deadline=$4 r all
  shift 4
  while awk -v f="$fault" -v d="$deadline" -v t="$EPOCHREALTIME" 'BEGIN { exit !(t < f + d) }'; do
    all=1
    for r in "$@"; do [[ -n $(detection "$fault" "$r" "$nproc" "$dir") ]] || { all=0; break; }; done
    ((all)) && return 0
    sleep 0.2
  done
  return 1
}

# judge_detection NAME FAULT_TEXT FAULT NPROC DIR BOUND "PEERS" RANK...: one row per rank; each
# must have reacted within BOUND seconds, with an error naming one of PEERS (its own, or for a
# rank its launcher stopped, a sibling's on the same host).
judge_detection() {
  local name=$1 fault_text=$2 fault=$3 nproc=$4 dir=$5 bound=$6 peers=$7 r ok=1
  shift 7
  for r in "$@"; do
    local d took how line result
    d=$(detection "$fault" "$r" "$nproc" "$dir")
    if [[ -z $d ]]; then
      row "$name" "$fault_text" "$r" ">$(awk -v b="$bound" -v g="$GRACE" 'BEGIN { print b + g }')" "$bound" "FAIL: no report"
      ok=0
      continue
    fi
    took=$(elapsed "$fault" "${d%%|*}")
    how=$(cut -d'|' -f2 <<<"$d")
    line=$(cut -d'|' -f3- <<<"$d")
    if [[ $how == launcher ]]; then
      # Stopped by its launcher: the host's error line (a sibling's) must name the peer, or else
      # the launcher's, which carries the failed worker's last error line from another host.
      local host_log
      host_log="$dir/node$(node_of "$r" "$nproc").log"
      line=$(first_line "$fault" '^\[rank [0-9]+\] .*error' "$host_log")
      [[ -n $line ]] || line=$(first_line "$fault" '^tandem-run: node [0-9]+: .*; stopping the workers' "$host_log")
    fi
    result="ok"
    if awk -v t="$took" -v b="$bound" 'BEGIN { exit !(t > b) }'; then result="FAIL: after the bound"; ok=0; fi
    # shellcheck disable=SC2086
    if ! names_peer "$line" $peers; then result=$(worse "$result" "names none of ranks $peers"); ok=0; fi
    row "$name" "$fault_text" "$r" "$took" "$bound" "$result ($how): $(cut -c1-150 <<<"${line#\[rank * }")"
  done
  ((ok)) || { fail "$name" "not every rank reported the fault in time naming the peer"; return 1; }
}

# case_freeze NPROC VICTIM STEP: rank VICTIM SIGSTOPs itself after STEP (no restarts); every
# other rank must report it naming it within T + 5 s.
case_freeze() {
  local nproc=$1 victim=$2 step=$3 name=$CASE
  local dir="$WORK/$name" bound=$((T + SLACK)) r others=()
  for ((r = 0; r < 2 * nproc; ++r)); do ((r != victim)) && others+=("$r"); done
  hosts_up veth || { fail "$name" "cannot make the hosts"; return 1; }
  job_start "$dir" "$nproc" 0 $((60 + bound + GRACE)) --stop-at-step "$step" --victim "$victim"
  local fault="" i
  for ((i = 0; i < 1200; ++i)); do
    fault=$(first_stamp 0 "raises SIGSTOP" "$dir"/node*.log)
    [[ -n $fault ]] && break
    sleep 0.05
  done
  [[ -n $fault ]] || { hosts_down; fail "$name" "the victim never froze"; return 1; }
  ranks_react "$fault" "$nproc" "$dir" $((bound + GRACE)) "${others[@]}"
  hosts_down
  judge_detection "$name" "SIGSTOP rank $victim (2x$nproc) @$step" "$fault" "$nproc" "$dir" "$bound" "$victim" "${others[@]}"
}

# case_partition NPROC veth|relay: the link stops carrying packets mid-training (veth: host 0's
# end goes down; relay: it drops everything) and stays so; every rank must report it naming a
# rank of the other host within T + 5 s.
case_partition() {
  local nproc=$1 link=$2 name=$CASE
  local dir="$WORK/$name" bound=$((T + SLACK)) r all=()
  for ((r = 0; r < 2 * nproc; ++r)); do all+=("$r"); done
  if [[ $link == relay ]]; then
    hosts_up relay 0 || { fail "$name" "cannot make the hosts"; return 1; }
  else
    hosts_up veth || { fail "$name" "cannot make the hosts"; return 1; }
  fi
  # Enough epochs to be mid-training whenever the link goes; the job never ends on its own.
  job_start "$dir" "$nproc" 0 $((60 + bound + GRACE)) --epochs 100000
  if ! wait_for_lines "$dir/node0/losses-0.txt" 20 60; then
    hosts_down
    fail "$name" "training did not reach step 20 within 60 s"
    return 1
  fi
  local fault
  if [[ $link == relay ]]; then
    kill -USR1 "$RELAY_PID"
  else
    ip -n "${HOST_NS[0]}" link set "$HOST_DEV" down
  fi
  fault=$(now)
  ranks_react "$fault" "$nproc" "$dir" $((bound + GRACE)) "${all[@]}"
  hosts_down
  local peers0 peers1 ok=0
  peers0=$(seq -s ' ' "$nproc" $((2 * nproc - 1)))
  peers1=$(seq -s ' ' 0 $((nproc - 1)))
  judge_detection "$name" "link down ($link, 2x$nproc)" "$fault" "$nproc" "$dir" "$bound" "$peers0" $(seq 0 $((nproc - 1))) || ok=1
  judge_detection "$name" "link down ($link, 2x$nproc)" "$fault" "$nproc" "$dir" "$bound" "$peers1" $(seq "$nproc" $((2 * nproc - 1))) || ok=1
  return $ok
}

# names_sizes LINE A B: LINE speaks of world sizes and names A and B as numbers of their own (not
# within an address, nor a rank's, worker's or node's number).
names_sizes() {
  local text
  text=$(sed -E 's/(rank|worker|node)s? [0-9]+//g; s/[0-9]+(\.[0-9]+){3}(:[0-9]+)?//g' <<<"$1")
  [[ ${text,,} =~ world[\ _-]?size ]] && [[ $text =~ (^|[^0-9])$2([^0-9]|$) ]] && [[ $text =~ (^|[^0-9])$3([^0-9]|$) ]]
}

# case_world_size: host 0 starts a job of 2 nodes, host 1 one of 3 (torchrun's variables: no
# --hosts); both must fail within R + 5 s, each naming both world sizes. The trainer keeps its
# default collective timeout (5 minutes), as the README's command does: the rendezvous timeout
# alone must bound the start-up.
case_world_size() {
  local name=$CASE dir="$WORK/$CASE" bound=$((R + SLACK)) n ok=1
  hosts_up veth || { fail "$name" "cannot make the hosts"; return 1; }
  local start
  start=$(now)
  for n in 0 1; do
    mkdir -p "$dir/node$n"
    node_start "$n" "$dir/node$n.log" $((bound + GRACE + 5)) TANDEM_RENDEZVOUS_TIMEOUT="$R" -- \
      --nnodes $((n == 0 ? 2 : 3)) --node_rank "$n" --master_addr 10.77.0.1 --master_port 29500 --nproc_per_node 1 \
      --stop_timeout 5 -- "$TRAINER" --out "$dir/node$n"
  done
  nodes_wait $((bound + GRACE))
  hosts_down
  for n in 0 1; do
    local took result line="" candidate
    took=$(elapsed "$start" "${NODE_END[n]}")
    while IFS= read -r candidate; do
      names_sizes "$candidate" 2 3 && { line=$candidate; break; }
    done < <(cut -d' ' -f2- "$dir/node$n.log")
    result=ok
    if [[ ${NODE_RC[n]} == hung ]]; then
      result="FAIL: still running"; took=">$took"; ok=0
    elif [[ ${NODE_RC[n]} == 0 ]]; then
      result="FAIL: exited 0"; ok=0
    elif awk -v t="$took" -v b="$bound" 'BEGIN { exit !(t > b) }'; then
      result="FAIL: after the bound"; ok=0
    fi
    if [[ -z $line ]]; then
      result=$(worse "$result" "no line names world sizes 2 and 3")
      line=$(grep -E '\] .*error' "$dir/node$n.log" | head -n 1 | cut -d' ' -f2-)
      ok=0
    fi
    row "$name" "--nnodes 2 vs 3" "host$n" "$took" "$bound" "$result: $(cut -c1-150 <<<"${line#\[rank * }")"
  done
  ((ok)) || { fail "$name" "the world-size mismatch was not reported on both hosts in time"; return 1; }
}

# case_soak: --kills N kill cases, cycling through chief on 2x1, non-chief on 2x2, chief on 2x2,
# non-chief on 2x1, with a random step and non-chief rank (seeded: --seed repeats a run).
case_soak() {
  echo "soak: $kills kills, seed $seed (--seed $seed repeats them)"
  RANDOM=$seed
  local i nproc victim step passed=0
  for ((i = 0; i < kills; ++i)); do
    case $((i % 4)) in
      0) nproc=1 victim=0 ;;
      1) nproc=2 victim=$((1 + RANDOM % 3)) ;;
      2) nproc=2 victim=0 ;;
      3) nproc=1 victim=1 ;;
    esac
    step=$((1 + RANDOM % (STEPS - 1)))
    case_kill "$nproc" "$victim" "$step" "soak-$((i + 1))" && ((++passed))
  done
  row "soak" "$kills random kills" "all" "" "" "$passed of $kills bitwise equal to the uninterrupted run"
  ((passed == kills))
}

# rtt_ms: one TCP round trip from host 0 to host 1 (a connection refused by a closed port), the
# best of five, in milliseconds.
rtt_ms() {
  local i best=""
  for ((i = 0; i < 5; ++i)); do
    local t
    t=$(ip netns exec "${HOST_NS[0]}" timeout 5 bash -c \
      't=$EPOCHREALTIME; (exec 3<>/dev/tcp/10.77.0.2/9) 2>/dev/null; echo "$t $EPOCHREALTIME"' |
      awk '{ printf "%.3f", ($2 - $1) * 1000 }')
    [[ -z $best ]] || awk -v a="$t" -v b="$best" 'BEGIN { exit !(a < b) }' && best=$t
  done
  echo "$best"
}

# measure_step DELAY_MS HIDDEN: sets STEP_MS to the median time per step of a 2x1 job over the
# relay with that delay (the trainer's model with HIDDEN units), and RTT_MS to the link's round trip.
measure_step() {
  local delay=$1 hidden=$2 dir="$WORK/$CASE/delay-$1-hidden-$2"
  hosts_up relay "$delay" || return 1
  RTT_MS=$(rtt_ms)
  job_start "$dir" 1 0 300 --step-times 1 --hidden "$hidden"
  nodes_wait 300
  hosts_down
  [[ ${NODE_RC[0]} == 0 && ${NODE_RC[1]} == 0 ]] || return 1
  # Steps follow each other within an epoch; the median leaves out the epochs' ends.
  STEP_MS=$(awk 'NR > 1 { print ($1 - p) * 1000 } { p = $1 }' "$dir/node0/step-times-0.txt" | sort -n |
    awk '{ v[NR] = $1 } END { printf "%.1f", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
}

# case_latency: the time per step of a 2x1 job with a DELAY_MS one-way delay, in round trips, for
# the trainer's own model (16 hidden units: 230 parameters, where only latency counts) and for one
# of the README's main sample's size (7270 hidden units: 101,783 parameters against
# fashion_mnist_mlp's 101,770, so that the gradients' bytes count as in the README's command).
case_latency() {
  local name=$CASE hidden ok=1
  mkdir -p "$WORK/$name"
  for hidden in 16 7270; do
    local base slow rtt_base rtt per_step extra
    measure_step 0 "$hidden" || { fail "$name" "the job without delay failed"; return 1; }
    base=$STEP_MS rtt_base=$RTT_MS
    measure_step "$DELAY_MS" "$hidden" || { fail "$name" "the job with a ${DELAY_MS} ms delay failed"; return 1; }
    slow=$STEP_MS rtt=$RTT_MS
    per_step=$(awk -v s="$slow" -v r="$rtt" 'BEGIN { printf "%.2f", s / r }')
    extra=$(awk -v s="$slow" -v b="$base" -v r="$rtt" 'BEGIN { printf "%.2f", (s - b) / r }')
    echo "latency (--hidden $hidden): one-way delay ${DELAY_MS} ms, RTT ${rtt} ms (${rtt_base} ms without);" \
      "median step ${slow} ms, ${base} ms without the delay: ${per_step} round trips per step (${extra} beyond compute)"
    local result="ok"
    if [[ -n ${MH_MAX_ROUND_TRIPS:-} ]] && awk -v x="$per_step" -v m="$MH_MAX_ROUND_TRIPS" 'BEGIN { exit !(x > m) }'; then
      result="FAIL: above MH_MAX_ROUND_TRIPS=$MH_MAX_ROUND_TRIPS"
      ok=0
    fi
    row "$name" "${DELAY_MS} ms one-way, hidden $hidden" "0" "${slow}ms" "${MH_MAX_ROUND_TRIPS:--}" \
      "$result: ${per_step} RTT/step (RTT ${rtt} ms; ${base} ms/step without delay)"
  done
  ((ok)) || { fail "$name" "more round trips per step than MH_MAX_ROUND_TRIPS"; return 1; }
}

# ---------------------------------------------------------------------------------------------

finish() {
  ((hosts_allowed)) && hosts_cleanup
  if ((failed || keep)); then echo "logs kept in $WORK"; else rm -rf "$WORK"; fi
}

# Everything runs from main, so that bash has read the whole file before the first case (an
# edit while a run goes on cannot derail it).
main() {
  while (($#)); do
    case $1 in
      --tandem-run) TANDEM_RUN=$2; shift ;;
      --trainer) TRAINER=$2; shift ;;
      --relay) RELAY=$2; shift ;;
      --suite) suites+=("$2"); shift ;;
      --case) cases+=("$2"); shift ;;
      --kills) kills=$2; shift ;;
      --seed) seed=$2; shift ;;
      --keep) keep=1 ;;
      --list) printf '%s\n' "${!CASES[@]}" | sort; exit 0 ;;
      *) usage ;;
    esac
    shift
  done
  [[ -x $TANDEM_RUN && -x $TRAINER && -x $RELAY ]] || usage
  for s in "${suites[@]}"; do
    case $s in
      ci) cases+=("${SUITE_CI[@]}") ;;
      extra) cases+=("${SUITE_EXTRA[@]}") ;;
      soak | latency) cases+=("$s") ;;
      all) cases+=("${SUITE_CI[@]}" "${SUITE_EXTRA[@]}" soak latency) ;;
      *) usage ;;
    esac
  done
  ((${#cases[@]})) || cases=("${SUITE_CI[@]}")
  for c in "${cases[@]}"; do [[ -n ${CASES[$c]:-} ]] || { echo "unknown case '$c' (--list names them)" >&2; exit 2; }; done

  WORK=$(mktemp -d "${TMPDIR:-/tmp}/tandem-multihost.XXXXXX")
  trap finish EXIT
  trap 'exit 130' INT TERM HUP
  hosts_require
  hosts_allowed=1
  hosts_cleanup # namespaces of earlier runs that were killed before their trap
  if [[ ! -c /dev/net/tun ]]; then
    # The relay's cases cannot run; the others can.
    local kept=() c
    for c in "${cases[@]}"; do [[ $c == latency || $c == partition-relay-* ]] || kept+=("$c"); done
    ((${#kept[@]})) || skip "the delay relay's cases need /dev/net/tun"
    echo "no /dev/net/tun: leaving out the delay relay's cases"
    cases=("${kept[@]}")
  fi

  echo "multi-host cases: ${cases[*]} (collective timeout $T s, rendezvous timeout $R s); work folder $WORK"
  for CASE in "${cases[@]}"; do
    started=$(now)
    if ${CASES[$CASE]}; then status=passed; else status=FAILED; fi
    echo "$CASE: $status ($(elapsed "$started") s)"
  done
  hosts_down

  echo
  table_line "case" "fault" "rank" "detect s" "bound s" "result"
  echo
  ((${#ROWS[@]})) && printf '%s\n' "${ROWS[@]}"
  return $failed
}

main "$@"; exit
