#include "tandem/ops/cpu/broadcast.h"

#include <algorithm>

#include "tandem/base/errors.h"

namespace tandem::ops::cpu {

std::int64_t BroadcastLayout::num_elements() const {
  std::int64_t n = 1;
  for (int d = 0; d < rank; ++d) n *= dims[static_cast<std::size_t>(d)];
  return n;
}

BroadcastLayout make_broadcast_layout(const graph::Shape& out, std::initializer_list<const graph::Shape*> inputs) {
  TANDEM_ASSERT(static_cast<int>(inputs.size()) <= kMaxOperands, "too many broadcast operands");
  BroadcastLayout full;
  full.rank = out.rank();
  full.operands = static_cast<int>(inputs.size());
  for (int d = 0; d < out.rank(); ++d) full.dims[static_cast<std::size_t>(d)] = out[d];
  int k = 0;
  for (const graph::Shape* in : inputs) {
    std::int64_t stride = 1;
    for (int d = out.rank() - 1; d >= 0; --d) {
      const int di = in->rank() - out.rank() + d;
      const std::int64_t size = di >= 0 ? (*in)[di] : 1;
      TANDEM_ASSERT(size == out[d] || size == 1, "shape {} does not broadcast to {}", *in, out);
      full.strides[static_cast<std::size_t>(k)][static_cast<std::size_t>(d)] = size == 1 ? 0 : stride;
      stride *= size;
    }
    ++k;
  }
  // Drop size-1 dimensions, then merge neighbours that every operand walks contiguously.
  BroadcastLayout merged;
  merged.operands = full.operands;
  for (int d = 0; d < full.rank; ++d) {
    const auto du = static_cast<std::size_t>(d);
    if (full.dims[du] == 1) continue;
    if (merged.rank > 0) {
      const auto last = static_cast<std::size_t>(merged.rank - 1);
      bool can_merge = true;
      for (int o = 0; o < full.operands; ++o) {
        const auto ou = static_cast<std::size_t>(o);
        const std::int64_t outer_stride = merged.strides[ou][last];
        const std::int64_t inner_stride = full.strides[ou][du];
        const bool both_broadcast = outer_stride == 0 && inner_stride == 0;
        const bool contiguous = outer_stride == inner_stride * full.dims[du] && inner_stride != 0;
        can_merge &= both_broadcast || contiguous;
      }
      if (can_merge) {
        merged.dims[last] *= full.dims[du];
        for (int o = 0; o < full.operands; ++o) {
          merged.strides[static_cast<std::size_t>(o)][last] = full.strides[static_cast<std::size_t>(o)][du];
        }
        continue;
      }
    }
    const auto m = static_cast<std::size_t>(merged.rank++);
    merged.dims[m] = full.dims[du];
    for (int o = 0; o < full.operands; ++o)
      merged.strides[static_cast<std::size_t>(o)][m] = full.strides[static_cast<std::size_t>(o)][du];
  }
  if (merged.rank == 0 && out.num_elements() == 1) {
    merged.rank = 1;
    merged.dims[0] = 1;
  }
  if (out.num_elements() == 0) {  // an empty output: nothing to iterate
    merged.rank = 1;
    merged.dims[0] = 0;
  }
  return merged;
}

graph::Shape keep_dims_shape(const graph::Shape& in, const std::vector<int>& axes) {
  graph::Shape out;
  for (int d = 0; d < in.rank(); ++d) out.push_back(std::binary_search(axes.begin(), axes.end(), d) ? 1 : in[d]);
  return out;
}

ReductionLayout make_reduction_layout(const graph::Shape& in, const std::vector<int>& axes) {
  ReductionLayout layout;
  layout.in_shape = in;
  // Groups of adjacent dimensions of the same kind, ignoring size-1 dimensions.
  struct Group {
    bool reduced;
    std::int64_t size;
  };
  std::vector<Group> groups;
  for (int d = 0; d < in.rank(); ++d) {
    if (in[d] == 1) continue;
    const bool reduced = std::binary_search(axes.begin(), axes.end(), d);
    if (!groups.empty() && groups.back().reduced == reduced) {
      groups.back().size *= in[d];
    } else {
      groups.push_back({reduced, in[d]});
    }
  }
  const std::size_t reduced_groups =
      static_cast<std::size_t>(std::count_if(groups.begin(), groups.end(), [](const Group& g) { return g.reduced; }));
  if (reduced_groups <= 1) {
    layout.contiguous = true;
    bool seen_reduced = false;
    for (const auto& g : groups) {
      if (g.reduced) {
        layout.reduce = g.size;
        seen_reduced = true;
      } else if (!seen_reduced) {
        layout.outer *= g.size;
      } else {
        layout.inner *= g.size;
      }
    }
    return layout;
  }
  // General: output strides in the reduced tensor's row-major layout, 0 on reduced axes.
  std::int64_t stride = 1;
  for (int d = in.rank() - 1; d >= 0; --d) {
    const bool reduced = std::binary_search(axes.begin(), axes.end(), d);
    layout.out_strides[static_cast<std::size_t>(d)] = reduced ? 0 : stride;
    if (!reduced) stride *= in[d];
  }
  layout.out_elements = stride;
  return layout;
}

}  // namespace tandem::ops::cpu
