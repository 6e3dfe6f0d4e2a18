#!/usr/bin/env bash
# scripts/tensorboard_screenshot.sh [OUT.png]: trains the Fashion-MNIST MLP sample 10 epochs with
# --tensorboard, serves the logs with the real TensorBoard (the tests' virtual environment,
# tests/common/test_venv.sh) on 127.0.0.1 and takes a picture of its scalars page with Debian's
# headless Chromium (apt-get install chromium; not a project dependency). Needs a built tree.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-tensorboard.png}
command -v chromium >/dev/null || { echo "tensorboard_screenshot: install Debian's chromium first" >&2; exit 1; }
python=$(sh "$root/tests/common/test_venv.sh" tensorboard=tensorboard)
work=$(mktemp -d)
port=$((20000 + RANDOM % 20000))
trap 'kill "$server" 2>/dev/null || true; rm -rf "$work"' EXIT
"${TANDEM_BUILD_DIR:-$root/build}/samples/fashion_mnist_mlp" --epochs 10 --tensorboard "$work/logs"
"$(dirname "$python")/tensorboard" --logdir "$work/logs" --host 127.0.0.1 --port "$port" >"$work/server.log" 2>&1 &
server=$!
for _ in $(seq 60); do curl -sf "http://127.0.0.1:$port/" >/dev/null && break; sleep 1; done
chromium --headless=new --no-sandbox --disable-gpu --hide-scrollbars --window-size=1600,1100 \
  --virtual-time-budget=20000 --screenshot="$out" \
  "http://127.0.0.1:$port/?darkMode=false#scalars&_smoothingWeight=0&tagFilter=epoch_(loss%7Caccuracy)" 2>/dev/null
echo "tensorboard_screenshot: $out"
