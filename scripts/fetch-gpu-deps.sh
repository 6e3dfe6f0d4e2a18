#!/usr/bin/env bash
# Downloads the Debian 12 packages tandem's build needs and unpacks them into DIR/root (default
# .gpu-deps/root), for a GPU machine that has the CUDA toolkit, CMake and PyTorch but no Debian
# -dev packages and no network. Carry DIR to that machine and run scripts/gpu_check.sh there: it
# builds against DIR/root when the system lacks the packages.
#
#   scripts/fetch-gpu-deps.sh [DIR]
#
# Runs here, on a Debian 12 machine that reaches its mirror (apt-get download needs no root).
# Idempotent: a second run with the same package list does nothing. The unpacked tree is about
# 40 MiB, most of it the Fashion-MNIST data set (the PyTorch peer reads it).
set -euo pipefail

dir=${1:-.gpu-deps}
root="$dir/root"
stamp="$root/.tandem-gpu-deps"

# What the build needs (cmake/TandemDependencies.cmake, tests/CMakeLists.txt) and what its
# binaries load at run time. libgloo0 needs hiredis, ibverbs and libnl at run time (see
# `ldd /usr/lib/libgloo.so.0`), and the linker needs them to resolve libgloo's own references.
# OpenBLAS is left out: tandem falls back to Eigen, and the GPU check measures no CPU kernels.
packages=(
  libeigen3-dev
  libfmt-dev libfmt9
  libspdlog-dev libspdlog1.10
  libcli11-dev
  nlohmann-json3-dev
  doctest-dev
  zlib1g-dev zlib1g
  libgloo-dev libgloo0 libhiredis0.14 libibverbs1 libnl-3-200 libnl-route-3-200
  libssl-dev libssl3         # libcrypto, for the TCP store's handshake
  dataset-fashion-mnist      # /usr/share/datasets/fashion-mnist, for the PyTorch peer
)

want="${packages[*]}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "fetch-gpu-deps: $root is up to date ($(du -sh "$root" | cut -f1))"
  exit 0
fi

debs=$(mktemp -d)
trap 'rm -rf "$debs"' EXIT
echo "fetch-gpu-deps: downloading ${#packages[@]} packages"
# apt-get download writes into the current folder; as root it drops privileges to _apt, which
# must be able to write there.
chmod 777 "$debs"
(cd "$debs" && apt-get download -q "${packages[@]}") || {
  echo "fetch-gpu-deps: apt-get download failed (is the package list current? try apt-get update)" >&2
  exit 1
}

rm -rf "$root"
mkdir -p "$root"
for deb in "$debs"/*.deb; do
  dpkg -x "$deb" "$root"
done

# Absolute links (libz.so -> /lib/x86_64-linux-gnu/libz.so.1.2.13) would point into the GPU
# machine's own /lib; make them relative so that they stay inside the tree.
root_abs=$(cd "$root" && pwd)
while IFS= read -r link; do
  target=$(readlink "$link")
  case "$target" in
    /*) ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$root_abs$target")" "$link" ;;
  esac
done < <(find "$root_abs" -type l)

# Gloo's exported CMake targets name the library by its absolute path (/usr/lib/libgloo.so.0.5.0);
# point them at the copy in this tree, relative to the config file as the rest of it already is.
for f in "$root"/usr/share/cmake/Gloo/GlooTargets-*.cmake; do
  sed -i 's|"/usr/lib/|"${_IMPORT_PREFIX}/lib/|g' "$f"
done

# Documentation, manuals and static libraries are not needed to build or run.
rm -rf "$root"/usr/share/doc "$root"/usr/share/man "$root"/usr/share/lintian
find "$root" -name '*.a' -delete

echo "$want" >"$stamp"
echo "fetch-gpu-deps: unpacked into $root ($(du -sh "$root" | cut -f1))"
