// tandem/ops/detail/masked_softmax_args.h — which entries of each row a MaskedSoftmax attends to,
// for every backend.
//
// x [..., T, S] is walked as rows of S; row r is query r % T. The CPU kernels (ops/cpu/nn_kernels.cc)
// and the GPU kernels (ops/cuda/kernels.cu, built by ops/cuda/cuda_kernels.cc) read the same
// description, so both mask the same entries. Plain C++ for the host and, under nvcc, the device;
// nothing here throws (the op's shape function has checked that the mask broadcasts to x).
#pragma once

#include <cstdint>

#include "tandem/ops/cuda/element_math.h"  // BroadcastArgs: plain C++, host and device
#include "tandem/ops/detail/host_device.h"

namespace tandem::ops::detail {

struct MaskedSoftmaxRows {
  std::int64_t rows = 0;     // x's elements / S
  std::int64_t cols = 0;     // S, keys
  std::int64_t queries = 1;  // T (1 for a vector x)
  bool causal = false;       // key j attended only when j <= query i
  bool has_mask = false;
  // x's leading axes (all but the last) walked as rows, with the mask's element strides in
  // strides[0] (0 where it broadcasts); the mask's stride along the last axis (0 or 1).
  cuda::BroadcastArgs lead;
  std::int64_t col_stride = 0;
};

// Where row `row`'s mask starts (in mask elements).
TANDEM_HOST_DEVICE inline std::int64_t mask_row_offset(const MaskedSoftmaxRows& a, std::int64_t row) {
  return cuda::broadcast_offset(a.lead, row, 0);
}

// The keys [0, n) a row may attend to before the mask: all of them, or, when causal, those up to
// its query (entries beyond are 0 and need no exp).
TANDEM_HOST_DEVICE inline std::int64_t attended_prefix(const MaskedSoftmaxRows& a, std::int64_t row) {
  if (!a.causal) return a.cols;
  const std::int64_t query = row % a.queries;
  return query + 1 < a.cols ? query + 1 : a.cols;
}

// x's dimensions and, when has_mask, the mask's (right-aligned, each 1 or x's: NumPy broadcasting).
inline MaskedSoftmaxRows masked_softmax_rows(const std::int64_t* x_dims, int x_rank, const std::int64_t* mask_dims,
                                             int mask_rank, bool has_mask, bool causal) {
  MaskedSoftmaxRows a;
  a.cols = x_rank > 0 ? x_dims[x_rank - 1] : 1;
  std::int64_t elements = 1;
  for (int d = 0; d < x_rank; ++d) elements *= x_dims[d];
  a.rows = a.cols > 0 ? elements / a.cols : 0;
  a.queries = x_rank >= 2 && x_dims[x_rank - 2] > 0 ? x_dims[x_rank - 2] : 1;
  a.causal = causal;
  a.has_mask = has_mask;
  a.lead.rank = x_rank > 0 ? x_rank - 1 : 0;
  a.lead.elements = a.rows;
  std::int64_t stride = 1;
  for (int d = x_rank - 1; d >= 0; --d) {
    const int dm = d - (x_rank - mask_rank);
    const std::int64_t mask_dim = has_mask && dm >= 0 ? mask_dims[dm] : 1;
    const std::int64_t s = mask_dim == 1 ? 0 : stride;
    stride *= mask_dim;
    if (d == x_rank - 1) {
      a.col_stride = s;
    } else {
      a.lead.dims[d] = x_dims[d];
      a.lead.strides[0][d] = s;
    }
  }
  return a;
}

}  // namespace tandem::ops::detail
