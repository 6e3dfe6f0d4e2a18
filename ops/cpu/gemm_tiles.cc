#include "tandem/ops/cpu/gemm_tiles.h"

#include <algorithm>
#include <array>
#include <utility>

#include "tandem/ops/cpu/conv_scratch.h"
#include "tandem/ops/cpu/vec.h"

namespace tandem::ops::cpu::tiles {

#if TANDEM_CPU_VECTORS
namespace {

using namespace vec;
using std::int64_t;

// A tile is kRows rows of C x 2 registers of columns: 24 accumulators of AVX-512's 32 registers
// (12 rows), 12 of AVX2's 16 (6 rows), leaving room for the two B vectors and a broadcast of A.
constexpr int kPanel = 2 * kLanes;  // columns of a panel, and of a tile
constexpr int kRows = kRegisters == 32 ? 12 : 6;
// op(A) is copied kBlockRows rows at a time (a multiple of kRows), and k is cut into blocks of
// kDepth: a panel of B (kDepth x kPanel floats: 128 KiB with AVX-512) and a tile's rows of A stay
// in L2 while every tile of the block reads them.
constexpr int64_t kBlockRows = 192;
constexpr int64_t kDepth = 1024;

thread_local ScratchBuffer tls_packed_a;  // the calling thread's: op(A)'s block, read by every thread
thread_local ScratchBuffer tls_packed_b;  // each thread's: its current panel of op(B)

// op(A)'s rows [i0, i0 + rows) x columns [k0, k0 + depth) as dst[k * kRows + r].
void pack_a(const GemmShape& s, const float* a, int64_t i0, int rows, int64_t k0, int64_t depth, float* dst) {
  if (s.transpose_a) {  // op(A)(i, k) = a[k * lda + i]: a row of a holds kRows consecutive i
    for (int64_t k = 0; k < depth; ++k) {
      const float* src = a + (k0 + k) * s.lda + i0;
      for (int r = 0; r < rows; ++r) dst[k * kRows + r] = src[r];
    }
    return;
  }
  // Rows of a: kLanes values of k from each of the tile's rows, transposed in registers.
  for (int64_t k = 0; k < depth; k += kLanes) {
    const int count = static_cast<int>(std::min<int64_t>(kLanes, depth - k));
    Vec v[kLanes];
    for (int r = 0; r < kLanes; ++r) {
      const float* src = a + (i0 + r) * s.lda + k0 + k;
      v[r] = r >= rows ? vzero() : count == kLanes ? vload(src) : vload_n(src, count);
    }
    vtranspose(v);
    for (int t = 0; t < count; ++t) vstore_n(dst + (k + t) * kRows, v[t], kRows);
  }
}

// op(B)'s rows [k0, k0 + depth) x columns [j0, j0 + width) as dst[k * kPanel + c], zeros past
// width (a last panel narrower than kPanel).
void pack_b(const GemmShape& s, const float* b, int64_t k0, int64_t depth, int64_t j0, int width, float* dst) {
  if (!s.transpose_b) {
    for (int64_t k = 0; k < depth; ++k) {
      const float* src = b + (k0 + k) * s.ldb + j0;
      float* out = dst + k * kPanel;
      if (width == kPanel) {
        vstore(out, vload(src));
        vstore(out + kLanes, vload(src + kLanes));
      } else {
        vstore(out, width >= kLanes ? vload(src) : vload_n(src, width));
        vstore(out + kLanes, width > kLanes ? vload_n(src + kLanes, width - kLanes) : vzero());
      }
    }
    return;
  }
  // op(B)(k, j) = b[j * ldb + k]: each column of the panel is a row of b, kLanes of them
  // transposed in registers at a time (zeros for columns past width).
  for (int c0 = 0; c0 < kPanel; c0 += kLanes) {
    const int columns = std::clamp(width - c0, 0, kLanes);
    for (int64_t k = 0; k < depth; k += kLanes) {
      const int count = static_cast<int>(std::min<int64_t>(kLanes, depth - k));
      Vec v[kLanes];
      for (int c = 0; c < kLanes; ++c) {
        const float* src = b + (j0 + c0 + c) * s.ldb + k0 + k;
        v[c] = c >= columns ? vzero() : count == kLanes ? vload(src) : vload_n(src, count);
      }
      vtranspose(v);
      for (int t = 0; t < count; ++t) vstore(dst + (k + t) * kPanel + c0, v[t]);
    }
  }
}

// C's tile of R rows x `width` columns (at most kPanel) from a panel of A (stride kRows) and one of
// B (stride kPanel) over `depth` values of k, continuing from C's values when `resume`.
template <int R>
void tile(int64_t depth, const float* pa, const float* pb, float* c, int64_t ldc, int width, bool resume) {
  Vec acc[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    if (!resume) {
      acc[r][0] = vzero();
      acc[r][1] = vzero();
    } else if (width == kPanel) {
      acc[r][0] = vload(c + r * ldc);
      acc[r][1] = vload(c + r * ldc + kLanes);
    } else {
      acc[r][0] = width >= kLanes ? vload(c + r * ldc) : vload_n(c + r * ldc, width);
      acc[r][1] = width > kLanes ? vload_n(c + r * ldc + kLanes, width - kLanes) : vzero();
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    const Vec b0 = vload(pb + k * kPanel), b1 = vload(pb + k * kPanel + kLanes);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const Vec av = vbroadcast(pa[k * kRows + r]);
      acc[r][0] = vfmadd(av, b0, acc[r][0]);
      acc[r][1] = vfmadd(av, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    float* out = c + r * ldc;
    if (width == kPanel) {
      vstore(out, acc[r][0]);
      vstore(out + kLanes, acc[r][1]);
    } else if (width > kLanes) {
      vstore(out, acc[r][0]);
      vstore_n(out + kLanes, acc[r][1], width - kLanes);
    } else if (width == kLanes) {
      vstore(out, acc[r][0]);
    } else {
      vstore_n(out, acc[r][0], width);
    }
  }
}

using TileFn = void (*)(int64_t, const float*, const float*, float*, int64_t, int, bool);
template <int... R>
constexpr std::array<TileFn, sizeof...(R)> make_tiles(std::integer_sequence<int, R...>) {
  return {&tile<R + 1>...};
}
constexpr auto kTiles = make_tiles(std::make_integer_sequence<int, kRows>{});

}  // namespace

bool gemm(devices::Device& device, const GemmShape& s, const float* a, const float* b, float* c,
          const BlockDone* done) {
  // Narrower than a panel, most lanes of every tile would be wasted (the library does better).
  if (s.m <= 0 || s.n < kPanel || s.k <= 0 || s.m * s.n * s.k < kMinMacs) return false;
  const int64_t panels = (s.n + kPanel - 1) / kPanel;
  const int64_t block_rows = (std::min(s.m, kBlockRows) + kRows - 1) / kRows * kRows;
  float* packed_a = tls_packed_a.get<float>(block_rows * std::min(s.k, kDepth));
  for (int64_t k0 = 0; k0 < s.k; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, s.k - k0);
    const bool resume = k0 > 0, last = k0 + depth == s.k;
    for (int64_t m0 = 0; m0 < s.m; m0 += kBlockRows) {
      const int64_t rows = std::min(kBlockRows, s.m - m0);
      const int64_t row_panels = (rows + kRows - 1) / kRows;
      device.parallel_for(row_panels, 1, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
          pack_a(s, a, m0 + p * kRows, static_cast<int>(std::min<int64_t>(kRows, rows - p * kRows)), k0, depth,
                 packed_a + p * kRows * depth);
        }
      });
      // A work item is a panel, or part of its rows when there are fewer panels than threads
      // (each part copies the panel of B for itself). Either way each tile is one thread's.
      const int64_t parts =
          std::min(row_panels, std::max<int64_t>(1, (device.intra_op_threads() + panels - 1) / panels));
      const int64_t part_panels = (row_panels + parts - 1) / parts;
      device.parallel_for(panels * parts, 1, [&](int64_t begin, int64_t end) {
        float* packed_b = tls_packed_b.get<float>(depth * kPanel);
        for (int64_t item = begin; item < end; ++item) {
          const int64_t j0 = item / parts * kPanel;
          const int64_t p0 = item % parts * part_panels, p1 = std::min(row_panels, p0 + part_panels);
          if (p0 >= p1) continue;
          const int width = static_cast<int>(std::min<int64_t>(kPanel, s.n - j0));
          pack_b(s, b, k0, depth, j0, width, packed_b);
          for (int64_t p = p0; p < p1; ++p) {
            const int64_t i0 = m0 + p * kRows;
            const int tile_rows = static_cast<int>(std::min<int64_t>(kRows, s.m - i0));
            kTiles[static_cast<std::size_t>(tile_rows - 1)](depth, packed_a + p * kRows * depth, packed_b,
                                                            c + i0 * s.ldc + j0, s.ldc, width, resume);
          }
          if (last && done != nullptr) {
            (*done)(m0 + p0 * kRows, std::min(m0 + rows, m0 + p1 * kRows), j0, j0 + width);
          }
        }
      });
    }
  }
  return true;
}

#else  // baseline: the library GEMM does every product

bool gemm(devices::Device&, const GemmShape&, const float*, const float*, float*, const BlockDone*) { return false; }

#endif

}  // namespace tandem::ops::cpu::tiles
