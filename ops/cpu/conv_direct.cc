#include "tandem/ops/cpu/conv_direct.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <utility>

#include "tandem/ops/cpu/conv_scratch.h"
#include "tandem/ops/cpu/kernel_util.h"
#include "tandem/ops/cpu/vec.h"

namespace tandem::ops::cpu::direct {

#if TANDEM_CPU_VECTORS
namespace {

using detail::Window2DGeometry;
using std::int64_t;
using namespace vec;

// The vector operations beyond cpu/vec.h's that the kernels use. Register tiles hold the
// accumulators and leave room for the operands: with AVX-512's 32 registers, up to 12 rows
// (pixels, or filter rows) x 2 registers (32 channels), or 6 rows x 4 registers (64 channels),
// which needs fewer broadcasts per FMA; with AVX2's 16, 12 rows x 1 register or 6 rows x 2 (12
// accumulators, 2 operands, 1 broadcast).
#if defined(__AVX512F__)
constexpr int kWidestBlock = 4;  // registers across the output channels
// The max pool's compare-and-select, and its winning cells as 32-bit lanes.
using Mask = __mmask16;
using IVec = __m512i;
Mask vgreater(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
Vec vselect(Mask m, Vec if_false, Vec if_true) { return _mm512_mask_blend_ps(m, if_false, if_true); }
IVec iselect(Mask m, IVec if_false, IVec if_true) { return _mm512_mask_blend_epi32(m, if_false, if_true); }
IVec iset(int v) { return _mm512_set1_epi32(v); }
IVec load_bytes(const std::uint8_t* p) {  // 16 bytes, one a lane
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
Vec select_equal(IVec a, IVec b, Vec v) { return _mm512_maskz_mov_ps(_mm512_cmpeq_epi32_mask(a, b), v); }  // else +0
void store_low_bytes(std::uint8_t* p, IVec v) {  // the low byte of each lane, in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
}
#else
constexpr int kWidestBlock = 2;
using Mask = __m256;  // all ones in the lanes that hold
using IVec = __m256i;
Mask vgreater(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
Vec vselect(Mask m, Vec if_false, Vec if_true) { return _mm256_blendv_ps(if_false, if_true, m); }
IVec iselect(Mask m, IVec if_false, IVec if_true) {
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(if_false), _mm256_castsi256_ps(if_true), m));
}
IVec iset(int v) { return _mm256_set1_epi32(v); }
IVec load_bytes(const std::uint8_t* p) {  // 8 bytes, one a lane
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
Vec select_equal(IVec a, IVec b, Vec v) {  // v where a == b, else +0
  return _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b)), v);
}
void store_low_bytes(std::uint8_t* p, IVec v) {  // the low byte of each lane, in order
  // Each 128-bit half gathers its lanes' low bytes into its first 4 bytes; then the two halves'
  // first 32 bits are brought together.
  const __m256i bytes =
      _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12,
                                              -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  const __m256i packed = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif
constexpr int kTileRows = 12;     // rows of a tile one register wide (and of 2 with AVX-512)
constexpr int kWideTileRows = 6;  // rows of a tile kWidestBlock registers wide
// Forward's unit of work: up to this many output rows of one image.
constexpr int64_t kBlockRows = 12;
// Backprop-filter walks its pixels in chunks whose dy rows stay in L1 across the passes over
// column blocks and filter rows. On a Zen 3 (32 KiB of L1d, AVX2) chunks of 32 KiB ran cnn's
// second layer at 134-141 GFLOP/s where chunks of 256 KiB, meant for L2, ran at 108-109
// (bench_ops --only conv); 64 KiB ran at 131, 16 KiB at 98.
constexpr int64_t kDyChunkBytes = 32 * 1024;
// Forward keeps a copy of the filter rows of each edge column's taps; past this it declines
// (the im2col + GEMM path takes the convolution).
constexpr int64_t kMaxEdgeFilterBytes = 8 << 20;
// Backprop-input with few channels keeps the (kh, kw) positions of an input row on the stack.
constexpr int64_t kMaxBackpropInputTaps = 64;

// Scratch of the calling thread (worker threads only read it), one buffer per purpose.
thread_local ScratchBuffer tls_offsets;       // patch offsets
thread_local ScratchBuffer tls_edge_offsets;  // forward: taps of the edge columns ...
thread_local ScratchBuffer tls_edge_w;        // ... and their filter rows
thread_local ScratchBuffer tls_flipped;       // backprop-input: the flipped, transposed filter
thread_local ScratchBuffer tls_padded;        // backprop-filter: the zero-padded input (SAME)
thread_local ScratchBuffer tls_partials;      // backprop-filter: partial sums of the parts but one
thread_local ScratchBuffer tls_columns;       // backprop-input: (iw, kw) -> ow, or -1
thread_local ScratchBuffer tls_full_columns;  // backprop-input: every kw of iw inside dy
thread_local ScratchBuffer tls_pooled_rows;   // forward with a max pool: one block of y (every thread)
thread_local ScratchBuffer tls_dy_chunk;      // backprop-filter from an argmax: one chunk of dy (every thread)
thread_local ScratchBuffer tls_dz_image;      // backprop-input from an argmax: one image of dz (every thread)
thread_local ScratchBuffer tls_corners;       // backprop-filter: the window corners of a chunk's pixels (every thread)
thread_local ScratchBuffer tls_windows;       // backprop-filter from an argmax: each pixel's pool window ...
thread_local ScratchBuffer tls_cells;         // ... and its cell in it (every thread)
// The winners' paths from an argmax (every thread): each list's winners (backprop-filter: their
// window corners; backprop-input: their filter rows), their dp and the lists' lengths, and
// backprop-filter's part sums transposed ([out_c, patch]).
thread_local ScratchBuffer tls_winner_corners;
thread_local ScratchBuffer tls_winner_offsets;
thread_local ScratchBuffer tls_winner_values;
thread_local ScratchBuffer tls_winner_counts;
thread_local ScratchBuffer tls_transposed_dw;

// Registers in the next column block of the output channels when `left` channels remain.
int column_block(int64_t left) {
  if (kWidestBlock >= 4 && left >= 4 * kLanes) return 4;
  return left >= 2 * kLanes ? 2 : 1;
}
constexpr int max_tile_rows(int registers) { return registers == kWidestBlock ? kWideTileRows : kTileRows; }
// Tiles 4 registers wide exist with AVX-512 only (a 1-row table, never used, stands in on AVX2).
constexpr int kRows4 = kWidestBlock >= 4 ? max_tile_rows(4) : 1;

// Offsets of the patch elements (kh, kw, c), in HWIO row order, from a window's corner in an
// image `width` pixels wide with `c` channels.
const int64_t* patch_offsets(const Window2DGeometry& g, int64_t width, int64_t c) {
  int64_t* offsets = tls_offsets.get<int64_t>(g.patch_size());
  std::size_t i = 0;
  for (int64_t kh = 0; kh < g.k_h; ++kh) {
    for (int64_t kw = 0; kw < g.k_w; ++kw) {
      for (int64_t ci = 0; ci < c; ++ci) offsets[i++] = (kh * width + kw) * c + ci;
    }
  }
  return offsets;
}

// --- forward ---------------------------------------------------------------------------------

// y[MR pixels x 16 NV channels] = act(patches @ w + bias). Pixel r's patch element kk is
// a[base + r * stride + off[kk]]; the index is summed before it touches the pointer, since a
// window's corner may lie in the padding, outside the array (every element read is inside).
// `epilogue.bias` points at the tile's first channel.
template <int MR, int NV>
void forward_tile(int64_t k, const float* a, int64_t base, int64_t stride, const int64_t* off, const float* w,
                  int64_t ldw, float* y, int64_t ldy, ForwardEpilogue epilogue) {
  Vec acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* column = a + (base + off[kk]);
    Vec wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = vload(w + kk * ldw + kLanes * v);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const Vec av = vbroadcast(column[r * stride]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = vfmadd(av, wv[v], acc[r][v]);
    }
  }
  if (epilogue.bias != nullptr) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const Vec b = vload(epilogue.bias + kLanes * v);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) acc[r][v] = vadd(acc[r][v], b);
    }
  }
  if (epilogue.relu) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = vrelu(acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(y + r * ldy + kLanes * v, acc[r][v]);
  }
}

// Tables of every tile height, so that remainders run the same register-held code.
using ForwardTileFn = void (*)(int64_t, const float*, int64_t, int64_t, const int64_t*, const float*, int64_t, float*,
                               int64_t, ForwardEpilogue);
template <int NV, int... R>
constexpr std::array<ForwardTileFn, sizeof...(R)> forward_tiles(std::integer_sequence<int, R...>) {
  return {&forward_tile<R + 1, NV>...};
}
constexpr auto kForwardTiles1 = forward_tiles<1>(std::make_integer_sequence<int, max_tile_rows(1)>{});
constexpr auto kForwardTiles2 = forward_tiles<2>(std::make_integer_sequence<int, max_tile_rows(2)>{});
constexpr auto kForwardTiles4 = forward_tiles<4>(std::make_integer_sequence<int, kRows4>{});

ForwardTileFn forward_tile_fn(int registers, int64_t rows) {
  const auto i = static_cast<std::size_t>(rows - 1);
  return registers == 4 ? kForwardTiles4[i] : registers == 2 ? kForwardTiles2[i] : kForwardTiles1[i];
}

// The output columns whose windows lie inside the input's width: [begin, end). The others are
// the edge columns.
struct FullColumns {
  int64_t begin, end;
};
FullColumns full_columns(const Window2DGeometry& g) {
  const int64_t begin = std::min(g.out_w, (g.pad_left + g.stride_w - 1) / g.stride_w);
  const int64_t end =
      g.in_w < g.k_w ? begin : std::clamp((g.in_w - g.k_w + g.pad_left) / g.stride_w + 1, begin, g.out_w);
  return {begin, end};
}

bool forward_applies(const Window2DGeometry& g) {
  if (g.in_c < 1 || g.out_c < 1 || g.out_c % kLanes != 0 || g.patch_size() > kMaxPatch) return false;
  const auto full = full_columns(g);
  const int64_t edges = g.out_w - (full.end - full.begin);
  return edges * g.patch_size() * g.out_c * static_cast<int64_t>(sizeof(float)) <= kMaxEdgeFilterBytes;
}

// One pool window over NV registers of channels: each register's running maximum and winning cell
// are a chain of compares and selects (4-5 cycles a cell), so NV independent chains keep the core
// busy where one at a time left it waiting (cnn's first layer: 0.3 ms of pooling, in L1).
template <int NV>
void pool_window(const float* corner, int64_t width, int64_t c, int64_t k_h, int64_t k_w, bool relu, float* p,
                 std::uint8_t* argmax) {
  Vec best[NV];
  IVec arg[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    best[v] = vbroadcast(-std::numeric_limits<float>::infinity());
    arg[v] = iset(detail::kNoWinner);
  }
  int cell = 0;
  for (int64_t dh = 0; dh < k_h; ++dh) {
    for (int64_t dw = 0; dw < k_w; ++dw, ++cell) {
      const float* in = corner + (dh * width + dw) * c;
      const IVec here = iset(cell);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const Vec x = vload(in + kLanes * v);
        const Mask greater = vgreater(x, best[v]);  // strict: the first maximum wins
        best[v] = vselect(greater, best[v], x);
        arg[v] = iselect(greater, arg[v], here);
      }
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    if (relu) arg[v] = iselect(vgreater(best[v], vzero()), iset(detail::kNoWinner), arg[v]);  // relu' = 0 there
    vstore(p + kLanes * v, best[v]);
    store_low_bytes(argmax + kLanes * v, arg[v]);
  }
}

// Max-pools y's rows [row0, row_end) of image n (in `rows`, row0 first) into the windows that lie
// inside them: the same strict comparisons in the same cell order as MaxPool2D and
// MaxPool2DBiasActivationGrad, so p and the winners are theirs, bit for bit.
void max_pool_rows(const ForwardMaxPool& mp, const float* rows, int64_t row0, int64_t row_end, int64_t n, bool relu) {
  const Window2DGeometry& pg = mp.pool;
  const int64_t c = pg.in_c, width = pg.in_w;
  for (int64_t ph = row0 / pg.stride_h; ph < pg.out_h && ph * pg.stride_h + pg.k_h <= row_end; ++ph) {
    for (int64_t pw = 0; pw < pg.out_w; ++pw) {
      const int64_t out = ((n * pg.out_h + ph) * pg.out_w + pw) * c;
      const float* corner = rows + ((ph * pg.stride_h - row0) * width + pw * pg.stride_w) * c;
      int64_t i = 0;
      for (; i + 4 * kLanes <= c; i += 4 * kLanes)
        pool_window<4>(corner + i, width, c, pg.k_h, pg.k_w, relu, mp.p + out + i, mp.argmax + out + i);
      for (; i < c; i += kLanes)
        pool_window<1>(corner + i, width, c, pg.k_h, pg.k_w, relu, mp.p + out + i, mp.argmax + out + i);
    }
  }
}

// Rows [r0, r1) of dz (rows of its images' output rows, flattened) into `chunk`: each cell gets its
// window's dp where the argmax names it, +0 elsewhere and where no window covers it, the values
// max_pool_argmax_bias_grad stores (ops/cpu/conv_kernels.cc). The windows are disjoint (stride
// >= size), so a row is walked window by window with no division per pixel: on cnn's first layer
// (32 channels: four vectors a pixel) two divisions a pixel had cost about as much as its FMAs.
void expand_argmax_rows(const Window2DGeometry& g, const DyFromArgmax& src, int64_t r0, int64_t r1, float* chunk) {
  const Window2DGeometry& pg = src.pool;
  const int64_t o = g.out_c;
  const auto select_row = [&](const std::uint8_t* argmax, const float* dp, int cell, float* out) {
    const IVec winner = iset(cell);
    for (int64_t i = 0; i < o; i += kLanes)
      vstore(out + i, select_equal(load_bytes(argmax + i), winner, vload(dp + i)));
  };
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t n = row / g.out_h, oh = row % g.out_h;
    const int64_t ph = oh / pg.stride_h, dh = oh % pg.stride_h;
    float* out = chunk + (row - r0) * g.out_w * o;
    if (ph >= pg.out_h || dh >= pg.k_h) {
      std::fill_n(out, g.out_w * o, 0.0f);
      continue;
    }
    const int64_t at = (n * pg.out_h + ph) * pg.out_w * o;
    int64_t ow = 0;
    for (int64_t pw = 0; pw < pg.out_w; ++pw) {
      const std::uint8_t* argmax = src.argmax + at + pw * o;
      const float* dp = src.dp + at + pw * o;
      for (int64_t dw = 0; dw < pg.stride_w && ow < g.out_w; ++dw, ++ow, out += o) {
        if (dw < pg.k_w) {
          select_row(argmax, dp, static_cast<int>(dh * pg.k_w + dw), out);
        } else {
          std::fill_n(out, o, 0.0f);
        }
      }
    }
    std::fill_n(out, (g.out_w - ow) * o, 0.0f);
  }
}

// y = conv(x, w) (w: [kh * kw * in_c, out_c], out_c % 16 == 0). Padding is never materialised
// nor multiplied:
//  - filter rows over padding rows are left out of the reduction (a kh range per output row);
//  - the output columns whose windows cross the left or right edge (edge columns) have their own
//    tap lists, with a copy of the filter rows of those taps, and run as tiles down the column
//    (consecutive output rows with the same kh range), so that they too get a full register tile.
// Work is split into blocks of up to kBlockRows output rows of one image. With `pool`, a block is
// a whole number of pool rows (windows never straddle two), its rows go to a per-thread buffer
// that max_pool_rows then reduces, and rows no window reads (the VALID remainder) are skipped.
// With `dz_images` (backprop input from FusedConv2DMaxPool's argmax), x is not read: each image is
// expanded from the argmax into a per-thread buffer when a thread's first block of it starts.
struct ImagesFromArgmax {
  const Window2DGeometry& conv;  // the convolution whose output dz is
  const DyFromArgmax& source;
};
void forward_direct(devices::Device& device, const Window2DGeometry& g, const float* x, const float* w, float* y,
                    ForwardEpilogue epilogue, const ForwardMaxPool* pool = nullptr,
                    const ImagesFromArgmax* dz_images = nullptr) {
  const int64_t o = g.out_c, c = g.in_c, k = g.patch_size(), kh_size = g.k_w * c;
  const int64_t* offsets = patch_offsets(g, g.in_w, c);
  const auto [full_begin, full_end] = full_columns(g);
  const int64_t full = full_end - full_begin, edges = g.out_w - full;
  const auto edge_column = [&](int64_t e) { return e < full_begin ? e : full_end + (e - full_begin); };
  const auto kw_range = [&](int64_t ow) {  // filter columns over real input columns
    const int64_t left = ow * g.stride_w - g.pad_left;
    return std::pair<int64_t, int64_t>{std::max<int64_t>(0, -left), std::min(g.k_w, g.in_w - left)};
  };
  const auto kh_range = [&](int64_t oh) {  // filter rows over real input rows
    const int64_t top = oh * g.stride_h - g.pad_top;
    return std::pair<int64_t, int64_t>{std::max<int64_t>(0, -top), std::max<int64_t>(0, std::min(g.k_h, g.in_h - top))};
  };
  // Each edge column's taps over all kh (grouped by kh), and its filter rows packed to match.
  int64_t* edge_offsets = tls_edge_offsets.get<int64_t>(edges * k);
  float* edge_w = tls_edge_w.get<float>(edges * k * o);
  for (int64_t e = 0; e < edges; ++e) {
    const auto [kw0, kw1] = kw_range(edge_column(e));
    int64_t* eo = edge_offsets + e * k;
    float* ew = edge_w + e * k * o;
    for (int64_t kh = 0; kh < g.k_h; ++kh) {
      for (int64_t kw = kw0; kw < kw1; ++kw) {
        for (int64_t ci = 0; ci < c; ++ci, ++eo, ew += o) {
          *eo = (kh * g.in_w + kw) * c + ci;
          std::copy_n(w + ((kh * g.k_w + kw) * c + ci) * o, o, ew);
        }
      }
    }
  }
  const int64_t pool_stride = pool != nullptr ? pool->pool.stride_h : 1;
  const int64_t block_rows = std::max<int64_t>(1, kBlockRows / pool_stride) * pool_stride;
  const int64_t rows = pool != nullptr ? std::min(g.out_h, pool->pool.out_h * pool_stride) : g.out_h;
  const int64_t blocks_per_image = (rows + block_rows - 1) / block_rows;
  const int64_t block_work = block_rows * g.out_w * o * k;
  device.parallel_for(
      g.batch * blocks_per_image, std::max<int64_t>(1, 8 * kElementwiseGrain / block_work),
      [&](int64_t begin, int64_t end) {
        float* expanded = dz_images != nullptr ? tls_dz_image.get<float>(g.in_h * g.in_w * c) : nullptr;
        int64_t expanded_image = -1;
        for (int64_t unit = begin; unit < end; ++unit) {
          const int64_t n = unit / blocks_per_image;
          const int64_t oh_begin = unit % blocks_per_image * block_rows, oh_end = std::min(rows, oh_begin + block_rows);
          const float* image = x + n * g.in_h * g.in_w * c;
          if (dz_images != nullptr) {
            if (expanded_image != n) {
              const int64_t h = dz_images->conv.out_h;
              expand_argmax_rows(dz_images->conv, dz_images->source, n * h, (n + 1) * h, expanded);
              expanded_image = n;
            }
            image = expanded;
          }
          // Output row oh goes to y_rows + (oh - y_row0) * g.out_w * o.
          float* y_rows =
              pool != nullptr ? tls_pooled_rows.get<float>(block_rows * g.out_w * o) : y + n * g.out_h * g.out_w * o;
          const int64_t y_row0 = pool != nullptr ? oh_begin : 0;
          const auto y_at = [&](int64_t oh, int64_t ow) { return y_rows + ((oh - y_row0) * g.out_w + ow) * o; };
          // Index in `image` of the corner of output pixel (oh, ow)'s window: negative in padding.
          const auto corner = [&](int64_t oh, int64_t ow) {
            return ((oh * g.stride_h - g.pad_top) * g.in_w + ow * g.stride_w - g.pad_left) * c;
          };
          for (int64_t j = 0; j < o;) {
            const int registers = column_block(o - j);
            const int64_t max_rows = max_tile_rows(registers);
            ForwardEpilogue tile_epilogue = epilogue;
            if (epilogue.bias != nullptr) tile_epilogue.bias = epilogue.bias + j;
            // Full columns: balanced tiles along each output row.
            const int64_t tiles = (full + max_rows - 1) / max_rows;
            for (int64_t oh = oh_begin; oh < oh_end; ++oh) {
              const auto [kh0, kh1] = kh_range(oh);
              const int64_t kk0 = kh0 * kh_size;
              for (int64_t t = 0; t < tiles; ++t) {
                const int64_t ow0 = full_begin + t * full / tiles, ow1 = full_begin + (t + 1) * full / tiles;
                forward_tile_fn(registers, ow1 - ow0)((kh1 - kh0) * kh_size, image, corner(oh, ow0), g.stride_w * c,
                                                      offsets + kk0, w + kk0 * o + j, o, y_at(oh, ow0) + j, o,
                                                      tile_epilogue);
              }
            }
            // Edge columns: runs of rows with the same kh range, as tiles down the column.
            for (int64_t oh = oh_begin; oh < oh_end;) {
              const auto range = kh_range(oh);
              int64_t run = 1;
              while (run < max_rows && oh + run < oh_end && kh_range(oh + run) == range) ++run;
              const auto [kh0, kh1] = range;
              for (int64_t e = 0; e < edges; ++e) {
                const int64_t ow = edge_column(e);
                const auto [kw0, kw1] = kw_range(ow);
                const int64_t per_kh = (kw1 - kw0) * c, first = e * k + kh0 * per_kh;
                forward_tile_fn(registers, run)((kh1 - kh0) * per_kh, image, corner(oh, ow), g.stride_h * g.in_w * c,
                                                edge_offsets + first, edge_w + first * o + j, o, y_at(oh, ow) + j,
                                                g.out_w * o, tile_epilogue);
              }
              oh += run;
            }
            j += registers * kLanes;
          }
          if (pool != nullptr) max_pool_rows(*pool, y_rows, oh_begin, oh_end, n, epilogue.relu);
        }
      });
}

// --- backprop filter -------------------------------------------------------------------------

// The input as backprop-filter's windows see it: zero-padded when SAME padding reaches outside,
// so that every window is a plain offset pattern from its corner.
struct Image {
  const float* data;
  int64_t h, w, c;
  const float* corner(const Window2DGeometry& g, int64_t n, int64_t oh, int64_t ow) const {
    return data + ((n * h + oh * g.stride_h) * w + ow * g.stride_w) * c;
  }
};

Image padded_input(devices::Device& device, const Window2DGeometry& g, const float* x) {
  const int64_t hp = (g.out_h - 1) * g.stride_h + g.k_h, wp = (g.out_w - 1) * g.stride_w + g.k_w, c = g.in_c;
  if (g.pad_top == 0 && g.pad_left == 0 && hp <= g.in_h && wp <= g.in_w) return {x, g.in_h, g.in_w, c};
  float* padded = tls_padded.get<float>(g.batch * hp * wp * c);
  device.parallel_for(g.batch * hp, row_grain(wp * c), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = row / hp, ih = row % hp - g.pad_top;
      float* dst = padded + row * wp * c;
      if (ih < 0 || ih >= g.in_h) {
        std::fill_n(dst, wp * c, 0.0f);
        continue;
      }
      const int64_t first = std::min(g.pad_left, wp), last = std::min(wp, g.pad_left + g.in_w);
      std::fill_n(dst, first * c, 0.0f);
      std::copy_n(x + ((n * g.in_h + ih) * g.in_w) * c, (last - first) * c, dst + first * c);
      std::fill_n(dst + last * c, (wp - last) * c, 0.0f);
    }
  });
  return {padded, hp, wp, c};
}

// dw[KB filter rows x 16 NV channels] (+)= sum over `count` pixels of patch[offsets[r]] * dy: the
// whole pixel range reduces in registers. Pixel p's window corner is image + corners[p], its dy
// row dy + p * ldy (a chunk's dy rows are contiguous). One flat loop over the chunk's pixels, not
// one per output row: cnn's second layer has rows of 11 pixels, and a row's setup (its corner's
// division by the image height, the loop's exit) had cost about a tenth of the kernel's time.
template <int KB, int NV>
void filter_tile(const float* image, const int64_t* corners, int64_t count, const int64_t* offsets, const float* dy,
                 int64_t ldy, float* dw, int64_t ldw, bool accumulate) {
  Vec acc[KB][NV];
  int64_t off[KB];
#pragma GCC unroll 16
  for (int r = 0; r < KB; ++r) {
    off[r] = offsets[r];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
  }
  for (int64_t p = 0; p < count; ++p, dy += ldy) {
    const float* corner = image + corners[p];
    Vec dv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) dv[v] = vload(dy + kLanes * v);
#pragma GCC unroll 16
    for (int r = 0; r < KB; ++r) {
      const Vec av = vbroadcast(corner[off[r]]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = vfmadd(av, dv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < KB; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* out = dw + r * ldw + kLanes * v;
      vstore(out, accumulate ? vadd(vload(out), acc[r][v]) : acc[r][v]);
    }
  }
}

using FilterTileFn = void (*)(const float*, const int64_t*, int64_t, const int64_t*, const float*, int64_t, float*,
                              int64_t, bool);
template <int NV, int... R>
constexpr std::array<FilterTileFn, sizeof...(R)> filter_tiles(std::integer_sequence<int, R...>) {
  return {&filter_tile<R + 1, NV>...};
}
constexpr auto kFilterTiles1 = filter_tiles<1>(std::make_integer_sequence<int, max_tile_rows(1)>{});
constexpr auto kFilterTiles2 = filter_tiles<2>(std::make_integer_sequence<int, max_tile_rows(2)>{});
constexpr auto kFilterTiles4 = filter_tiles<4>(std::make_integer_sequence<int, kRows4>{});

FilterTileFn filter_tile_fn(int registers, int64_t rows) {
  const auto i = static_cast<std::size_t>(rows - 1);
  return registers == 4 ? kFilterTiles4[i] : registers == 2 ? kFilterTiles2[i] : kFilterTiles1[i];
}

// filter_tile with dy expanded from FusedConv2DMaxPool's argmax in registers: pixel p's dy
// vectors are its window's dp where the argmax names its cell, +0 elsewhere (dp and argmax +
// windows[p], the cell cells[p]); pixels outside every window are not listed. For patches short
// enough to take one tile (cnn's first layer: 9 rows), each dy vector is expanded once where the
// chunked path wrote it to L1 and read it back for each tile, which cost as much as the FMAs
// (9 per dy vector). Each dw element is the same FMA chain over the same pixels in the same
// order as filter_tile's, less the pixels whose dy is +0 (x * +0 added to a sum started at +0
// leaves it unchanged, x finite), so the result is bitwise the chunked path's.
template <int KB, int NV>
void filter_tile_argmax(const float* image, const int64_t* corners, const int64_t* windows,
                        const std::int32_t* cells, int64_t count, const int64_t* offsets, const std::uint8_t* argmax,
                        const float* dp, float* dw, int64_t ldw, bool accumulate) {
  Vec acc[KB][NV];
  int64_t off[KB];
#pragma GCC unroll 16
  for (int r = 0; r < KB; ++r) {
    off[r] = offsets[r];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
  }
  for (int64_t p = 0; p < count; ++p) {
    const float* corner = image + corners[p];
    const IVec cell = iset(cells[p]);
    Vec dv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      dv[v] = select_equal(load_bytes(argmax + windows[p] + kLanes * v), cell, vload(dp + windows[p] + kLanes * v));
    }
#pragma GCC unroll 16
    for (int r = 0; r < KB; ++r) {
      const Vec av = vbroadcast(corner[off[r]]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = vfmadd(av, dv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < KB; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* out = dw + r * ldw + kLanes * v;
      vstore(out, accumulate ? vadd(vload(out), acc[r][v]) : acc[r][v]);
    }
  }
}

using FilterTileArgmaxFn = void (*)(const float*, const int64_t*, const int64_t*, const std::int32_t*, int64_t,
                                    const int64_t*, const std::uint8_t*, const float*, float*, int64_t, bool);
template <int NV, int... R>
constexpr std::array<FilterTileArgmaxFn, sizeof...(R)> filter_tiles_argmax(std::integer_sequence<int, R...>) {
  return {&filter_tile_argmax<R + 1, NV>...};
}
constexpr auto kFilterTilesArgmax1 = filter_tiles_argmax<1>(std::make_integer_sequence<int, max_tile_rows(1)>{});
constexpr auto kFilterTilesArgmax2 = filter_tiles_argmax<2>(std::make_integer_sequence<int, max_tile_rows(2)>{});
constexpr auto kFilterTilesArgmax4 = filter_tiles_argmax<4>(std::make_integer_sequence<int, kRows4>{});

FilterTileArgmaxFn filter_tile_argmax_fn(int registers, int64_t rows) {
  const auto i = static_cast<std::size_t>(rows - 1);
  return registers == 4 ? kFilterTilesArgmax4[i] : registers == 2 ? kFilterTilesArgmax2[i] : kFilterTilesArgmax1[i];
}

// The widest column block whose tile holds a whole patch of k rows, or 0 when none does (then
// dy is expanded chunk by chunk and read by filter_tile).
int argmax_tile_registers(int64_t k) {
  for (int registers = kWidestBlock; registers >= 1; registers /= 2) {
    if (k <= max_tile_rows(registers)) return registers;
  }
  return 0;
}

// The pixels of dy rows [r0, r1) that lie in a pool window, in row order: each one's window
// corner in `image`, its window's offset in the argmax and dp, and its cell. Returns their count.
int64_t argmax_pixels(const Window2DGeometry& g, const Window2DGeometry& pg, const Image& image, int64_t r0,
                      int64_t r1, int64_t* corners, int64_t* windows, std::int32_t* cells) {
  int64_t count = 0;
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t n = row / g.out_h, oh = row % g.out_h;
    const int64_t ph = oh / pg.stride_h, dh = oh % pg.stride_h;
    if (ph >= pg.out_h || dh >= pg.k_h) continue;
    const int64_t corner = image.corner(g, n, oh, 0) - image.data;
    const int64_t window_row = (n * pg.out_h + ph) * pg.out_w * g.out_c;
    int64_t ow = 0;
    for (int64_t pw = 0; pw < pg.out_w; ++pw) {
      for (int64_t dw = 0; dw < pg.stride_w && ow < g.out_w; ++dw, ++ow) {
        if (dw >= pg.k_w) continue;
        corners[count] = corner + ow * g.stride_w * image.c;
        windows[count] = window_row + pw * g.out_c;
        cells[count] = static_cast<std::int32_t>(dh * pg.k_w + dw);
        ++count;
      }
    }
  }
  return count;
}

// --- backprop filter from the argmax, one winner a window --------------------------------------
//
// With input channels a multiple of the lanes, the filter gradient is reduced over each window's
// winners alone: a max pool's dz is dp at one cell of each window and +0 at the others (3 of 4
// with 2x2 windows), so the chunked path's FMAs are mostly x * +0. The winner differs from one
// output channel to the next, so here the tile runs down one output channel, vectorised over the
// patch (whose input channels are consecutive in memory), and each winner costs one load and one
// FMA per vector of its patch: cnn's second layer does a quarter of the chunked path's
// arithmetic. Each dw element is the same FMA chain, over the same chunks of dy rows and in
// pixel order within each, as the chunked path's over the expanded dz, less the terms x * +0
// (which leave a sum started at +0 unchanged, x finite), so the result is bitwise
// conv2d_backprop_filter's of that dz.

// Whether the winners' path takes g's filter gradient from an argmax over pool windows pg.
bool winner_path_applies(const Window2DGeometry& g, const Window2DGeometry& pg) {
  return g.in_c % kLanes == 0 && pg.k_h * pg.k_w >= 2;
}

// Patch vectors a winners' tile holds: the registers less 8, for the broadcast dp and the loads.
constexpr int kWinnerTileVectors = kRegisters - 8;

// A pool window's cells (argmax values) as a row and column in the window: no row for
// detail::kNoWinner (and cells past the window), so that a winner test is one comparison. Made
// once per op call, for both winners' paths.
struct WindowCells {
  std::array<std::uint8_t, 256> row, col;
  explicit WindowCells(const Window2DGeometry& pool) {
    for (int cell = 0; cell < 256; ++cell) {
      const auto i = static_cast<std::size_t>(cell);
      const bool in_window = cell < pool.k_h * pool.k_w;
      row[i] = in_window ? static_cast<std::uint8_t>(cell / pool.k_w) : kNoRow;
      col[i] = in_window ? static_cast<std::uint8_t>(cell % pool.k_w) : 0;
    }
  }
  static constexpr std::uint8_t kNoRow = 255;  // windows have at most 254 cells
};

// One chunk's winners of each output channel, in pixel order: for channel co, entries
// [co * capacity, co * capacity + counts[co]) hold each winning pixel's window corner in `image`
// and its window's dp. A pixel row visits each window of its pool row once, and a window names
// its winner once per channel, so a chunk lists at most (r1 - r0) * pool.out_w per channel
// (`capacity`). Appended without branches (whether a window's winner lies in the row at hand is
// as likely as not): every entry is written, and the count moves past it only for a winner.
void winner_lists(const Window2DGeometry& g, const DyFromArgmax& src, const WindowCells& cells, const Image& image,
                  int64_t r0, int64_t r1, int64_t capacity, int64_t* corners, float* values, int64_t* counts) {
  const Window2DGeometry& pg = src.pool;
  const int64_t o = g.out_c;
  std::fill_n(counts, o, 0);
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t n = row / g.out_h, oh = row % g.out_h;
    const int64_t ph = oh / pg.stride_h, dh = oh % pg.stride_h;
    if (ph >= pg.out_h || dh >= pg.k_h) continue;
    const int64_t row_corner = image.corner(g, n, oh, 0) - image.data;
    const int64_t window_row = (n * pg.out_h + ph) * pg.out_w * o;
    for (int64_t pw = 0; pw < pg.out_w; ++pw) {
      const std::uint8_t* argmax = src.argmax + window_row + pw * o;
      const float* dp = src.dp + window_row + pw * o;
      const int64_t window_corner = row_corner + pw * pg.stride_w * g.stride_w * image.c;
      for (int64_t co = 0; co < o; ++co) {
        const std::uint8_t cell = argmax[co];
        const int64_t at = co * capacity + counts[co];
        corners[at] = window_corner + cells.col[cell] * g.stride_w * image.c;
        values[at] = dp[co];
        counts[co] += cells.row[cell] == dh ? 1 : 0;
      }
    }
  }
}

// out[KV vectors] (+)= sum over the `count` winners of patch vectors * dp: winner p's patch vector
// v is image[corners[p] + offsets[v * kLanes]] onwards (kLanes consecutive patch elements), its dp
// values[p]. The FMA takes x * dp as the chunked path's takes x * dz: the same bits.
template <int KV>
void winner_tile(const float* image, const int64_t* corners, const float* values, int64_t count,
                 const int64_t* offsets, float* out, bool accumulate) {
  Vec acc[KV];
  int64_t off[KV];
#pragma GCC unroll 32
  for (int v = 0; v < KV; ++v) {
    acc[v] = vzero();
    off[v] = offsets[v * kLanes];
  }
  for (int64_t p = 0; p < count; ++p) {
    const float* corner = image + corners[p];
    const Vec d = vbroadcast(values[p]);
#pragma GCC unroll 32
    for (int v = 0; v < KV; ++v) acc[v] = vfmadd(vload(corner + off[v]), d, acc[v]);
  }
#pragma GCC unroll 32
  for (int v = 0; v < KV; ++v) {
    float* o = out + kLanes * v;
    vstore(o, accumulate ? vadd(vload(o), acc[v]) : acc[v]);
  }
}

using WinnerTileFn = void (*)(const float*, const int64_t*, const float*, int64_t, const int64_t*, float*, bool);
template <int... V>
constexpr std::array<WinnerTileFn, sizeof...(V)> winner_tiles(std::integer_sequence<int, V...>) {
  return {&winner_tile<V + 1>...};
}
constexpr auto kWinnerTiles = winner_tiles(std::make_integer_sequence<int, kWinnerTileVectors>{});

// Rows [first, last) of dz, from the argmax, into acc ([k, out_c], as the chunked path's part
// writes it): chunk by chunk (chunk_rows, the chunked path's), each output channel's tiles
// accumulating into a transposed copy ([out_c, k], contiguous patch vectors), transposed into acc
// at the end.
void backprop_filter_winners(const Window2DGeometry& g, const DyFromArgmax& src, const Image& image,
                             const int64_t* offsets, int64_t first, int64_t last, int64_t chunk_rows, float* acc) {
  const int64_t k = g.patch_size(), o = g.out_c, vectors = k / kLanes;
  const int64_t capacity = chunk_rows * src.pool.out_w;
  int64_t* corners = tls_winner_corners.get<int64_t>(o * capacity);
  float* values = tls_winner_values.get<float>(o * capacity);
  int64_t* counts = tls_winner_counts.get<int64_t>(o);
  float* transposed = tls_transposed_dw.get<float>(o * k);
  const WindowCells cells(src.pool);
  for (int64_t r0 = first; r0 < last; r0 += chunk_rows) {
    const int64_t r1 = std::min(last, r0 + chunk_rows);
    winner_lists(g, src, cells, image, r0, r1, capacity, corners, values, counts);
    for (int64_t co = 0; co < o; ++co) {
      for (int64_t v0 = 0; v0 < vectors; v0 += kWinnerTileVectors) {
        const int64_t block = std::min<int64_t>(kWinnerTileVectors, vectors - v0);
        kWinnerTiles[static_cast<std::size_t>(block - 1)](image.data, corners + co * capacity, values + co * capacity,
                                                          counts[co], offsets + v0 * kLanes,
                                                          transposed + co * k + v0 * kLanes, r0 != first);
      }
    }
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int64_t co = 0; co < o; ++co) acc[kk * o + co] = transposed[co * k + kk];
  }
}

// --- backprop input, few input channels ------------------------------------------------------

// One (kh, kw) position of a dx row's windows that lands inside dy: the index of its dy vectors
// in dy (for the pixel at hand) and its filter vectors.
struct Tap {
  int64_t dy;
  const float* w;
};

// dx elements (n, ih, iw .. iw + P - 1, :), for P = 1, or for P = 4 consecutive columns whose
// windows all lie inside dy with stride 1 (so their dy columns are consecutive too). Each element
// is the dot product of the dy vectors its window reaches with the matching filter vectors,
// reduced over the output channels at the end. Four pixels at once share the filter loads and
// give the FMA units independent chains; two accumulators per element halve the chains.
template <int C, int P, int kVectors>
void backprop_input_pixels(int64_t o, const float* dy, const Tap* taps, int64_t num_taps, int64_t dy_shift,
                           float* out) {
  constexpr int kSplit = P * C <= 4 ? 2 : 1;
  const int64_t vectors = kVectors > 0 ? kVectors : o / kLanes;
  Vec acc[P][C][kSplit];
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
#pragma GCC unroll 2
      for (int s = 0; s < kSplit; ++s) acc[p][c][s] = vzero();
    }
  }
  for (int64_t t = 0; t < num_taps; ++t) {
    const float* d = dy + (taps[t].dy + dy_shift);
    const float* wk = taps[t].w;
    // Pairs of channel vectors, into the two accumulators: constant indices only (a variable
    // one, such as j & 1, would keep acc in memory).
    int64_t j = 0;
#pragma GCC unroll 4
    for (; j + 2 <= vectors; j += 2) {
      Vec d0[P], d1[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        d0[p] = vload(d + p * o + kLanes * j);
        d1[p] = vload(d + p * o + kLanes * (j + 1));
      }
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const Vec w0 = vload(wk + c * o + kLanes * j);
        const Vec w1 = vload(wk + c * o + kLanes * (j + 1));
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          acc[p][c][0] = vfmadd(d0[p], w0, acc[p][c][0]);
          acc[p][c][kSplit - 1] = vfmadd(d1[p], w1, acc[p][c][kSplit - 1]);
        }
      }
    }
    if (j < vectors) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const Vec w0 = vload(wk + c * o + kLanes * j);
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          acc[p][c][0] = vfmadd(vload(d + p * o + kLanes * j), w0, acc[p][c][0]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      Vec sum = acc[p][c][0];
      if constexpr (kSplit == 2) sum = vadd(sum, acc[p][c][1]);
      out[p * C + c] = vsum(sum);
    }
  }
}

template <int C, int kVectors>
void backprop_input_row(const Window2DGeometry& g, const float* w, const float* dy, const std::int32_t* columns,
                        const std::uint8_t* full, float* dx, int64_t n, int64_t ih) {
  // Pixels at once: 4 share each filter load with AVX-512; AVX2 has registers for 2.
  constexpr int64_t kQuad = kLanes == 16 ? 4 : 2;
  const int64_t o = g.out_c;
  // Uninitialised on purpose: only the entries written below are read.
  std::array<Tap, kMaxBackpropInputTaps> full_taps;  // all kw, for column 0 (stride 1)
  std::array<int64_t, kMaxBackpropInputTaps> dy_rows;
  std::array<const float*, kMaxBackpropInputTaps> w_rows;
  int64_t rows = 0, num_full = 0;
  for (int64_t kh = 0; kh < g.k_h; ++kh) {
    const int64_t t = ih + g.pad_top - kh;  // oh * stride_h, when a whole output row
    if (t < 0) break;
    if (t % g.stride_h != 0 || t / g.stride_h >= g.out_h) continue;
    const int64_t dy_row = ((n * g.out_h + t / g.stride_h) * g.out_w) * o;
    const float* w_row = w + kh * g.k_w * C * o;
    dy_rows[static_cast<std::size_t>(rows)] = dy_row;
    w_rows[static_cast<std::size_t>(rows)] = w_row;
    ++rows;
    for (int64_t kw = 0; kw < g.k_w; ++kw) {
      full_taps[static_cast<std::size_t>(num_full++)] = Tap{dy_row + (g.pad_left - kw) * o, w_row + kw * C * o};
    }
  }
  float* out = dx + ((n * g.in_h + ih) * g.in_w) * C;
  std::array<Tap, kMaxBackpropInputTaps> taps;
  for (int64_t iw = 0; iw < g.in_w;) {
    // full[] is true on one contiguous run of columns, so checking both ends suffices.
    if (g.stride_w == 1 && iw + kQuad <= g.in_w && full[iw] && full[iw + kQuad - 1]) {
      backprop_input_pixels<C, kQuad, kVectors>(o, dy, full_taps.data(), num_full, iw * o, out + iw * C);
      iw += kQuad;
      continue;
    }
    int64_t num_taps = 0;
    const std::int32_t* ows = columns + iw * g.k_w;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t kw = 0; kw < g.k_w; ++kw) {
        if (ows[kw] < 0) continue;
        taps[static_cast<std::size_t>(num_taps++)] =
            Tap{dy_rows[static_cast<std::size_t>(i)] + ows[kw] * o, w_rows[static_cast<std::size_t>(i)] + kw * C * o};
      }
    }
    backprop_input_pixels<C, 1, kVectors>(o, dy, taps.data(), num_taps, 0, out + iw * C);
    ++iw;
  }
}

template <int C, int kVectors>
void backprop_input_few_channels(devices::Device& device, const Window2DGeometry& g, const float* w, const float* dy,
                                 float* dx) {
  // The output column (if any) each (iw, kw) reads, computed once rather than per element (it
  // divides by the stride).
  std::int32_t* columns = tls_columns.get<std::int32_t>(g.in_w * g.k_w);
  std::uint8_t* full = tls_full_columns.get<std::uint8_t>(g.in_w);
  for (int64_t iw = 0; iw < g.in_w; ++iw) {
    full[iw] = 1;
    for (int64_t kw = 0; kw < g.k_w; ++kw) {
      const int64_t u = iw + g.pad_left - kw;
      const bool hit = u >= 0 && u % g.stride_w == 0 && u / g.stride_w < g.out_w;
      columns[iw * g.k_w + kw] = hit ? static_cast<std::int32_t>(u / g.stride_w) : -1;
      full[iw] &= hit ? 1 : 0;
    }
  }
  const int64_t row_work = g.in_w * g.k_h * g.k_w * g.out_c;
  device.parallel_for(g.batch * g.in_h, row_grain(row_work), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      backprop_input_row<C, kVectors>(g, w, dy, columns, full, dx, row / g.in_h, row % g.in_h);
    }
  });
}

// 16, 32 and 64 output channels get channel loops the compiler unrolls completely.
template <int C>
void backprop_input_few_channels(devices::Device& device, const Window2DGeometry& g, const float* w, const float* dy,
                                 float* dx) {
  switch (g.out_c / kLanes) {
    case 1: return backprop_input_few_channels<C, 1>(device, g, w, dy, dx);
    case 2: return backprop_input_few_channels<C, 2>(device, g, w, dy, dx);
    case 4: return backprop_input_few_channels<C, 4>(device, g, w, dy, dx);
    default: return backprop_input_few_channels<C, 0>(device, g, w, dy, dx);
  }
}

// --- backprop input, stride 1 ----------------------------------------------------------------

// The forward convolution that computes dx for stride 1: dx[ih, iw] sums
// dy[ih + pad_top - kh, iw + pad_left - kw] @ w[kh, kw]^T, which is dy padded by k - 1 - pad,
// convolved with the filter flipped in space and transposed in channels:
// w'[kh', kw', o, c] = w[k_h - 1 - kh', k_w - 1 - kw', c, o].
Window2DGeometry flipped_geometry(const Window2DGeometry& g) {
  Window2DGeometry t = g;
  t.in_h = g.out_h;
  t.in_w = g.out_w;
  t.in_c = g.out_c;
  t.out_c = g.in_c;
  t.out_h = g.in_h;
  t.out_w = g.in_w;
  t.pad_top = g.k_h - 1 - g.pad_top;
  t.pad_left = g.k_w - 1 - g.pad_left;
  return t;
}

// Backprop-input from the argmax, over each window's winners alone (see the filter gradient's
// winners above): dx pixel (ih, iw) reduces, as the flipped forward does, over its valid taps
// (kh', kw') in order and the output channels in order, but only over the channels whose winner
// is the dz pixel the tap reaches (a quarter of them with 2x2 windows); the terms left out are
// dz = +0. Each pixel has its own winners; tiles hold all of a pixel's input channels, for a strip
// of pixels along a row (each winner read once for all of them) or a pixel alone.

// One image's winners by dz pixel: entries [q * o, q * o + counts[q]) of dz pixel q hold, in
// channel order, the offset of the channel's row in a flipped tap's filter rows (co * in_c) and
// its window's dp. A channel without a winner writes its entry to a spare pixel past the image's
// (whose count stays 0), so that appending needs no branch.
void pixel_winners(const Window2DGeometry& g, const DyFromArgmax& src, const WindowCells& cells, int64_t n,
                   int32_t* offsets, float* values, int64_t* counts) {
  const Window2DGeometry& pg = src.pool;
  const int64_t o = g.out_c, pixels = g.out_h * g.out_w;
  std::fill_n(counts, pixels + 1, 0);
  for (int64_t ph = 0; ph < pg.out_h; ++ph) {
    for (int64_t pw = 0; pw < pg.out_w; ++pw) {
      const int64_t window = ((n * pg.out_h + ph) * pg.out_w + pw) * o;
      const int64_t corner = ph * pg.stride_h * g.out_w + pw * pg.stride_w;
      for (int64_t co = 0; co < o; ++co) {
        const std::uint8_t cell = src.argmax[window + co];
        const bool won = cells.row[cell] != WindowCells::kNoRow;
        const int64_t q = won ? corner + cells.row[cell] * g.out_w + cells.col[cell] : pixels;
        const int64_t at = q * o + counts[q];
        offsets[at] = static_cast<int32_t>(co * g.in_c);
        values[at] = src.dp[window + co];
        counts[q] += won ? 1 : 0;
      }
    }
  }
}

// dx[KV vectors] of one pixel = sum over its taps (each a dz pixel's winners and the flipped filter
// rows of that tap) of dp * filter row: taps[t] indexes the dz pixel, tap_w[t] the tap's rows
// (already offset to the tile's first input channel). The FMA takes dp * w as the flipped
// forward's takes dz * w: the same bits. For the pixels the strips below do not take (the ends of
// rows, filters over 5 columns wide, over 4 vectors of input channels).
template <int KV>
void winner_pixel_tile(const int64_t* taps, const float* const* tap_w, int64_t num_taps, int64_t o,
                       const int32_t* offsets, const float* values, const int64_t* counts, float* dx) {
  Vec acc[KV];
#pragma GCC unroll 32
  for (int v = 0; v < KV; ++v) acc[v] = vzero();
  for (int64_t t = 0; t < num_taps; ++t) {
    const int64_t q = taps[t];
    const int32_t* off = offsets + q * o;
    const float* val = values + q * o;
    const float* w = tap_w[t];
    for (int64_t e = 0; e < counts[q]; ++e) {
      const Vec d = vbroadcast(val[e]);
      const float* row = w + off[e];
#pragma GCC unroll 32
      for (int v = 0; v < KV; ++v) acc[v] = vfmadd(d, vload(row + kLanes * v), acc[v]);
    }
  }
#pragma GCC unroll 32
  for (int v = 0; v < KV; ++v) vstore(dx + kLanes * v, acc[v]);
}

using WinnerPixelTileFn = void (*)(const int64_t*, const float* const*, int64_t, int64_t, const int32_t*, const float*,
                                   const int64_t*, float*);
template <int... V>
constexpr std::array<WinnerPixelTileFn, sizeof...(V)> winner_pixel_tiles(std::integer_sequence<int, V...>) {
  return {&winner_pixel_tile<V + 1>...};
}
constexpr auto kWinnerPixelTiles = winner_pixel_tiles(std::make_integer_sequence<int, kWinnerTileVectors>{});

// A strip of S dx pixels of one row, for filters KW columns wide: each winner of a dz pixel is read
// once and added to every pixel of the strip whose window holds that dz pixel, each with its own
// tap (dz column first_col + U is tap kw = U - J of strip pixel J), where a pixel alone read each
// winner for one FMA per vector. Each pixel's chain keeps the flipped forward's order: rows
// (kh') in order, then within a row the dz columns, hence its taps kw', in order, then the
// channels. rows[t] is the t-th valid tap row's first dz pixel in the image (r * out_w), row_w[t]
// its flipped filter rows (tap kw at + kw * tap_stride); dz columns outside [0, out_w) are left
// out, as the flipped forward leaves out taps over padding.
template <int S, int KW, int KV>
void winner_strip_tile(const int64_t* rows, const float* const* row_w, int64_t num_rows, int64_t first_col,
                       int64_t out_w, int64_t o, int64_t tap_stride, const int32_t* offsets, const float* values,
                       const int64_t* counts, float* dx, int64_t dx_next) {
  Vec acc[S][KV];
#pragma GCC unroll 8
  for (int j = 0; j < S; ++j) {
#pragma GCC unroll 32
    for (int v = 0; v < KV; ++v) acc[j][v] = vzero();
  }
  for (int64_t t = 0; t < num_rows; ++t) {
    const float* w = row_w[t];
    const auto column = [&]<int U>() {
      const int64_t col = first_col + U;
      if (col < 0 || col >= out_w) return;
      const int64_t q = rows[t] + col;
      const int32_t* off = offsets + q * o;
      const float* val = values + q * o;
      for (int64_t e = 0; e < counts[q]; ++e) {
        const Vec d = vbroadcast(val[e]);
        const float* base = w + off[e];
        const auto add = [&]<int J>() {
          if constexpr (U - J >= 0 && U - J < KW) {
#pragma GCC unroll 32
            for (int v = 0; v < KV; ++v)
              acc[J][v] = vfmadd(d, vload(base + (U - J) * tap_stride + kLanes * v), acc[J][v]);
          }
        };
        [&]<int... J>(std::integer_sequence<int, J...>) {
          (add.template operator()<J>(), ...);
        }(std::make_integer_sequence<int, S>{});
      }
    };
    [&]<int... U>(std::integer_sequence<int, U...>) {
      (column.template operator()<U>(), ...);
    }(std::make_integer_sequence<int, S + KW - 1>{});
  }
#pragma GCC unroll 8
  for (int j = 0; j < S; ++j) {
#pragma GCC unroll 32
    for (int v = 0; v < KV; ++v) vstore(dx + j * dx_next + kLanes * v, acc[j][v]);
  }
}

// Strips for filters 1-5 columns wide and 1-4 vectors of input channels, as many pixels as the
// registers hold, up to 6: on cnn's second layer (dx rows of 13 pixels, 2 vectors with AVX-512)
// strips of 6 took the input gradient in 1.08-1.09 ms, of 8 in 1.17-1.20 (5 pixels of a row left
// to single-pixel tiles), of 4 in 1.10-1.15 (bench_ops --only conv, alternating).
inline constexpr int kStripMaxKw = 5, kStripMaxVectors = 4;
constexpr int strip_pixels(int vectors) { return std::max(1, std::min(6, kWinnerTileVectors / vectors)); }
using WinnerStripTileFn = void (*)(const int64_t*, const float* const*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                   const int32_t*, const float*, const int64_t*, float*, int64_t);
template <int KW, int... V>
constexpr std::array<WinnerStripTileFn, sizeof...(V)> winner_strip_tiles(std::integer_sequence<int, V...>) {
  return {&winner_strip_tile<strip_pixels(V + 1), KW, V + 1>...};
}
template <int... W>
constexpr std::array<std::array<WinnerStripTileFn, kStripMaxVectors>, sizeof...(W)> winner_strip_table(
    std::integer_sequence<int, W...>) {
  return {winner_strip_tiles<W + 1>(std::make_integer_sequence<int, kStripMaxVectors>{})...};
}
constexpr auto kWinnerStripTiles = winner_strip_table(std::make_integer_sequence<int, kStripMaxKw>{});

// dx from the argmax for stride 1, image by image (flipped: the flipped, transposed filter).
void backprop_input_winners(devices::Device& device, const Window2DGeometry& g, const float* flipped,
                            const DyFromArgmax& src, float* dx) {
  const int64_t c = g.in_c, o = g.out_c, pixels = g.out_h * g.out_w, vectors = c / kLanes;
  // dz row and column reached by flipped tap kh' (kw') from dx row ih (column iw).
  const int64_t top = g.k_h - 1 - g.pad_top, left = g.k_w - 1 - g.pad_left;
  // Strips along each dx row where the filter and channels have one; single pixels for the rest.
  const bool strips = g.k_w <= kStripMaxKw && vectors <= kStripMaxVectors;
  const WinnerStripTileFn strip =
      strips ? kWinnerStripTiles[static_cast<std::size_t>(g.k_w - 1)][static_cast<std::size_t>(vectors - 1)] : nullptr;
  const int64_t strip_width = strips ? strip_pixels(static_cast<int>(vectors)) : 0;
  const WindowCells cells(src.pool);
  device.parallel_for(g.batch, 1, [&](int64_t begin, int64_t end) {
    int32_t* offsets = tls_winner_offsets.get<int32_t>((pixels + 1) * o);
    float* values = tls_winner_values.get<float>((pixels + 1) * o);
    int64_t* counts = tls_winner_counts.get<int64_t>(pixels + 1);
    std::array<int64_t, kMaxBackpropInputTaps> taps, rows;
    std::array<const float*, kMaxBackpropInputTaps> tap_w, row_w;
    for (int64_t n = begin; n < end; ++n) {
      pixel_winners(g, src, cells, n, offsets, values, counts);
      for (int64_t ih = 0; ih < g.in_h; ++ih) {
        int64_t num_rows = 0;
        for (int64_t kh = 0; kh < g.k_h; ++kh) {
          const int64_t r = ih - top + kh;
          if (r < 0 || r >= g.out_h) continue;
          rows[static_cast<std::size_t>(num_rows)] = r * g.out_w;
          row_w[static_cast<std::size_t>(num_rows)] = flipped + kh * g.k_w * o * c;
          ++num_rows;
        }
        float* out_row = dx + (n * g.in_h + ih) * g.in_w * c;
        int64_t iw = 0;
        if (strip != nullptr) {
          for (; iw + strip_width <= g.in_w; iw += strip_width) {
            strip(rows.data(), row_w.data(), num_rows, iw - left, g.out_w, o, o * c, offsets, values, counts,
                  out_row + iw * c, c);
          }
        }
        for (; iw < g.in_w; ++iw) {
          int64_t num_taps = 0;
          for (int64_t t = 0; t < num_rows; ++t) {
            for (int64_t kw = 0; kw < g.k_w; ++kw) {
              const int64_t col = iw - left + kw;
              if (col < 0 || col >= g.out_w) continue;
              taps[static_cast<std::size_t>(num_taps)] = rows[static_cast<std::size_t>(t)] + col;
              tap_w[static_cast<std::size_t>(num_taps)] = row_w[static_cast<std::size_t>(t)] + kw * o * c;
              ++num_taps;
            }
          }
          kWinnerPixelTiles[static_cast<std::size_t>(vectors - 1)](taps.data(), tap_w.data(), num_taps, o, offsets,
                                                                   values, counts, out_row + iw * c);
        }
      }
    }
  });
}

void backprop_input_flipped(devices::Device& device, const Window2DGeometry& g, const float* w, const float* dy,
                            float* dx, const DyFromArgmax* from_argmax = nullptr) {
  const int64_t c = g.in_c, o = g.out_c, taps = g.k_h * g.k_w;
  float* flipped = tls_flipped.get<float>(taps * c * o);
  for (int64_t t = 0; t < taps; ++t) {
    const float* src = w + (taps - 1 - t) * c * o;  // tap (k_h-1-kh', k_w-1-kw') is tap taps-1-t
    float* dst = flipped + t * o * c;
    for (int64_t ci = 0; ci < c; ++ci) {
      for (int64_t oi = 0; oi < o; ++oi) dst[oi * c + ci] = src[ci * o + oi];
    }
  }
  if (from_argmax == nullptr) {
    forward_direct(device, flipped_geometry(g), dy, flipped, dx, {});
    return;
  }
  // The winners' tiles hold a pixel's input channels in registers (kWinnerTileVectors: 384
  // channels with AVX-512, 64 with AVX2); wider layers keep the flipped forward.
  if (winner_path_applies(g, from_argmax->pool) && g.in_c <= kWinnerTileVectors * kLanes &&
      g.k_h * g.k_w <= kMaxBackpropInputTaps) {
    backprop_input_winners(device, g, flipped, *from_argmax, dx);
    return;
  }
  const ImagesFromArgmax images{g, *from_argmax};
  forward_direct(device, flipped_geometry(g), nullptr, flipped, dx, {}, nullptr, &images);
}

}  // namespace

bool conv2d_forward(devices::Device& device, const Window2DGeometry& g, const float* x, const float* w, float* y,
                    ForwardEpilogue epilogue) {
  if (!forward_applies(g)) return false;
  forward_direct(device, g, x, w, y, epilogue);
  return true;
}

bool conv2d_forward_max_pool(devices::Device& device, const Window2DGeometry& g, const float* x, const float* w,
                             ForwardEpilogue epilogue, const ForwardMaxPool& pool) {
  if (!forward_applies(g)) return false;
  forward_direct(device, g, x, w, nullptr, epilogue, &pool);
  return true;
}

namespace {

bool backprop_filter_applies(const Window2DGeometry& g) {
  return g.in_c >= 1 && g.out_c >= 1 && g.out_c % kLanes == 0 && g.patch_size() <= kMaxPatch;
}

// dy, or with `from_argmax` each chunk of dy expanded into an L1-sized buffer first (dy unused).
void backprop_filter_direct(devices::Device& device, const Window2DGeometry& g, const float* x, const float* dy,
                            float* dw, const DyFromArgmax* from_argmax) {
  const Image image = padded_input(device, g, x);
  const int64_t* offsets = patch_offsets(g, image.w, image.c);
  const int64_t k = g.patch_size(), o = g.out_c, rows = g.batch * g.out_h;
  // Parts (not threads) own partial sums: part 0 writes dw, the others scratch, added at the end.
  const int64_t parts = std::min<int64_t>(device.intra_op_threads(), rows);
  const int64_t part_rows = (rows + parts - 1) / parts;
  const int64_t chunk_rows = std::max<int64_t>(1, kDyChunkBytes / (g.out_w * o * static_cast<int64_t>(sizeof(float))));
  float* partials = tls_partials.get<float>((parts - 1) * k * o);
  // The register tile (filter_tile_argmax) when it is at least as wide as the chunked path's
  // first column block: a narrower one walks the pixels more often than the chunked path. With
  // AVX2, 9 taps fit a tile one register wide, not two, and cnn's first layer (32 channels) took
  // 0.59 ms that way against 0.49 chunked (Zen 4 under TANDEM_CPU_ISA=avx2, bench_ops minimums).
  const int tile_registers = argmax_tile_registers(k);
  const bool winners = from_argmax != nullptr && winner_path_applies(g, from_argmax->pool);
  const int fused_registers =
      from_argmax != nullptr && !winners && tile_registers >= column_block(o) ? tile_registers : 0;
  device.parallel_for(parts, 1, [&](int64_t begin, int64_t end) {
    const bool expand = from_argmax != nullptr && !winners && fused_registers == 0;
    float* chunk = expand ? tls_dy_chunk.get<float>(chunk_rows * g.out_w * o) : nullptr;
    int64_t* corners = winners ? nullptr : tls_corners.get<int64_t>(chunk_rows * g.out_w);  // the winners list their own
    int64_t* windows = fused_registers > 0 ? tls_windows.get<int64_t>(chunk_rows * g.out_w) : nullptr;
    std::int32_t* cells = fused_registers > 0 ? tls_cells.get<std::int32_t>(chunk_rows * g.out_w) : nullptr;
    for (int64_t part = begin; part < end; ++part) {
      float* acc = part == 0 ? dw : partials + (part - 1) * k * o;
      const int64_t first = part * part_rows, last = std::min(rows, first + part_rows);
      if (first >= last) std::fill_n(acc, k * o, 0.0f);
      if (winners) {
        if (first < last) backprop_filter_winners(g, *from_argmax, image, offsets, first, last, chunk_rows, acc);
        continue;
      }
      for (int64_t r0 = first; r0 < last; r0 += chunk_rows) {
        const int64_t r1 = std::min(last, r0 + chunk_rows);
        if (fused_registers > 0) {
          const int64_t count = argmax_pixels(g, from_argmax->pool, image, r0, r1, corners, windows, cells);
          for (int64_t j = 0; j < o;) {
            const int registers = std::min(column_block(o - j), fused_registers);
            filter_tile_argmax_fn(registers, k)(image.data, corners, windows, cells, count, offsets,
                                                from_argmax->argmax + j, from_argmax->dp + j, acc + j, o, r0 != first);
            j += registers * kLanes;
          }
          continue;
        }
        if (chunk != nullptr) expand_argmax_rows(g, *from_argmax, r0, r1, chunk);
        const float* dy_rows = chunk != nullptr ? chunk : dy + r0 * g.out_w * o;
        int64_t count = 0;
        for (int64_t row = r0; row < r1; ++row) {
          const int64_t corner = image.corner(g, row / g.out_h, row % g.out_h, 0) - image.data;
          for (int64_t ow = 0; ow < g.out_w; ++ow) corners[count++] = corner + ow * g.stride_w * image.c;
        }
        for (int64_t j = 0; j < o;) {
          const int registers = column_block(o - j);
          const int64_t max_rows = max_tile_rows(registers);
          for (int64_t k0 = 0; k0 < k; k0 += max_rows) {
            filter_tile_fn(registers, std::min(max_rows, k - k0))(image.data, corners, count, offsets + k0, dy_rows + j,
                                                                  o, acc + k0 * o + j, o, r0 != first);
          }
          j += registers * kLanes;
        }
      }
    }
  });
  if (parts > 1) {
    device.parallel_for(k * o, kElementwiseGrain, [&](int64_t begin, int64_t end) {
      for (int64_t part = 1; part < parts; ++part) {
        const float* p = partials + (part - 1) * k * o;
        for (int64_t i = begin; i < end; ++i) dw[i] += p[i];
      }
    });
  }
}

}  // namespace

bool conv2d_backprop_filter(devices::Device& device, const Window2DGeometry& g, const float* x, const float* dy,
                            float* dw) {
  if (!backprop_filter_applies(g)) return false;
  backprop_filter_direct(device, g, x, dy, dw, nullptr);
  return true;
}

bool conv2d_backprop_filter_argmax(devices::Device& device, const Window2DGeometry& g, const float* x,
                                   const DyFromArgmax& dy, float* dw) {
  if (!backprop_filter_applies(g)) return false;
  backprop_filter_direct(device, g, x, nullptr, dw, &dy);
  return true;
}

namespace {

// Which direct kernel takes backprop input at g, if any: one decision for conv2d_backprop_input
// and conv2d_backprop_input_argmax, so that the two always run the same arithmetic.
enum class BackpropInputPath { kNone, kFewChannels, kFlipped };
BackpropInputPath backprop_input_path(const Window2DGeometry& g) {
  if (g.in_c < 1 || g.out_c < 1 || g.out_c % kLanes != 0) return BackpropInputPath::kNone;
  if (g.in_c <= kMaxBackpropInputChannels && g.k_h * g.k_w <= kMaxBackpropInputTaps)
    return BackpropInputPath::kFewChannels;
  if (g.stride_h == 1 && g.stride_w == 1 && forward_applies(flipped_geometry(g))) return BackpropInputPath::kFlipped;
  return BackpropInputPath::kNone;
}

}  // namespace

bool conv2d_backprop_input(devices::Device& device, const Window2DGeometry& g, const float* w, const float* dy,
                           float* dx) {
  switch (backprop_input_path(g)) {
    case BackpropInputPath::kFewChannels:
      switch (g.in_c) {
        case 1: backprop_input_few_channels<1>(device, g, w, dy, dx); break;
        case 2: backprop_input_few_channels<2>(device, g, w, dy, dx); break;
        case 3: backprop_input_few_channels<3>(device, g, w, dy, dx); break;
        default: backprop_input_few_channels<4>(device, g, w, dy, dx); break;
      }
      return true;
    case BackpropInputPath::kFlipped: backprop_input_flipped(device, g, w, dy, dx); return true;
    case BackpropInputPath::kNone: break;
  }
  return false;
}

bool conv2d_backprop_input_argmax(devices::Device& device, const Window2DGeometry& g, const float* w,
                                  const DyFromArgmax& dy, float* dx) {
  if (backprop_input_path(g) != BackpropInputPath::kFlipped) return false;
  backprop_input_flipped(device, g, w, nullptr, dx, &dy);
  return true;
}

#else  // baseline: the GEMM paths handle everything

bool conv2d_forward(devices::Device&, const detail::Window2DGeometry&, const float*, const float*, float*,
                    ForwardEpilogue) {
  return false;
}
bool conv2d_forward_max_pool(devices::Device&, const detail::Window2DGeometry&, const float*, const float*,
                             ForwardEpilogue, const ForwardMaxPool&) {
  return false;
}
bool conv2d_backprop_filter(devices::Device&, const detail::Window2DGeometry&, const float*, const float*, float*) {
  return false;
}
bool conv2d_backprop_filter_argmax(devices::Device&, const detail::Window2DGeometry&, const float*, const DyFromArgmax&,
                                   float*) {
  return false;
}
bool conv2d_backprop_input(devices::Device&, const detail::Window2DGeometry&, const float*, const float*, float*) {
  return false;
}
bool conv2d_backprop_input_argmax(devices::Device&, const detail::Window2DGeometry&, const float*, const DyFromArgmax&,
                                  float*) {
  return false;
}

#endif

}  // namespace tandem::ops::cpu::direct
