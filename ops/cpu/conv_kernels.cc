// CPU kernels of the convolution and pooling ops (definitions: ops/conv_ops.cc).
//
// Float32 convolutions run the direct kernels of conv_direct.cc (implicit GEMM with register
// tiles; AVX-512 and AVX2 levels, ops/cpu/isa.h) whenever they apply: output channels a multiple
// of the vector's lanes (16, 8), patches up to 3x3x512.
// Everything else, float64 included, is lowered to GEMM through im2col, one chunk of output
// pixels at a time: a chunk's patch matrix (rows: output pixels; columns: kh * kw * in_channels,
// the filter's HWIO row order) is sized to stay in L2, and chunks run in parallel, each with a
// single-threaded GEMM (gemm.h: OpenBLAS or Eigen).
//   forward          y[chunk] = col[chunk] @ W              (W viewed as [kh * kw * cin, cout])
//   backprop filter  dW += col[chunk]^T @ dy[chunk]         (a partial dW per part, summed)
//   backprop input   dcol = dy[chunk] @ W^T, added back into dx (col2im)
// A 1x1, stride-1 convolution needs no patch matrix: it is one GEMM over all pixels.
//
// Pooling is memory-bound: plain loops over the channels (the contiguous NHWC axis), which the
// compiler vectorises, parallel over output rows (forward) or over images and channel blocks
// (gradients: windows overlap along height and width, never across images or channels). The max
// pool's gradient has an AVX2 path for float32 that keeps each window's state in registers.
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "tandem/graph/dtype.h"
#include "tandem/ops/cpu/bias_activation.h"
#include "tandem/ops/cpu/conv_direct.h"
#include "tandem/ops/cpu/conv_geometry.h"
#include "tandem/ops/cpu/conv_scratch.h"
#include "tandem/ops/cpu/gemm.h"
#include "tandem/ops/cpu/kernel_util.h"
#include "tandem/ops/cpu/isa.h"

namespace tandem::ops::cpu {
namespace {

using detail::Window2DGeometry;
using graph::FloatTypes;
using graph::Shape;

// A chunk's patch matrix is about this big: well inside L2 (2 MiB per core on the Xeons we
// measure on), so that im2col's writes are still cached when the GEMM reads them.
constexpr std::int64_t kColChunkBytes = 256 * 1024;
// ... but never fewer rows than this (a GEMM with a handful of rows runs far below peak) nor more.
constexpr std::int64_t kMinChunkRows = 32;
constexpr std::int64_t kMaxChunkRows = 4096;
// Backprop-input scatters whole images from one chunk (so chunks never write the same dx cell);
// above this many bytes of patch matrix per image it runs image by image, row blocks in order.
constexpr std::int64_t kMaxImageColBytes = 4 * 1024 * 1024;
// Pool gradients split work into (image, channel block) units; at least this many channels each.
constexpr std::int64_t kMinPoolChannelBlock = 16;

// --- per-thread scratch ----------------------------------------------------------------------

thread_local ScratchBuffer tls_col;       // im2col / col2im chunks (every thread)
thread_local ScratchBuffer tls_partials;  // backprop-filter partial sums (the calling thread)
thread_local ScratchBuffer tls_pool_best;
thread_local ScratchBuffer tls_pool_arg;
// FusedConv2DMaxPool without the direct kernels: a chunk of y; Conv2DBackpropFilterArgmax's dz.
thread_local ScratchBuffer tls_fused_y;

// --- geometry --------------------------------------------------------------------------------

Window2DGeometry conv_geometry(const KernelContext& ctx, const Shape& x, const Shape& filter) {
  return detail::conv_geometry(ctx.attrs(), x, filter);
}

Window2DGeometry pool_geometry(const KernelContext& ctx, const Shape& x) {
  return detail::pool_geometry(ctx.attrs(), x);
}

// Rows of a patch-matrix chunk: about kColChunkBytes, and no more than an even share per thread.
std::int64_t chunk_rows(std::int64_t row_elements, std::size_t element_size, std::int64_t total_rows, int threads) {
  const auto row_bytes = std::max<std::int64_t>(1, row_elements * static_cast<std::int64_t>(element_size));
  std::int64_t rows = std::clamp(kColChunkBytes / row_bytes, kMinChunkRows, kMaxChunkRows);
  const std::int64_t share = (total_rows + threads - 1) / threads;
  return std::max<std::int64_t>(1, std::min(rows, share));
}

// Walks output pixels r0, r0 + 1, ... (flattened over batch, out_h, out_w) and, for each, the
// top-left input coordinate of its window (possibly negative: padding).
struct PixelCursor {
  const Window2DGeometry& g;
  std::int64_t n, oh, ow;
  PixelCursor(const Window2DGeometry& geometry, std::int64_t r) : g(geometry) {
    ow = r % g.out_w;
    const std::int64_t t = r / g.out_w;
    oh = t % g.out_h;
    n = t / g.out_h;
  }
  std::int64_t ih0() const { return oh * g.stride_h - g.pad_top; }
  std::int64_t iw0() const { return ow * g.stride_w - g.pad_left; }
  void next() {
    if (++ow == g.out_w) {
      ow = 0;
      if (++oh == g.out_h) {
        oh = 0;
        ++n;
      }
    }
  }
};

// col[(r - r0), (kh, kw, c)] = x[n, ih0 + kh, iw0 + kw, c], zero in the padding.
template <class T>
void im2col(const Window2DGeometry& g, const T* x, std::int64_t r0, std::int64_t r1, T* col) {
  const std::int64_t c = g.in_c, k = g.patch_size(), row_len = g.k_w * c;
  PixelCursor p(g, r0);
  for (std::int64_t r = r0; r < r1; ++r, p.next()) {
    T* dst = col + (r - r0) * k;
    const T* image = x + p.n * g.in_h * g.in_w * c;
    const std::int64_t ih0 = p.ih0(), iw0 = p.iw0();
    const bool w_inside = iw0 >= 0 && iw0 + g.k_w <= g.in_w;
    for (std::int64_t kh = 0; kh < g.k_h; ++kh, dst += row_len) {
      const std::int64_t ih = ih0 + kh;
      if (ih < 0 || ih >= g.in_h) {
        std::fill_n(dst, row_len, T(0));
        continue;
      }
      const T* src = image + ih * g.in_w * c;
      if (w_inside) {
        std::copy_n(src + iw0 * c, row_len, dst);
        continue;
      }
      for (std::int64_t kw = 0; kw < g.k_w; ++kw) {
        const std::int64_t iw = iw0 + kw;
        if (iw < 0 || iw >= g.in_w) {
          std::fill_n(dst + kw * c, c, T(0));
        } else {
          std::copy_n(src + iw * c, c, dst + kw * c);
        }
      }
    }
  }
}

// The adjoint of im2col: dx[n, ih0 + kh, iw0 + kw, c] += col[(r - r0), (kh, kw, c)].
template <class T>
void col2im_add(const Window2DGeometry& g, const T* col, std::int64_t r0, std::int64_t r1, T* dx) {
  const std::int64_t c = g.in_c, k = g.patch_size(), row_len = g.k_w * c;
  PixelCursor p(g, r0);
  for (std::int64_t r = r0; r < r1; ++r, p.next()) {
    const T* src = col + (r - r0) * k;
    T* image = dx + p.n * g.in_h * g.in_w * c;
    const std::int64_t ih0 = p.ih0(), iw0 = p.iw0();
    const bool w_inside = iw0 >= 0 && iw0 + g.k_w <= g.in_w;
    for (std::int64_t kh = 0; kh < g.k_h; ++kh, src += row_len) {
      const std::int64_t ih = ih0 + kh;
      if (ih < 0 || ih >= g.in_h) continue;
      T* dst = image + ih * g.in_w * c;
      if (w_inside) {
        T* d = dst + iw0 * c;
        for (std::int64_t i = 0; i < row_len; ++i) d[i] += src[i];
        continue;
      }
      for (std::int64_t kw = 0; kw < g.k_w; ++kw) {
        const std::int64_t iw = iw0 + kw;
        if (iw < 0 || iw >= g.in_w) continue;
        T* d = dst + iw * c;
        const T* s = src + kw * c;
        for (std::int64_t i = 0; i < c; ++i) d[i] += s[i];
      }
    }
  }
}

template <class T>
void fill_zero(devices::Device& device, T* data, std::int64_t n) {
  device.parallel_for(n, kElementwiseGrain,
                      [&](std::int64_t begin, std::int64_t end) { std::fill(data + begin, data + end, T(0)); });
}

// --- convolution -----------------------------------------------------------------------------

// c[m x n] = a[m x k] @ w[k x n] on the calling thread.
template <class T>
void chunk_product(std::int64_t m, std::int64_t n, std::int64_t k, const T* a, const T* w, T* c) {
  gemm_serial(GemmShape{.m = m, .n = n, .k = k, .lda = k, .ldb = n, .ldc = n}, T(1), a, w, T(0), c);
}

// c[k x n] (+)= a[m x k]^T @ dy[m x n] on the calling thread.
template <class T>
void chunk_product_tn(std::int64_t m, std::int64_t n, std::int64_t k, const T* a, const T* dy, bool accumulate, T* c) {
  gemm_serial(GemmShape{.transpose_a = true, .m = k, .n = n, .k = m, .lda = k, .ldb = n, .ldc = n}, T(1), a, dy,
              accumulate ? T(1) : T(0), c);
}

template <class T>
void conv2d_forward(devices::Device& device, const Window2DGeometry& g, const T* x, const T* w, T* y) {
  const std::int64_t m = g.out_pixels(), k = g.patch_size(), n = g.out_c;
  if (m == 0 || n == 0) return;
  if (k == 0) return fill_zero(device, y, m * n);
  if constexpr (std::is_same_v<T, float>) {
    if (direct::conv2d_forward(device, g, x, w, y)) return;
  }
  if (g.is_pointwise()) {  // x is already the patch matrix
    gemm(device, GemmShape{.m = m, .n = n, .k = k, .lda = k, .ldb = n, .ldc = n}, T(1), x, w, T(0), y);
    return;
  }
  const std::int64_t rows = chunk_rows(k, sizeof(T), m, device.intra_op_threads());
  const std::int64_t chunks = (m + rows - 1) / rows;
  device.parallel_for(chunks, 1, [&](std::int64_t begin, std::int64_t end) {
    T* col = tls_col.get<T>(rows * k);
    for (std::int64_t chunk = begin; chunk < end; ++chunk) {
      const std::int64_t r0 = chunk * rows, r1 = std::min(m, r0 + rows);
      im2col(g, x, r0, r1, col);
      chunk_product(r1 - r0, n, k, col, w, y + r0 * n);
    }
  });
}

template <class T>
void conv2d_backprop_filter(devices::Device& device, const Window2DGeometry& g, const T* x, const T* dy, T* dw) {
  const std::int64_t m = g.out_pixels(), k = g.patch_size(), n = g.out_c;
  if (k == 0 || n == 0) return;
  if (m == 0) return fill_zero(device, dw, k * n);
  if constexpr (std::is_same_v<T, float>) {
    if (direct::conv2d_backprop_filter(device, g, x, dy, dw)) return;
  }
  if (g.is_pointwise()) {
    gemm(device, GemmShape{.transpose_a = true, .m = k, .n = n, .k = m, .lda = k, .ldb = n, .ldc = n}, T(1), x, dy,
         T(0), dw);
    return;
  }
  // Each part sums its share of the pixels into its own dW (part 0 into the output), then the
  // parts are added. Parts, not threads, own the partial sums: parallel_for may run several
  // parts on one thread, or all of them inline.
  const int threads = device.intra_op_threads();
  const std::int64_t rows = chunk_rows(k, sizeof(T), m, threads);
  const std::int64_t parts = std::min<std::int64_t>(threads, (m + rows - 1) / rows);
  const std::int64_t part_rows = (m + parts - 1) / parts;
  T* partials = tls_partials.get<T>((parts - 1) * k * n);
  device.parallel_for(parts, 1, [&](std::int64_t begin, std::int64_t end) {
    T* col = tls_col.get<T>(rows * k);
    for (std::int64_t part = begin; part < end; ++part) {
      T* acc = part == 0 ? dw : partials + (part - 1) * k * n;
      const std::int64_t first = part * part_rows, last = std::min(m, first + part_rows);
      if (first >= last) {
        std::fill_n(acc, k * n, T(0));
        continue;
      }
      for (std::int64_t r0 = first; r0 < last; r0 += rows) {
        const std::int64_t r1 = std::min(last, r0 + rows);
        im2col(g, x, r0, r1, col);
        chunk_product_tn(r1 - r0, n, k, col, dy + r0 * n, r0 != first, acc);
      }
    }
  });
  if (parts > 1) {
    device.parallel_for(k * n, kElementwiseGrain, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t part = 1; part < parts; ++part) {
        const T* p = partials + (part - 1) * k * n;
        for (std::int64_t i = begin; i < end; ++i) dw[i] += p[i];
      }
    });
  }
}

template <class T>
void conv2d_backprop_input(devices::Device& device, const Window2DGeometry& g, const T* w, const T* dy, T* dx) {
  const std::int64_t m = g.out_pixels(), k = g.patch_size(), n = g.out_c;
  const std::int64_t dx_size = g.batch * g.in_h * g.in_w * g.in_c;
  if (dx_size == 0) return;
  if (m == 0 || n == 0) return fill_zero(device, dx, dx_size);
  if constexpr (std::is_same_v<T, float>) {
    if (direct::conv2d_backprop_input(device, g, w, dy, dx)) return;
  }
  if (g.is_pointwise()) {  // dx = dy @ W^T
    gemm(device, GemmShape{.transpose_b = true, .m = m, .n = k, .k = n, .lda = n, .ldb = n, .ldc = k}, T(1), dy, w,
         T(0), dx);
    return;
  }
  fill_zero(device, dx, dx_size);
  const int threads = device.intra_op_threads();
  const std::int64_t image_pixels = g.out_h * g.out_w;
  const std::int64_t image_col_bytes = image_pixels * k * static_cast<std::int64_t>(sizeof(T));
  const auto dcol_gemm = [&](std::int64_t r0, std::int64_t r1, T* col, bool parallel) {
    const GemmShape s{.transpose_b = true, .m = r1 - r0, .n = k, .k = n, .lda = n, .ldb = n, .ldc = k};
    if (parallel) {
      gemm(device, s, T(1), dy + r0 * n, w, T(0), col);
    } else {
      gemm_serial(s, T(1), dy + r0 * n, w, T(0), col);
    }
  };
  if ((g.batch >= threads || threads == 1) && image_col_bytes <= kMaxImageColBytes) {
    // Chunks of whole images: two chunks never scatter into the same image.
    const std::int64_t per_chunk = std::clamp<std::int64_t>(kColChunkBytes / std::max<std::int64_t>(1, image_col_bytes),
                                                            1, (g.batch + threads - 1) / threads);
    const std::int64_t chunks = (g.batch + per_chunk - 1) / per_chunk;
    device.parallel_for(chunks, 1, [&](std::int64_t begin, std::int64_t end) {
      T* col = tls_col.get<T>(per_chunk * image_pixels * k);
      for (std::int64_t chunk = begin; chunk < end; ++chunk) {
        const std::int64_t r0 = chunk * per_chunk * image_pixels;
        const std::int64_t r1 = std::min(m, r0 + per_chunk * image_pixels);
        dcol_gemm(r0, r1, col, false);
        col2im_add(g, col, r0, r1, dx);
      }
    });
    return;
  }
  // Few or large images: chunks in order, each GEMM over all threads.
  const std::int64_t rows = chunk_rows(k, sizeof(T), m, 1);
  T* col = tls_col.get<T>(rows * k);
  for (std::int64_t r0 = 0; r0 < m; r0 += rows) {
    const std::int64_t r1 = std::min(m, r0 + rows);
    dcol_gemm(r0, r1, col, true);
    col2im_add(g, col, r0, r1, dx);
  }
}

// --- pooling ---------------------------------------------------------------------------------

// The window of output (oh, ow) clipped to the input: rows [h0, h1), columns [w0, w1).
struct ClippedWindow {
  std::int64_t h0, h1, w0, w1;
  ClippedWindow(const Window2DGeometry& g, std::int64_t oh, std::int64_t ow) {
    const std::int64_t top = oh * g.stride_h - g.pad_top, left = ow * g.stride_w - g.pad_left;
    h0 = std::max<std::int64_t>(top, 0);
    h1 = std::min(top + g.k_h, g.in_h);
    w0 = std::max<std::int64_t>(left, 0);
    w1 = std::min(left + g.k_w, g.in_w);
  }
  std::int64_t count() const { return (h1 - h0) * (w1 - w0); }
};

// Row-wise pooling forward: reduce(window) per channel; `average` divides by the cells inside.
template <class T, bool kAverage>
void pool_forward(devices::Device& device, const Window2DGeometry& g, const T* x, T* y) {
  const std::int64_t c = g.in_c, rows = g.batch * g.out_h;
  const std::int64_t row_work = g.out_w * c * g.k_h * g.k_w;
  device.parallel_for(rows, row_grain(row_work), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t image = row / g.out_h, oh = row % g.out_h;
      const T* x_image = x + image * g.in_h * g.in_w * c;
      for (std::int64_t ow = 0; ow < g.out_w; ++ow) {
        const ClippedWindow win(g, oh, ow);
        T* out = y + (row * g.out_w + ow) * c;
        std::fill_n(out, c, kAverage ? T(0) : -std::numeric_limits<T>::infinity());
        for (std::int64_t h = win.h0; h < win.h1; ++h) {
          for (std::int64_t w = win.w0; w < win.w1; ++w) {
            const T* in = x_image + (h * g.in_w + w) * c;
            if constexpr (kAverage) {
              for (std::int64_t i = 0; i < c; ++i) out[i] += in[i];
            } else {
              for (std::int64_t i = 0; i < c; ++i) out[i] = in[i] > out[i] ? in[i] : out[i];
            }
          }
        }
        if constexpr (kAverage) {
          const T scale = T(1) / static_cast<T>(win.count());
          for (std::int64_t i = 0; i < c; ++i) out[i] *= scale;
        }
      }
    }
  });
}

// Runs fn(image, c0, c1) over (image, channel block) units in parallel: enough units for the
// threads even with a small batch, and no two units write the same dx cell.
template <class F>
void for_image_channel_blocks(devices::Device& device, const Window2DGeometry& g, F&& fn) {
  const std::int64_t wanted = 4 * static_cast<std::int64_t>(device.intra_op_threads());
  std::int64_t blocks = 1;
  if (g.batch < wanted) {
    blocks = std::clamp<std::int64_t>((wanted + g.batch - 1) / std::max<std::int64_t>(g.batch, 1), 1,
                                      std::max<std::int64_t>(1, g.in_c / kMinPoolChannelBlock));
  }
  const std::int64_t block = (g.in_c + blocks - 1) / blocks;
  blocks = (g.in_c + block - 1) / block;
  device.parallel_for(g.batch * blocks, 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t u = begin; u < end; ++u) {
      const std::int64_t c0 = (u % blocks) * block;
      fn(u / blocks, c0, std::min(g.in_c, c0 + block));
    }
  });
}

// The pool gradients' channels that take their AVX2 paths (float32, eight at a time) at this
// level, out of `channels`; the others take the portable loops.
template <class T>
std::int64_t vector_channels(std::int64_t channels) {
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) return channels / 8 * 8;
#endif
  (void)channels;
  return 0;
}

// Windows that never overlap (stride >= pool size, the usual 2x2 / 2) write each dx cell at most
// once: the gradients then store instead of adding, and only cells no window covers (a VALID
// remainder, gaps when stride > pool size) are zeroed, instead of all of dx first.
bool disjoint_windows(const Window2DGeometry& g) { return g.stride_h >= g.k_h && g.stride_w >= g.k_w; }

bool covered(std::int64_t i, std::int64_t pad, std::int64_t stride, std::int64_t k, std::int64_t out) {
  const std::int64_t t = i + pad;  // window o covers [o * stride - pad, o * stride - pad + k)
  return t % stride < k && t / stride < out;
}

// Zeroes channels [c0, c1) of the cells of one image that no window covers (disjoint windows).
template <class T>
void zero_uncovered(const Window2DGeometry& g, T* dx_image, std::int64_t nc) {
  for (std::int64_t h = 0; h < g.in_h; ++h) {
    const bool row = covered(h, g.pad_top, g.stride_h, g.k_h, g.out_h);
    // Column coverage without a division per cell: t = w + pad_left = q * stride + r.
    std::int64_t q = g.pad_left / g.stride_w, r = g.pad_left % g.stride_w;
    for (std::int64_t w = 0; w < g.in_w; ++w) {
      if (!row || r >= g.k_w || q >= g.out_w) std::fill_n(dx_image + (h * g.in_w + w) * g.in_c, nc, T(0));
      if (++r == g.stride_w) {
        r = 0;
        ++q;
      }
    }
  }
}

#if defined(__AVX2__)
// max_pool_backward's work on one window for the float32 channels [0, nv) (nv a multiple of 8),
// eight channels at a time with the running maximum, the winning cell and the sums in registers.
// The generic loops below keep them in per-thread arrays instead and went through memory for
// every cell: 7 GB/s on cnn's first pool, where this path runs at memory speed. Same results, bit
// for bit: the same strict comparisons in the same cell order, and dy or +0 written.
template <bool kRelu, bool kSums>
void max_pool_window_grad_avx2(const Window2DGeometry& g, const ClippedWindow& win, const float* x_image,
                               const float* grad, float* dx_image, double* sums, std::int64_t nv, bool disjoint) {
  const std::int64_t c = g.in_c;
  for (std::int64_t i = 0; i < nv; i += 8) {
    __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256i arg = _mm256_set1_epi32(-1);
    int cell = 0;
    for (std::int64_t h = win.h0; h < win.h1; ++h) {
      for (std::int64_t w = win.w0; w < win.w1; ++w, ++cell) {
        const __m256 v = _mm256_loadu_ps(x_image + (h * g.in_w + w) * c + i);
        const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  // strict: the first maximum wins
        best = _mm256_blendv_ps(best, v, greater);
        arg = _mm256_castps_si256(
            _mm256_blendv_ps(_mm256_castsi256_ps(arg), _mm256_castsi256_ps(_mm256_set1_epi32(cell)), greater));
      }
    }
    if constexpr (kRelu) {  // relu' = 0 at the winner: no cell gets this window's dy
      const __m256 positive = _mm256_cmp_ps(best, _mm256_setzero_ps(), _CMP_GT_OQ);
      arg = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(-1)), _mm256_castsi256_ps(arg), positive));
    }
    const __m256 dy = _mm256_loadu_ps(grad + i);
    if constexpr (kSums) {
      const __m256 won = _mm256_castsi256_ps(_mm256_cmpgt_epi32(arg, _mm256_set1_epi32(-1)));
      const __m256 added = _mm256_and_ps(won, dy);
      _mm256_storeu_pd(sums + i,
                       _mm256_add_pd(_mm256_loadu_pd(sums + i), _mm256_cvtps_pd(_mm256_castps256_ps128(added))));
      _mm256_storeu_pd(sums + i + 4,
                       _mm256_add_pd(_mm256_loadu_pd(sums + i + 4), _mm256_cvtps_pd(_mm256_extractf128_ps(added, 1))));
    }
    cell = 0;
    for (std::int64_t h = win.h0; h < win.h1; ++h) {
      for (std::int64_t w = win.w0; w < win.w1; ++w, ++cell) {
        float* out = dx_image + (h * g.in_w + w) * c + i;
        const __m256 mine = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(arg, _mm256_set1_epi32(cell))), dy);
        _mm256_storeu_ps(out, disjoint ? mine : _mm256_add_ps(_mm256_loadu_ps(out), mine));
      }
    }
  }
}
#endif

// dx gets each dy at the first maximum of its window (scanning rows, then columns), like TF's CPU
// kernel; the maxima are found again from x. Both passes over a window are branch-free loops
// over the channels (which the compiler vectorises): one finds each channel's winning cell,
// the other adds (or, for disjoint windows, stores) dy where the cell is the winner. No scatter.
//
// With kRelu, x is relu's output and dx is also multiplied by relu's derivative, (x > 0) at the
// winner, whose value is the maximum found anyway; with kSums, db[c] = the sum of dx over images
// and cells, in double per image (from dy: each window's dy lands on one cell) and then over the
// images in order, so it does not depend on the thread count. MaxPool2DBiasActivationGrad is the
// two together: one pass over x where MaxPool2DGrad and BiasActivationGrad take three.
template <class T, bool kRelu = false, bool kSums = false>
void max_pool_backward(devices::Device& device, const Window2DGeometry& g, const T* x, const T* dy, T* dx,
                       T* db = nullptr) {
  // A window cell's index, as wide as T so that compare-and-select vectorises.
  using Cell = std::conditional_t<sizeof(T) == 4, std::int32_t, std::int64_t>;
  const std::int64_t c = g.in_c;
  const bool disjoint = disjoint_windows(g);
  if (!disjoint) fill_zero(device, dx, g.batch * g.in_h * g.in_w * c);
  if (c == 0) return;
  std::vector<double> image_sums(kSums ? static_cast<std::size_t>(g.batch * c) : 0, 0.0);
  for_image_channel_blocks(device, g, [&](std::int64_t image, std::int64_t c0, std::int64_t c1) {
    const std::int64_t nc = c1 - c0;
    T* best = tls_pool_best.get<T>(nc);
    Cell* arg = tls_pool_arg.get<Cell>(nc);
    double* sums = kSums ? image_sums.data() + image * c + c0 : nullptr;
    const std::int64_t image_offset = image * g.in_h * g.in_w * c + c0;
    if (disjoint) zero_uncovered(g, dx + image_offset, nc);
    const std::int64_t nv = vector_channels<T>(nc);  // [0, nv) the vector path, [nv, nc) the loops below
    for (std::int64_t oh = 0; oh < g.out_h; ++oh) {
      for (std::int64_t ow = 0; ow < g.out_w; ++ow) {
        const ClippedWindow win(g, oh, ow);
        const T* grad = dy + ((image * g.out_h + oh) * g.out_w + ow) * c + c0;
#if defined(__AVX2__)
        if constexpr (std::is_same_v<T, float>) {
          if (nv > 0) {
            max_pool_window_grad_avx2<kRelu, kSums>(g, win, x + image_offset, grad, dx + image_offset, sums, nv,
                                                    disjoint);
          }
        }
#endif
        if (nv == nc) continue;
        std::fill_n(best, nc, -std::numeric_limits<T>::infinity());
        std::fill_n(arg, nc, Cell{-1});
        Cell cell = 0;
        for (std::int64_t h = win.h0; h < win.h1; ++h) {
          for (std::int64_t w = win.w0; w < win.w1; ++w, ++cell) {
            const T* in = x + image_offset + (h * g.in_w + w) * c;
            for (std::int64_t i = nv; i < nc; ++i) {
              const bool greater = in[i] > best[i];  // strict: the first maximum wins
              best[i] = greater ? in[i] : best[i];
              arg[i] = greater ? cell : arg[i];
            }
          }
        }
        if constexpr (kRelu) {  // relu' = 0 at the winner: no cell gets this window's dy
          for (std::int64_t i = nv; i < nc; ++i) arg[i] = best[i] > T(0) ? arg[i] : Cell{-1};
        }
        if constexpr (kSums) {
          for (std::int64_t i = nv; i < nc; ++i) sums[i] += arg[i] >= 0 ? static_cast<double>(grad[i]) : 0.0;
        }
        cell = 0;
        for (std::int64_t h = win.h0; h < win.h1; ++h) {
          for (std::int64_t w = win.w0; w < win.w1; ++w, ++cell) {
            T* out = dx + image_offset + (h * g.in_w + w) * c;
            if (disjoint) {
              for (std::int64_t i = nv; i < nc; ++i) out[i] = arg[i] == cell ? grad[i] : T(0);
            } else {
              for (std::int64_t i = nv; i < nc; ++i) out[i] += arg[i] == cell ? grad[i] : T(0);
            }
          }
        }
      }
    }
  });
  if constexpr (kSums) {
    for (std::int64_t ch = 0; ch < c; ++ch) {
      double sum = 0;
      for (std::int64_t image = 0; image < g.batch; ++image)
        sum += image_sums[static_cast<std::size_t>(image * c + ch)];
      db[ch] = static_cast<T>(sum);
    }
  }
}

// FusedConv2DMaxPool's pool where the direct kernels do not take it (float64, other
// geometries): y is one chunk of images' act(conv + bias); p gets each window's maximum and
// argmax its first winning cell, or detail::kNoWinner (see conv_direct.h's ForwardMaxPool).
template <class T>
void max_pool_argmax(devices::Device& device, const Window2DGeometry& g, const T* y, T* p, std::uint8_t* argmax,
                     bool relu) {
  const std::int64_t c = g.in_c, rows = g.batch * g.out_h;
  device.parallel_for(rows, row_grain(g.out_w * c * g.k_h * g.k_w), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t image = row / g.out_h, oh = row % g.out_h;
      const T* y_image = y + image * g.in_h * g.in_w * c;
      for (std::int64_t ow = 0; ow < g.out_w; ++ow) {
        const ClippedWindow win(g, oh, ow);
        T* best = p + (row * g.out_w + ow) * c;
        std::uint8_t* arg = argmax + (row * g.out_w + ow) * c;
        std::fill_n(best, c, -std::numeric_limits<T>::infinity());
        std::fill_n(arg, c, detail::kNoWinner);
        std::uint8_t cell = 0;
        for (std::int64_t h = win.h0; h < win.h1; ++h) {
          for (std::int64_t w = win.w0; w < win.w1; ++w, ++cell) {
            const T* in = y_image + (h * g.in_w + w) * c;
            for (std::int64_t i = 0; i < c; ++i) {
              const bool greater = in[i] > best[i];  // strict: the first maximum wins
              best[i] = greater ? in[i] : best[i];
              arg[i] = greater ? cell : arg[i];
            }
          }
        }
        if (relu) {  // relu' = 0 at the winner
          for (std::int64_t i = 0; i < c; ++i) arg[i] = best[i] > T(0) ? arg[i] : detail::kNoWinner;
        }
      }
    }
  });
}

#if defined(__AVX2__)
// max_pool_argmax_bias_grad's work on one window for the float32 channels [0, nv) (nv a multiple
// of 8), eight at a time: the same values and sums as its loops, which the compiler leaves scalar
// (they mix bytes and floats).
template <bool kDz>
void argmax_window_grad_avx2(const Window2DGeometry& g, const ClippedWindow& win, const std::uint8_t* arg,
                             const float* grad, float* dz_image, double* sums, std::int64_t nv) {
  const std::int64_t c = g.in_c;
  for (std::int64_t i = 0; i < nv; i += 8) {
    const __m256i winner = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(arg + i)));
    const __m256 dy = _mm256_loadu_ps(grad + i);
    const __m256 none = _mm256_castsi256_ps(_mm256_cmpeq_epi32(winner, _mm256_set1_epi32(detail::kNoWinner)));
    const __m256 added = _mm256_andnot_ps(none, dy);
    _mm256_storeu_pd(sums + i,
                     _mm256_add_pd(_mm256_loadu_pd(sums + i), _mm256_cvtps_pd(_mm256_castps256_ps128(added))));
    _mm256_storeu_pd(sums + i + 4,
                     _mm256_add_pd(_mm256_loadu_pd(sums + i + 4), _mm256_cvtps_pd(_mm256_extractf128_ps(added, 1))));
    if constexpr (!kDz) continue;
    int cell = 0;
    for (std::int64_t h = win.h0; h < win.h1; ++h) {
      for (std::int64_t w = win.w0; w < win.w1; ++w, ++cell) {
        const __m256 mine = _mm256_castsi256_ps(_mm256_cmpeq_epi32(winner, _mm256_set1_epi32(cell)));
        _mm256_storeu_ps(dz_image + (h * g.in_w + w) * c + i, _mm256_and_ps(mine, dy));
      }
    }
  }
}
#endif

// The argmax gradient ops' dz when they store it (the paths without the direct kernels): each
// window's dp at its winning cell (argmax) and 0 elsewhere, db the sum of dz; g is the pool over z. The same values and
// sums, in the same order, as max_pool_backward<T, kRelu, true> (MaxPool2DBiasActivationGrad) finds from y, without
// reading y. Without kDz, db alone (dz is not written).
template <class T, bool kDz = true>
void max_pool_argmax_bias_grad(devices::Device& device, const Window2DGeometry& g, const std::uint8_t* argmax,
                               const T* dp, T* dz, T* db) {
  const std::int64_t c = g.in_c;
  if (c == 0) return;
  std::vector<double> image_sums(static_cast<std::size_t>(g.batch * c), 0.0);
  for_image_channel_blocks(device, g, [&](std::int64_t image, std::int64_t c0, std::int64_t c1) {
    const std::int64_t nc = c1 - c0;
    double* sums = image_sums.data() + image * c + c0;
    T* dz_image = kDz ? dz + image * g.in_h * g.in_w * c + c0 : nullptr;
    if constexpr (kDz) zero_uncovered(g, dz_image, nc);  // disjoint windows (FusedConv2DMaxPool's shape function)
    const std::int64_t nv = vector_channels<T>(nc);      // [0, nv) the vector path, [nv, nc) the loops below
    for (std::int64_t oh = 0; oh < g.out_h; ++oh) {
      for (std::int64_t ow = 0; ow < g.out_w; ++ow) {
        const ClippedWindow win(g, oh, ow);
        const std::int64_t at = ((image * g.out_h + oh) * g.out_w + ow) * c + c0;
        const std::uint8_t* arg = argmax + at;
        const T* grad = dp + at;
#if defined(__AVX2__)
        if constexpr (std::is_same_v<T, float>) {
          if (nv > 0) argmax_window_grad_avx2<kDz>(g, win, arg, grad, dz_image, sums, nv);
        }
#endif
        if (nv == nc) continue;
        for (std::int64_t i = nv; i < nc; ++i)
          sums[i] += arg[i] != detail::kNoWinner ? static_cast<double>(grad[i]) : 0.0;
        if constexpr (!kDz) continue;
        std::uint8_t cell = 0;
        for (std::int64_t h = win.h0; h < win.h1; ++h) {
          for (std::int64_t w = win.w0; w < win.w1; ++w, ++cell) {
            T* out = dz_image + (h * g.in_w + w) * c;
            for (std::int64_t i = nv; i < nc; ++i) out[i] = arg[i] == cell ? grad[i] : T(0);
          }
        }
      }
    }
  });
  for (std::int64_t ch = 0; ch < c; ++ch) {
    double sum = 0;
    for (std::int64_t image = 0; image < g.batch; ++image) sum += image_sums[static_cast<std::size_t>(image * c + ch)];
    db[ch] = static_cast<T>(sum);
  }
}

// dx gets dy / (cells in the window) on every cell of the window (padding is not counted).
template <class T>
void avg_pool_grad(devices::Device& device, const Window2DGeometry& g, const T* dy, T* dx) {
  const std::int64_t c = g.in_c;
  const bool disjoint = disjoint_windows(g);
  if (!disjoint) fill_zero(device, dx, g.batch * g.in_h * g.in_w * c);
  if (c == 0) return;
  for_image_channel_blocks(device, g, [&](std::int64_t image, std::int64_t c0, std::int64_t c1) {
    const std::int64_t nc = c1 - c0;
    T* dx_image = dx + image * g.in_h * g.in_w * c + c0;
    if (disjoint) zero_uncovered(g, dx_image, nc);
    for (std::int64_t oh = 0; oh < g.out_h; ++oh) {
      for (std::int64_t ow = 0; ow < g.out_w; ++ow) {
        const ClippedWindow win(g, oh, ow);
        const T scale = T(1) / static_cast<T>(win.count());
        const T* grad = dy + ((image * g.out_h + oh) * g.out_w + ow) * c + c0;
        for (std::int64_t h = win.h0; h < win.h1; ++h) {
          for (std::int64_t w = win.w0; w < win.w1; ++w) {
            T* d = dx_image + (h * g.in_w + w) * c;
            if (disjoint) {
              for (std::int64_t i = 0; i < nc; ++i) d[i] = grad[i] * scale;
            } else {
              for (std::int64_t i = 0; i < nc; ++i) d[i] += grad[i] * scale;
            }
          }
        }
      }
    }
  });
}

// --- kernels ---------------------------------------------------------------------------------

void conv2d_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const auto g = conv_geometry(ctx, x.shape(), ctx.input(1).shape());
  graph::dispatch<FloatTypes>(x.dtype(), ctx.label(), [&]<class T>() {
    conv2d_forward<T>(ctx.device(), g, in_ptr<T>(ctx, 0), in_ptr<T>(ctx, 1), out_ptr<T>(ctx, 0));
  });
}

// Output bytes convolved before the bias and activation are applied to them: small enough to still
// be in the cores' L2 caches (2 MiB each here) beside the inputs.
constexpr std::int64_t kFusedEpilogueChunkBytes = 512 * 1024;

// y = act(conv(x, w) + bias) for the images of `part`, the bias and activation applied while that
// output is still in cache: FusedConv2D's and FusedConv2DMaxPool's path without the direct kernels.
template <class T, Activation A>
void convolve_chunk(devices::Device& device, const Window2DGeometry& part, const T* x, const T* w, const T* bias,
                    T* y) {
  conv2d_forward<T>(device, part, x, w, y);
  const std::int64_t rows = part.out_pixels(), n = part.out_c;
  device.parallel_for(rows, row_grain(n),
                      [&](std::int64_t r0, std::int64_t r1) { bias_activation_rows<A>(y, y, n, r0, r1, 0, n, bias); });
}

// FusedConv2D: the direct kernels' epilogue where it applies (float32, relu or linear). Else
// convolve a few images at a time, then apply bias + activation to that output while it is in
// cache, instead of in a second pass over the whole batch's output.
void fused_conv2d_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const auto g = conv_geometry(ctx, x.shape(), ctx.input(1).shape());
  const Activation activation = activation_of(ctx);
  graph::dispatch<FloatTypes>(x.dtype(), ctx.label(), [&]<class T>() {
    with_activation(activation, [&]<Activation A>() {
      const T* px = in_ptr<T>(ctx, 0);
      const T* w = in_ptr<T>(ctx, 1);
      const T* bias = in_ptr<T>(ctx, 2);
      T* y = out_ptr<T>(ctx, 0);
      // The direct kernels add the bias and apply relu to each tile in registers: no pass over y.
      if constexpr (std::is_same_v<T, float> && (A == Activation::kLinear || A == Activation::kRelu)) {
        if (direct::conv2d_forward(ctx.device(), g, px, w, y, {.bias = bias, .relu = A == Activation::kRelu})) return;
      }
      const std::int64_t image_in = g.in_h * g.in_w * g.in_c;
      const std::int64_t image_rows = g.out_h * g.out_w;
      const std::int64_t image_bytes = image_rows * g.out_c * static_cast<std::int64_t>(sizeof(T));
      const std::int64_t chunk =
          std::max<std::int64_t>(1, kFusedEpilogueChunkBytes / std::max<std::int64_t>(1, image_bytes));
      for (std::int64_t b0 = 0; b0 < g.batch; b0 += chunk) {
        Window2DGeometry part = g;
        part.batch = std::min(chunk, g.batch - b0);
        convolve_chunk<T, A>(ctx.device(), part, px + b0 * image_in, w, bias, y + b0 * image_rows * g.out_c);
      }
    });
  });
}

// FusedConv2DMaxPool: the direct kernels pool each block of rows as they compute it (float32).
// Else a few images at a time go through FusedConv2D's steps into a buffer that stays in cache,
// which is then pooled.
void fused_conv2d_max_pool_kernel(KernelContext& ctx) {
  const Tensor& x = ctx.input(0);
  const auto g = conv_geometry(ctx, x.shape(), ctx.input(1).shape());
  const auto pg = detail::fused_pool_geometry(ctx.attrs(), g);
  const bool relu = activation_of(ctx) == Activation::kRelu;
  std::uint8_t* argmax = out_ptr<std::uint8_t>(ctx, 1);
  graph::dispatch<FloatTypes>(x.dtype(), ctx.label(), [&]<class T>() {
    const T* px = in_ptr<T>(ctx, 0);
    const T* w = in_ptr<T>(ctx, 1);
    const T* bias = in_ptr<T>(ctx, 2);
    T* p = out_ptr<T>(ctx, 0);
    if (pg.out_pixels() == 0 || g.out_c == 0) return;
    if constexpr (std::is_same_v<T, float>) {
      if (direct::conv2d_forward_max_pool(ctx.device(), g, px, w, {.bias = bias, .relu = relu},
                                          {.pool = pg, .p = p, .argmax = argmax}))
        return;
    }
    const std::int64_t image_in = g.in_h * g.in_w * g.in_c;
    const std::int64_t image_rows = g.out_h * g.out_w, pooled_image = pg.out_h * pg.out_w * g.out_c;
    const std::int64_t image_bytes = image_rows * g.out_c * static_cast<std::int64_t>(sizeof(T));
    const std::int64_t chunk =
        std::max<std::int64_t>(1, kFusedEpilogueChunkBytes / std::max<std::int64_t>(1, image_bytes));
    T* y = tls_fused_y.get<T>(std::min(chunk, g.batch) * image_rows * g.out_c);
    const auto run = [&]<Activation A>() {
      for (std::int64_t b0 = 0; b0 < g.batch; b0 += chunk) {
        Window2DGeometry part = g, pool_part = pg;
        part.batch = pool_part.batch = std::min(chunk, g.batch - b0);
        convolve_chunk<T, A>(ctx.device(), part, px + b0 * image_in, w, bias, y);
        max_pool_argmax<T>(ctx.device(), pool_part, y, p + b0 * pooled_image, argmax + b0 * pooled_image,
                           A == Activation::kRelu);
      }
    };
    if (relu) {
      run.template operator()<Activation::kRelu>();
    } else {
      run.template operator()<Activation::kLinear>();
    }
  });
}

// Conv2DBackpropFilterArgmax(x, filter_like, argmax, dp) -> (dfilter, db): the direct kernel
// expands dz from the argmax a chunk at a time as it reads it; else dz is stored in scratch first.
void conv2d_backprop_filter_argmax_kernel(KernelContext& ctx) {
  const auto g = conv_geometry(ctx, ctx.input(0).shape(), ctx.input(1).shape());
  const auto pg = detail::fused_pool_geometry(ctx.attrs(), g);
  const std::uint8_t* argmax = in_ptr<std::uint8_t>(ctx, 2);
  graph::dispatch<FloatTypes>(ctx.input(3).dtype(), ctx.label(), [&]<class T>() {
    const T* x = in_ptr<T>(ctx, 0);
    const T* dp = in_ptr<T>(ctx, 3);
    T* dw = out_ptr<T>(ctx, 0);
    T* db = out_ptr<T>(ctx, 1);
    if constexpr (std::is_same_v<T, float>) {
      if (g.out_pixels() > 0 && g.patch_size() > 0 &&
          direct::conv2d_backprop_filter_argmax(ctx.device(), g, x, {.pool = pg, .argmax = argmax, .dp = dp}, dw)) {
        max_pool_argmax_bias_grad<T, false>(ctx.device(), pg, argmax, dp, nullptr, db);
        return;
      }
    }
    T* dz = tls_fused_y.get<T>(g.out_pixels() * g.out_c);
    max_pool_argmax_bias_grad<T>(ctx.device(), pg, argmax, dp, dz, db);
    conv2d_backprop_filter<T>(ctx.device(), g, x, dz, dw);
  });
}

// Conv2DBackpropInputArgmax(x_like, filter, argmax, dp) -> dx: the direct kernel expands dz from
// the argmax an image at a time as it reads it; else dz is stored in scratch first. Either way dx
// is bitwise Conv2DBackpropInput's of that dz.
void conv2d_backprop_input_argmax_kernel(KernelContext& ctx) {
  const auto g = conv_geometry(ctx, ctx.input(0).shape(), ctx.input(1).shape());
  const auto pg = detail::fused_pool_geometry(ctx.attrs(), g);
  const std::uint8_t* argmax = in_ptr<std::uint8_t>(ctx, 2);
  graph::dispatch<FloatTypes>(ctx.input(3).dtype(), ctx.label(), [&]<class T>() {
    const T* w = in_ptr<T>(ctx, 1);
    const T* dp = in_ptr<T>(ctx, 3);
    T* dx = out_ptr<T>(ctx, 0);
    if constexpr (std::is_same_v<T, float>) {
      if (g.out_pixels() > 0 && g.batch * g.in_h * g.in_w > 0 &&
          direct::conv2d_backprop_input_argmax(ctx.device(), g, w, {.pool = pg, .argmax = argmax, .dp = dp}, dx))
        return;
    }
    T* dz = tls_fused_y.get<T>(g.out_pixels() * g.out_c);
    std::vector<T> db(static_cast<std::size_t>(g.out_c));  // not an output of this op
    max_pool_argmax_bias_grad<T>(ctx.device(), pg, argmax, dp, dz, db.data());
    conv2d_backprop_input<T>(ctx.device(), g, w, dz, dx);
  });
}

void conv2d_backprop_input_kernel(KernelContext& ctx) {
  const auto g = conv_geometry(ctx, ctx.input(0).shape(), ctx.input(1).shape());
  graph::dispatch<FloatTypes>(ctx.input(1).dtype(), ctx.label(), [&]<class T>() {
    conv2d_backprop_input<T>(ctx.device(), g, in_ptr<T>(ctx, 1), in_ptr<T>(ctx, 2), out_ptr<T>(ctx, 0));
  });
}

void conv2d_backprop_filter_kernel(KernelContext& ctx) {
  const auto g = conv_geometry(ctx, ctx.input(0).shape(), ctx.input(1).shape());
  graph::dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    conv2d_backprop_filter<T>(ctx.device(), g, in_ptr<T>(ctx, 0), in_ptr<T>(ctx, 2), out_ptr<T>(ctx, 0));
  });
}

void max_pool2d_kernel(KernelContext& ctx) {
  const auto g = pool_geometry(ctx, ctx.input(0).shape());
  graph::dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    pool_forward<T, false>(ctx.device(), g, in_ptr<T>(ctx, 0), out_ptr<T>(ctx, 0));
  });
}

void max_pool2d_grad_kernel(KernelContext& ctx) {
  const auto g = pool_geometry(ctx, ctx.input(0).shape());
  graph::dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    max_pool_backward<T>(ctx.device(), g, in_ptr<T>(ctx, 0), in_ptr<T>(ctx, 2), out_ptr<T>(ctx, 0));
  });
}

void max_pool2d_bias_activation_grad_kernel(KernelContext& ctx) {
  const auto g = pool_geometry(ctx, ctx.input(0).shape());
  const bool relu = parse_activation(ctx.attrs().get<std::string>("activation")) == Activation::kRelu;
  graph::dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    const auto run = [&]<bool kRelu>() {
      max_pool_backward<T, kRelu, true>(ctx.device(), g, in_ptr<T>(ctx, 0), in_ptr<T>(ctx, 1), out_ptr<T>(ctx, 0),
                                        out_ptr<T>(ctx, 1));
    };
    if (relu) {
      run.template operator()<true>();
    } else {
      run.template operator()<false>();
    }
  });
}

void avg_pool2d_kernel(KernelContext& ctx) {
  const auto g = pool_geometry(ctx, ctx.input(0).shape());
  graph::dispatch<FloatTypes>(ctx.input(0).dtype(), ctx.label(), [&]<class T>() {
    pool_forward<T, true>(ctx.device(), g, in_ptr<T>(ctx, 0), out_ptr<T>(ctx, 0));
  });
}

void avg_pool2d_grad_kernel(KernelContext& ctx) {
  const auto g = pool_geometry(ctx, ctx.input(0).shape());
  graph::dispatch<FloatTypes>(ctx.input(1).dtype(), ctx.label(), [&]<class T>() {
    avg_pool_grad<T>(ctx.device(), g, in_ptr<T>(ctx, 1), out_ptr<T>(ctx, 0));
  });
}

}  // namespace
}  // namespace tandem::ops::cpu

namespace tandem::ops::cpu::TANDEM_CPU_ISA_NS {

void register_conv_kernels() {
  auto& r = graph::OpRegistry::global();
  constexpr auto kCpu = devices::DeviceType::kCPU;
  r.add_kernel("Conv2D", kCpu, cpu::conv2d_kernel);
  r.add_kernel("FusedConv2D", kCpu, cpu::fused_conv2d_kernel);
  r.add_kernel("Conv2DBackpropInput", kCpu, cpu::conv2d_backprop_input_kernel);
  r.add_kernel("Conv2DBackpropFilter", kCpu, cpu::conv2d_backprop_filter_kernel);
  r.add_kernel("MaxPool2D", kCpu, cpu::max_pool2d_kernel);
  r.add_kernel("MaxPool2DGrad", kCpu, cpu::max_pool2d_grad_kernel);
  r.add_kernel("MaxPool2DBiasActivationGrad", kCpu, cpu::max_pool2d_bias_activation_grad_kernel);
  r.add_kernel("FusedConv2DMaxPool", kCpu, cpu::fused_conv2d_max_pool_kernel);
  r.add_kernel("Conv2DBackpropFilterArgmax", kCpu, cpu::conv2d_backprop_filter_argmax_kernel);
  r.add_kernel("Conv2DBackpropInputArgmax", kCpu, cpu::conv2d_backprop_input_argmax_kernel);
  r.add_kernel("AvgPool2D", kCpu, cpu::avg_pool2d_kernel);
  r.add_kernel("AvgPool2DGrad", kCpu, cpu::avg_pool2d_grad_kernel);
}

}  // namespace tandem::ops::cpu::TANDEM_CPU_ISA_NS
