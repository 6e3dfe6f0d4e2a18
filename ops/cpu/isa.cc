// Which level's kernels a process uses (cpu/isa.h): the tables of the levels this build has.
#include "tandem/ops/cpu/isa.h"

#include "tandem/base/errors.h"

namespace tandem::ops::cpu {

namespace isa_baseline {
const IsaKernels& kernels();
}
#if TANDEM_CPU_ISA_VARIANTS
namespace isa_avx2 {
const IsaKernels& kernels();
}
namespace isa_avx512 {
const IsaKernels& kernels();
}
#endif

const IsaKernels& isa_kernels(CpuIsa isa) {
  TANDEM_REQUIRE(cpu_supports(isa), FailedPrecondition, "this CPU cannot run the {} kernels (the best it runs: {})",
                 cpu_isa_name(isa), cpu_isa_name(best_cpu_isa()));
  switch (isa) {
    case CpuIsa::kBaseline: return isa_baseline::kernels();
#if TANDEM_CPU_ISA_VARIANTS
    case CpuIsa::kAvx2: return isa_avx2::kernels();
    case CpuIsa::kAvx512: return isa_avx512::kernels();
#endif
    default: break;
  }
  throw Unimplemented(
      fmt::format("this build of tandem has no {} kernels (only baseline: not an x86-64 build)", cpu_isa_name(isa)));
}

const IsaKernels& current_isa_kernels() {
  static const IsaKernels& table = isa_kernels(cpu_isa());
  return table;
}

}  // namespace tandem::ops::cpu
