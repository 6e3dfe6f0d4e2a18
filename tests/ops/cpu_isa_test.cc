// The CPU kernels' instruction-set levels (base/cpu_isa.h, ops/cpu/isa.h): which level runs, and
// every level this CPU has against a float64 reference, in one process (the op suites run once
// per level besides, under TANDEM_CPU_ISA; see CMakeLists.txt).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "common/random_values.h"
#include "tandem/base/cpu_isa.h"
#include "tandem/base/env.h"
#include "tandem/base/errors.h"
#include "tandem/devices/device.h"
#include "tandem/ops/cpu/conv_geometry.h"
#include "tandem/ops/cpu/isa.h"
#include "tandem/ops/ops.h"

namespace {

using tandem::CpuIsa;
using tandem::ops::Padding;
using tandem::ops::detail::Window2DGeometry;

Window2DGeometry geometry(std::int64_t batch, std::int64_t h, std::int64_t w, std::int64_t c, std::int64_t k,
                          std::int64_t o, std::int64_t stride, Padding padding) {
  namespace d = tandem::ops::detail;
  Window2DGeometry g;
  g.batch = batch;
  g.in_h = h;
  g.in_w = w;
  g.in_c = c;
  g.k_h = g.k_w = k;
  g.out_c = o;
  g.stride_h = g.stride_w = stride;
  g.out_h = d::window_output_size(h, k, stride, padding);
  g.out_w = d::window_output_size(w, k, stride, padding);
  g.pad_top = d::window_pad_before(h, k, stride, g.out_h, padding);
  g.pad_left = d::window_pad_before(w, k, stride, g.out_w, padding);
  return g;
}

// The three passes of a convolution in float64, by their definitions (NHWC input, HWIO filter).
struct Reference {
  std::vector<double> y, dw, dx;
};

Reference reference(const Window2DGeometry& g, const std::vector<float>& x, const std::vector<float>& w,
                    const std::vector<float>& dy) {
  Reference r{std::vector<double>(static_cast<std::size_t>(g.out_pixels() * g.out_c)),
              std::vector<double>(static_cast<std::size_t>(g.patch_size() * g.out_c)),
              std::vector<double>(static_cast<std::size_t>(g.batch * g.in_h * g.in_w * g.in_c))};
  for (std::int64_t n = 0; n < g.batch; ++n) {
    for (std::int64_t oh = 0; oh < g.out_h; ++oh) {
      for (std::int64_t ow = 0; ow < g.out_w; ++ow) {
        const std::int64_t pixel = (n * g.out_h + oh) * g.out_w + ow;
        for (std::int64_t kh = 0; kh < g.k_h; ++kh) {
          for (std::int64_t kw = 0; kw < g.k_w; ++kw) {
            const std::int64_t ih = oh * g.stride_h - g.pad_top + kh, iw = ow * g.stride_w - g.pad_left + kw;
            if (ih < 0 || ih >= g.in_h || iw < 0 || iw >= g.in_w) continue;
            for (std::int64_t c = 0; c < g.in_c; ++c) {
              const std::size_t xi = static_cast<std::size_t>(((n * g.in_h + ih) * g.in_w + iw) * g.in_c + c);
              const std::int64_t row = (kh * g.k_w + kw) * g.in_c + c;
              for (std::int64_t o = 0; o < g.out_c; ++o) {
                const std::size_t wi = static_cast<std::size_t>(row * g.out_c + o);
                const std::size_t yi = static_cast<std::size_t>(pixel * g.out_c + o);
                r.y[yi] += double{x[xi]} * w[wi];
                r.dw[wi] += double{x[xi]} * dy[yi];
                r.dx[xi] += double{w[wi]} * dy[yi];
              }
            }
          }
        }
      }
    }
  }
  return r;
}

// The largest difference over the largest reference value.
double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0, scale = 1e-30;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return diff / scale;
}

struct Case {
  const char* name;
  Window2DGeometry g;
};

std::vector<Case> cases() {
  return {
      {"first layer 12x12x1 -> 32, 3x3 VALID", geometry(3, 12, 12, 1, 3, 32, 1, Padding::kValid)},
      {"7x7x32 -> 64, 3x3 VALID", geometry(2, 7, 7, 32, 3, 64, 1, Padding::kValid)},
      {"9x9x3 -> 16, 3x3 SAME stride 2", geometry(2, 9, 9, 3, 3, 16, 2, Padding::kSame)},
      {"6x6x8 -> 48, 5x5 SAME", geometry(2, 6, 6, 8, 5, 48, 1, Padding::kSame)},
      {"5x6x16 -> 24, 3x3 SAME (24 channels: AVX2's lanes only)", geometry(2, 5, 6, 16, 3, 24, 1, Padding::kSame)},
  };
}

}  // namespace

TEST_CASE("the CPU kernels run the level TANDEM_CPU_ISA asks for, else the newest this CPU has") {
  const auto levels = tandem::supported_cpu_isas();
  REQUIRE(!levels.empty());
  CHECK(levels.front() == CpuIsa::kBaseline);
  CHECK(tandem::best_cpu_isa() == levels.back());
  const std::string requested = tandem::env::get_string(tandem::env::kCpuIsa);
  MESSAGE("this CPU runs: " << tandem::supported_cpu_isa_names() << "; TANDEM_CPU_ISA=" << requested
                            << "; running: " << tandem::cpu_isa_name(tandem::cpu_isa()));
  if (requested == "auto") {
    CHECK(tandem::cpu_isa() == tandem::best_cpu_isa());
  } else {
    CHECK(tandem::cpu_isa_name(tandem::cpu_isa()) == requested);
  }
  tandem::ops::register_all();  // registers the chosen level's kernels; must not throw
  for (CpuIsa isa : levels) CHECK(tandem::ops::cpu::isa_kernels(isa).isa == isa);
}

TEST_CASE("a level this CPU lacks is refused, naming the variable") {
  bool any_missing = false;
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (tandem::cpu_supports(isa)) continue;
    any_missing = true;
    CHECK_THROWS_AS(tandem::ops::cpu::isa_kernels(isa), tandem::FailedPrecondition);
  }
  if (!any_missing) MESSAGE("this CPU runs every level: nothing to refuse here");
  CHECK_THROWS_WITH_AS(tandem::env::parse_choice(tandem::env::kCpuIsa, "avx9"),
                       doctest::Contains("TANDEM_CPU_ISA=\"avx9\""), tandem::InvalidArgument);
}

TEST_CASE("every level's direct convolutions equal the float64 definition") {
  auto& device = tandem::devices::default_cpu_device();
  for (CpuIsa isa : tandem::supported_cpu_isas()) {
    const auto& k = tandem::ops::cpu::isa_kernels(isa);
    int ran = 0;
    for (const auto& [name, g] : cases()) {
      CAPTURE(tandem::cpu_isa_name(isa));
      CAPTURE(name);
      const auto x = tandem::testing::random_values(g.batch * g.in_h * g.in_w * g.in_c, 1);
      const auto w = tandem::testing::random_values(g.patch_size() * g.out_c, 2);
      const auto dy = tandem::testing::random_values(g.out_pixels() * g.out_c, 3);
      const Reference want = reference(g, x, w, dy);
      std::vector<float> y(want.y.size()), dw(want.dw.size()), dx(want.dx.size());
      if (k.conv2d_forward(device, g, x.data(), w.data(), y.data(), {})) {
        CHECK(relative_error(y, want.y) < 2e-6);
        ++ran;
        // FusedConv2D's epilogue: relu(y + bias) in registers, the same bits as a pass after.
        const auto bias = tandem::testing::random_values(g.out_c, 4);
        std::vector<float> fused(y.size()), after(y.size());
        REQUIRE(k.conv2d_forward(device, g, x.data(), w.data(), fused.data(), {.bias = bias.data(), .relu = true}));
        for (std::size_t i = 0; i < y.size(); ++i) {
          const float z = y[i] + bias[i % static_cast<std::size_t>(g.out_c)];
          after[i] = std::max(z, 0.0f);
        }
        CHECK(fused == after);
      }
      if (k.conv2d_backprop_filter(device, g, x.data(), dy.data(), dw.data())) {
        CHECK(relative_error(dw, want.dw) < 2e-6);
        ++ran;
      }
      if (k.conv2d_backprop_input(device, g, w.data(), dy.data(), dx.data())) {
        CHECK(relative_error(dx, want.dx) < 2e-6);
        ++ran;
      }
    }
    MESSAGE(tandem::cpu_isa_name(isa) << ": " << ran << " direct convolution passes checked");
    // The baseline level has no direct kernels (im2col + GEMM takes every convolution); AVX2
    // takes all 15 passes; AVX-512 (16 lanes) declines the 24-channel case's three and the
    // 8-input-channel case's backprop input (its flipped forward would have 8 output channels).
    if (isa == CpuIsa::kBaseline) CHECK(ran == 0);
    if (isa == CpuIsa::kAvx2) CHECK(ran == 15);
    if (isa == CpuIsa::kAvx512) CHECK(ran == 11);
  }
}

namespace {

// A CPU device that reports `threads` intra-op threads but runs parallel_for's chunks inline, one
// after another: the register tiles split their work for that many threads, on one.
class ReportedThreads final : public tandem::devices::Device {
 public:
  explicit ReportedThreads(int threads) : Device(name()), threads_(threads) {}
  tandem::devices::Allocator& allocator() override { return cpu().allocator(); }
  tandem::devices::Stream& compute_stream() override { return cpu().compute_stream(); }
  bool host_accessible() const override { return true; }
  void copy_from_host(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_on_device(void* dst, const void* src, std::size_t bytes) override { std::memcpy(dst, src, bytes); }
  void fill_zero(void* dst, std::size_t bytes) override { std::memset(dst, 0, bytes); }
  void synchronize() override {}
  int intra_op_threads() const override { return threads_; }

 private:
  static tandem::devices::Device& cpu() { return tandem::devices::default_cpu_device(); }
  static tandem::devices::DeviceName name() {
    tandem::devices::DeviceName n;
    n.type = tandem::devices::DeviceType::kCPU;
    n.index = 99;
    return n;
  }
  int threads_;
};

struct GemmCase {
  std::int64_t m, n, k;
  std::int64_t pad = 0;  // extra columns in each operand's rows and in C's (strided views)
};

}  // namespace

TEST_CASE("every level's register-tile GEMM is one FMA chain over k per element, on any thread count") {
  using tandem::ops::cpu::GemmShape;
  auto& device = tandem::devices::default_cpu_device();
  ReportedThreads one(1), three(3);
  // Tails of rows, columns and k; a k longer than a block (1024), which resumes from C; more rows
  // than a block of A (1 MiB: 256 rows of 1024); one panel among several threads (its rows
  // split); strided views; op(A) copied tile by tile first (gemm_tiles.cc's packs_a: the third
  // from last untransposed with AVX-512, lda 1024; the last two transposed, lda 512, the second
  // over two blocks of rows and of k with AVX-512 alone, the last with either level, 16 panels of
  // AVX2's or more).
  const std::vector<GemmCase> gemm_cases{{37, 45, 29},        {200, 64, 1100},    {5, 300, 70, 3}, {130, 32, 17, 5},
                                         {12, 96, 2049},      {600, 48, 1030},    {64, 33, 40, 1}, {37, 70, 1000, 24},
                                         {500, 70, 1030, 12}, {40, 260, 150, 472}};
  for (CpuIsa isa : tandem::supported_cpu_isas()) {
    const auto& kernels = tandem::ops::cpu::isa_kernels(isa);
    int ran = 0;
    for (const auto& [m, n, k, pad] : gemm_cases) {
      for (const bool ta : {false, true}) {
        for (const bool tb : {false, true}) {
          CAPTURE(tandem::cpu_isa_name(isa));
          CAPTURE(m);
          CAPTURE(n);
          CAPTURE(k);
          CAPTURE(ta);
          CAPTURE(tb);
          const GemmShape s{.transpose_a = ta,
                            .transpose_b = tb,
                            .m = m,
                            .n = n,
                            .k = k,
                            .lda = (ta ? m : k) + pad,
                            .ldb = (tb ? k : n) + pad,
                            .ldc = n + pad};
          const auto a = tandem::testing::random_values((ta ? k : m) * s.lda, 5);
          const auto b = tandem::testing::random_values((tb ? n : k) * s.ldb, 6);
          constexpr float kUntouched = -7.5f;
          std::vector<float> c(static_cast<std::size_t>(m * s.ldc), kUntouched);
          std::vector<int> handed(c.size(), 0);
          std::mutex mutex;
          const auto count = [&](std::int64_t r0, std::int64_t r1, std::int64_t c0, std::int64_t c1) {
            std::lock_guard lock(mutex);
            for (std::int64_t i = r0; i < r1; ++i) {
              for (std::int64_t j = c0; j < c1; ++j) ++handed[static_cast<std::size_t>(i * s.ldc + j)];
            }
          };
          const tandem::ops::cpu::tiles::BlockDone done(count);
          if (!kernels.gemm_tiles(device, s, a.data(), b.data(), c.data(), &done)) continue;
          ++ran;
          bool chains = true, blocks = true, outside = true;
          for (std::int64_t i = 0; i < m; ++i) {
            for (std::int64_t j = 0; j < s.ldc; ++j) {
              const auto at = static_cast<std::size_t>(i * s.ldc + j);
              if (j >= n) {
                outside = outside && c[at] == kUntouched && handed[at] == 0;
                continue;
              }
              float chain = 0.0f;
              for (std::int64_t p = 0; p < k; ++p) {
                const float x = a[static_cast<std::size_t>(ta ? p * s.lda + i : i * s.lda + p)];
                const float y = b[static_cast<std::size_t>(tb ? j * s.ldb + p : p * s.ldb + j)];
                chain = std::fma(x, y, chain);
              }
              chains = chains && c[at] == chain;
              blocks = blocks && handed[at] == 1;
            }
          }
          CHECK(chains);   // bitwise: one FMA chain over k in order, from +0
          CHECK(blocks);   // each element handed over once, in a block
          CHECK(outside);  // the padding columns of C left alone
          // The same bits when the work is split for one thread or for three.
          for (ReportedThreads* other : {&one, &three}) {
            std::vector<float> again(c.size(), kUntouched);
            REQUIRE(kernels.gemm_tiles(*other, s, a.data(), b.data(), again.data(), nullptr));
            CHECK(again == c);
          }
          // And on the calling thread alone (gemm_serial, BatchMatMul's products).
          std::vector<float> serial(c.size(), kUntouched);
          REQUIRE(kernels.gemm_tiles_serial(s, a.data(), b.data(), serial.data()));
          CHECK(serial == c);
        }
      }
    }
    // Declined: narrower than a panel (32 columns with AVX-512, 16 with AVX2), or too small.
    const auto declines = [&](std::int64_t m, std::int64_t n, std::int64_t k) {
      const GemmShape s{.m = m, .n = n, .k = k, .lda = k, .ldb = n, .ldc = n};
      const auto a = tandem::testing::random_values(m * k, 7), b = tandem::testing::random_values(k * n, 8);
      std::vector<float> c(static_cast<std::size_t>(m * n));
      return !kernels.gemm_tiles(device, s, a.data(), b.data(), c.data(), nullptr) &&
             !kernels.gemm_tiles_serial(s, a.data(), b.data(), c.data());
    };
    CHECK(declines(512, 15, 512));
    CHECK(declines(8, 64, 8));
    MESSAGE(tandem::cpu_isa_name(isa) << ": " << ran << " products in register tiles");
    if (isa == CpuIsa::kBaseline) CHECK(ran == 0);
    if (isa != CpuIsa::kBaseline) CHECK(ran == static_cast<int>(4 * gemm_cases.size()));
  }
}

TEST_CASE("every level's register-tile GEMM skips a triangle with op(A) copied tile by tile, bitwise") {
  // The copy (rows of op(A) 4 KiB apart, or 2 KiB when transposed) under each triangle: the
  // masked diagonal blocks and the skipped k read the copied layout. The reference is the chain
  // over every k with the triangle's entries of op(A) as 0 (fma(0, x, acc) = acc), and C's upper
  // triangle 0 for kLowerC; the triangle's stored values are not 0, so reading them would show.
  using tandem::ops::cpu::GemmShape;
  using tandem::ops::cpu::GemmTriangle;
  auto& device = tandem::devices::default_cpu_device();
  ReportedThreads three(3);
  for (CpuIsa isa : tandem::supported_cpu_isas()) {
    if (isa == CpuIsa::kBaseline) continue;  // no tiles
    const auto& kernels = tandem::ops::cpu::isa_kernels(isa);
    for (const bool ta : {false, true}) {
      // Untransposed (copied with AVX-512 alone): 300 rows over k of 1100 (two blocks of k), lda
      // 2048, 40 columns. Transposed: 600 rows (blocks of 256) over k of 1100, lda 1024, 260
      // columns: 9 panels of AVX-512's, 17 of AVX2's.
      const std::int64_t m = ta ? 600 : 300, k = 1100, n = ta ? 260 : 40, lda = ta ? 1024 : 2048;
      const auto a = tandem::testing::random_values((ta ? k : m) * lda, 9);
      const auto b = tandem::testing::random_values(k * n, 10);
      for (const GemmTriangle triangle : {GemmTriangle::kLowerA, GemmTriangle::kUpperA, GemmTriangle::kLowerC}) {
        CAPTURE(tandem::cpu_isa_name(isa));
        CAPTURE(ta);
        CAPTURE(static_cast<int>(triangle));
        const GemmShape s{
            .transpose_a = ta, .m = m, .n = n, .k = k, .lda = lda, .ldb = n, .ldc = n, .triangle = triangle};
        std::vector<float> c(static_cast<std::size_t>(m * n), -7.5f);
        REQUIRE(kernels.gemm_tiles(device, s, a.data(), b.data(), c.data(), nullptr));
        bool chains = true;
        for (std::int64_t i = 0; i < m; ++i) {
          for (std::int64_t j = 0; j < n; ++j) {
            float chain = 0.0f;
            if (triangle != GemmTriangle::kLowerC || j <= i) {
              for (std::int64_t p = 0; p < k; ++p) {
                const bool zero =
                    (triangle == GemmTriangle::kLowerA && p > i) || (triangle == GemmTriangle::kUpperA && p < i);
                const float x = zero ? 0.0f : a[static_cast<std::size_t>(ta ? p * lda + i : i * lda + p)];
                chain = std::fma(x, b[static_cast<std::size_t>(p * n + j)], chain);
              }
            }
            chains = chains && c[static_cast<std::size_t>(i * n + j)] == chain;
          }
        }
        CHECK(chains);
        std::vector<float> again(c.size(), -7.5f);
        REQUIRE(kernels.gemm_tiles(three, s, a.data(), b.data(), again.data(), nullptr));
        CHECK(again == c);
      }
    }
  }
}
