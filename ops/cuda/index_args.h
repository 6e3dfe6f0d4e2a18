// tandem/ops/cuda/index_args.h — building the GPU kernels' index arguments from tensor shapes.
//
// Host-only and CUDA-free: cuda_kernels.cc builds its launches with these, and
// tests/ops/gpu_index_math_test.cc checks them (with element_math.h) against the CPU kernels in
// every build.
#pragma once

#include <algorithm>
#include <array>
#include <vector>

#include "tandem/graph/shape.h"
#include "tandem/ops/cpu/conv_geometry.h"
#include "tandem/ops/cuda/element_math.h"

namespace tandem::ops::cuda {

// Strides of `in` walked as `out` (right-aligned; 0 where broadcast).
inline void set_broadcast_strides(const graph::Shape& out, const graph::Shape& in, std::int64_t* strides) {
  std::int64_t stride = 1;
  for (int d = out.rank() - 1; d >= 0; --d) {
    const int di = d - (out.rank() - in.rank());
    if (di < 0) {
      strides[d] = 0;
      continue;
    }
    strides[d] = in[di] == 1 && out[d] != 1 ? 0 : stride;
    stride *= in[di];
  }
}

// `a` (and `b`) broadcast into `out`.
inline BroadcastArgs broadcast_args(const graph::Shape& out, const graph::Shape& a, const graph::Shape* b) {
  BroadcastArgs args;
  args.rank = out.rank();
  for (int d = 0; d < out.rank(); ++d) args.dims[d] = out[d];
  set_broadcast_strides(out, a, args.strides[0]);
  if (b != nullptr) set_broadcast_strides(out, *b, args.strides[1]);
  args.elements = out.num_elements();
  if (args.rank == 0) {  // a scalar: one element at offset 0
    args.rank = 1;
    args.dims[0] = 1;
  }
  return args;
}

// Output `out` = input `in` with its dimensions permuted: out dimension d is in dimension perm[d].
inline BroadcastArgs transpose_args(const graph::Shape& in, const graph::Shape& out,
                                    const std::vector<std::int64_t>& perm) {
  std::array<std::int64_t, kMaxRank> in_strides{};
  std::int64_t stride = 1;
  for (int d = in.rank() - 1; d >= 0; --d) {
    in_strides[static_cast<std::size_t>(d)] = stride;
    stride *= in[d];
  }
  BroadcastArgs args = broadcast_args(out, out, nullptr);
  for (int d = 0; d < out.rank(); ++d)
    args.strides[0][d] = in_strides[static_cast<std::size_t>(perm[static_cast<std::size_t>(d)])];
  return args;
}

// A reduction of `in` over `axes` (any order, any subset).
inline ReduceArgs reduce_args(const graph::Shape& in, const std::vector<int>& axes) {
  ReduceArgs args;
  std::array<std::int64_t, kMaxRank> strides{};
  std::int64_t stride = 1;
  for (int d = in.rank() - 1; d >= 0; --d) {
    strides[static_cast<std::size_t>(d)] = stride;
    stride *= in[d];
  }
  args.out_elements = 1;
  args.reduced_elements = 1;
  for (int d = 0; d < in.rank(); ++d) {
    if (std::find(axes.begin(), axes.end(), d) != axes.end()) {
      args.reduced_dims[args.reduced_rank] = in[d];
      args.reduced_strides[args.reduced_rank++] = strides[static_cast<std::size_t>(d)];
      args.reduced_elements *= in[d];
    } else {
      args.kept_dims[args.kept_rank] = in[d];
      args.kept_strides[args.kept_rank++] = strides[static_cast<std::size_t>(d)];
      args.out_elements *= in[d];
    }
  }
  return args;
}

inline WindowGeometry flatten(const detail::Window2DGeometry& g) {
  return {g.batch,    g.in_h,     g.in_w,  g.in_c,  g.k_h,     g.k_w,
          g.stride_h, g.stride_w, g.out_h, g.out_w, g.pad_top, g.pad_left};
}

}  // namespace tandem::ops::cuda
