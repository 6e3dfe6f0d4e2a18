// tandem/ops/cpu/kernel_util.h — helpers shared by the CPU kernels.
#pragma once

#include <Eigen/Core>
#include <cstdint>

#include "tandem/graph/op_registry.h"

namespace tandem::ops::cpu {

using graph::DType;
using graph::KernelContext;
using graph::Tensor;

// Below this many elements an element-wise kernel runs on one thread: waking another costs more
// than it saves (a wake-up is ~10 us; a core streams ~4K floats per us).
inline constexpr std::int64_t kElementwiseGrain = 32 * 1024;
// Rows per chunk floor for row-wise kernels (softmax, bias gradients): at least this many
// elements per chunk, expressed through the row length.
inline std::int64_t row_grain(std::int64_t row_length) {
  return std::max<std::int64_t>(1, kElementwiseGrain / std::max<std::int64_t>(1, row_length));
}

template <class T>
using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>, Eigen::Unaligned>;
template <class T>
using ConstArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>, Eigen::Unaligned>;
template <class T>
using MatrixMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, Eigen::Unaligned>;
template <class T>
using ConstMatrixMap =
    Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, Eigen::Unaligned>;

// An Eigen array view of [begin, end) of a tensor's elements.
template <class T>
ArrayMap<T> array_slice(const Tensor& t, std::int64_t begin, std::int64_t end) {
  return ArrayMap<T>(static_cast<T*>(t.raw_data()) + begin, end - begin);
}
template <class T>
ConstArrayMap<T> const_array_slice(const Tensor& t, std::int64_t begin, std::int64_t end) {
  return ConstArrayMap<T>(static_cast<const T*>(t.raw_data()) + begin, end - begin);
}

// Runs fn(begin, end) over [0, n) elements on the device's threads.
template <class F>
void parallel_elements(KernelContext& ctx, std::int64_t n, F&& fn) {
  ctx.device().parallel_for(n, kElementwiseGrain, fn);
}

template <class T>
const T* in_ptr(KernelContext& ctx, int i) {
  return static_cast<const T*>(ctx.input(i).raw_data());
}
template <class T>
T* out_ptr(KernelContext& ctx, int i) {
  return static_cast<T*>(ctx.output(i).raw_data());
}

}  // namespace tandem::ops::cpu
