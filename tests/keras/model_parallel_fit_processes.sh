#!/bin/sh
# ModelParallel under fit across 2 processes under tandem-run: TP=2 with the model axis across the
# processes (mesh 1x2, one CPU device each), DP2xTP2 with the batch axis across them (mesh 2x2,
# two CPU devices each), PP=2 with one stage per process, PP2xDP2 with a pipeline per process, and
# TP2xPP2 (mesh 1x2x2: a pipeline per process, the model axis across them).
# Each worker checks its run against OneDeviceStrategy (within 1e-5); here every rank's run must
# equal, bit for bit, the same mesh in one process (model_parallel_fit_worker --reference).
#   model_parallel_fit_processes.sh TANDEM_RUN WORKER
set -eu
run=$1 worker=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "model_parallel_fit_processes: $*" >&2; exit 1; }
# The fourth field: whether the split weights' pieces sit on both processes (the model or stage
# axis across them), so that each process's checkpoint file must hold some.
# A fifth field: a ZeRO stage (DP2xTP2 and PP2xDP2 with each piece's or stage's slots sharded along the
# batch axis, across the processes).
for config in 1x2:model:1:every 2x2:model:2:one 1x2:stage:1:every 2x2:stage:2:one 1x2x2:model,stage:2:every \
  2x2:model:2:one:2 2x2:model:2:one:3 2x2:stage:2:one:1; do
  zero=0
  case $config in *:*:*:*:*) zero=${config##*:} config=${config%:*} ;; esac
  mesh=${config%%:*} rest=${config#*:}
  spread=${rest##*:} rest=${rest%:*}
  axis=${rest%:*} per_process=${rest#*:}
  pieces=""
  [ "$spread" = every ] && pieces=--pieces-on-every-worker
  name="$mesh-$(echo "$axis" | tr , -)-zero$zero"
  TANDEM_NUM_CPU_DEVICES=$((per_process * 2)) "$worker" --mesh "$mesh" --axes "batch,$axis" --out "$dir/reference-$name" \
    --zero "$zero" --reference || fail "mesh $mesh (batch, $axis): the one-process run failed"
  TANDEM_NUM_CPU_DEVICES=$per_process TANDEM_RENDEZVOUS_TIMEOUT=60 \
    "$run" --nproc_per_node 2 --master_port 0 -- "$worker" --mesh "$mesh" --axes "batch,$axis" --out "$dir/job-$name" --zero "$zero" $pieces \
    >"$dir/job-$name.log" 2>&1 || { cat "$dir/job-$name.log" >&2; fail "mesh $mesh (batch, $axis): the 2-process job failed"; }
  for rank in 0 1; do
    cmp "$dir/reference-$name/rank-0.txt" "$dir/job-$name/rank-$rank.txt" ||
      fail "mesh $mesh (batch, $axis): rank $rank of the 2-process job differs from the one-process run"
  done
  echo "mesh $mesh (batch, $axis), ZeRO stage $zero, over 2 processes: equivalent to one device, bitwise the one-process run ($(grep -c '^loss' "$dir/job-$name/rank-0.txt") steps)"
done
