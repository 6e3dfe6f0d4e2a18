#include "tandem/base/cpu_isa.h"

#include <array>
#include <string>

#include "tandem/base/env.h"
#include "tandem/base/errors.h"
#include "tandem/base/log.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace tandem {
namespace {

constexpr std::array<CpuIsa, 3> kAllIsas = {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512};

#if defined(__x86_64__) || defined(_M_X64)
constexpr bool kX86 = true;
#else
constexpr bool kX86 = false;
#endif

// The flags each level's kernels are compiled with (ops/CMakeLists.txt) must all be checked here:
// a kernel built with -mf16c dies with SIGILL on a CPU with AVX2 but no F16C.
bool supports_avx2() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  // F16C from CPUID itself (clang's __builtin_cpu_supports does not know it); the AVX2 check
  // already covers the OS's saving of the YMM registers, which F16C needs too.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
#else
  return false;
#endif
}

bool supports_avx512() {
#if defined(__x86_64__)
  return supports_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

CpuIsa parse_level(std::string_view word) {
  for (CpuIsa isa : kAllIsas) {
    if (cpu_isa_name(isa) == word) return isa;
  }
  TANDEM_ASSERT(false, "TANDEM_CPU_ISA choice '{}' has no level", word);
  return CpuIsa::kBaseline;
}

CpuIsa choose_cpu_isa() {
  const std::optional<CpuIsa> requested = requested_cpu_isa();
  if (!requested) return best_cpu_isa();
  const std::string_view name = cpu_isa_name(*requested);
  TANDEM_REQUIRE(cpu_supports(*requested), FailedPrecondition,
                 "environment variable {}={}: this CPU cannot run the {} kernels (it supports: {})", env::kCpuIsa.name,
                 name, name, supported_cpu_isa_names());
  return *requested;
}

}  // namespace

std::string_view cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline: return "baseline";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "?";
}

bool cpu_supports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline: return true;
    case CpuIsa::kAvx2: return kX86 && supports_avx2();
    case CpuIsa::kAvx512: return kX86 && supports_avx512();
  }
  return false;
}

std::vector<CpuIsa> supported_cpu_isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : kAllIsas) {
    if (cpu_supports(isa)) isas.push_back(isa);
  }
  return isas;
}

CpuIsa best_cpu_isa() { return supported_cpu_isas().back(); }

std::string supported_cpu_isa_names() {
  std::string names;
  for (CpuIsa isa : supported_cpu_isas()) names += fmt::format("{}{}", names.empty() ? "" : ", ", cpu_isa_name(isa));
  return names;
}

std::optional<CpuIsa> requested_cpu_isa() {
  const std::string word = env::get_string(env::kCpuIsa);
  if (word == "auto") return std::nullopt;
  return parse_level(word);
}

CpuIsa cpu_isa() {
  // Decided once: kernels registered for one level must not be mixed with another's.
  static const CpuIsa chosen = [] {
    const CpuIsa isa = choose_cpu_isa();
    logging::debug("CPU kernels: the {} build (this CPU supports: {}; {}={})", cpu_isa_name(isa),
                   supported_cpu_isa_names(), env::kCpuIsa.name, env::get_string(env::kCpuIsa));
    return isa;
  }();
  return chosen;
}

}  // namespace tandem
