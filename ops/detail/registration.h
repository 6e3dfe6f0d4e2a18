// tandem/ops/detail/registration.h — what register_all() calls, one pair per op family.
//
// Definitions (shape and gradient functions) and kernels register separately, so that a new
// backend adds kernels for existing definitions.
#pragma once

namespace tandem::ops::detail {

void register_array_ops();
void register_math_ops();
void register_nn_ops();
void register_conv_ops();

// The CPU kernels register through the table of the instruction-set level the process runs
// (ops/cpu/isa.h).
// CUDA builds only (ops/cuda/cuda_kernels.cc).
void register_cuda_kernels();
// CUDA builds only (ops/cuda/array_cuda_kernels.cc): BatchMatMul, Gather, UnsortedSegmentSum,
// Slice, SliceGrad, Concat.
void register_cuda_array_kernels();

}  // namespace tandem::ops::detail
