// tandem/ops/detail/block_copy.h — copying a block between two row-major tensors (Slice, its
// gradient, Concat), described once for the CPU kernels (ops/cpu/array_kernels.cc: one memcpy per
// row) and the GPU ones (ops/cuda/array_kernels.cu: one thread per element).
//
// Plain C++ without tandem's host headers, so nvcc compiles it; tests/ops/array_ops_test.cc checks
// it against the reference slices. Nothing here throws: the ops' shape functions validated the
// shapes and offsets.
#pragma once

#include <cstdint>

#include "tandem/ops/detail/host_device.h"

namespace tandem::ops::detail {

inline constexpr int kMaxBlockRank = 8;

// `rows` rows of `run` contiguous elements; row r starts at src_offset(r) in the source and at
// dst_offset(r) in the destination. The trailing axes that both tensors hold whole are merged
// into the run, so a slice of leading axes or a concatenation along axis 0 is a handful of long
// rows.
struct BlockCopy {
  int rank = 0;  // the axes left outside the run
  std::int64_t dims[kMaxBlockRank] = {};
  std::int64_t src_strides[kMaxBlockRank] = {};
  std::int64_t dst_strides[kMaxBlockRank] = {};
  std::int64_t src_base = 0, dst_base = 0;
  std::int64_t rows = 0, run = 0;

  TANDEM_HOST_DEVICE std::int64_t src_offset(std::int64_t r) const { return offset(r, src_base, src_strides); }
  TANDEM_HOST_DEVICE std::int64_t dst_offset(std::int64_t r) const { return offset(r, dst_base, dst_strides); }
  TANDEM_HOST_DEVICE std::int64_t elements() const { return rows * run; }

 private:
  TANDEM_HOST_DEVICE std::int64_t offset(std::int64_t r, std::int64_t base, const std::int64_t* strides) const {
    std::int64_t o = base;
    for (int d = rank - 1; d >= 0; --d) {
      o += (r % dims[d]) * strides[d];
      r /= dims[d];
    }
    return o;
  }
};

// The block of shape `block` (rank axes) read at `src_begin` of a tensor shaped `src` and written
// at `dst_begin` of one shaped `dst`.
inline BlockCopy block_copy(int rank, const std::int64_t* block, const std::int64_t* src, const std::int64_t* src_begin,
                            const std::int64_t* dst, const std::int64_t* dst_begin) {
  BlockCopy c;
  std::int64_t src_stride[kMaxBlockRank] = {}, dst_stride[kMaxBlockRank] = {};
  std::int64_t s = 1, t = 1;
  for (int d = rank - 1; d >= 0; --d) {
    src_stride[d] = s;
    dst_stride[d] = t;
    s *= src[d];
    t *= dst[d];
    c.src_base += src_begin[d] * src_stride[d];
    c.dst_base += dst_begin[d] * dst_stride[d];
  }
  if (rank == 0) {
    c.rows = c.run = 1;
    return c;
  }
  // Axes after `split` are whole in the block, the source and the destination.
  int split = rank - 1;
  c.run = 1;
  while (split > 0 && block[split] == src[split] && block[split] == dst[split]) c.run *= block[split--];
  c.run *= block[split];
  c.rank = split;
  c.rows = 1;
  for (int d = 0; d < split; ++d) {
    c.dims[d] = block[d];
    c.src_strides[d] = src_stride[d];
    c.dst_strides[d] = dst_stride[d];
    c.rows *= block[d];
  }
  return c;
}

}  // namespace tandem::ops::detail
