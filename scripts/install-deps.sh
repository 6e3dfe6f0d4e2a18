#!/usr/bin/env bash
# Installs the Debian 12 packages tandem builds with, and only those that are missing: a second
# run with everything present does nothing (no apt-get update, no network).
# Run as root, or as a user who may sudo.
set -euo pipefail

packages=(
  g++ cmake ninja-build
  libeigen3-dev libfmt-dev nlohmann-json3-dev doctest-dev zlib1g-dev
  libspdlog-dev              # the library's leveled messages (base/log.h)
  libcli11-dev               # command lines of the samples, benchmarks and tandem-run
  libgloo-dev                # collectives between worker processes (TCP)
  libssl-dev                 # libcrypto: the TCP store's handshake (HMAC-SHA256)
  libprotobuf-dev protobuf-compiler  # TensorBoard's event files (keras_like/detail/event_file.cc)
  libopenblas-dev            # loaded at run time for MatMul/convolution (Eigen otherwise)
  dataset-fashion-mnist      # the samples' data set, in /usr/share/datasets/fashion-mnist
  jargon-text                # the GPT sample's text, /usr/share/doc/jargon-text/jargon.txt.gz
  iproute2                   # ip netns, for the multi-host tests (tests/multihost/; skipped without it)
  python3-venv               # the test-only virtual environment for tensorboard and onnxruntime (tests/common/test_venv.sh; skipped without it)
  clang libclang-rt-14-dev   # libFuzzer, ASan, UBSan for the fuzzing harnesses (scripts/fuzz.sh)
  libonnx-dev                # Model::export_model (ONNX's messages and checker)
  libonnx-testdata           # ONNX's node tests as an oracle for the ops (tests/onnx/)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: run as root (sudo is not installed)" >&2; exit 1; }
  sudo=(sudo)
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
