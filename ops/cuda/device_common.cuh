// tandem/ops/cuda/device_common.cuh — what every .cu file of ops/cuda shares: the launch grid,
// loads and stores of 16-bit types through float, and the ElementType dispatch.
//
// Included by nvcc only (kernels.cu, array_kernels.cu), after launchers.h's ElementType.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "tandem/ops/cuda/launchers.h"

namespace tandem::ops::cuda {

// Element-wise kernels run a grid-stride loop over a grid of at most kMaxBlocks blocks.
constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 65535;

inline int blocks_for(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

#define TANDEM_GRID_STRIDE(i, n) \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)

// What T computes in: 16-bit types in float (loaded exactly, rounded once when stored).
template <class T>
struct ComputeOf {
  using type = T;
};
template <>
struct ComputeOf<__half> {
  using type = float;
};
template <>
struct ComputeOf<__nv_bfloat16> {
  using type = float;
};
template <class T>
using compute_t = typename ComputeOf<T>::type;

template <class T>
__device__ __forceinline__ compute_t<T> load(const T* p, std::int64_t i) {
  return static_cast<compute_t<T>>(p[i]);
}
template <class T, class C>
__device__ __forceinline__ void store(T* p, std::int64_t i, C value) {
  if constexpr (std::is_same_v<T, __half>) {
    p[i] = __float2half_rn(static_cast<float>(value));
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    p[i] = __float2bfloat16_rn(static_cast<float>(value));
  } else {
    p[i] = static_cast<T>(value);
  }
}

// ---- Dispatch: f(static_cast<T*>(nullptr)) for the C++ type of an ElementType ----------------------

template <class F>
void with_float_type(ElementType type, F&& f) {
  switch (type) {
    case ElementType::kF32: f(static_cast<float*>(nullptr)); break;
    case ElementType::kF64: f(static_cast<double*>(nullptr)); break;
    case ElementType::kF16: f(static_cast<__half*>(nullptr)); break;
    case ElementType::kBF16: f(static_cast<__nv_bfloat16*>(nullptr)); break;
    default: break;  // the host side accepts only the types a launcher supports
  }
}
template <class F>
void with_numeric_type(ElementType type, F&& f) {
  switch (type) {
    case ElementType::kI32: f(static_cast<std::int32_t*>(nullptr)); break;
    case ElementType::kI64: f(static_cast<std::int64_t*>(nullptr)); break;
    default: with_float_type(type, f); break;
  }
}
template <class F>
void with_any_type(ElementType type, F&& f) {
  if (type == ElementType::kU8) {
    f(static_cast<std::uint8_t*>(nullptr));
  } else {
    with_numeric_type(type, f);
  }
}

}  // namespace tandem::ops::cuda
