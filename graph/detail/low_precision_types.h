// tandem/graph/detail/low_precision_types.h — the C++ types of float16 and bfloat16.
//
// Eigen's half and bfloat16 are 2-byte types with arithmetic through float, rounding to nearest
// even: exactly the storage of DType::kF16 / kBF16. They live here rather than in dtype.h so
// that Eigen stays out of the public headers; kernels and tests include this one.
#pragma once

#include <Eigen/Core>

#include "tandem/graph/dtype.h"

namespace tandem::graph {

using float16 = Eigen::half;
using bfloat16 = Eigen::bfloat16;
static_assert(sizeof(float16) == 2 && sizeof(bfloat16) == 2);

template <>
struct DTypeOf<Eigen::half> {
  static constexpr DType value = DType::kF16;
};
template <>
struct DTypeOf<Eigen::bfloat16> {
  static constexpr DType value = DType::kBF16;
};

using LowPrecisionTypes = TypeList<Eigen::half, Eigen::bfloat16>;
// Every floating type, for kernels with their own 16-bit code.
using AllFloatTypes = TypeList<float, double, Eigen::half, Eigen::bfloat16>;
// Every dtype, for kernels that only move or convert elements (Cast).
using EveryType = TypeList<float, double, std::int32_t, std::int64_t, std::uint8_t, Eigen::half, Eigen::bfloat16>;

// The type a kernel accumulates T in: float for the 16-bit types.
template <class T>
struct AccumulatorOf {
  using type = T;
};
template <>
struct AccumulatorOf<Eigen::half> {
  using type = float;
};
template <>
struct AccumulatorOf<Eigen::bfloat16> {
  using type = float;
};
template <class T>
using accumulator_t = typename AccumulatorOf<T>::type;

}  // namespace tandem::graph
