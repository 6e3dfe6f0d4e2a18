// tandem/collective/detail/reduce_kernels.h — the element-wise reductions of the host-memory
// backends (in-process threads, shared memory between processes), and how they split a buffer
// among ranks. Not part of the public contract.
//
// Plain loops over restrict pointers: GCC vectorises each to AVX-512 under -march=native. Each
// element is combined in rank order, so every rank that reduces the same inputs gets bitwise the
// same result.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>
#include <utility>

#include "tandem/collective/communicator.h"
#include "tandem/graph/detail/low_precision_types.h"
#include "tandem/graph/dtype.h"

namespace tandem::collective::detail {

template <class T>
struct Sum {
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {  // wraps like the hardware, without signed-overflow UB
      using U = std::make_unsigned_t<T>;
      return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
    } else {
      return a + b;
    }
  }
};
template <class T>
struct Max {
  static T apply(T a, T b) { return a < b ? b : a; }
};
template <class T>
struct Min {
  static T apply(T a, T b) { return b < a ? b : a; }
};

// out = a op b.
template <class T, class Op>
void combine2(T* __restrict out, const T* __restrict a, const T* __restrict b, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = Op::apply(a[i], b[i]);
}
// acc = acc op a.
template <class T, class Op>
void combine_into(T* __restrict acc, const T* __restrict a, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) acc[i] = Op::apply(acc[i], a[i]);
}
template <class T>
void divide(T* __restrict acc, T divisor, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) acc[i] = acc[i] / divisor;
}

// The n-rank reduction works through blocks that stay in L1 with all n inputs.
constexpr std::size_t kReduceBlockBytes = 4096;

// Reduces `count` elements of inputs[0..n) into outputs[0..m) (which may be among the inputs)
// block by block, each element in rank order (((in0 op in1) op in2) ...): the block's inputs and
// the accumulator stay in L1, so the writes hit lines the reads just brought in. The in-process
// group and Gloo's rank-ordered all-reduce (ordered_all_reduce.h) share it, so that both give
// bitwise the same sums.
template <class T, class Op, bool kMean>
void reduce_blocks(const void* const* inputs, int n, void* const* outputs, int m, std::int64_t count) {
  constexpr std::int64_t kBlock = static_cast<std::int64_t>(kReduceBlockBytes / sizeof(T));
  alignas(64) T acc[kBlock];
  const auto in = [&](int q, std::int64_t base) { return static_cast<const T*>(inputs[q]) + base; };
  for (std::int64_t base = 0; base < count; base += kBlock) {
    const std::int64_t len = std::min(kBlock, count - base);
    if (n == 1) {
      std::memcpy(acc, in(0, base), static_cast<std::size_t>(len) * sizeof(T));
    } else {
      combine2<T, Op>(acc, in(0, base), in(1, base), len);
      for (int q = 2; q < n; ++q) combine_into<T, Op>(acc, in(q, base), len);
    }
    if constexpr (kMean) divide<T>(acc, static_cast<T>(n), len);
    for (int q = 0; q < m; ++q) {
      std::memcpy(static_cast<T*>(outputs[q]) + base, acc, static_cast<std::size_t>(len) * sizeof(T));
    }
  }
}

// What the host backends reduce. float16 and bfloat16 (compressed gradients) combine through
// float, rounding after each rank's contribution, as NCCL's ring does.
using ReducibleTypes = graph::TypeList<float, double, std::int32_t, std::int64_t, Eigen::half, Eigen::bfloat16>;

// Calls fn.template operator()<T, Op, kMean>() for the dtype and reduction (MEAN is a SUM that
// the caller divides when kMean).
template <class Fn>
void dispatch_reduction(DType dtype, ReduceOp op, std::string_view what, Fn&& fn) {
  graph::dispatch<ReducibleTypes>(dtype, what, [&]<class T>() {
    switch (op) {
      case ReduceOp::kSum: fn.template operator()<T, Sum<T>, false>(); break;
      case ReduceOp::kMean: fn.template operator()<T, Sum<T>, true>(); break;
      case ReduceOp::kMax: fn.template operator()<T, Max<T>, false>(); break;
      case ReduceOp::kMin: fn.template operator()<T, Min<T>, false>(); break;
    }
  });
}

// The dtypes the host backends reduce.
inline bool reducible(DType dtype) {
  return dtype == kFloat32 || dtype == kFloat64 || dtype == kInt32 || dtype == kInt64 || graph::is_low_precision(dtype);
}

// [begin, end) of part `rank` when `total` items, `align` to a part, are split `size` ways.
inline std::pair<std::int64_t, std::int64_t> part_of(std::int64_t total, int size, int rank, std::int64_t align) {
  const std::int64_t per_rank = (total + size - 1) / size;
  const std::int64_t part = (per_rank + align - 1) / align * align;
  const std::int64_t begin = std::min(total, part * rank);
  return {begin, std::min(total, begin + part)};
}

}  // namespace tandem::collective::detail
