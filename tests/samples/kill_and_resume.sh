#!/bin/sh
# The README's fault-tolerance story, run with a sample's flags: two workers under
# `tandem-run --max_restarts 1`, backing up every epoch (--backup) and saving weights
# (--checkpoint); once the first backup exists the worker of local rank VICTIM is SIGKILLed, the
# launcher restarts the group, and fit resumes from the backup and finishes.
#
#   kill_and_resume.sh TANDEM_RUN SAMPLE VICTIM EPOCHS
#
# EPOCHS must make the run last well beyond the 0.1 s this script takes to notice the first backup
# (the regression sample's epochs take tens of milliseconds; a hundred of them, seconds).
#
# Exits 0 when the run ends well, said it resumed, and saved the weights of an uninterrupted run
# (the same command run first without a kill, compared byte for byte); else prints the log and what
# is missing. Needs only POSIX sh and /proc (no procps).
set -u
run=$1 sample=$2 victim=$3 epochs=$4
dir=$(mktemp -d "${TMPDIR:-/tmp}/tandem_kill_and_resume.XXXXXX")
launcher=
cleanup() {
  if [ -n "$launcher" ]; then
    kill "$launcher" 2>/dev/null  # tandem-run stops its workers
    wait "$launcher" 2>/dev/null
  fi
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  cat "$dir/log"
  echo "kill_and_resume: $*"
  exit 1
}

# run_sample WEIGHTS_FILE: the sample's two workers under tandem-run, its output in $dir/log. It
# execs tandem-run, so run it in a subshell: ( run_sample ... ), or run_sample ... & (then $! is
# the launcher, whose children are the workers).
run_sample() {
  exec "$run" --nproc_per_node 2 --master_port 0 --max_restarts 1 -- "$sample" --strategy multiworker \
    --epochs "$epochs" --verbose 2 --backup "$dir/backup" --checkpoint "$1" --collective-timeout 30 >"$dir/log" 2>&1
}

(run_sample "$dir/uninterrupted.safetensors") || fail "the uninterrupted run failed"
[ ! -e "$dir/backup/backup.safetensors" ] || fail "a finished run left its backup"

run_sample "$dir/weights.safetensors" &
launcher=$!

# The first backup appears at the end of epoch 1.
tries=0
while [ ! -e "$dir/backup/backup.safetensors" ]; do
  kill -0 "$launcher" 2>/dev/null || fail "the run ended before its first backup"
  tries=$((tries + 1))
  [ "$tries" -lt 3000 ] || fail "no backup after 300 s"
  sleep 0.1
done

# The launcher's child whose environment says TANDEM_LOCAL_RANK=VICTIM.
killed=
for proc in /proc/[0-9]*; do
  { read -r _ _ _ ppid _ <"$proc/stat"; } 2>/dev/null || continue
  [ "$ppid" = "$launcher" ] || continue
  if tr '\0' '\n' <"$proc/environ" 2>/dev/null | grep -qx "TANDEM_LOCAL_RANK=$victim"; then
    kill -9 "${proc#/proc/}" && killed=${proc#/proc/}
  fi
done
[ -n "$killed" ] || fail "found no worker of local rank $victim to kill"
echo "kill_and_resume: SIGKILLed worker $victim (pid $killed) after the first backup"

wait "$launcher"
status=$?
launcher=
cat "$dir/log"
[ "$status" -eq 0 ] || fail "tandem-run exited with status $status"
grep -q "BackupAndRestore: resuming from" "$dir/log" || fail "the restarted run did not resume from the backup"
[ -s "$dir/weights.safetensors" ] || fail "no checkpoint at $dir/weights.safetensors"
cmp -s "$dir/weights.safetensors" "$dir/uninterrupted.safetensors" ||
  fail "the resumed run's weights differ from the uninterrupted run's"
echo "kill_and_resume: the restarted group resumed from the backup and ended with the uninterrupted run's weights"
