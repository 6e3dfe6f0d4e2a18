// tandem/ops/cpu/broadcast.h — index arithmetic for broadcasting and reductions.
//
// A broadcast is described by the output's dimensions and, per input, a stride per dimension
// (0 where the input is stretched). Adjacent dimensions that move the same way in every operand
// are merged first, so that most real cases (same shape, scalar, row vector) become rank 1 or 2
// and the innermost loop runs over a contiguous run with unit or zero stride.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "tandem/graph/shape.h"

namespace tandem::ops::cpu {

inline constexpr int kMaxOperands = 3;

struct BroadcastLayout {
  int rank = 0;
  std::array<std::int64_t, graph::Shape::kMaxRank> dims{};
  // strides[k][d]: element stride of operand k along output dimension d (0 when broadcast).
  std::array<std::array<std::int64_t, graph::Shape::kMaxRank>, kMaxOperands> strides{};
  int operands = 0;
  std::int64_t num_elements() const;
};

// Layout of `out` against up to three input shapes (each broadcastable to out).
BroadcastLayout make_broadcast_layout(const graph::Shape& out, std::initializer_list<const graph::Shape*> inputs);

// Calls run(out_offset, count, offsets[kMaxOperands], inner_strides[kMaxOperands]) for each
// contiguous run of the innermost dimension within output elements [begin, end).
template <class Run>
void for_each_run(const BroadcastLayout& layout, std::int64_t begin, std::int64_t end, Run&& run) {
  if (begin >= end) return;
  const int rank = layout.rank;
  if (rank == 0) {
    std::array<std::int64_t, kMaxOperands> offsets{};
    std::array<std::int64_t, kMaxOperands> inner{};
    run(std::int64_t{0}, std::int64_t{1}, offsets, inner);
    return;
  }
  const std::int64_t inner_dim = layout.dims[static_cast<std::size_t>(rank - 1)];
  // Multi-index of `begin`.
  std::array<std::int64_t, graph::Shape::kMaxRank> index{};
  std::int64_t rest = begin;
  for (int d = rank - 1; d >= 0; --d) {
    const auto du = static_cast<std::size_t>(d);
    index[du] = rest % layout.dims[du];
    rest /= layout.dims[du];
  }
  std::array<std::int64_t, kMaxOperands> inner{};
  for (int k = 0; k < layout.operands; ++k)
    inner[static_cast<std::size_t>(k)] =
        layout.strides[static_cast<std::size_t>(k)][static_cast<std::size_t>(rank - 1)];
  std::int64_t position = begin;
  while (position < end) {
    std::array<std::int64_t, kMaxOperands> offsets{};
    for (int k = 0; k < layout.operands; ++k) {
      std::int64_t o = 0;
      for (int d = 0; d < rank; ++d)
        o += index[static_cast<std::size_t>(d)] *
             layout.strides[static_cast<std::size_t>(k)][static_cast<std::size_t>(d)];
      offsets[static_cast<std::size_t>(k)] = o;
    }
    const std::int64_t count = std::min(inner_dim - index[static_cast<std::size_t>(rank - 1)], end - position);
    run(position, count, offsets, inner);
    position += count;
    // Advance the multi-index past this run.
    index[static_cast<std::size_t>(rank - 1)] += count;
    for (int d = rank - 1; d > 0 && index[static_cast<std::size_t>(d)] == layout.dims[static_cast<std::size_t>(d)];
         --d) {
      index[static_cast<std::size_t>(d)] = 0;
      ++index[static_cast<std::size_t>(d - 1)];
    }
  }
}

// A reduction over some axes of `in`, viewed as [outer, reduce, inner] when the reduced axes
// are contiguous (after merging adjacent dimensions of the same kind).
struct ReductionLayout {
  bool contiguous = false;
  std::int64_t outer = 1, reduce = 1, inner = 1;  // when contiguous
  // General case: for every input element, its output offset (strides over input dims).
  graph::Shape in_shape;
  std::array<std::int64_t, graph::Shape::kMaxRank> out_strides{};
  std::int64_t out_elements = 1;
};

// axes: sorted, unique, normalised.
ReductionLayout make_reduction_layout(const graph::Shape& in, const std::vector<int>& axes);

// The shape of the reduction's result with every reduced axis kept as 1.
graph::Shape keep_dims_shape(const graph::Shape& in, const std::vector<int>& axes);

}  // namespace tandem::ops::cpu
