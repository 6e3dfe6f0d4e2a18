#!/usr/bin/env bash
# The README's second command: install what is missing, build, run every test through CTest.
# GPU tests report "skipped" where no GPU is usable. Extra arguments go to ctest (-L ops, -R graph).
# Without them, every fuzzer then runs briefly too (scripts/fuzz.sh, TANDEM_FUZZ_SECONDS each,
# default 5; 0 to skip), reporting "skipped" where clang's libFuzzer is missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
status=0
ctest --test-dir "${TANDEM_BUILD_DIR:-$root/build}" --output-on-failure -j "$(nproc)" "$@" || status=$?
if [ $# -eq 0 ] && [ "${TANDEM_FUZZ_SECONDS:-5}" != 0 ]; then
  "$root/scripts/fuzz.sh" "${TANDEM_FUZZ_SECONDS:-5}" || status=1
fi
exit $status
