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
// k is cut into blocks of kDepth, so that a panel of B (kDepth x kPanel floats: 128 KiB with
// AVX-512) stays in L2 while every tile of the panel reads it; and the rows into blocks of about
// kABlockBytes of op(A), which every panel reads again (a dense layer's batch is one block).
constexpr int64_t kDepth = 1024;
constexpr int64_t kABlockBytes = int64_t{1} << 20;
// Elements of C in each part handed to an epilogue (BlockDone): 64 KiB of floats.
constexpr int64_t kHandOverElements = 16384;

thread_local ScratchBuffer tls_packed_b;  // each thread's: its current panel of op(B)
thread_local ScratchBuffer tls_packed_a;  // the calling thread's: a block of op(A), shared by its helpers

// Whether each block of op(A) is copied tile by tile (pack_a) before the panels read it, rather
// than read where it is: only where op(A)'s layout fights the L1 cache (32 KiB, 8-way on the x86
// cores we measure), and enough panels read the block to pay for the copy.
// - Untransposed, a tile reads its kRows rows side by side: rows 4 KiB apart (lda a multiple of
//   1024 floats) all fall in one set. AVX-512's 12 rows are more than its 8 ways; AVX2's 6 fit.
// - Transposed, a tile reads one line per step of k, lda apart: at a multiple of 2 KiB those lines
//   land in two sets, and the next tile, which reads the rest of each line, finds none of them
//   left. AVX2's tiles, half as tall, share each line among more of them.
// Measured on a 2-core Zen 4, both ways alternated call by call, medians of 200 calls each at 2
// threads. AVX-512: [128, 1024] @ [1024, 1024] went from 147 to 190 GFLOP/s, [128, 1024] @
// [1024, 1024]^T from 170 to 198, char_gpt's kernel gradient [4096, 512]^T @ [4096, 128] (4
// panels) from 102 to 136. AVX2 (TANDEM_CPU_ISA=avx2): the untransposed copies measured 2-8%
// slower; wide's kernel gradient [128, 1024]^T @ [128, 1024] (64 panels) went from medians of
// 128-164 to 156-203 in three runs, but char_gpt's (8 panels) fell from 103-116 to 86-105. Copied
// always, char_gpt's [4096, 512] @ [512, 128] fell from about 205 to 170 (bench_ops), one copy of
// a 4 MiB A for 4 panels.
bool packs_a(const GemmShape& s, int64_t panels) {
  constexpr int kL1Ways = 8;
  const int64_t row_bytes = s.lda * static_cast<int64_t>(sizeof(float));
  if (!s.transpose_a) return kRows > kL1Ways && panels > 1 && row_bytes % 4096 == 0;
  return row_bytes % 2048 == 0 && panels >= (kRows > kL1Ways ? 2 : 16);
}

// op(A)'s rows [i0, i0 + rows) (rows <= kRows) x [k0, k0 + depth) as dst[k * kRows + r], zeros
// past `rows` (a last, shorter tile, which never reads them).
void pack_a(const GemmShape& s, const float* a, int64_t i0, int rows, int64_t k0, int64_t depth, float* dst) {
  if (s.transpose_a) {  // op(A)(i, k) = a[k * lda + i]: the tile's values at one k are contiguous
    for (int64_t k = 0; k < depth; ++k) vstore_n(dst + k * kRows, vload_n(a + (k0 + k) * s.lda + i0, rows), kRows);
    return;
  }
  // op(A)(i, k) = a[i * lda + k]: kLanes values of k of each row, transposed in registers.
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

// The diagonal block of a tile under kLowerA or kUpperA: which values of k row r of the tile
// takes from op(A), the others counting as 0. `first` is the block's first k minus the tile's
// first row, so that row r's diagonal is at k = r - first.
struct Diagonal {
  int64_t first = 0;
  bool lower = true;  // kLowerA: k up to the diagonal; kUpperA: k from it
  bool keeps(int64_t k, int r) const { return lower ? first + k <= r : first + k >= r; }
};

// C's tile of R rows x `width` columns (at most kPanel) over `depth` values of k, continuing from
// C's values when `resume`: op(A)(r, k) at pa[r * a_row + k * a_k], read where it is (a tile's
// rows of A are a few cache lines a step, in L1), and the panel of B at pb[k * kPanel + c]. With
// kMasked, the diagonal block of a triangular op(A) (depth at most R): values past the diagonal
// count as 0 whatever is stored (an FMA with 0 leaves the chain as it is).
template <int R, bool kMasked = false>
void tile(int64_t depth, const float* pa, int64_t a_row, int64_t a_k, const float* pb, float* c, int64_t ldc, int width,
          bool resume, Diagonal diagonal = {}) {
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
      float x = pa[k * a_k + r * a_row];
      if constexpr (kMasked) x = diagonal.keeps(k, r) ? x : 0.0f;
      const Vec av = vbroadcast(x);
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

using TileFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, float*, int64_t, int, bool, Diagonal);
template <bool kMasked, int... R>
constexpr std::array<TileFn, sizeof...(R)> make_tiles(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, kMasked>...};
}
constexpr auto kTiles = make_tiles<false>(std::make_integer_sequence<int, kRows>{});
constexpr auto kDiagonalTiles = make_tiles<true>(std::make_integer_sequence<int, kRows>{});

}  // namespace

namespace {

// The k range [lo, hi) that rows [i0, i1) of a tile read within the block [k0, k1), where op(A)'s
// promised zeros (GemmTriangle) allow less than the whole block.
struct KRange {
  int64_t lo, hi;
};
KRange tile_k_range(GemmTriangle t, int64_t i0, int64_t i1, int64_t k0, int64_t k1) {
  if (t == GemmTriangle::kLowerA) return {k0, std::clamp(i1, k0, k1)};  // row i1 - 1 stops at k = i1 - 1
  if (t == GemmTriangle::kUpperA) return {std::clamp(i0, k0, k1), k1};  // row i0 starts at k = i0
  return {k0, k1};
}

// One tile: rows [i0, i0 + rows) of C against the packed panel (its k from k0), over the block
// [k0, k0 + depth) of k, or the part of it that a triangular op(A) leaves: under kLowerA the
// values of k below the tile's first row (all rows take them), then the diagonal block, masked;
// under kUpperA the diagonal block, masked, then the rest. pa is op(A)'s row i0 at k = k0.
void tile_rows(const GemmShape& s, int rows, int64_t i0, int64_t k0, int64_t depth, bool resume, const float* pa,
               int64_t a_row, int64_t a_k, const float* packed_b, float* c, int width) {
  const auto run = [&](int64_t lo, int64_t hi, bool masked) {
    if (hi <= lo && resume) return;  // nothing to add (a first block with nothing stores zeros)
    const auto& tiles = masked ? kDiagonalTiles : kTiles;
    tiles[static_cast<std::size_t>(rows - 1)](std::max<int64_t>(hi - lo, 0), pa + (lo - k0) * a_k, a_row, a_k,
                                              packed_b + (lo - k0) * kPanel, c, s.ldc, width, resume,
                                              {.first = lo - i0, .lower = s.triangle == GemmTriangle::kLowerA});
    resume = true;
  };
  const int64_t k1 = k0 + depth;
  const int64_t diagonal_lo = std::clamp(i0, k0, k1), diagonal_hi = std::clamp(i0 + rows, k0, k1);
  switch (s.triangle) {
    case GemmTriangle::kLowerA:
      if (diagonal_lo > k0 || diagonal_hi == diagonal_lo) run(k0, diagonal_lo, false);
      if (diagonal_hi > diagonal_lo) run(diagonal_lo, diagonal_hi, true);
      return;
    case GemmTriangle::kUpperA:
      if (diagonal_hi > diagonal_lo) run(diagonal_lo, diagonal_hi, true);
      if (k1 > diagonal_hi || diagonal_hi == diagonal_lo) run(diagonal_hi, k1, false);
      return;
    default:
      run(k0, k1, false);
  }
}

// kLowerC: clears C(i, j) for j > i in rows [i0, i1) x columns [j0, j1).
void clear_above_diagonal(float* c, int64_t ldc, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t from = std::max(j0, i + 1);
    if (from < j1) std::fill(c + i * ldc + from, c + i * ldc + j1, 0.0f);
  }
}

// Hands rows [m0, m1) of C, complete, to `done` in parts of whole rows, over the threads. Whole
// rows, not each panel as it is done: an epilogue over a panel's 16 or 32 columns paid its setup
// (Eigen's maps, erf's constants) on every row. bench_ops --only nn, FusedMatMul with GELU at
// char_gpt's [4096, 128] @ [128, 512] on 2 threads: 3.90-4.21 ms that way, 2.88 over whole rows,
// the product alone 2.48-2.78.
template <class ForItems>
void hand_over_rows(int64_t n, int64_t m0, int64_t m1, ForItems&& for_items, const BlockDone& done) {
  const int64_t rows = std::max<int64_t>(1, kHandOverElements / std::max<int64_t>(n, 1));
  for_items((m1 - m0 + rows - 1) / rows, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) done(m0 + item * rows, std::min(m1, m0 + (item + 1) * rows), 0, n);
  });
}

// The product in work items (a panel, or a part of its rows), which for_items(count, fn) hands to
// fn(begin, end): the device's threads, or the calling thread alone.
template <class ForItems>
bool run_tiles(const GemmShape& s, int threads, ForItems&& for_items, const float* a, const float* b, float* c,
               const BlockDone* done) {
  // Narrower than a panel, most lanes of every tile would be wasted (the library does better).
  if (s.m <= 0 || s.n < kPanel || s.k <= 0 || s.m * s.n * s.k < kMinMacs) return false;
  const int64_t panels = (s.n + kPanel - 1) / kPanel;
  // op(A)(i, k) is read where it is: a[i * lda + k], or a[k * lda + i] when transposed.
  const int64_t a_row = s.transpose_a ? 1 : s.lda, a_k = s.transpose_a ? s.lda : 1;
  const int64_t block_rows = std::max<int64_t>(
      kRows, kABlockBytes / (static_cast<int64_t>(sizeof(float)) * std::min(s.k, kDepth)) / kRows * kRows);
  const bool lower_c = s.triangle == GemmTriangle::kLowerC;
  const bool pack = packs_a(s, panels);
  // How a tile steps through op(A): a copied tile holds its rows at each k side by side,
  // (r, k) at [k * kRows + r].
  const int64_t tile_a_row = pack ? 1 : a_row, tile_a_k = pack ? int64_t{kRows} : a_k;
  for (int64_t k0 = 0; k0 < s.k; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, s.k - k0);
    const bool resume = k0 > 0, last = k0 + depth == s.k;
    for (int64_t m0 = 0; m0 < s.m; m0 += block_rows) {
      const int64_t m1 = std::min(s.m, m0 + block_rows);
      const int64_t row_panels = (m1 - m0 + kRows - 1) / kRows;
      // A work item is a panel, or a part of its rows when there are fewer panels than threads.
      const int64_t parts = std::min(row_panels, std::max<int64_t>(1, (threads + panels - 1) / panels));
      const int64_t part_panels = (row_panels + parts - 1) / parts;
      float* packed_a = nullptr;
      if (pack) {
        packed_a = tls_packed_a.get<float>(row_panels * kRows * depth);
        for_items(row_panels, [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            const int64_t i0 = m0 + t * kRows;
            const int rows = static_cast<int>(std::min<int64_t>(kRows, m1 - i0));
            pack_a(s, a, i0, rows, k0, depth, packed_a + t * kRows * depth);
          }
        });
      }
      for_items(panels * parts, [&](int64_t begin, int64_t end) {
        float* packed_b = tls_packed_b.get<float>(depth * kPanel);
        for (int64_t item = begin; item < end; ++item) {
          const int64_t j0 = item / parts * kPanel;
          const int64_t r0 = m0 + item % parts * part_panels * kRows;
          const int64_t r1 = std::min(m1, r0 + part_panels * kRows);
          if (r0 >= r1) continue;
          const int width = static_cast<int>(std::min<int64_t>(kPanel, s.n - j0));
          // Only the rows of op(B) that some tile of the item reads (all of them but for kLowerA
          // and kUpperA); under kLowerC, none where the whole item lies above the diagonal.
          const KRange packed = tile_k_range(s.triangle, r0, r1, k0, k0 + depth);
          const bool above = lower_c && j0 > r1 - 1;
          if (!above && packed.hi > packed.lo)
            pack_b(s, b, packed.lo, packed.hi - packed.lo, j0, width, packed_b + (packed.lo - k0) * kPanel);
          for (int64_t i0 = r0; i0 < r1; i0 += kRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kRows, r1 - i0));
            if (lower_c && j0 > i0 + rows - 1) continue;  // above the diagonal: cleared below
            const float* pa = pack ? packed_a + (i0 - m0) * depth : a + i0 * a_row + k0 * a_k;
            tile_rows(s, rows, i0, k0, depth, resume, pa, tile_a_row, tile_a_k, packed_b, c + i0 * s.ldc + j0, width);
          }
          if (last && lower_c) clear_above_diagonal(c, s.ldc, r0, r1, j0, j0 + width);
        }
      });
      if (last && done != nullptr) hand_over_rows(s.n, m0, m1, for_items, *done);
    }
  }
  return true;
}

}  // namespace

bool gemm(devices::Device& device, const GemmShape& s, const float* a, const float* b, float* c,
          const BlockDone* done) {
  const auto on_device = [&](int64_t items, FunctionRef<void(int64_t, int64_t)> fn) {
    device.parallel_for(items, 1, fn);
  };
  return run_tiles(s, device.intra_op_threads(), on_device, a, b, c, done);
}

bool gemm_serial(const GemmShape& s, const float* a, const float* b, float* c) {
  const auto here = [](int64_t items, FunctionRef<void(int64_t, int64_t)> fn) { fn(0, items); };
  return run_tiles(s, 1, here, a, b, c, nullptr);
}

#else  // baseline: the library GEMM does every product

bool gemm(devices::Device&, const GemmShape&, const float*, const float*, float*, const BlockDone*) { return false; }
bool gemm_serial(const GemmShape&, const float*, const float*, float*) { return false; }

#endif

}  // namespace tandem::ops::cpu::tiles
