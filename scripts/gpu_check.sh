#!/usr/bin/env bash
# One-shot check on a machine with an NVIDIA GPU: configures and builds tandem with CUDA for sm_90,
# runs the GPU test suites, and bench_fit --device gpu (mlp, wide, cnn in float32 and
# mixed_bfloat16, with and without CUDA graphs) beside the PyTorch eager peer on that GPU where
# PyTorch sees it; prints one table.
#
#   scripts/gpu_check.sh OUTDIR
#
# Writes OUTDIR/table.md (the table, also printed on stdout) and OUTDIR/log.txt (everything).
# Progress lines go to stderr. Exit status 0 when every step that ran passed (a test that skips,
# e.g. the two-GPU NCCL test on a one-GPU machine, is reported, not counted as a failure).
#
# The GPU machine has the CUDA toolkit, CMake and PyTorch but no Debian -dev packages and no
# network: when the system lacks the packages, the build uses the tree that
# scripts/fetch-gpu-deps.sh unpacked (carry `.gpu-deps` along).
#
# cuDNN (convolution and pooling; tandem loads libcudnn with dlopen and falls back to its own
# kernels without it) is taken from the CUDA toolkit when it has it, else from PyTorch's pip
# package nvidia-cudnn-cu13 (site-packages/nvidia/cudnn): its lib folder goes on LD_LIBRARY_PATH
# for tandem's programs and its include folder to CMake (TANDEM_CUDNN_INCLUDE_DIR). ops_gpu_test
# runs twice, with cuDNN and with TANDEM_CUDNN=0 (im2col + cuBLAS), both against the CPU kernels.
#
# Every step runs under `timeout`, within a total budget, so that the script never hangs.
# Environment:
#   TANDEM_GPU_DEPS=DIR                   the fetched tree (default .gpu-deps; DIR/root is used)
#   TANDEM_GPU_CHECK_FORCE_LOCAL_DEPS=1   use DIR/root even when the system has the packages
#   TANDEM_GPU_BUILD_DIR=DIR              build folder (default build-gpu)
#   TANDEM_BUILD_JOBS=N                   build parallelism (default: all cores)
#   TANDEM_GPU_CHECK_BUDGET_S=S           total time budget in seconds (default 480)
#   TANDEM_GPU_CHECK_TARGETS="t1 t2"      build only these targets (default: everything)
set -uo pipefail

if [ $# -ne 1 ]; then
  echo "usage: scripts/gpu_check.sh OUTDIR" >&2
  exit 2
fi
out=$1
src=$(cd "$(dirname "$0")/.." && pwd)
cd "$src"
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/log.txt"
table="$out/table.md"
: >"$log"

budget=${TANDEM_GPU_CHECK_BUDGET_S:-480}
# Python and PyTorch run with the caller's library path, not with the fetched tree's.
orig_ld_library_path=${LD_LIBRARY_PATH-}
start=$(date +%s)
jobs=${TANDEM_BUILD_JOBS:-$(nproc)}
build=${TANDEM_GPU_BUILD_DIR:-build-gpu}
deps=${TANDEM_GPU_DEPS:-.gpu-deps}
deps_root="$(cd "$src" && realpath -m "$deps")/root"

rows=()       # table rows, "| item | result | detail |"
failures=0

note() { echo "gpu_check: $*" >&2; echo "=== $* ($(date +%T))" >>"$log"; }
row() { rows+=("| $1 | $2 | $3 |"); }
fail_row() { row "$1" "**FAIL**" "$2"; failures=$((failures + 1)); }
# Seconds left of the budget, keeping `reserve` seconds back for the steps after this one.
left() { local r=$((budget - ($(date +%s) - start) - ${1:-0})); [ $r -lt 5 ] && r=5; echo $r; }
# run SECONDS CMD...: runs CMD with its output in the log, killed after SECONDS.
run() { local s=$1; shift; echo "\$ $*" >>"$log"; timeout -k 10 "$s" "$@" >>"$log" 2>&1; }
# When a step ran out of time, say so instead of printing a bare exit status.
why() { case $1 in 124|137) echo "timed out (limit ${2}s)" ;; *) echo "exit $1" ;; esac; }

# --- the GPU --------------------------------------------------------------------------------
note "GPU"
gpu_present=0
if command -v nvidia-smi >/dev/null; then
  gpu=$(timeout -k 5 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>>"$log")
  if [ -n "$gpu" ]; then
    gpu_present=1
    row "GPU" "$(echo "$gpu" | head -1 | cut -d, -f1)" "$(echo "$gpu" | wc -l) GPU(s); $(echo "$gpu" | head -1 | cut -d, -f2-) (memory, driver)"
  else
    row "GPU" "none" "nvidia-smi found no GPU"
  fi
else
  row "GPU" "none" "no nvidia-smi: GPU tests will report skipped"
fi
echo "GPU: ${gpu:-none}" >>"$log"

# --- dependencies: the system's Debian packages, or the fetched tree -----------------------
system_has_deps() {
  local f
  for f in /usr/include/eigen3/Eigen/Core /usr/include/fmt/core.h /usr/include/nlohmann/json.hpp \
           /usr/include/doctest/doctest.h /usr/include/zlib.h /usr/include/gloo/config.h \
           /usr/share/cmake/Gloo/GlooConfig.cmake /usr/include/spdlog/spdlog.h /usr/include/CLI/CLI.hpp \
           /usr/include/openssl/hmac.h; do
    [ -e "$f" ] || return 1
  done
}
cmake_deps=()
if [ "${TANDEM_GPU_CHECK_FORCE_LOCAL_DEPS:-0}" != 1 ] && system_has_deps; then
  row "dependencies" "system" "Debian packages installed"
elif [ -f "$deps_root/.tandem-gpu-deps" ]; then
  prefix="$deps_root/usr"
  export CMAKE_PREFIX_PATH="$prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  # The linker resolves libgloo's own needs (hiredis, ibverbs, libnl) and the programs load
  # libfmt, libspdlog and libgloo from here. The system's folders come first, so that a library the system
  # has (libz.so.1, newer there than Debian 12's) is the system's.
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu:$prefix/lib/x86_64-linux-gnu:$deps_root/lib/x86_64-linux-gnu:$prefix/lib"
  cmake_deps=(-DCMAKE_PREFIX_PATH="$prefix")
  why_local="system lacks the packages"
  [ "${TANDEM_GPU_CHECK_FORCE_LOCAL_DEPS:-0}" = 1 ] && why_local="forced by TANDEM_GPU_CHECK_FORCE_LOCAL_DEPS"
  row "dependencies" "$deps/root" "$why_local; $(du -sh "$deps_root" 2>/dev/null | cut -f1)"
  echo "CMAKE_PREFIX_PATH=$CMAKE_PREFIX_PATH LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >>"$log"
else
  fail_row "dependencies" "system lacks the Debian -dev packages and $deps/root is missing: run scripts/fetch-gpu-deps.sh on a Debian 12 machine and carry $deps"
fi

# --- cuDNN: the toolkit's, or the one in PyTorch's pip package ---------------------------------
note "cuDNN"
cuda_home=/usr/local/cuda
if command -v nvcc >/dev/null; then cuda_home=$(cd "$(dirname "$(command -v nvcc)")/.." && pwd); fi
# site-packages/nvidia/cudnn as Python sees it (a namespace package: ask __path__), else a glob.
pip_cudnn=$(LD_LIBRARY_PATH=$orig_ld_library_path timeout -k 5 60 python3 -c \
  "import nvidia.cudnn as m; print(list(m.__path__)[0])" 2>>"$log")
if [ -z "$pip_cudnn" ] || [ ! -e "$pip_cudnn/lib/libcudnn.so.9" ]; then
  pip_cudnn=""
  for d in $(LD_LIBRARY_PATH=$orig_ld_library_path timeout -k 5 30 python3 -c \
               "import site; print(' '.join(site.getsitepackages() + [site.getusersitepackages()]))" 2>>"$log") \
           /usr/local/lib/python3*/dist-packages /usr/lib/python3*/dist-packages /usr/local/lib/python3*/site-packages; do
    if [ -e "$d/nvidia/cudnn/lib/libcudnn.so.9" ]; then pip_cudnn="$d/nvidia/cudnn"; break; fi
  done
fi
echo "cuDNN: toolkit $cuda_home; pip package: ${pip_cudnn:-none}" >>"$log"
cudnn_header="none"
if [ -e "$cuda_home/include/cudnn.h" ]; then
  cudnn_header="toolkit"
elif [ -n "$pip_cudnn" ] && [ -e "$pip_cudnn/include/cudnn.h" ]; then
  cudnn_header="$pip_cudnn/include"
  cmake_deps+=(-DTANDEM_CUDNN_INCLUDE_DIR="$pip_cudnn/include")
fi
cudnn_library="none"
if [ -e "$cuda_home/lib64/libcudnn.so.9" ] || [ -e "$cuda_home/lib/libcudnn.so.9" ] || \
   ldconfig -p 2>/dev/null | grep -q 'libcudnn\.so\.9 '; then
  cudnn_library="system"
  for d in "$cuda_home/lib64" "$cuda_home/lib"; do
    [ -e "$d/libcudnn.so.9" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" && break
  done
elif [ -n "$pip_cudnn" ]; then
  cudnn_library="$pip_cudnn/lib"
  # Only tandem's programs: Python and PyTorch keep the caller's path (orig_ld_library_path).
  export LD_LIBRARY_PATH="$pip_cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [ "$cudnn_header" = none ] || [ "$cudnn_library" = none ]; then
  row "cuDNN" "not found" "header: $cudnn_header, library: $cudnn_library; convolution and pooling use tandem's kernels"
else
  row "cuDNN" "found" "header: $cudnn_header, library: $cudnn_library (loaded with dlopen)"
fi
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH-}" >>"$log"

# --- configure and build --------------------------------------------------------------------
built=0
if [ $failures -eq 0 ]; then
  note "configure ($build)"
  generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  t0=$(date +%s)
  budget_s=$(left 300)
  [ "$budget_s" -gt 180 ] && budget_s=180
  run "$budget_s" cmake --fresh -S "$src" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DTANDEM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DTANDEM_BUILD_SAMPLES=ON -DTANDEM_BUILD_BENCH=ON \
    -DTANDEM_BUILD_TESTS=ON "${cmake_deps[@]}"
  rc=$?
  if [ $rc -eq 0 ]; then
    cuda=$(grep -o 'tandem: CUDA [^ ]* found' "$log" | tail -1 | cut -d' ' -f3)
    row "configure" "ok" "CUDA ${cuda:-?}, sm_90, $(( $(date +%s) - t0 ))s"
    note "build (-j$jobs)"
    t0=$(date +%s)
    targets=()
    for t in ${TANDEM_GPU_CHECK_TARGETS:-}; do targets+=(--target "$t"); done
    # Keep about three minutes for the tests and the peers.
    budget_s=$(left 180)
    run "$budget_s" cmake --build "$build" -j"$jobs" "${targets[@]}"
    rc=$?
    warnings=$(grep -c 'warning:' "$log")
    if [ $rc -eq 0 ]; then
      built=1
      row "build" "ok" "$(( $(date +%s) - t0 ))s, -j$jobs, $warnings compiler warning(s)${TANDEM_GPU_CHECK_TARGETS:+, targets: $TANDEM_GPU_CHECK_TARGETS}"
    else
      fail_row "build" "$(why $rc "$budget_s") after $(( $(date +%s) - t0 ))s; see log.txt"
    fi
  else
    fail_row "configure" "$(why $rc "$budget_s"); see log.txt"
  fi
fi

# --- GPU test suites --------------------------------------------------------------------------
if [ $built -eq 1 ]; then
  note "GPU tests"
  # Every registered test whose name says GPU, CUDA or NCCL; later suites join by their names.
  mapfile -t tests < <(ctest --test-dir "$build" -N 2>>"$log" | sed -n 's/^ *Test *#[0-9]*: *//p' | grep -Ei 'gpu|cuda|nccl')
  [ ${#tests[@]} -eq 0 ] && fail_row "GPU tests" "ctest lists no test named gpu, cuda or nccl"
  # run_test NAME LABEL [VAR=value ...]: one table row for one suite, under the given environment.
  run_test() {
    local t=$1 label=$2
    shift 2
    if [ -n "${TANDEM_GPU_CHECK_TARGETS:-}" ] && [ ! -x "$(find "$build/tests" -name "$t" -type f 2>/dev/null | head -1)" ]; then
      row "$label" "not built" "not among TANDEM_GPU_CHECK_TARGETS"
      return
    fi
    budget_s=$(left 120)
    [ "$budget_s" -gt 300 ] && budget_s=300
    tlog=$(mktemp)
    t0=$(date +%s)
    [ $# -gt 0 ] && echo "(environment: $*)" >>"$log"
    env "$@" timeout -k 10 "$budget_s" ctest --test-dir "$build" -R "^${t}\$" -V --timeout "$budget_s" >"$tlog" 2>&1
    rc=$?
    cat "$tlog" >>"$log"
    secs=$(( $(date +%s) - t0 ))
    if grep -q 'tests passed, 0 tests failed' "$tlog" && ! grep -q '\*\*\*Skipped\|Skipped *[0-9.]* sec' "$tlog"; then
      row "$label" "passed" "${secs}s"
    elif grep -q 'Skipped' "$tlog"; then
      reason=$(grep -o 'skipped: .*' "$tlog" | head -1 | sed 's/|/\\|/g')
      row "$label" "skipped" "${reason:-exit 77}"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
      fail_row "$label" "timed out after ${budget_s}s"
    else
      fail_row "$label" "failed after ${secs}s; see log.txt"
    fi
    rm -f "$tlog"
  }
  for t in "${tests[@]}"; do
    if [ "$t" = ops_gpu_test ]; then
      # Both convolution paths against the CPU kernels: cuDNN where its plan accepts, then none.
      run_test "$t" "test $t (cuDNN where planned)"
      run_test "$t" "test $t with TANDEM_CUDNN=0 (im2col + cuBLAS)" TANDEM_CUDNN=0
    else
      run_test "$t" "test $t"
    fi
  done
fi

# --- bench_fit on the GPU, beside PyTorch eager on the same GPU --------------------------------
# bench_fit --device gpu trains mlp, wide and cnn on GPU:0 in float32 and mixed_bfloat16, with and
# without CUDA graphs, and runs
# scripts/torch_fmnist_gpu.py (PyTorch eager, float32 and bf16 autocast) in the same invocation;
# each of its rows becomes a table row with the ratio.
data=/usr/share/datasets/fashion-mnist
[ -f "$data/train-images-idx3-ubyte.gz" ] || data="$deps_root/usr/share/datasets/fashion-mnist"
note "bench_fit on the GPU"
peer_args=()
if ! LD_LIBRARY_PATH=$orig_ld_library_path timeout -k 5 60 python3 -c "import torch; assert torch.cuda.is_available()" >>"$log" 2>&1; then
  row "PyTorch eager" "not run" "python3 cannot import torch, or torch sees no GPU"
  peer_args=(--no-peer)
else
  torch_version=$(LD_LIBRARY_PATH=$orig_ld_library_path timeout -k 5 60 python3 -c "import torch; print(torch.__version__)" 2>>"$log")
  peer_args=(--gpu-peer-command "env LD_LIBRARY_PATH=$orig_ld_library_path python3 $src/scripts/torch_fmnist_gpu.py")
  row "PyTorch eager" "torch $torch_version" "same GPU, batch 128, 1 epoch, run by bench_fit beside tandem"
fi
if [ $gpu_present -eq 0 ]; then
  row "bench_fit GPU" "not run" "no GPU"
elif [ ! -f "$data/train-images-idx3-ubyte.gz" ]; then
  fail_row "bench_fit GPU" "no Fashion-MNIST in /usr/share/datasets or $deps/root (run scripts/fetch-gpu-deps.sh)"
elif [ $built -eq 1 ] && [ -x "$build/bench/bench_fit" ]; then
  budget_s=$(left 15)
  [ "$budget_s" -gt 300 ] && budget_s=300
  bench_out="$out/bench_fit_gpu.txt"
  echo "\$ bench_fit --device gpu" >>"$log"
  timeout -k 10 "$budget_s" "$build/bench/bench_fit" --device gpu --models mlp,wide,cnn --data "$data" "${peer_args[@]}" \
    >"$bench_out" 2>>"$log"
  rc=$?
  cat "$bench_out" >>"$log"
  # Rows look like: "mlp    float32         |  123456   0.8400 |  98765 |  45678   0.8300 |  2.70x  2.16x"
  while read -r m precision _ gsps acc _ esps _ tsps tacc _ ratio eratio; do
    row "bench_fit GPU $m $precision" "$gsps samples/s" "test acc $acc; without CUDA graphs $esps/s; PyTorch eager $tsps/s (acc $tacc); ratio $ratio (no graphs $eratio)"
  done < <(grep -E '^(mlp|wide|cnn) ' "$bench_out")
  [ $rc -ne 0 ] && fail_row "bench_fit GPU" "$(why $rc "$budget_s"); see log.txt"
else
  row "bench_fit GPU" "not run" "bench_fit was not built"
fi

# --- what tandem's programs report about cuDNN -------------------------------------------------
# bench_fit's GPU header has a "cuDNN: <status>" line; without a GPU run, the plan test's
# cudnn_status case prints the same status (it needs no GPU).
cudnn_status=""
[ -f "${bench_out:-/nonexistent}" ] && cudnn_status=$(sed -n 's/^cuDNN: //p' "$bench_out" | head -1)
status_source="bench_fit --device gpu"
plan_test="$build/tests/ops/ops_cudnn_plan_test"
if [ -z "$cudnn_status" ] && [ $built -eq 1 ] && [ -x "$plan_test" ]; then
  cudnn_status=$(timeout -k 5 60 "$plan_test" -tc='cudnn_status*' -s 2>>"$log" | sed -n 's/.*cudnn_status(): //p' | head -1)
  status_source="ops_cudnn_plan_test (no GPU run)"
fi
if [ -n "$cudnn_status" ]; then
  case $cudnn_status in
    loaded*) verdict="loaded" ;;
    "turned off"*) verdict="off" ;;
    "not built"*) verdict="not built" ;;
    *) verdict="not loaded" ;;
  esac
  row "cuDNN status" "$verdict" "$(echo "$cudnn_status" | sed 's/|/\\|/g'); reported by $status_source"
else
  row "cuDNN status" "not reported" "neither bench_fit --device gpu nor ops_cudnn_plan_test ran"
fi

# --- the table ------------------------------------------------------------------------------
total=$(( $(date +%s) - start ))
{
  echo "## tandem GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), git $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  echo "| item | result | detail |"
  echo "|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "$failures failure(s); ${total}s in all (budget ${budget}s)."
} >"$table"
cat "$table" | tee -a "$log"
[ $failures -eq 0 ]
