// tandem/ops/cuda/element_math.h — the index arithmetic of the GPU kernels, one element at a time.
//
// Plain C++ (host and device): kernels.cu calls these from its threads, and
// tests/ops/gpu_index_math_test.cc calls them from a loop over every "thread" on the CPU and
// compares the result with the CPU kernels. So the part of the GPU kernels most likely to be
// wrong (which element goes where) is tested in every build, with or without a GPU.
#pragma once

#include <cstdint>

#include "tandem/ops/detail/host_device.h"

namespace tandem::ops::cuda {

inline constexpr int kMaxRank = 8;

// An n-dimensional walk over an output with up to two inputs broadcast into it: per output
// dimension, each input's stride in elements (0 where it is broadcast).
struct BroadcastArgs {
  int rank = 0;
  std::int64_t dims[kMaxRank] = {};
  std::int64_t strides[2][kMaxRank] = {};
  std::int64_t elements = 0;
};

// Offset of output element i in operand `operand` (0 or 1).
TANDEM_HOST_DEVICE inline std::int64_t broadcast_offset(const BroadcastArgs& args, std::int64_t i, int operand) {
  std::int64_t rest = i, offset = 0;
  for (int d = args.rank - 1; d >= 0; --d) {
    offset += (rest % args.dims[d]) * args.strides[operand][d];
    rest /= args.dims[d];
  }
  return offset;
}

// A reduction: each output element reduces the input over `reduced` dimensions, starting at the
// offset its `kept` index gives. Covers Sum/Mean/Max over any axes and SumToShape.
struct ReduceArgs {
  int kept_rank = 0;
  std::int64_t kept_dims[kMaxRank] = {};
  std::int64_t kept_strides[kMaxRank] = {};  // input strides of the kept dimensions
  int reduced_rank = 0;
  std::int64_t reduced_dims[kMaxRank] = {};
  std::int64_t reduced_strides[kMaxRank] = {};
  std::int64_t out_elements = 0;
  std::int64_t reduced_elements = 0;
};

// Input offset where output element o's reduction starts.
TANDEM_HOST_DEVICE inline std::int64_t reduce_base(const ReduceArgs& args, std::int64_t o) {
  std::int64_t rest = o, base = 0;
  for (int d = args.kept_rank - 1; d >= 0; --d) {
    base += (rest % args.kept_dims[d]) * args.kept_strides[d];
    rest /= args.kept_dims[d];
  }
  return base;
}
// Input offset of the r-th reduced element from `base`.
TANDEM_HOST_DEVICE inline std::int64_t reduce_offset(const ReduceArgs& args, std::int64_t base, std::int64_t r) {
  std::int64_t rest = r, offset = base;
  for (int d = args.reduced_rank - 1; d >= 0; --d) {
    offset += (rest % args.reduced_dims[d]) * args.reduced_strides[d];
    rest /= args.reduced_dims[d];
  }
  return offset;
}

// 2-D windows over NHWC tensors (convolution as im2col + GEMM, pooling); the geometry of
// ops/cpu/conv_geometry.h, flattened.
struct WindowGeometry {
  std::int64_t batch = 0, in_h = 0, in_w = 0, in_c = 0;
  std::int64_t k_h = 0, k_w = 0;
  std::int64_t stride_h = 1, stride_w = 1;
  std::int64_t out_h = 0, out_w = 0;
  std::int64_t pad_top = 0, pad_left = 0;
};

// im2col: the input offset that patch-matrix element i reads, or -1 for padding. The patch
// matrix is [batch * out_h * out_w, k_h * k_w * in_c], a row's elements ordered (ky, kx, c) like
// an HWIO filter's rows.
TANDEM_HOST_DEVICE inline std::int64_t im2col_source(const WindowGeometry& g, std::int64_t i) {
  const std::int64_t patch = g.k_h * g.k_w * g.in_c;
  const std::int64_t pixel = i / patch, e = i % patch;
  const std::int64_t c = e % g.in_c, kx = (e / g.in_c) % g.k_w, ky = e / (g.in_c * g.k_w);
  const std::int64_t ow = pixel % g.out_w, oh = (pixel / g.out_w) % g.out_h, n = pixel / (g.out_w * g.out_h);
  const std::int64_t h = oh * g.stride_h - g.pad_top + ky, w = ow * g.stride_w - g.pad_left + kx;
  if (h < 0 || h >= g.in_h || w < 0 || w >= g.in_w) return -1;
  return ((n * g.in_h + h) * g.in_w + w) * g.in_c + c;
}

// The output rows [lo, hi) whose windows (stride s, size k, padding pad, `out` rows) contain
// input row h: o * s - pad <= h < o * s - pad + k.
TANDEM_HOST_DEVICE inline void covering_windows(std::int64_t h, std::int64_t k, std::int64_t s, std::int64_t pad,
                                                std::int64_t out, std::int64_t& lo, std::int64_t& hi) {
  const std::int64_t top = h + pad;
  lo = top - k + 1 <= 0 ? 0 : (top - k + 1 + s - 1) / s;
  hi = top / s + 1;
  if (hi > out) hi = out;
  if (lo > hi) lo = hi;
}

// The NHWC coordinates of element i of an [batch, rows, cols, channels] tensor.
struct Pixel {
  std::int64_t n, h, w, c;
};
TANDEM_HOST_DEVICE inline Pixel pixel_of(std::int64_t i, std::int64_t rows, std::int64_t cols, std::int64_t channels) {
  return {i / (channels * cols * rows), (i / (channels * cols)) % rows, (i / channels) % cols, i % channels};
}

// col2im: calls f(offset into the patch matrix) for every patch element that reads input
// element i (the gradient of i is their sum).
template <class F>
TANDEM_HOST_DEVICE inline void for_each_col2im_source(const WindowGeometry& g, std::int64_t i, F&& f) {
  const std::int64_t patch = g.k_h * g.k_w * g.in_c;
  const Pixel p = pixel_of(i, g.in_h, g.in_w, g.in_c);
  std::int64_t oh0, oh1, ow0, ow1;
  covering_windows(p.h, g.k_h, g.stride_h, g.pad_top, g.out_h, oh0, oh1);
  covering_windows(p.w, g.k_w, g.stride_w, g.pad_left, g.out_w, ow0, ow1);
  for (std::int64_t oh = oh0; oh < oh1; ++oh) {
    const std::int64_t ky = p.h + g.pad_top - oh * g.stride_h;
    for (std::int64_t ow = ow0; ow < ow1; ++ow) {
      const std::int64_t kx = p.w + g.pad_left - ow * g.stride_w;
      const std::int64_t pixel = (p.n * g.out_h + oh) * g.out_w + ow;
      f(pixel * patch + (ky * g.k_w + kx) * g.in_c + p.c);
    }
  }
}

// A pooling window clipped to the image: rows [h0, h1), columns [w0, w1).
struct Window {
  std::int64_t h0, h1, w0, w1;
  TANDEM_HOST_DEVICE std::int64_t count() const { return (h1 - h0) * (w1 - w0); }
};
TANDEM_HOST_DEVICE inline Window window_at(const WindowGeometry& g, std::int64_t oh, std::int64_t ow) {
  const std::int64_t top = oh * g.stride_h - g.pad_top, left = ow * g.stride_w - g.pad_left;
  return {top < 0 ? 0 : top, top + g.k_h < g.in_h ? top + g.k_h : g.in_h, left < 0 ? 0 : left,
          left + g.k_w < g.in_w ? left + g.k_w : g.in_w};
}

// Pooling gradients: calls f(output offset, window) for every window containing input element i.
template <class F>
TANDEM_HOST_DEVICE inline void for_each_pool_window_of(const WindowGeometry& g, std::int64_t i, F&& f) {
  const Pixel p = pixel_of(i, g.in_h, g.in_w, g.in_c);
  std::int64_t oh0, oh1, ow0, ow1;
  covering_windows(p.h, g.k_h, g.stride_h, g.pad_top, g.out_h, oh0, oh1);
  covering_windows(p.w, g.k_w, g.stride_w, g.pad_left, g.out_w, ow0, ow1);
  for (std::int64_t oh = oh0; oh < oh1; ++oh) {
    for (std::int64_t ow = ow0; ow < ow1; ++ow) {
      f(((p.n * g.out_h + oh) * g.out_w + ow) * g.in_c + p.c, window_at(g, oh, ow));
    }
  }
}

// Column sums over many rows (bias gradients, batch-norm statistics and gradient sums), in a fixed
// order so that results do not depend on scheduling (no atomics on values): the rows are split
// into `chunks` consecutive ranges; a block of kColumnsPerBlock columns x kRowGroups row groups
// sums one range (thread (column, group) takes rows begin + group, begin + group + kRowGroups,
// ...; the groups' partials meet in group order) into a partial per (chunk, column), and a second
// pass adds each column's partials in chunk order. One block per column block alone would leave
// most of the GPU idle for a convolution's bias gradient (rows = batch x height x width).
inline constexpr int kColumnsPerBlock = 32;
inline constexpr int kRowGroups = 8;
inline constexpr std::int64_t kRowsPerChunk = 512;   // enough rows per block to hide its start-up
inline constexpr std::int64_t kMaxRowChunks = 1024;  // bounds the partials' memory (and pass 2's loop)
struct ColumnChunks {
  std::int64_t chunks = 1;
  std::int64_t rows_per_chunk = 0;
};
TANDEM_HOST_DEVICE inline ColumnChunks column_chunks(std::int64_t rows) {
  ColumnChunks split;
  if (rows <= 0) return split;
  split.chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  split.chunks = split.chunks > kMaxRowChunks ? kMaxRowChunks : split.chunks;
  split.rows_per_chunk = (rows + split.chunks - 1) / split.chunks;
  return split;
}
// Rows [chunk_begin, chunk_end) of chunk `chunk`.
TANDEM_HOST_DEVICE inline std::int64_t chunk_begin(const ColumnChunks& split, std::int64_t chunk) {
  return chunk * split.rows_per_chunk;
}
TANDEM_HOST_DEVICE inline std::int64_t chunk_end(const ColumnChunks& split, std::int64_t chunk, std::int64_t rows) {
  const std::int64_t end = (chunk + 1) * split.rows_per_chunk;
  return end < rows ? end : rows;
}

// A row-major product C[m, n] = op(A) op(B) as cuBLAS's column-major call: cuBLAS reads each
// row-major matrix as its transpose, so C^T = op(B)^T op(A)^T: the operands swap, each keeps its
// own transpose flag, and the row lengths are the leading dimensions.
struct ColumnMajorGemm {
  bool transpose_first = false, transpose_second = false;  // cuBLAS's transa, transb
  std::int64_t m = 0, n = 0, k = 0;                        // cuBLAS's m, n, k
  std::int64_t ld_first = 0, ld_second = 0, ldc = 0;       // lda, ldb, ldc
};
// lda / ldb: the stored row lengths of A and B (A is [m, k], or [k, m] when transpose_a).
inline ColumnMajorGemm column_major_gemm(bool transpose_a, bool transpose_b, std::int64_t m, std::int64_t n,
                                         std::int64_t k, std::int64_t lda, std::int64_t ldb) {
  return {transpose_b, transpose_a, n, m, k, ldb, lda, n};
}

}  // namespace tandem::ops::cuda
