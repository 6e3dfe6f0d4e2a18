// tandem/base/cpu_isa.h — which build of the CPU kernels this process runs.
//
// The CPU kernels (ops/cpu/) are compiled once per instruction-set level and linked side by side:
//   baseline  x86-64 (SSE2): runs on every x86-64 CPU; the only level on other architectures
//   avx2      AVX2 + FMA + F16C (Haswell, Zen 1 and later)
//   avx512    AVX-512 F/BW/DQ/VL on top of avx2 (Skylake-SP, Ice Lake, Sapphire Rapids, Zen 4/5)
// The rest of tandem is compiled for the baseline (unless built with TANDEM_NATIVE_ARCH=ON), so one
// binary runs anywhere and still uses the widest vectors the CPU has. The level is chosen once per
// process, at the first call of cpu_isa(): TANDEM_CPU_ISA when set, else the newest this CPU and
// its operating system support (AVX-512 needs the OS to save the ZMM registers; cpuid alone is not
// enough, so the checks below go through the compiler's runtime, which reads XGETBV as well).
//
// Callers: ops/register.cc (which kernels to register), benchmarks and samples (to print the
// path), tests (to run every level the machine has). Nothing here blocks; cpu_isa() throws
// FailedPrecondition, naming TANDEM_CPU_ISA and the CPU's levels, when the variable asks for a
// level this CPU cannot run, and InvalidArgument when it names none of the levels. The test main
// asks requested_cpu_isa() first and reports a run under a level the CPU lacks as skipped.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

enum class CpuIsa { kBaseline, kAvx2, kAvx512 };

// "baseline", "avx2", "avx512" (TANDEM_CPU_ISA's words).
std::string_view cpu_isa_name(CpuIsa isa);
// Whether this CPU (and OS) can run the kernels compiled for `isa`.
bool cpu_supports(CpuIsa isa);
// The levels this CPU can run, oldest first (always starts with kBaseline).
std::vector<CpuIsa> supported_cpu_isas();
// The newest level this CPU can run.
CpuIsa best_cpu_isa();
// The level the CPU kernels of this process use (see above); the same on every call.
CpuIsa cpu_isa();
// "baseline, avx2, avx512": the levels this CPU can run, for messages and reports.
std::string supported_cpu_isa_names();
// The level TANDEM_CPU_ISA names, whether or not this CPU supports it; nullopt when it is unset or
// "auto". Throws InvalidArgument, naming the variable, for a word that is no level.
std::optional<CpuIsa> requested_cpu_isa();

}  // namespace tandem
