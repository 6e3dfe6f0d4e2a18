#!/usr/bin/env bash
# How the main sample degrades on a busy machine: the epoch time of fashion_mnist_mlp (its
# defaults: MirroredStrategy over one logical CPU device per core, batch 32) alone, and beside a
# CPU-bound second process, and their ratio. See bench/README.md ("Waiting on a shared machine").
#
#   scripts/wait_policy_check.sh [BUILD_DIR]            # default: build/ in the repository
#   REPEAT=3 HOG=spin TANDEM_WAIT_POLICY=active scripts/wait_policy_check.sh
#
# An epoch's time is its training steps times the time per step that the progress bar prints
# (--verbose 2: the first step and the validation pass left out; whole milliseconds once a step
# takes 1 ms or more), the median over EPOCHS epochs of each run and over REPEAT runs, alone and
# busy interleaved; the slowest busy epoch is shown too (a busy machine's slowdowns come and go). HOG=cnn (default) trains
# fashion_mnist_cnn beside it (under the same TANDEM_WAIT_POLICY), HOG=spin runs one busy shell
# loop per core.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-${TANDEM_BUILD_DIR:-$root/build}}
epochs=${EPOCHS:-3}
repeat=${REPEAT:-1}
hog=${HOG:-cnn}
mlp=$build/samples/fashion_mnist_mlp
cnn=$build/samples/fashion_mnist_cnn
for program in "$mlp" "$cnn"; do
  [[ -x $program ]] || { echo "wait_policy_check: $program is missing; build the samples first" >&2; exit 1; }
done
[[ $hog == cnn || $hog == spin ]] || { echo "wait_policy_check: HOG=$hog: expected cnn or spin" >&2; exit 1; }

hog_pids=()
stop_hog() {
  for pid in "${hog_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${hog_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  hog_pids=()
}
trap stop_hog EXIT

start_hog() {
  if [[ $hog == cnn ]]; then
    "$cnn" --epochs 1000 --verbose 0 >/dev/null 2>&1 &
    hog_pids+=($!)
    sleep 3  # past its start-up (reading the data set): training from here on
  else
    for _ in $(seq "$(nproc)"); do
      sh -c 'while :; do :; done' &
      hog_pids+=($!)
    done
  fi
}

# Milliseconds of one epoch's training steps, one line per epoch of a run of the MLP sample.
# Progress lines read "1875/1875 - 1s - 554us/step - loss: ...".
epoch_ms() {
  "$mlp" --epochs "$epochs" --verbose 2 | awk '
    match($0, /^ *[0-9]+\/[0-9]+ - [0-9]+s - [0-9]+(us|ms|s)\/step/) {
      split(substr($0, RSTART, RLENGTH), parts, " ")
      split(parts[1], counts, "/")
      per = parts[5]; sub(/\/step/, "", per)
      scale = per ~ /us$/ ? 1e-3 : per ~ /ms$/ ? 1 : 1e3
      sub(/[a-z]+$/, "", per)
      printf "%.0f\n", per * scale * counts[2]
    }'
}

median() { sort -n | awk '{v[NR] = $1} END {if (NR == 0) exit 1; print v[int((NR + 1) / 2)]}'; }
slowest() { sort -n | tail -1; }

echo "wait policy: ${TANDEM_WAIT_POLICY:-adaptive (default)}; $(nproc) cores; load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
idle=()
busy=()
for ((i = 1; i <= repeat; ++i)); do
  idle+=($(epoch_ms))
  start_hog
  busy+=($(epoch_ms))
  stop_hog
done
echo "epochs alone: ${idle[*]} ms; beside $hog: ${busy[*]} ms"

awk -v idle="$(printf '%s\n' "${idle[@]}" | median)" -v busy="$(printf '%s\n' "${busy[@]}" | median)" \
    -v worst="$(printf '%s\n' "${busy[@]}" | slowest)" -v hog="$hog" 'BEGIN {
  printf "MLP epoch alone:        %6.2f s (median)\n", idle / 1000
  printf "MLP epoch beside %-5s  %6.2f s (median; slowest %.2f s)\n", hog ":", busy / 1000, worst / 1000
  printf "ratio:                  %6.2fx (the target: at most 2.5x)\n", busy / idle
}'
