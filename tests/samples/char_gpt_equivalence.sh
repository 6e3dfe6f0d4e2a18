#!/bin/sh
# The GPT sample's distribution check: with dropout off, the first STEPS training steps under
# MirroredStrategy on 2 logical CPU devices and under MultiWorkerMirroredStrategy with 2 workers
# (tandem-run) give every step's loss within 1e-5 (relative) of OneDeviceStrategy's, and the same
# validation loss after the last step; under ZeRO stage 3 (--zero 3: weights, gradients and Adam's
# slots sharded, weights gathered layer by layer) the mirrored run's losses are bitwise the
# unsharded run's, and the 2 workers' within 1e-5 of one device's; under ModelParallel on a 2x2
# mesh (data parallelism over 2 x tensor parallelism over 2) and as a pipeline of 2 stages (1F1B,
# 4 micro-batches) within 1e-5. Also: the run's saved weights,
# loaded by a new process, give the same validation loss, and the same run twice writes the same
# weights byte for byte.
#
#   char_gpt_equivalence.sh TANDEM_RUN CHAR_GPT STEPS
#
# Needs only POSIX sh and awk.
set -u
run=$1 gpt=$2 steps=$3
dir=$(mktemp -d "${TMPDIR:-/tmp}/tandem_char_gpt.XXXXXX")
trap 'rm -rf "$dir"' EXIT
fail() {
  for f in "$dir"/*.out; do
    echo "== $f"
    tail -n 30 "$f"
  done
  echo "char_gpt_equivalence: $*"
  exit 1
}

common="--steps $steps --eval-every $steps --eval-batches 4 --dropout 0 --verbose 0"
# shellcheck disable=SC2086
"$gpt" $common --strategy one --loss-log "$dir/one.loss" --save "$dir/one" >"$dir/one.out" 2>&1 ||
  fail "the OneDeviceStrategy run failed"
# shellcheck disable=SC2086
"$gpt" $common --strategy one --loss-log "$dir/again.loss" --save "$dir/again" >"$dir/again.out" 2>&1 ||
  fail "the second OneDeviceStrategy run failed"
# shellcheck disable=SC2086
"$gpt" $common --strategy mirrored --cpu-devices 2 --loss-log "$dir/mirrored.loss" >"$dir/mirrored.out" 2>&1 ||
  fail "the MirroredStrategy run failed"
# shellcheck disable=SC2086
"$run" --nproc_per_node 2 --master_port 0 -- "$gpt" $common --strategy multiworker --collective-timeout 60 \
  --loss-log "$dir/multiworker.loss" >"$dir/multiworker.out" 2>&1 || fail "the 2-worker run failed"
# shellcheck disable=SC2086
"$gpt" $common --strategy mirrored --cpu-devices 2 --zero 3 --loss-log "$dir/zero3.loss" >"$dir/zero3.out" 2>&1 ||
  fail "the MirroredStrategy run under ZeRO stage 3 failed"
# shellcheck disable=SC2086
"$run" --nproc_per_node 2 --master_port 0 -- "$gpt" $common --strategy multiworker --zero 3 --collective-timeout 60 \
  --loss-log "$dir/multiworker_zero3.loss" >"$dir/multiworker_zero3.out" 2>&1 ||
  fail "the 2-worker run under ZeRO stage 3 failed"
# Tensor parallelism: DP2xTP2 under ModelParallel (LayoutMap::megatron: attention split over heads,
# the blocks' Dense layers over features).
# shellcheck disable=SC2086
"$gpt" $common --mesh 2x2 --cpu-devices 4 --loss-log "$dir/tensor_parallel.loss" >"$dir/tensor_parallel.out" 2>&1 ||
  fail "the DP2xTP2 ModelParallel run failed"
# A pipeline of 2 stages (1F1B, 4 micro-batches), cut between the transformer blocks.
# shellcheck disable=SC2086
"$gpt" $common --pipeline-stages 2 --microbatches 4 --loss-log "$dir/pipeline.loss" >"$dir/pipeline.out" 2>&1 ||
  fail "the 2-stage pipeline run failed"
# shellcheck disable=SC2086
"$gpt" --steps 0 --eval-batches 4 --verbose 0 --strategy one --load "$dir/one" >"$dir/load.out" 2>&1 ||
  fail "loading the saved weights failed"

# compare A B: every step of A's loss log within 1e-5 (relative) of B's, and as many steps.
compare() {
  awk -v a="$1" -v b="$2" '
    FILENAME == a { want[$1] = $2; n++; next }
    { m++; if (!($1 in want)) { print "step " $1 " missing from " a; bad = 1; next }
      d = $2 - want[$1]; if (d < 0) d = -d; s = want[$1] < 0 ? -want[$1] : want[$1]
      if (d > 1e-5 * s) { printf "step %s: loss %.9g, one device %.9g\n", $1, $2, want[$1]; bad = 1 } }
    END { if (n != m || n == 0) { print n " steps in " a ", " m " in " b; bad = 1 } exit bad }' "$1" "$2"
}
compare "$dir/one.loss" "$dir/mirrored.loss" || fail "MirroredStrategy's losses differ from one device's"
compare "$dir/one.loss" "$dir/multiworker.loss" || fail "the 2 workers' losses differ from one device's"
compare "$dir/one.loss" "$dir/multiworker_zero3.loss" || fail "the 2 workers' losses under stage 3 differ from one device's"
compare "$dir/one.loss" "$dir/tensor_parallel.loss" || fail "DP2xTP2's losses differ from one device's"
compare "$dir/one.loss" "$dir/pipeline.loss" || fail "the pipeline's losses differ from one device's"
cmp -s "$dir/mirrored.loss" "$dir/zero3.loss" || fail "ZeRO stage 3's losses are not bitwise the unsharded run's"
cmp -s "$dir/one.loss" "$dir/again.loss" || fail "two OneDeviceStrategy runs logged different losses"
cmp -s "$dir/one.weights.safetensors" "$dir/again.weights.safetensors" ||
  fail "two OneDeviceStrategy runs saved different weights"

val() { sed -n 's/^final val_loss \([0-9.]*\).*/\1/p' "$1"; }
[ -n "$(val "$dir/one.out")" ] || fail "no final validation loss printed"
[ "$(val "$dir/one.out")" = "$(val "$dir/load.out")" ] ||
  fail "the loaded weights give val_loss $(val "$dir/load.out"), the trained model $(val "$dir/one.out")"
echo "char_gpt_equivalence: $steps steps equal under mirrored (2 devices) and 2 workers, unsharded and under ZeRO" \
  "stage 3, and under DP2xTP2 and a 2-stage pipeline (ModelParallel); reload and rerun identical"
