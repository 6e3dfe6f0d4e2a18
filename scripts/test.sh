#!/usr/bin/env bash
# The README's second command: install what is missing, build, run every test through CTest.
# GPU tests report "skipped" where no GPU is usable. Extra arguments go to ctest (-L ops, -R graph).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
exec ctest --test-dir "${TANDEM_BUILD_DIR:-$root/build}" --output-on-failure -j "$(nproc)" "$@"
