// The doctest main of every suite. A run under TANDEM_CPU_ISA set to a level this CPU cannot
// run (tests/ops runs its suites once per level) is reported as skipped: exit code 77, which
// CTest's SKIP_RETURN_CODE turns into "Skipped". A word that is no level is left to the suite,
// whose first kernel reports it.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <fmt/format.h>

#include <optional>

#include "tandem/base/cpu_isa.h"
#include "tandem/base/errors.h"

int main(int argc, char** argv) {
  std::optional<tandem::CpuIsa> requested;
  try {
    requested = tandem::requested_cpu_isa();
  } catch (const tandem::Error&) {
  }
  if (requested && !tandem::cpu_supports(*requested)) {
    fmt::print("skipped: TANDEM_CPU_ISA={0}, and this CPU cannot run the {0} kernels (it runs: {1})\n",
               tandem::cpu_isa_name(*requested), tandem::supported_cpu_isa_names());
    return 77;
  }
  return doctest::Context(argc, argv).run();
}
