// tandem/ops/cuda/cublas.h — matrix products on GPUs through cuBLAS, loaded with dlopen.
//
// Like NCCL, libcublas is loaded at first use rather than linked: a CUDA build of libtandem then
// starts (and reports zero GPUs, or runs its CPU paths) where cuBLAS is missing, and the binary
// carries no 100 MB dependency it may never use.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "tandem/graph/dtype.h"

namespace tandem::ops::cuda {

// Row-major C[m, n] = op(A) op(B) on `stream` of CUDA device `device`, where op(A) is [m, k]
// (A stored [k, m] when transpose_a) and op(B) is [k, n]; lda / ldb are the stored row lengths.
// float32 computes in float32 unless TF32 is enabled (tensor_float_32_execution_enabled()),
// float16 and bfloat16 accumulate in float32, float64 in float64. Throws FailedPrecondition when
// cuBLAS cannot be loaded, Internal when a call fails (with cuBLAS's status name).
// With batch > 1, `batch` such products in one strided-batched call: product i reads A at a +
// i * stride_a elements and B at b + i * stride_b (a stride of 0 shares the operand), and writes C
// at c + i * m * n.
struct GemmCall {
  graph::DType dtype = graph::DType::kF32;
  bool transpose_a = false, transpose_b = false;
  std::int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  std::int64_t batch = 1, stride_a = 0, stride_b = 0;
};
void gemm(int device, const std::string& device_name, cudaStream_t stream, const GemmCall& call);

}  // namespace tandem::ops::cuda
