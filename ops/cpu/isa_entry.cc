// One level's table of entry points (cpu/isa.h); compiled once per level like the kernels.
#include "tandem/ops/cpu/conv_direct.h"
#include "tandem/ops/cpu/gemm_tiles.h"
#include "tandem/ops/cpu/isa.h"

namespace tandem::ops::cpu::TANDEM_CPU_ISA_NS {
namespace {

void register_kernels() {
  register_array_kernels();
  register_math_kernels();
  register_nn_kernels();
  register_conv_kernels();
}

}  // namespace

const IsaKernels& kernels() {
  static const IsaKernels table{.isa = TANDEM_CPU_ISA_LEVEL,
                                .register_kernels = &register_kernels,
                                .conv2d_forward = &direct::conv2d_forward,
                                .conv2d_backprop_filter = &direct::conv2d_backprop_filter,
                                .conv2d_backprop_input = &direct::conv2d_backprop_input,
                                .gemm_tiles = &tiles::gemm,
                                .gemm_tiles_serial = &tiles::gemm_serial,
                                .update_f32 = update_loops<float>(),
                                .update_f64 = update_loops<double>()};
  return table;
}

}  // namespace tandem::ops::cpu::TANDEM_CPU_ISA_NS
