#include <mutex>

#include "tandem/base/cpu_isa.h"
#include "tandem/ops/cpu/isa.h"
#include "tandem/ops/detail/registration.h"
#include "tandem/ops/ops.h"

namespace tandem::ops {

void register_all() {
  static std::once_flag once;
  std::call_once(once, [] {
    detail::register_array_ops();
    detail::register_math_ops();
    detail::register_nn_ops();
    detail::register_conv_ops();
    cpu::isa_kernels(cpu_isa()).register_kernels();
#if TANDEM_HAVE_CUDA
    detail::register_cuda_kernels();
    detail::register_cuda_array_kernels();
#endif
  });
}

}  // namespace tandem::ops
