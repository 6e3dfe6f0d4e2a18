#!/bin/sh
# The TensorBoard callback under MultiWorkerMirroredStrategy: 2 processes under tandem-run, every
# worker given the same log_dir; only the chief (rank 0) may write, so train/ and validation/
# each hold one event file, the one the chief reports writing, and both workers' History agree.
#   tensorboard_processes.sh TANDEM_RUN TENSORBOARD_FIT_WRITER
set -eu
run=$1 writer=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "tensorboard_processes: $*" >&2; exit 1; }
TANDEM_NUM_CPU_DEVICES=1 TANDEM_RENDEZVOUS_TIMEOUT=60 \
  "$run" --nproc_per_node 2 --master_port 0 -- "$writer" --multiworker "$dir/logs" "$dir/history.json" \
  >"$dir/job.log" 2>&1 || { cat "$dir/job.log" >&2; fail "the 2-process job failed"; }
for run_dir in train validation; do
  count=$(ls "$dir/logs/$run_dir" | wc -l)
  [ "$count" -eq 1 ] || fail "$run_dir/ holds $count files, expected the chief's one: $(ls "$dir/logs/$run_dir")"
done
[ "$(ls "$dir/logs")" = "$(printf 'train\nvalidation')" ] || fail "log_dir holds $(ls "$dir/logs")"
# The chief prints the files it wrote (the other worker prints nothing).
grep -q "$(ls "$dir/logs/train")" "$dir/job.log" || { cat "$dir/job.log" >&2; fail "the event file is not the one the chief wrote"; }
cmp "$dir/history.json.0" "$dir/history.json.1" || fail "the workers' History differ"
echo "2 workers: one event file in train/ and one in validation/ ($(ls "$dir/logs/train")), written by the chief"
