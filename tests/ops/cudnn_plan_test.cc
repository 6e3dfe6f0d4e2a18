// The cuDNN plan (ops/detail/cudnn_plan.h), on the CPU: which convolution and pooling cases go
// to cuDNN, with which descriptor numbers, and why the others stay on tandem's kernels. Besides
// checking the numbers one by one, it runs cuDNN's documented semantics (cross-correlation over
// descriptor-strided tensors with symmetric zero padding, a KRSC filter; pooling that excludes
// padded cells) on the plan's numbers, fed by the CPU Transpose with the plan's permutation, and
// compares the result with tandem's CPU kernels: a wrong pad, stride, dimension order or filter
// permutation fails here without a GPU.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "common/random_values.h"
#include "tandem/base/env.h"
#include "tandem/graph/executor.h"
#include "tandem/graph/graph.h"
#include "tandem/ops/cuda/cudnn.h"
#include "tandem/ops/detail/cudnn_plan.h"
#include "tandem/ops/ops.h"

using namespace tandem;
using graph::Executor;
using ops::Padding;
using ops::detail::CudnnDataType;
using ops::detail::CudnnMathType;
using ops::detail::CudnnPlan;
using ops::detail::CudnnPoolingMode;
using ops::detail::CudnnWindowOp;
using ops::detail::Window2DGeometry;
using testing::random_values;

namespace {

Window2DGeometry geometry(const Shape& x, std::int64_t k_h, std::int64_t k_w, std::int64_t out_c, std::int64_t s_h,
                          std::int64_t s_w, Padding padding) {
  ops::detail::WindowAttrs attrs;
  attrs.strides = {s_h, s_w};
  attrs.padding = padding;
  return ops::detail::make_window_geometry(x, k_h, k_w, out_c, attrs);
}

// A convolution's geometry: x NHWC, filter HWIO.
Window2DGeometry conv(const Shape& x, const Shape& f, std::int64_t s_h, std::int64_t s_w, Padding padding) {
  return geometry(x, f[0], f[1], f[3], s_h, s_w, padding);
}
Window2DGeometry pool(const Shape& x, std::int64_t k, std::int64_t s, Padding padding) {
  return geometry(x, k, k, x[3], s, s, padding);
}

CudnnPlan plan(CudnnWindowOp op, const Window2DGeometry& g, DType dtype = kFloat32, bool tf32 = false) {
  return ops::detail::plan_cudnn(op, g, dtype, tf32);
}

void check_nhwc(const ops::detail::CudnnTensor4d& t, std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c) {
  CHECK(t.n == n);
  CHECK(t.c == c);
  CHECK(t.h == h);
  CHECK(t.w == w);
  CHECK(t.c_stride == 1);
  CHECK(t.w_stride == c);
  CHECK(t.h_stride == w * c);
  CHECK(t.n_stride == h * w * c);
}

std::vector<float> run_cpu(const std::shared_ptr<Graph>& g, const std::vector<graph::Feed>& feeds, Output fetch) {
  Executor e(g, devices::default_cpu_device());
  return e.run(feeds, {fetch})[0].to_vector<float>();
}

// The CPU Transpose of `values` (shape `shape`) by `perm`: what the GPU kernels do to the filter.
std::vector<float> cpu_transpose(const std::vector<float>& values, const Shape& shape,
                                 const std::array<std::int64_t, 4>& perm) {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, shape, "x");
  auto y = ops::transpose(x, std::vector<std::int64_t>(perm.begin(), perm.end()));
  return run_cpu(g, {{x, Tensor::from_vector<float>(values, shape)}}, y);
}

void check_close(const std::vector<float>& got, const std::vector<float>& want, double tolerance) {
  REQUIRE(got.size() == want.size());
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= tolerance * (1.0 + std::abs(want[i]))) && bad++ < 5) {
      CHECK_MESSAGE(false, "element ", i, ": cuDNN semantics on the plan ", got[i], ", CPU kernel ", want[i]);
    }
  }
  CHECK(bad == 0);
}

std::size_t at(std::int64_t i) { return static_cast<std::size_t>(i); }

// cuDNN's forward convolution (cross-correlation, dilation 1) read off the plan's descriptors:
// x and y addressed by their descriptor strides, the filter KRSC, padding symmetric and zero.
std::vector<float> cudnn_conv_semantics(const CudnnPlan& p, const std::vector<float>& x,
                                        const std::vector<float>& krsc) {
  const auto& xd = p.x;
  const auto& yd = p.y;
  const auto& f = p.filter;
  REQUIRE(f.c == xd.c);
  REQUIRE(f.k == yd.c);
  REQUIRE(f.h == p.window_h);
  REQUIRE(f.w == p.window_w);
  REQUIRE(ops::detail::cudnn_output_size(xd.h, f.h, p.stride_h, p.pad_h) == yd.h);
  REQUIRE(ops::detail::cudnn_output_size(xd.w, f.w, p.stride_w, p.pad_w) == yd.w);
  std::vector<float> y(at(std::int64_t{yd.n} * yd.c * yd.h * yd.w), std::numeric_limits<float>::quiet_NaN());
  for (int n = 0; n < yd.n; ++n) {
    for (int k = 0; k < yd.c; ++k) {
      for (int oh = 0; oh < yd.h; ++oh) {
        for (int ow = 0; ow < yd.w; ++ow) {
          double sum = 0;
          for (int r = 0; r < f.h; ++r) {
            const int h = oh * p.stride_h - p.pad_h + r * p.dilation_h;
            if (h < 0 || h >= xd.h) continue;
            for (int s = 0; s < f.w; ++s) {
              const int w = ow * p.stride_w - p.pad_w + s * p.dilation_w;
              if (w < 0 || w >= xd.w) continue;
              for (int c = 0; c < f.c; ++c) {
                const std::int64_t xi = std::int64_t{n} * xd.n_stride + std::int64_t{c} * xd.c_stride +
                                        std::int64_t{h} * xd.h_stride + std::int64_t{w} * xd.w_stride;
                const std::int64_t wi = ((std::int64_t{k} * f.h + r) * f.w + s) * f.c + c;  // KRSC
                sum += static_cast<double>(x[at(xi)]) * krsc[at(wi)];
              }
            }
          }
          const std::int64_t yi = std::int64_t{n} * yd.n_stride + std::int64_t{k} * yd.c_stride +
                                  std::int64_t{oh} * yd.h_stride + std::int64_t{ow} * yd.w_stride;
          y[at(yi)] = static_cast<float>(sum);
        }
      }
    }
  }
  return y;
}

// cuDNN's pooling forward on the plan: max over the window's cells inside the image, or their
// mean (CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING divides by the cells inside only).
std::vector<float> cudnn_pool_semantics(const CudnnPlan& p, const std::vector<float>& x) {
  const auto& xd = p.x;
  const auto& yd = p.y;
  REQUIRE(xd.c == yd.c);
  REQUIRE(ops::detail::cudnn_output_size(xd.h, p.window_h, p.stride_h, p.pad_h) == yd.h);
  REQUIRE(ops::detail::cudnn_output_size(xd.w, p.window_w, p.stride_w, p.pad_w) == yd.w);
  std::vector<float> y(at(std::int64_t{yd.n} * yd.c * yd.h * yd.w), std::numeric_limits<float>::quiet_NaN());
  for (int n = 0; n < yd.n; ++n) {
    for (int c = 0; c < yd.c; ++c) {
      for (int oh = 0; oh < yd.h; ++oh) {
        for (int ow = 0; ow < yd.w; ++ow) {
          double acc = p.pooling_mode == CudnnPoolingMode::kMax ? -INFINITY : 0.0;
          int cells = 0;
          for (int r = 0; r < p.window_h; ++r) {
            const int h = oh * p.stride_h - p.pad_h + r;
            if (h < 0 || h >= xd.h) continue;
            for (int s = 0; s < p.window_w; ++s) {
              const int w = ow * p.stride_w - p.pad_w + s;
              if (w < 0 || w >= xd.w) continue;
              const double v = x[at(std::int64_t{n} * xd.n_stride + std::int64_t{c} * xd.c_stride +
                                    std::int64_t{h} * xd.h_stride + std::int64_t{w} * xd.w_stride)];
              acc = p.pooling_mode == CudnnPoolingMode::kMax ? std::max(acc, v) : acc + v;
              ++cells;
            }
          }
          if (p.pooling_mode == CudnnPoolingMode::kAverageExcludePadding) acc /= cells;
          y[at(std::int64_t{n} * yd.n_stride + std::int64_t{c} * yd.c_stride + std::int64_t{oh} * yd.h_stride +
               std::int64_t{ow} * yd.w_stride)] = static_cast<float>(acc);
        }
      }
    }
  }
  return y;
}

// The adjoint of average pooling with the plan's numbers: each dy spreads over its window's cells
// inside the image, divided by their count (what cudnnPoolingBackward computes for that mode).
std::vector<float> cudnn_avg_pool_grad_semantics(const CudnnPlan& p, const std::vector<float>& dy) {
  const auto& xd = p.x;
  const auto& yd = p.y;
  std::vector<float> dx(at(std::int64_t{xd.n} * xd.c * xd.h * xd.w), 0.0f);
  for (int n = 0; n < yd.n; ++n) {
    for (int c = 0; c < yd.c; ++c) {
      for (int oh = 0; oh < yd.h; ++oh) {
        for (int ow = 0; ow < yd.w; ++ow) {
          const int h0 = std::max(oh * p.stride_h - p.pad_h, 0),
                    h1 = std::min(oh * p.stride_h - p.pad_h + p.window_h, xd.h);
          const int w0 = std::max(ow * p.stride_w - p.pad_w, 0),
                    w1 = std::min(ow * p.stride_w - p.pad_w + p.window_w, xd.w);
          const float g = dy[at(std::int64_t{n} * yd.n_stride + std::int64_t{c} * yd.c_stride +
                                std::int64_t{oh} * yd.h_stride + std::int64_t{ow} * yd.w_stride)];
          const float share = g / static_cast<float>((h1 - h0) * (w1 - w0));
          for (int h = h0; h < h1; ++h) {
            for (int w = w0; w < w1; ++w) {
              dx[at(std::int64_t{n} * xd.n_stride + std::int64_t{c} * xd.c_stride + std::int64_t{h} * xd.h_stride +
                    std::int64_t{w} * xd.w_stride)] += share;
            }
          }
        }
      }
    }
  }
  return dx;
}

struct ConvCase {
  Shape x, filter;  // NHWC, HWIO
  std::int64_t s_h, s_w;
  Padding padding;
};

}  // namespace

TEST_CASE("symmetric SAME and VALID convolutions go to cuDNN with NHWC tensors and a KRSC filter") {
  SUBCASE("SAME 3x3 stride 1: one row and column of padding on each side") {
    const auto g = conv({2, 5, 5, 2}, {3, 3, 2, 3}, 1, 1, Padding::kSame);
    const CudnnPlan p = plan(CudnnWindowOp::kConv2D, g);
    REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
    CHECK(p.fallback_reason.empty());
    check_nhwc(p.x, 2, 5, 5, 2);
    check_nhwc(p.y, 2, 5, 5, 3);
    CHECK(p.filter.k == 3);
    CHECK(p.filter.c == 2);
    CHECK(p.filter.h == 3);
    CHECK(p.filter.w == 3);
    CHECK(p.pad_h == 1);
    CHECK(p.pad_w == 1);
    CHECK(p.stride_h == 1);
    CHECK(p.stride_w == 1);
    CHECK(p.dilation_h == 1);
    CHECK(p.dilation_w == 1);
    CHECK_FALSE(p.filter_is_krsc);
    CHECK(p.data_type == CudnnDataType::kFloat);
    CHECK(p.compute_type == CudnnDataType::kFloat);
    CHECK(p.math_type == CudnnMathType::kFma);  // no TF32 unless asked for
  }
  SUBCASE("VALID, non-square kernel and input: no padding, output smaller") {
    const auto g = conv({2, 7, 6, 3}, {3, 2, 3, 5}, 1, 1, Padding::kValid);
    const CudnnPlan p = plan(CudnnWindowOp::kConv2D, g);
    REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
    check_nhwc(p.x, 2, 7, 6, 3);
    check_nhwc(p.y, 2, 5, 5, 5);
    CHECK(p.filter.h == 3);
    CHECK(p.filter.w == 2);
    CHECK(p.pad_h == 0);
    CHECK(p.pad_w == 0);
  }
  SUBCASE("SAME 5x5: two on each side") {
    const CudnnPlan p = plan(CudnnWindowOp::kConv2D, conv({1, 6, 5, 4}, {5, 5, 4, 8}, 1, 1, Padding::kSame));
    REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
    CHECK(p.pad_h == 2);
    CHECK(p.pad_w == 2);
    check_nhwc(p.y, 1, 6, 5, 8);
  }
}

TEST_CASE("strided convolutions keep their strides in (height, width) order") {
  SUBCASE("SAME 3x3 stride 2 on 7x7: total padding 2, symmetric") {
    const CudnnPlan p = plan(CudnnWindowOp::kConv2D, conv({1, 7, 7, 3}, {3, 3, 3, 4}, 2, 2, Padding::kSame));
    REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
    CHECK(p.stride_h == 2);
    CHECK(p.stride_w == 2);
    CHECK(p.pad_h == 1);
    CHECK(p.pad_w == 1);
    check_nhwc(p.y, 1, 4, 4, 4);
  }
  SUBCASE("VALID strides (2, 1) and (1, 3)") {
    CudnnPlan p = plan(CudnnWindowOp::kConv2D, conv({2, 7, 6, 6}, {2, 3, 6, 16}, 2, 1, Padding::kValid));
    REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
    CHECK(p.stride_h == 2);
    CHECK(p.stride_w == 1);
    check_nhwc(p.y, 2, 3, 4, 16);
    p = plan(CudnnWindowOp::kConv2D, conv({1, 5, 9, 2}, {2, 2, 2, 3}, 1, 3, Padding::kValid));
    REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
    CHECK(p.stride_h == 1);
    CHECK(p.stride_w == 3);
    check_nhwc(p.y, 1, 4, 3, 3);
  }
}

TEST_CASE("asymmetric SAME padding falls back to tandem's kernels, saying so") {
  // 6 rows, 3x3, stride 2: 3 outputs need 2*2 + 3 - 6 = 1 padding row, which TF puts at the bottom.
  CudnnPlan p = plan(CudnnWindowOp::kConv2D, conv({1, 6, 6, 2}, {3, 3, 2, 4}, 2, 2, Padding::kSame));
  CHECK_FALSE(p.use_cudnn);
  CHECK(p.fallback_reason.find("asymmetric SAME padding") != std::string::npos);
  CHECK(p.fallback_reason.find("rows 0 before, 1 after") != std::string::npos);
  // An even kernel at stride 1 always pads one more after than before.
  p = plan(CudnnWindowOp::kConv2D, conv({2, 5, 5, 2}, {2, 2, 2, 3}, 1, 1, Padding::kSame));
  CHECK_FALSE(p.use_cudnn);
  CHECK(p.fallback_reason.find("asymmetric") != std::string::npos);
  // Only one dimension asymmetric is enough: 2 rows (3 -> symmetric 1/1), columns 1 (0/1).
  p = plan(CudnnWindowOp::kConv2D, conv({1, 5, 6, 1}, {3, 3, 1, 2}, 1, 2, Padding::kSame));
  CHECK_FALSE(p.use_cudnn);
  CHECK(p.fallback_reason.find("columns 0 before, 1 after") != std::string::npos);
  // The same geometry with VALID padding is fine.
  p = plan(CudnnWindowOp::kConv2D, conv({1, 6, 6, 2}, {3, 3, 2, 4}, 2, 2, Padding::kValid));
  CHECK_MESSAGE(p.use_cudnn, p.fallback_reason);
}

TEST_CASE("1x1 convolutions, and filters whose bytes are already KRSC") {
  CudnnPlan p = plan(CudnnWindowOp::kConv2D, conv({2, 4, 4, 5}, {1, 1, 5, 3}, 1, 1, Padding::kValid));
  REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
  CHECK(p.pad_h == 0);
  CHECK(p.pad_w == 0);
  CHECK(p.filter.h == 1);
  CHECK(p.filter.w == 1);
  CHECK_FALSE(p.filter_is_krsc);  // HWIO [1, 1, 5, 3] is IO; KRSC wants OI
  // 1x1 stride 2 SAME needs no padding at all: 3 outputs of 5 rows, 2*2 + 1 - 5 = 0.
  p = plan(CudnnWindowOp::kConv2D, conv({2, 5, 5, 3}, {1, 1, 3, 4}, 2, 2, Padding::kSame));
  REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
  CHECK(p.pad_h == 0);
  check_nhwc(p.y, 2, 3, 3, 4);
  // One output channel, or a 1x1 window over one input channel: permuting moves no byte.
  CHECK(plan(CudnnWindowOp::kConv2D, conv({1, 5, 5, 4}, {3, 3, 4, 1}, 1, 1, Padding::kSame)).filter_is_krsc);
  CHECK(plan(CudnnWindowOp::kConv2D, conv({1, 5, 5, 1}, {1, 1, 1, 8}, 1, 1, Padding::kValid)).filter_is_krsc);
  CHECK_FALSE(plan(CudnnWindowOp::kConv2D, conv({1, 5, 5, 1}, {3, 3, 1, 8}, 1, 1, Padding::kSame)).filter_is_krsc);
}

TEST_CASE("pooling with and without padding: windows, modes, and the max gradient that stays ours") {
  SUBCASE("VALID 2x2 stride 2: no padding") {
    for (const auto op : {CudnnWindowOp::kMaxPool2D, CudnnWindowOp::kAvgPool2D, CudnnWindowOp::kAvgPool2DGrad}) {
      const CudnnPlan p = plan(op, pool({2, 7, 5, 3}, 2, 2, Padding::kValid));
      REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
      check_nhwc(p.x, 2, 7, 5, 3);
      check_nhwc(p.y, 2, 3, 2, 3);
      CHECK(p.window_h == 2);
      CHECK(p.window_w == 2);
      CHECK(p.pad_h == 0);
      CHECK(p.pad_w == 0);
      CHECK(p.stride_h == 2);
      CHECK(p.pooling_mode ==
            (op == CudnnWindowOp::kMaxPool2D ? CudnnPoolingMode::kMax : CudnnPoolingMode::kAverageExcludePadding));
    }
  }
  SUBCASE("SAME 3x3 stride 1 and stride 2: one cell of padding each side, excluded from averages") {
    CudnnPlan p = plan(CudnnWindowOp::kAvgPool2D, pool({1, 5, 5, 2}, 3, 1, Padding::kSame));
    REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
    CHECK(p.pad_h == 1);
    CHECK(p.pad_w == 1);
    CHECK(p.pooling_mode == CudnnPoolingMode::kAverageExcludePadding);
    p = plan(CudnnWindowOp::kMaxPool2D, pool({2, 7, 5, 4}, 3, 2, Padding::kSame));
    REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
    CHECK(p.pad_h == 1);
    CHECK(p.pad_w == 1);
    check_nhwc(p.y, 2, 4, 3, 4);
  }
  SUBCASE("SAME 2x2 stride 2 on an odd input is asymmetric: fallback") {
    const CudnnPlan p = plan(CudnnWindowOp::kMaxPool2D, pool({1, 5, 5, 2}, 2, 2, Padding::kSame));
    CHECK_FALSE(p.use_cudnn);
    CHECK(p.fallback_reason.find("asymmetric") != std::string::npos);
  }
  SUBCASE("MaxPool2DGrad never goes to cuDNN (its tie rule differs)") {
    const CudnnPlan p = plan(CudnnWindowOp::kMaxPool2DGrad, pool({2, 6, 6, 3}, 2, 2, Padding::kValid));
    CHECK_FALSE(p.use_cudnn);
    CHECK(p.fallback_reason.find("first in scan order") != std::string::npos);
  }
}

TEST_CASE("data types: float32 with or without TF32, 16-bit types computing in float32, float64 falls back") {
  const auto g = conv({2, 5, 5, 2}, {3, 3, 2, 3}, 1, 1, Padding::kSame);
  CHECK(plan(CudnnWindowOp::kConv2D, g, kFloat32, /*tf32=*/true).math_type == CudnnMathType::kTensorOp);
  for (const auto tf32 : {false, true}) {
    CudnnPlan p = plan(CudnnWindowOp::kConv2D, g, DType::kF16, tf32);
    REQUIRE(p.use_cudnn);
    CHECK(p.data_type == CudnnDataType::kHalf);
    CHECK(p.compute_type == CudnnDataType::kFloat);
    CHECK(p.math_type == CudnnMathType::kTensorOp);
    p = plan(CudnnWindowOp::kConv2D, g, DType::kBF16, tf32);
    REQUIRE(p.use_cudnn);
    CHECK(p.data_type == CudnnDataType::kBFloat16);
    CHECK(p.compute_type == CudnnDataType::kFloat);
  }
  CudnnPlan p = plan(CudnnWindowOp::kConv2D, g, kFloat64);
  CHECK_FALSE(p.use_cudnn);
  CHECK(p.fallback_reason.find("float64") != std::string::npos);
  CHECK_FALSE(plan(CudnnWindowOp::kAvgPool2D, pool({1, 4, 4, 2}, 2, 2, Padding::kValid), kFloat64).use_cudnn);
  p = plan(CudnnWindowOp::kMaxPool2D, pool({1, 4, 4, 2}, 2, 2, Padding::kValid), kInt32);
  CHECK_FALSE(p.use_cudnn);
  CHECK(p.fallback_reason.find("int32") != std::string::npos);
}

TEST_CASE("empty tensors and tensors beyond int fall back") {
  CudnnPlan p = plan(CudnnWindowOp::kConv2D, conv({0, 5, 5, 2}, {3, 3, 2, 3}, 1, 1, Padding::kSame));
  CHECK_FALSE(p.use_cudnn);
  CHECK(p.fallback_reason.find("empty") != std::string::npos);
  CHECK_FALSE(plan(CudnnWindowOp::kConv2D, conv({1, 5, 5, 0}, {3, 3, 0, 3}, 1, 1, Padding::kSame)).use_cudnn);
  CHECK_FALSE(plan(CudnnWindowOp::kConv2D, conv({1, 5, 5, 2}, {3, 3, 2, 0}, 1, 1, Padding::kSame)).use_cudnn);
  // 2^31 elements and more: the legacy descriptors take int.
  p = plan(CudnnWindowOp::kMaxPool2D, pool({2, 32768, 32768, 2}, 2, 2, Padding::kValid));
  CHECK_FALSE(p.use_cudnn);
  CHECK(p.fallback_reason.find("int") != std::string::npos);
  CHECK(plan(CudnnWindowOp::kMaxPool2D, pool({1, 1024, 1024, 64}, 2, 2, Padding::kValid)).use_cudnn);
}

TEST_CASE("every geometry: accepted exactly when the padding is symmetric, and then cuDNN's sizes are TF's") {
  int accepted = 0, refused = 0;
  for (std::int64_t in = 1; in <= 9; ++in) {
    for (std::int64_t k = 1; k <= 4; ++k) {
      for (std::int64_t s = 1; s <= 3; ++s) {
        for (const Padding padding : {Padding::kValid, Padding::kSame}) {
          if (padding == Padding::kValid && in < k) continue;  // rejected by the shape function
          CAPTURE(in);
          CAPTURE(k);
          CAPTURE(s);
          const std::string padding_name(ops::detail::padding_name(padding));
          CAPTURE(padding_name);
          const auto g = geometry({1, in, in, 2}, k, k, 3, s, s, padding);
          const std::int64_t total = std::max<std::int64_t>((g.out_h - 1) * s + k - in, 0);
          const CudnnPlan p = plan(CudnnWindowOp::kConv2D, g);
          CHECK(p.use_cudnn == (total % 2 == 0));
          if (!p.use_cudnn) {
            ++refused;
            continue;
          }
          ++accepted;
          CHECK(2 * p.pad_h == total);
          CHECK(ops::detail::cudnn_output_size(in, k, s, p.pad_h) == g.out_h);
          CHECK(p.y.h == g.out_h);
        }
      }
    }
  }
  CHECK(accepted > 100);
  CHECK(refused > 20);
}

TEST_CASE("the HWIO -> KRSC permutation, applied by the CPU Transpose, is filter[o][h][w][i]; and back") {
  const Shape hwio{3, 2, 4, 5};  // H W I O
  const std::int64_t kh = hwio[0], kw = hwio[1], ci = hwio[2], co = hwio[3];
  std::vector<float> filter(at(hwio.num_elements()));
  for (std::size_t i = 0; i < filter.size(); ++i) filter[i] = static_cast<float>(i);  // every value distinct
  const CudnnPlan p = plan(CudnnWindowOp::kConv2D, conv({1, 6, 6, ci}, hwio, 1, 1, Padding::kValid));
  REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
  const auto krsc = cpu_transpose(filter, hwio, ops::detail::kHwioToKrsc);
  // KRSC storage: k outermost, then r (rows), s (columns), c (input channels) innermost.
  REQUIRE(p.filter.k == co);
  REQUIRE(p.filter.h == kh);
  REQUIRE(p.filter.w == kw);
  REQUIRE(p.filter.c == ci);
  for (std::int64_t o = 0; o < co; ++o) {
    for (std::int64_t h = 0; h < kh; ++h) {
      for (std::int64_t w = 0; w < kw; ++w) {
        for (std::int64_t i = 0; i < ci; ++i) {
          const float want = filter[at(((h * kw + w) * ci + i) * co + o)];  // HWIO
          const float got = krsc[at(((o * p.filter.h + h) * p.filter.w + w) * p.filter.c + i)];
          if (got != want) FAIL("KRSC element (", o, ", ", h, ", ", w, ", ", i, ") is ", got, ", expected ", want);
        }
      }
    }
  }
  // The filter gradient comes back the other way.
  CHECK(cpu_transpose(krsc, Shape{co, kh, kw, ci}, ops::detail::kKrscToHwio) == filter);
  // Where the plan says the bytes are already KRSC, the permutation indeed moves nothing.
  const Shape one_out{3, 3, 4, 1};
  const CudnnPlan q = plan(CudnnWindowOp::kConv2D, conv({1, 5, 5, 4}, one_out, 1, 1, Padding::kSame));
  REQUIRE(q.filter_is_krsc);
  std::vector<float> f1(at(one_out.num_elements()));
  for (std::size_t i = 0; i < f1.size(); ++i) f1[i] = static_cast<float>(i);
  CHECK(cpu_transpose(f1, one_out, ops::detail::kHwioToKrsc) == f1);
}

TEST_CASE("cuDNN's convolution semantics on the plan's numbers reproduce the CPU Conv2D kernel") {
  const ConvCase cases[] = {
      {{2, 5, 5, 2}, {3, 3, 2, 3}, 1, 1, Padding::kSame},  {{2, 7, 6, 3}, {3, 2, 3, 5}, 1, 1, Padding::kValid},
      {{1, 7, 7, 3}, {3, 3, 3, 4}, 2, 2, Padding::kSame},  {{2, 7, 6, 6}, {2, 3, 6, 4}, 2, 1, Padding::kValid},
      {{1, 5, 9, 2}, {2, 2, 2, 3}, 1, 3, Padding::kValid}, {{2, 4, 4, 5}, {1, 1, 5, 3}, 1, 1, Padding::kValid},
      {{2, 5, 5, 3}, {1, 1, 3, 4}, 2, 2, Padding::kSame},  {{1, 6, 5, 4}, {5, 5, 4, 2}, 1, 1, Padding::kSame},
      {{1, 5, 5, 4}, {3, 3, 4, 1}, 1, 1, Padding::kSame},  {{2, 3, 4, 2}, {3, 4, 2, 3}, 1, 1, Padding::kValid},
      {{1, 2, 3, 2}, {5, 5, 2, 2}, 1, 1, Padding::kSame},  {{2, 9, 7, 5}, {5, 3, 5, 3}, 2, 2, Padding::kSame},
  };
  std::uint64_t seed = 100;
  for (const auto& c : cases) {
    CAPTURE(c.x.to_string());
    CAPTURE(c.filter.to_string());
    CAPTURE(c.s_h);
    CAPTURE(c.s_w);
    const auto g = conv(c.x, c.filter, c.s_h, c.s_w, c.padding);
    const CudnnPlan p = plan(CudnnWindowOp::kConv2D, g);
    REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
    auto graph = std::make_shared<Graph>();
    auto x = graph->placeholder(kFloat32, c.x, "x");
    auto w = graph->placeholder(kFloat32, c.filter, "w");
    auto y = ops::conv2d(x, w, {.strides = {c.s_h, c.s_w}, .padding = c.padding});
    const auto xv = random_values(c.x.num_elements(), ++seed), wv = random_values(c.filter.num_elements(), ++seed);
    const auto want =
        run_cpu(graph, {{x, Tensor::from_vector<float>(xv, c.x)}, {w, Tensor::from_vector<float>(wv, c.filter)}}, y);
    const auto krsc = p.filter_is_krsc ? wv : cpu_transpose(wv, c.filter, ops::detail::kHwioToKrsc);
    check_close(cudnn_conv_semantics(p, xv, krsc), want, 1e-4);
  }
}

TEST_CASE("cuDNN's pooling semantics on the plan's numbers reproduce the CPU pooling kernels") {
  struct PoolCase {
    Shape x;
    std::int64_t k, s;
    Padding padding;
  };
  const PoolCase cases[] = {
      {{2, 6, 6, 3}, 2, 2, Padding::kValid}, {{2, 7, 5, 3}, 2, 2, Padding::kValid},
      {{2, 7, 5, 4}, 3, 2, Padding::kSame},  {{1, 5, 5, 2}, 3, 1, Padding::kSame},
      {{2, 5, 6, 3}, 3, 1, Padding::kValid}, {{2, 8, 7, 3}, 2, 3, Padding::kValid},
      {{1, 9, 9, 2}, 5, 2, Padding::kSame},
  };
  std::uint64_t seed = 200;
  for (const auto& c : cases) {
    for (const bool average : {false, true}) {
      CAPTURE(c.x.to_string());
      CAPTURE(c.k);
      CAPTURE(c.s);
      CAPTURE(average);
      const auto g = pool(c.x, c.k, c.s, c.padding);
      const CudnnPlan p = plan(average ? CudnnWindowOp::kAvgPool2D : CudnnWindowOp::kMaxPool2D, g);
      REQUIRE_MESSAGE(p.use_cudnn, p.fallback_reason);
      auto graph = std::make_shared<Graph>();
      auto x = graph->placeholder(kFloat32, c.x, "x");
      const ops::Pool2DOptions options{.pool_size = {c.k, c.k}, .strides = {c.s, c.s}, .padding = c.padding};
      auto y = average ? ops::avg_pool2d(x, options) : ops::max_pool2d(x, options);
      const auto xv = random_values(c.x.num_elements(), ++seed);
      check_close(cudnn_pool_semantics(p, xv), run_cpu(graph, {{x, Tensor::from_vector<float>(xv, c.x)}}, y), 1e-6);
      if (!average) continue;
      // AvgPool2DGrad through the same plan numbers against the CPU kernel.
      const CudnnPlan pg = plan(CudnnWindowOp::kAvgPool2DGrad, g);
      REQUIRE(pg.use_cudnn);
      auto dy = graph->placeholder(kFloat32, y.shape(), "dy");
      auto dx = graph->add("AvgPool2DGrad", {x, dy}, graph->node(y.node).attrs);
      const auto dyv = random_values(y.shape().num_elements(), ++seed);
      const std::vector<graph::Feed> feeds{{x, Tensor::from_vector<float>(xv, c.x)},
                                           {dy, Tensor::from_vector<float>(dyv, y.shape())}};
      const auto want = run_cpu(graph, feeds, dx);
      check_close(cudnn_avg_pool_grad_semantics(pg, dyv), want, 1e-5);
    }
  }
}

// Registered twice in CTest, once with TANDEM_CUDNN=0 (tests/ops/CMakeLists.txt).
TEST_CASE("cudnn_status says whether cuDNN is used, and TANDEM_CUDNN=0 turns it off") {
  const std::string status = ops::cuda::cudnn_status();
  MESSAGE("cudnn_status(): ", status);
  REQUIRE_FALSE(status.empty());
  const bool off = !env::get_bool(env::kCudnn);
  const bool built = status.rfind("not built", 0) != 0;
  if (off && built) CHECK(status == "turned off by TANDEM_CUDNN=0");
  if (!built) CHECK_FALSE(ops::cuda::cudnn_enabled());
  if (built && !off) {
    // Loaded, or a reason (no libcudnn here, another major version, a missing symbol).
    const bool loaded = status.rfind("loaded (version 9", 0) == 0;
    CHECK(ops::cuda::cudnn_enabled() == loaded);
    CHECK(status.find("TANDEM_CUDNN=0") == std::string::npos);
  }
  if (off) CHECK_FALSE(ops::cuda::cudnn_enabled());
}
