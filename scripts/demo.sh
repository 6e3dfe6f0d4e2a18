#!/usr/bin/env bash
# The README's first command: install what is missing, build, run the main sample.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
exec "${TANDEM_BUILD_DIR:-$root/build}/samples/fashion_mnist_mlp" "$@"
