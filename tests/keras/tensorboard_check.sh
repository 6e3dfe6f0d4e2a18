#!/bin/sh
# tensorboard_check.sh <tensorboard_fit_writer> <tensorboard_check.py> <test_venv.sh>: writes a
# 3-epoch run with the TensorBoard callback and reads it back with the real tensorboard package
# (tensorboard_check.py), from the test-only virtual environment (tests/common/test_venv.sh; never
# a build dependency). Exit 77 (CTest: skipped) when that environment cannot be had (no python3
# venv, no network for pip).
set -u
writer=$1 check=$2 test_venv=$3
python=$(sh "$test_venv" tensorboard=tensorboard) || exit $?
work=$(mktemp -d "${TMPDIR:-/tmp}/tandem_tensorboard_check.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
"$writer" "$work/logs" "$work/history.json" || exit 1
"$python" -c "import tensorboard; print('tensorboard', tensorboard.__version__)"
"$python" "$check" "$work/logs" "$work/history.json"
