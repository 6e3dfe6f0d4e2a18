#!/bin/sh
# The GPT sample's step-by-step comparison flags (how its loss curve is checked against the
# PyTorch peer's): --init-from with the weights a run starts from anyway (written by --steps 0
# --save) trains to the same loss at every step, bit for bit; --train-starts trains on the listed
# windows, the same losses twice, and refuses a start past the training text.
#
#   char_gpt_diagnostics.sh CHAR_GPT
#
# Needs only POSIX sh, awk and cmp.
set -u
gpt=$1
dir=$(mktemp -d "${TMPDIR:-/tmp}/tandem_char_gpt_diag.XXXXXX")
trap 'rm -rf "$dir"' EXIT
fail() {
  for f in "$dir"/*.out; do
    echo "== $f"
    tail -n 20 "$f"
  done
  echo "char_gpt_diagnostics: $*"
  exit 1
}

small="--layers 1 --width 32 --context 32 --batch 8 --eval-batches 2 --dropout 0 --verbose 0 --strategy one"
# shellcheck disable=SC2086
"$gpt" $small --steps 0 --save "$dir/init" >"$dir/init.out" 2>&1 || fail "writing the initial weights failed"
# shellcheck disable=SC2086
"$gpt" $small --steps 6 --eval-every 6 --loss-log "$dir/own.loss" >"$dir/own.out" 2>&1 || fail "the plain run failed"
# shellcheck disable=SC2086
"$gpt" $small --steps 6 --eval-every 6 --loss-log "$dir/loaded.loss" --init-from "$dir/init.weights.safetensors" \
  >"$dir/loaded.out" 2>&1 || fail "the --init-from run failed"
cmp -s "$dir/own.loss" "$dir/loaded.loss" || fail "--init-from with the run's own initial weights changed the losses"

# 6 steps of 8 windows, starts spread over the first 100000 characters.
awk 'BEGIN { for (s = 0; s < 6; ++s) { line = ""; for (i = 0; i < 8; ++i) line = line " " (s * 8 + i) * 2011; print line } }' \
  >"$dir/starts.txt"
for run in a b; do
  # shellcheck disable=SC2086
  "$gpt" $small --steps 6 --eval-every 6 --loss-log "$dir/$run.loss" --train-starts "$dir/starts.txt" \
    >"$dir/$run.out" 2>&1 || fail "the --train-starts run $run failed"
done
cmp -s "$dir/a.loss" "$dir/b.loss" || fail "two --train-starts runs gave different losses"
cmp -s "$dir/a.loss" "$dir/own.loss" && fail "--train-starts gave the shuffled batches' losses"
[ "$(wc -l <"$dir/a.loss")" -eq 6 ] || fail "expected 6 steps in the --train-starts loss log"

echo "99999999" >"$dir/bad.txt"
# shellcheck disable=SC2086
if "$gpt" $small --steps 1 --eval-every 1 --train-starts "$dir/bad.txt" >"$dir/bad.out" 2>&1; then
  fail "a start past the training text was accepted"
fi
grep -q "outside" "$dir/bad.out" || fail "the error for a bad start does not say it is outside the text"
echo "char_gpt_diagnostics: ok"
