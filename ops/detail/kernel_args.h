// tandem/ops/detail/kernel_args.h — how kernels read the shapes and attributes every backend needs
// the same way: reduction axes, SumToShape's axes, the [rows, columns] view of row-wise ops.
// Shared by the CPU kernels (ops/cpu/) and the GPU kernels (ops/cuda/cuda_kernels.cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "tandem/graph/attrs.h"
#include "tandem/graph/shape.h"

namespace tandem::ops::detail {

// A reduction node's axes, non-negative and sorted; every axis when the attribute is empty.
inline std::vector<int> reduction_axes(const graph::Attrs& attrs, int rank) {
  const auto& axes = attrs.get<std::vector<std::int64_t>>("axes");
  std::vector<int> out;
  if (axes.empty()) {
    for (int d = 0; d < rank; ++d) out.push_back(d);
    return out;
  }
  for (auto a : axes) out.push_back(static_cast<int>(a < 0 ? a + rank : a));
  std::sort(out.begin(), out.end());
  return out;
}

// The axes SumToShape(x, like) sums: those broadcasting added or stretched.
inline std::vector<int> sum_to_shape_axes(const graph::Shape& x, const graph::Shape& like) {
  std::vector<int> axes;
  for (int d = 0; d < x.rank(); ++d) {
    const int dl = d - (x.rank() - like.rank());
    if (dl < 0 || (like[dl] == 1 && x[d] != 1)) axes.push_back(d);
  }
  return axes;
}

// A tensor seen as [elements / last dimension, last dimension] (softmax, bias, batch norm).
struct RowsCols {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
};
inline RowsCols rows_cols(const graph::Shape& shape) {
  const std::int64_t cols = shape.rank() == 0 ? 1 : shape.dim(-1);
  return {cols > 0 ? shape.num_elements() / cols : 0, cols};
}

}  // namespace tandem::ops::detail
