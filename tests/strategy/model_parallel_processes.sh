#!/bin/sh
# Tensor and pipeline parallelism across 2 processes under tandem-run: model_parallel_worker's
# ranks, one per process, write what a reference run of both ranks in one process writes, bit for
# bit (every step's loss and the final weights).
#   model_parallel_processes.sh TANDEM_RUN WORKER
set -eu
run=$1 worker=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "model_parallel_processes: $*" >&2; exit 1; }
for mode in tensor pipeline; do
  "$worker" --mode "$mode" --out "$dir/reference-$mode" --reference || fail "the $mode reference run failed"
  "$run" --nproc_per_node 2 --master_port 0 -- "$worker" --mode "$mode" --out "$dir/job-$mode" \
    >"$dir/job-$mode.log" 2>&1 || { cat "$dir/job-$mode.log" >&2; fail "the 2-process $mode job failed"; }
  for rank in 0 1; do
    cmp "$dir/reference-$mode/rank-$rank.txt" "$dir/job-$mode/rank-$rank.txt" ||
      fail "$mode: rank $rank of the 2-process job differs from the one-process run"
  done
  losses=$(cat "$dir/job-$mode"/rank-*.txt | grep -c '^loss' || true)
  echo "$mode: 2 processes bitwise the one-process run ($losses loss lines, weights of both ranks)"
done
