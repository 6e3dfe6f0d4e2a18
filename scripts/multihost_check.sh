#!/usr/bin/env bash
# The multi-host checks on demand (tests/multihost/multihost_test.sh says what each case checks):
# two hosts as network namespaces, each running tandem-run, under kills, freezes, partitions and
# a world-size mismatch; N random kills (default 20: the issue's acceptance run) that must each
# end with weights bitwise equal to an uninterrupted run; the round trips per step over a link
# with a 50 ms one-way delay. Needs root; builds the three programs it runs first.
#
#   scripts/multihost_check.sh                          # every case, N=20 kills
#   N=5 scripts/multihost_check.sh --suite soak         # 5 random kills (--seed S repeats a run)
#   scripts/multihost_check.sh --case freeze-chief-2x2 --keep
#   MH_MAX_ROUND_TRIPS=1.5 scripts/multihost_check.sh --suite latency
#
# Arguments go to multihost_test.sh (default: --suite all); the build is TANDEM_BUILD_DIR or build/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${TANDEM_BUILD_DIR:-$root/build}
[[ -f $build/CMakeCache.txt ]] || "$root/scripts/build.sh"
cmake --build "$build" --target tandem-run multi_worker_trainer delay_relay
(($#)) || set -- --suite all
exec bash "$root/tests/multihost/multihost_test.sh" --tandem-run "$build/tools/tandem-run" \
  --trainer "$build/tests/strategy/multi_worker_trainer" --relay "$build/tests/multihost/delay_relay" "$@"
