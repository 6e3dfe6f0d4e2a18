// tandem/ops/detail/slice_args.h — the block copies (block_copy.h) of Slice, SliceGrad and Concat
// from a kernel's shapes and attributes, the same for the CPU kernels (ops/cpu/array_kernels.cc)
// and the GPU ones (ops/cuda/array_cuda_kernels.cc). Host only; nothing here throws once the
// shape functions have accepted the node.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "tandem/graph/attrs.h"
#include "tandem/graph/shape.h"
#include "tandem/ops/detail/block_copy.h"

namespace tandem::ops::detail {

// Slice: y = x[begin : begin + y.shape] (the output shape resolves size -1).
inline BlockCopy slice_copy(const graph::Shape& x, const std::vector<std::int64_t>& begin, const graph::Shape& y) {
  const std::vector<std::int64_t> zeros(begin.size(), 0);
  return block_copy(y.rank(), y.dims().data(), x.dims().data(), begin.data(), y.dims().data(), zeros.data());
}

// SliceGrad: dy written into dx (zeroed first) at `begin`.
inline BlockCopy slice_grad_copy(const graph::Shape& dy, const std::vector<std::int64_t>& begin,
                                 const graph::Shape& dx) {
  const std::vector<std::int64_t> zeros(begin.size(), 0);
  return block_copy(dy.rank(), dy.dims().data(), dy.dims().data(), zeros.data(), dx.dims().data(), begin.data());
}

// Concat: each input's copy into y, in input order, along the node's axis.
inline std::vector<BlockCopy> concat_copies(const graph::Attrs& attrs, std::string_view label,
                                            const std::vector<graph::Shape>& inputs, const graph::Shape& y) {
  const int rank = y.rank();
  const auto axis =
      static_cast<std::size_t>(graph::normalize_axis(static_cast<int>(attrs.get_int("axis")), rank, label));
  std::vector<std::int64_t> zeros(static_cast<std::size_t>(rank), 0), at(static_cast<std::size_t>(rank), 0);
  std::vector<BlockCopy> copies;
  for (const auto& x : inputs) {
    copies.push_back(block_copy(rank, x.dims().data(), x.dims().data(), zeros.data(), y.dims().data(), at.data()));
    at[axis] += x[static_cast<int>(axis)];
  }
  return copies;
}

}  // namespace tandem::ops::detail
