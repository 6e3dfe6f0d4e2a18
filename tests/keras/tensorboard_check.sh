#!/bin/sh
# tensorboard_check.sh <tensorboard_fit_writer> <tensorboard_check.py>: writes a 3-epoch run with
# the TensorBoard callback and reads it back with the real tensorboard package
# (tensorboard_check.py). tensorboard lives in a test-only virtual environment,
# ${TANDEM_TEST_VENV:-$HOME/.cache/tandem/test-venv}, made and filled with pip on first use; it is
# never a build dependency. Exit 77 (CTest: skipped) when that environment cannot be had (no
# python3 venv, no network for pip).
set -u
writer=$1
check=$2
venv=${TANDEM_TEST_VENV:-${HOME:-/tmp}/.cache/tandem/test-venv}

if ! "$venv/bin/python" -c "import tensorboard" 2>/dev/null; then
  echo "tensorboard_check: setting up $venv (python3 -m venv, pip install tensorboard)"
  if ! python3 -m venv "$venv"; then
    echo "tensorboard_check: SKIPPED: cannot create a virtual environment at $venv"
    exit 77
  fi
  if ! "$venv/bin/pip" install -q --disable-pip-version-check --timeout 30 tensorboard; then
    echo "tensorboard_check: SKIPPED: cannot install tensorboard with pip (no network?)"
    exit 77
  fi
  if ! "$venv/bin/python" -c "import tensorboard" 2>/dev/null; then
    echo "tensorboard_check: SKIPPED: tensorboard does not import in $venv"
    exit 77
  fi
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/tandem_tensorboard_check.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
"$writer" "$work/logs" "$work/history.json" || exit 1
"$venv/bin/python" -c "import tensorboard; print('tensorboard', tensorboard.__version__)"
"$venv/bin/python" "$check" "$work/logs" "$work/history.json"
