#!/bin/sh
# ModelParallel's tensor parallelism under fit across 2 processes under tandem-run: TP=2 with the
# model axis across the processes (mesh 1x2, one CPU device each) and DP2xTP2 with the batch axis
# across them (mesh 2x2, two CPU devices each). Each worker checks its run against
# OneDeviceStrategy (within 1e-5); here every rank's run must equal, bit for bit, the same mesh in
# one process (model_parallel_fit_worker --reference).
#   model_parallel_fit_processes.sh TANDEM_RUN WORKER
set -eu
run=$1 worker=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "model_parallel_fit_processes: $*" >&2; exit 1; }
for config in 1x2:1 2x2:2; do
  mesh=${config%:*} per_process=${config#*:}
  TANDEM_NUM_CPU_DEVICES=$((per_process * 2)) "$worker" --mesh "$mesh" --out "$dir/reference-$mesh" --reference ||
    fail "mesh $mesh: the one-process run failed"
  TANDEM_NUM_CPU_DEVICES=$per_process TANDEM_RENDEZVOUS_TIMEOUT=60 \
    "$run" --nproc_per_node 2 --master_port 0 -- "$worker" --mesh "$mesh" --out "$dir/job-$mesh" \
    >"$dir/job-$mesh.log" 2>&1 || { cat "$dir/job-$mesh.log" >&2; fail "mesh $mesh: the 2-process job failed"; }
  for rank in 0 1; do
    cmp "$dir/reference-$mesh/rank-0.txt" "$dir/job-$mesh/rank-$rank.txt" ||
      fail "mesh $mesh: rank $rank of the 2-process job differs from the one-process run"
  done
  echo "mesh $mesh over 2 processes: equivalent to one device, bitwise the one-process run ($(grep -c '^loss' "$dir/job-$mesh/rank-0.txt") steps)"
done
