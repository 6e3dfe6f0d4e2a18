#!/bin/sh
# onnx_runtime_check.sh EXPORT_TEST CHECK_PY TEST_VENV: exports the test models with their predict
# outputs (onnx_export_test with TANDEM_ONNX_EXPORT_OUT) and runs them with ONNX Runtime from the
# test-only virtual environment (tests/common/test_venv.sh); every output must equal predict's
# within 1e-5. Exit 77 (skipped) where onnxruntime cannot be installed.
set -u
export_test=$1 check=$2 test_venv=$3
python=$(sh "$test_venv" onnxruntime=onnxruntime numpy=numpy) || exit $?
work=$(mktemp -d "${TMPDIR:-/tmp}/tandem_onnx_runtime.XXXXXX") || exit 1
trap 'rm -rf "$work"' EXIT
TANDEM_ONNX_EXPORT_OUT=$work "$export_test" -tc="export_model writes*" >"$work/export.log" 2>&1 ||
  { cat "$work/export.log"; exit 1; }
"$python" "$check" "$work"
