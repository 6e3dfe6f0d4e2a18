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

void register_array_cpu_kernels();
void register_math_cpu_kernels();
void register_nn_cpu_kernels();
void register_conv_cpu_kernels();
// CUDA builds only (ops/cuda/cuda_kernels.cc).
void register_cuda_kernels();
// CUDA builds only (ops/cuda/array_cuda_kernels.cc): BatchMatMul, Gather, UnsortedSegmentSum,
// Slice, SliceGrad, Concat.
void register_cuda_array_kernels();

}  // namespace tandem::ops::detail
