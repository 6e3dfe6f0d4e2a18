#!/bin/sh
# test_venv.sh MODULE=PIP_SPEC ...: prints the python of the test-only virtual environment once
# every MODULE imports there, installing the missing PIP_SPECs with pip first. The one place the
# tests get PyPI tools (tensorboard, onnxruntime): never a build dependency.
#   python=$(sh tests/common/test_venv.sh onnxruntime=onnxruntime numpy=numpy) || exit $?
# The environment is ${TANDEM_TEST_VENV:-$HOME/.cache/tandem/test-venv}, shared by the tests and
# made on first use; a lock file serialises tests that fill it at the same time (ctest -j).
# Exit 77 (CTest's "skipped") when it cannot be had: no python3 venv, or no network for pip.
set -u
venv=${TANDEM_TEST_VENV:-${HOME:-/tmp}/.cache/tandem/test-venv}
mkdir -p "$(dirname "$venv")" || exit 77
lock="$venv.lock"
missing() {
  for want in "$@"; do
    "$venv/bin/python" -c "import ${want%%=*}" 2>/dev/null || echo "${want#*=}"
  done
}
(
  flock -w 900 9 || { echo "test_venv: SKIPPED: $lock held for 15 minutes" >&2; exit 77; }
  if [ ! -x "$venv/bin/python" ]; then
    echo "test_venv: creating $venv" >&2
    python3 -m venv "$venv" >&2 || { echo "test_venv: SKIPPED: cannot create a virtual environment at $venv" >&2; exit 77; }
  fi
  specs=$(missing "$@")
  if [ -n "$specs" ]; then
    echo "test_venv: pip install $specs into $venv" >&2
    # shellcheck disable=SC2086
    "$venv/bin/pip" install -q --disable-pip-version-check --timeout 30 $specs >&2 ||
      { echo "test_venv: SKIPPED: cannot install $specs with pip (no network?)" >&2; exit 77; }
  fi
  specs=$(missing "$@")
  [ -z "$specs" ] || { echo "test_venv: SKIPPED: $specs do not import in $venv" >&2; exit 77; }
) 9>"$lock" || exit $?
echo "$venv/bin/python"
