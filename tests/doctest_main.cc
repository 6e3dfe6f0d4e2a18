// The doctest main of every suite. A run under TANDEM_CPU_ISA set to a level this CPU cannot
// run (tests/ops runs its suites once per level) is reported as skipped: exit code 77, which
// CTest's SKIP_RETURN_CODE turns into "Skipped".
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string_view>

#include "tandem/base/cpu_isa.h"

int main(int argc, char** argv) {
  std::string_view requested;
  if (tandem::cpu_isa_requested_but_unsupported(&requested)) {
    std::printf("skipped: TANDEM_CPU_ISA=%.*s, and this CPU cannot run the %.*s kernels (best: %.*s)\n",
                static_cast<int>(requested.size()), requested.data(), static_cast<int>(requested.size()),
                requested.data(), static_cast<int>(tandem::cpu_isa_name(tandem::best_cpu_isa()).size()),
                tandem::cpu_isa_name(tandem::best_cpu_isa()).data());
    return 77;
  }
  return doctest::Context(argc, argv).run();
}
