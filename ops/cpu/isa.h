// tandem/ops/cpu/isa.h — the CPU kernels are built once per instruction-set level
// (base/cpu_isa.h): every source that ops/CMakeLists.txt gives tandem_add_cpu_isa_levels is
// compiled with each level's flags and with TANDEM_CPU_ISA_NS naming that level's namespace
// (isa_baseline, isa_avx2, isa_avx512). Each level's objects are then linked into one object whose
// symbols, all but those in its own namespace, are renamed with the level as a prefix
// (cmake/TandemCpuIsaObject.cmake): an inline or template function (Eigen's, the standard
// library's, our headers') compiled with AVX-512 can then never be merged by the linker with the
// baseline copy that the rest of tandem calls. Only the entry points below cross between levels,
// through the table of the level cpu_isa() chose (ops/register.cc).
#pragma once

#include <cstdint>
#include <type_traits>

#include "tandem/base/cpu_isa.h"
#include "tandem/devices/device.h"
#include "tandem/ops/cpu/conv_direct.h"
#include "tandem/ops/cpu/conv_geometry.h"
#include "tandem/ops/cpu/gemm_tiles.h"
#include "tandem/ops/detail/update_rules.h"

namespace tandem::ops::cpu {

// The optimizers' update loops over elements [b, e) of a variable (keras_like/optimizers.cc).
// Slots that an option leaves out (momentum, AMSGrad's v_hat, ...) are null.
template <class T>
struct UpdateLoops {
  void (*sgd)(T* var, T* momentum, const T* g, std::int64_t b, std::int64_t e, detail::SgdStep<T>,
              detail::GradientTransform<T>);
  void (*rmsprop)(T* var, T* velocity, T* momentum, T* average, const T* g, std::int64_t b, std::int64_t e,
                  detail::RmspropStep<T>, detail::GradientTransform<T>);
  void (*adam)(T* var, T* m, T* v, T* v_hat, const T* g, std::int64_t b, std::int64_t e, detail::AdamStep<T>,
               detail::GradientTransform<T>);
};

// One level's entry points.
struct IsaKernels {
  CpuIsa isa;
  // Registers this level's CPU kernels for every op (once per process).
  void (*register_kernels)();
  // The direct convolutions (cpu/conv_direct.h), for the tests that compare levels.
  bool (*conv2d_forward)(devices::Device&, const detail::Window2DGeometry&, const float*, const float*, float*,
                         direct::ForwardEpilogue);
  bool (*conv2d_backprop_filter)(devices::Device&, const detail::Window2DGeometry&, const float*, const float*, float*);
  bool (*conv2d_backprop_input)(devices::Device&, const detail::Window2DGeometry&, const float*, const float*, float*);
  // The float32 register-tile GEMM (cpu/gemm_tiles.h): gemm() and gemm_serial() call it through
  // this table.
  bool (*gemm_tiles)(devices::Device&, const GemmShape&, const float*, const float*, float*, const tiles::BlockDone*);
  bool (*gemm_tiles_serial)(const GemmShape&, const float*, const float*, float*);
  UpdateLoops<float> update_f32;
  UpdateLoops<double> update_f64;
};

// The table of `isa`'s build. Throws FailedPrecondition when this CPU cannot run it, and
// Unimplemented when the build has no such level (non-x86 builds have only the baseline).
const IsaKernels& isa_kernels(CpuIsa isa);
// The table of the level this process runs (tandem::cpu_isa()).
const IsaKernels& current_isa_kernels();

template <class T>
const UpdateLoops<T>& update_loops() {
  if constexpr (std::is_same_v<T, float>) {
    return current_isa_kernels().update_f32;
  } else {
    return current_isa_kernels().update_f64;
  }
}

#if defined(TANDEM_CPU_ISA_NS)
// Inside one level's build: its kernel families' registration (cpu/*_kernels.cc) and its table
// (cpu/isa_entry.cc).
namespace TANDEM_CPU_ISA_NS {
void register_array_kernels();
void register_math_kernels();
void register_nn_kernels();
void register_conv_kernels();
template <class T>
UpdateLoops<T> update_loops();
const IsaKernels& kernels();
}  // namespace TANDEM_CPU_ISA_NS
#endif

}  // namespace tandem::ops::cpu
