#!/usr/bin/env bash
# Configures (once) and builds tandem into build/ (or $TANDEM_BUILD_DIR). Incremental: a second
# run with nothing changed takes about a second. Extra arguments go to the CMake configure step.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${TANDEM_BUILD_DIR:-$root/build}
# Two jobs per core is safe here: the heaviest translation unit needs well under 2 GB.
jobs=${TANDEM_BUILD_JOBS:-$(( $(nproc) + 1 ))}
if [ ! -f "$build/CMakeCache.txt" ] || [ $# -gt 0 ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
fi
cmake --build "$build" -j "$jobs"
