#!/usr/bin/env bash
# Builds the libFuzzer harnesses (tests/fuzz/) with clang++, ASan and UBSan in their own build
# folder, and runs each for SECONDS (default 30), starting from its committed corpus.
#
#   scripts/fuzz.sh                  # every fuzzer, 30 s each
#   scripts/fuzz.sh 600              # 10 minutes each
#   scripts/fuzz.sh -j 2 600 idx csv # two at a time, only these
#
# New inputs that reach new code go to BUILD/fuzz-corpus/<name>/ (not committed); a crash, a
# sanitizer report or a leak stops that fuzzer and leaves the input in
# BUILD/fuzz-artifacts/<name>/, to be fixed and committed to tests/fuzz/corpus/<name>/ as a
# regression seed. Prints one line per fuzzer (executions, coverage) and exits 1 if any failed.
# Without clang++ and libFuzzer (Debian: clang, libclang-rt-14-dev) it reports "skipped" and
# exits 0. BUILD is $TANDEM_FUZZ_BUILD_DIR, default build-fuzz/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${TANDEM_FUZZ_BUILD_DIR:-$root/build-fuzz}

jobs=1
if [ "${1:-}" = "-j" ]; then
  jobs=$2
  shift 2
fi
seconds=${1:-30}
shift $(( $# > 0 ? 1 : 0 ))

# libFuzzer is in Debian's libclang-rt-14-dev; clang alone links no fuzzer.
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' > "$probe/p.cc"
if ! command -v clang++ >/dev/null ||
   ! clang++ -fsanitize=fuzzer,address,undefined "$probe/p.cc" -o "$probe/p" 2>/dev/null; then
  echo "fuzz: skipped: clang++ with libFuzzer is not installed (Debian: clang libclang-rt-14-dev)"
  exit 0
fi

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
    -DTANDEM_FUZZ=ON -DTANDEM_CUDA=OFF -DTANDEM_BUILD_SAMPLES=OFF -DTANDEM_BUILD_BENCH=OFF "${launcher[@]}" >/dev/null
fi
cmake --build "$build" --target fuzzers -j "${TANDEM_BUILD_JOBS:-$(( $(nproc) + 1 ))}"

names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  mapfile -t names < "$build/tests/fuzz/fuzzers.txt"
fi

# One fuzzer: its log in BUILD/fuzz-logs/<name>.log.
run_one() {
  local name=$1 work=$build/fuzz-corpus/$1 artifacts=$build/fuzz-artifacts/$1/
  mkdir -p "$work" "$artifacts" "$build/fuzz-logs"
  # -rss_limit_mb: any input that makes a reader take 2 GB is a finding (a header's sizes must be
  # checked before allocating); -timeout: one input running 25 s is one too.
  "$build/tests/fuzz/fuzz_$name" -max_total_time="$seconds" -print_final_stats=1 -timeout=25 \
    -rss_limit_mb=2048 -artifact_prefix="$artifacts" "$work" "$root/tests/fuzz/corpus/$name" \
    > "$build/fuzz-logs/$name.log" 2>&1
}

# A finished fuzzer's summary line.
report() {
  local name=$1 status=$2 log=$build/fuzz-logs/$1.log
  local execs cov
  execs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | grep -o '[0-9]*$' || true)
  cov=$(grep -o 'cov: [0-9]* ft: [0-9]* corp: [0-9]*/[^ ]*' "$log" | tail -1 || true)
  if [ "$status" -eq 0 ]; then
    printf 'fuzz: %-18s ok      %s s, %s executions, %s\n' "$name" "$seconds" "${execs:-?}" "${cov:-?}"
  else
    printf 'fuzz: %-18s FAILED  (status %s) %s\n' "$name" "$status" "$(grep -m1 -E 'ERROR|fuzz check failed|deadly' "$log" || true)"
    grep -o "Test unit written to .*" "$log" | sed 's/^/fuzz:   /' || true
    echo "fuzz:   log: $log"
  fi
}

failed=0
declare -A running=()
for name in "${names[@]}"; do
  [ -x "$build/tests/fuzz/fuzz_$name" ] || { echo "fuzz: no fuzzer named $name"; failed=1; continue; }
  while [ ${#running[@]} -ge "$jobs" ]; do
    status=0
    wait -n -p done "${!running[@]}" || status=$?
    report "${running[$done]}" "$status"
    [ "$status" -eq 0 ] || failed=1
    unset "running[$done]"
  done
  run_one "$name" &
  running[$!]=$name
done
for pid in "${!running[@]}"; do
  status=0
  wait "$pid" || status=$?
  report "${running[$pid]}" "$status"
  [ "$status" -eq 0 ] || failed=1
done
exit $failed
