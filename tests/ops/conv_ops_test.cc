// Convolution and pooling: every op against a float64 reference written as plain loops, with a
// finite-difference gradient check (which covers the backprop ops' float64 kernels), float32
// checks of the backprop ops at the shapes that take the fast float32 paths, and shape errors.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>

#include <fmt/format.h>

#include "op_test_harness.h"
#include "tandem/graph/autodiff.h"
#include "tandem/ops/detail/op_util.h"

using namespace tandem;
using namespace tandem::testing;
using ops::Padding;

namespace {

// TF's window arithmetic, written out independently of the library's.
struct Dim {
  std::int64_t out, pad_before;
};
Dim window_dim(std::int64_t in, std::int64_t k, std::int64_t s, Padding p) {
  if (p == Padding::kValid) return {(in - k + 1 + s - 1) / s, 0};
  const std::int64_t out = (in + s - 1) / s;
  return {out, std::max<std::int64_t>((out - 1) * s + k - in, 0) / 2};
}

// Row-major offset of (a, b, c, d) in a rank-4 shape (the references' hot path: no checks).
std::int64_t at4(const Shape& s, std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
  return ((a * s[1] + b) * s[2] + c) * s[3] + d;
}

struct Window {
  std::int64_t k_h, k_w, s_h, s_w;
  Padding padding;
};

// y[n, oh, ow, o] = sum over (kh, kw, c) inside the input of x[n, ih, iw, c] * f[kh, kw, c, o].
RefTensor ref_conv2d(const RefTensor& x, const RefTensor& f, std::int64_t s_h, std::int64_t s_w, Padding p) {
  const auto n = x.shape[0], h = x.shape[1], w = x.shape[2], c = x.shape[3];
  const auto kh = f.shape[0], kw = f.shape[1], o = f.shape[3];
  const Dim dh = window_dim(h, kh, s_h, p), dw = window_dim(w, kw, s_w, p);
  RefTensor y(Shape{n, dh.out, dw.out, o});
  for (std::int64_t b = 0; b < n; ++b) {
    for (std::int64_t oh = 0; oh < dh.out; ++oh) {
      for (std::int64_t ow = 0; ow < dw.out; ++ow) {
        for (std::int64_t oc = 0; oc < o; ++oc) {
          double sum = 0;
          for (std::int64_t i = 0; i < kh; ++i) {
            const auto ih = oh * s_h - dh.pad_before + i;
            if (ih < 0 || ih >= h) continue;
            for (std::int64_t j = 0; j < kw; ++j) {
              const auto iw = ow * s_w - dw.pad_before + j;
              if (iw < 0 || iw >= w) continue;
              for (std::int64_t ic = 0; ic < c; ++ic)
                sum += x[at4(x.shape, b, ih, iw, ic)] * f[at4(f.shape, i, j, ic, oc)];
            }
          }
          y[at4(y.shape, b, oh, ow, oc)] = sum;
        }
      }
    }
  }
  return y;
}

// dx = the adjoint of x -> conv2d(x, f) applied to dy.
RefTensor ref_conv2d_backprop_input(const Shape& x_shape, const RefTensor& f, const RefTensor& dy, std::int64_t s_h,
                                    std::int64_t s_w, Padding p) {
  const auto h = x_shape[1], w = x_shape[2], c = x_shape[3];
  const auto kh = f.shape[0], kw = f.shape[1], o = f.shape[3];
  const Dim dh = window_dim(h, kh, s_h, p), dw = window_dim(w, kw, s_w, p);
  RefTensor dx(x_shape);
  for (std::int64_t b = 0; b < x_shape[0]; ++b) {
    for (std::int64_t oh = 0; oh < dh.out; ++oh) {
      for (std::int64_t ow = 0; ow < dw.out; ++ow) {
        for (std::int64_t i = 0; i < kh; ++i) {
          const auto ih = oh * s_h - dh.pad_before + i;
          if (ih < 0 || ih >= h) continue;
          for (std::int64_t j = 0; j < kw; ++j) {
            const auto iw = ow * s_w - dw.pad_before + j;
            if (iw < 0 || iw >= w) continue;
            for (std::int64_t ic = 0; ic < c; ++ic) {
              double sum = 0;
              for (std::int64_t oc = 0; oc < o; ++oc)
                sum += dy[at4(dy.shape, b, oh, ow, oc)] * f[at4(f.shape, i, j, ic, oc)];
              dx[at4(dx.shape, b, ih, iw, ic)] += sum;
            }
          }
        }
      }
    }
  }
  return dx;
}

RefTensor ref_conv2d_backprop_filter(const RefTensor& x, const Shape& f_shape, const RefTensor& dy, std::int64_t s_h,
                                     std::int64_t s_w, Padding p) {
  const auto h = x.shape[1], w = x.shape[2], c = x.shape[3];
  const auto kh = f_shape[0], kw = f_shape[1], o = f_shape[3];
  const Dim dh = window_dim(h, kh, s_h, p), dw = window_dim(w, kw, s_w, p);
  RefTensor df(f_shape);
  for (std::int64_t i = 0; i < kh; ++i) {
    for (std::int64_t j = 0; j < kw; ++j) {
      for (std::int64_t ic = 0; ic < c; ++ic) {
        for (std::int64_t oc = 0; oc < o; ++oc) {
          double sum = 0;
          for (std::int64_t b = 0; b < x.shape[0]; ++b) {
            for (std::int64_t oh = 0; oh < dh.out; ++oh) {
              const auto ih = oh * s_h - dh.pad_before + i;
              if (ih < 0 || ih >= h) continue;
              for (std::int64_t ow = 0; ow < dw.out; ++ow) {
                const auto iw = ow * s_w - dw.pad_before + j;
                if (iw < 0 || iw >= w) continue;
                sum += x[at4(x.shape, b, ih, iw, ic)] * dy[at4(dy.shape, b, oh, ow, oc)];
              }
            }
          }
          df[at4(df.shape, i, j, ic, oc)] = sum;
        }
      }
    }
  }
  return df;
}

// Max or mean over the window cells inside the input (padding is never counted).
RefTensor ref_pool(const RefTensor& x, const Window& win, bool average) {
  const auto n = x.shape[0], h = x.shape[1], w = x.shape[2], c = x.shape[3];
  const Dim dh = window_dim(h, win.k_h, win.s_h, win.padding), dw = window_dim(w, win.k_w, win.s_w, win.padding);
  RefTensor y(Shape{n, dh.out, dw.out, c});
  for (std::int64_t b = 0; b < n; ++b) {
    for (std::int64_t oh = 0; oh < dh.out; ++oh) {
      for (std::int64_t ow = 0; ow < dw.out; ++ow) {
        for (std::int64_t ch = 0; ch < c; ++ch) {
          double acc = average ? 0.0 : -std::numeric_limits<double>::infinity();
          int count = 0;
          for (std::int64_t i = 0; i < win.k_h; ++i) {
            const auto ih = oh * win.s_h - dh.pad_before + i;
            if (ih < 0 || ih >= h) continue;
            for (std::int64_t j = 0; j < win.k_w; ++j) {
              const auto iw = ow * win.s_w - dw.pad_before + j;
              if (iw < 0 || iw >= w) continue;
              const double v = x[at4(x.shape, b, ih, iw, ch)];
              acc = average ? acc + v : std::max(acc, v);
              ++count;
            }
          }
          y[at4(y.shape, b, oh, ow, ch)] = average ? acc / count : acc;
        }
      }
    }
  }
  return y;
}

// dx of max pooling: each dy goes to the first maximum of its window (rows, then columns).
RefTensor ref_max_pool_grad(const RefTensor& x, const RefTensor& dy, const Window& win) {
  const auto h = x.shape[1], w = x.shape[2], c = x.shape[3];
  const Dim dh = window_dim(h, win.k_h, win.s_h, win.padding), dw = window_dim(w, win.k_w, win.s_w, win.padding);
  RefTensor dx(x.shape);
  for (std::int64_t b = 0; b < x.shape[0]; ++b) {
    for (std::int64_t oh = 0; oh < dh.out; ++oh) {
      for (std::int64_t ow = 0; ow < dw.out; ++ow) {
        for (std::int64_t ch = 0; ch < c; ++ch) {
          double best = -std::numeric_limits<double>::infinity();
          std::int64_t bi = -1, bj = -1;
          for (std::int64_t i = 0; i < win.k_h; ++i) {
            const auto ih = oh * win.s_h - dh.pad_before + i;
            if (ih < 0 || ih >= h) continue;
            for (std::int64_t j = 0; j < win.k_w; ++j) {
              const auto iw = ow * win.s_w - dw.pad_before + j;
              if (iw < 0 || iw >= w) continue;
              if (x[at4(x.shape, b, ih, iw, ch)] > best) {
                best = x[at4(x.shape, b, ih, iw, ch)];
                bi = ih;
                bj = iw;
              }
            }
          }
          dx[at4(dx.shape, b, bi, bj, ch)] += dy[at4(dy.shape, b, oh, ow, ch)];
        }
      }
    }
  }
  return dx;
}

graph::Attrs window_attrs(std::int64_t s_h, std::int64_t s_w, Padding p) {
  graph::Attrs attrs;
  attrs.set("strides", std::vector<std::int64_t>{s_h, s_w});
  attrs.set("padding", p == Padding::kSame ? "SAME" : "VALID");
  return attrs;
}

Shape conv_out_shape(const Shape& x, const Shape& f, std::int64_t s_h, std::int64_t s_w, Padding p) {
  return Shape{x[0], window_dim(x[1], f[0], s_h, p).out, window_dim(x[2], f[1], s_w, p).out, f[3]};
}

OpCase conv_case(const std::string& name, const Shape& x, const Shape& f, std::int64_t s_h, std::int64_t s_w,
                 Padding p) {
  OpCase c;
  c.name = name;
  c.inputs = {InputSpec::floats(x), InputSpec::floats(f)};
  c.build = [=](const std::vector<Output>& in) {
    return std::vector<Output>{ops::conv2d(in[0], in[1], {.strides = {s_h, s_w}, .padding = p})};
  };
  c.reference = [=](const std::vector<RefTensor>& in) {
    return std::vector<RefTensor>{ref_conv2d(in[0], in[1], s_h, s_w, p)};
  };
  return c;
}

// Conv2DBackpropInput(x_like, filter, dy), built directly (x_like only gives the shape).
OpCase backprop_input_case(const std::string& name, const Shape& x, const Shape& f, std::int64_t s_h, std::int64_t s_w,
                           Padding p) {
  OpCase c;
  c.name = name;
  c.inputs = {InputSpec::floats(x).no_gradient(), InputSpec::floats(f),
              InputSpec::floats(conv_out_shape(x, f, s_h, s_w, p))};
  c.build = [=](const std::vector<Output>& in) {
    return std::vector<Output>{
        ops::detail::add_op("Conv2DBackpropInput", {in[0], in[1], in[2]}, window_attrs(s_h, s_w, p))};
  };
  c.reference = [=](const std::vector<RefTensor>& in) {
    return std::vector<RefTensor>{ref_conv2d_backprop_input(in[0].shape, in[1], in[2], s_h, s_w, p)};
  };
  return c;
}

OpCase backprop_filter_case(const std::string& name, const Shape& x, const Shape& f, std::int64_t s_h, std::int64_t s_w,
                            Padding p) {
  OpCase c;
  c.name = name;
  c.inputs = {InputSpec::floats(x), InputSpec::floats(f).no_gradient(),
              InputSpec::floats(conv_out_shape(x, f, s_h, s_w, p))};
  c.build = [=](const std::vector<Output>& in) {
    return std::vector<Output>{
        ops::detail::add_op("Conv2DBackpropFilter", {in[0], in[1], in[2]}, window_attrs(s_h, s_w, p))};
  };
  c.reference = [=](const std::vector<RefTensor>& in) {
    return std::vector<RefTensor>{ref_conv2d_backprop_filter(in[0], in[1].shape, in[2], s_h, s_w, p)};
  };
  return c;
}

OpCase pool_case(const std::string& name, const Shape& x, const Window& win, bool average) {
  OpCase c;
  c.name = name;
  // Distinct values: a finite-difference step must not change which cell is a window's maximum.
  c.inputs = {average ? InputSpec::floats(x) : InputSpec::floats(x).with_distinct()};
  const ops::Pool2DOptions options{
      .pool_size = {win.k_h, win.k_w}, .strides = {win.s_h, win.s_w}, .padding = win.padding};
  c.build = [=](const std::vector<Output>& in) {
    return std::vector<Output>{average ? ops::avg_pool2d(in[0], options) : ops::max_pool2d(in[0], options)};
  };
  c.reference = [=](const std::vector<RefTensor>& in) { return std::vector<RefTensor>{ref_pool(in[0], win, average)}; };
  return c;
}

// Float32 sums of hundreds of products: looser than the harness's element-wise default.
constexpr double kLongSumF32Tolerance = 1e-4;

}  // namespace

TEST_CASE("Conv2D, VALID and SAME, strides 1 and 2, against the reference with gradients") {
  run_op_case(conv_case("valid stride 1", {2, 5, 6, 3}, {3, 3, 3, 4}, 1, 1, Padding::kValid));
  run_op_case(conv_case("same stride 1", {2, 5, 5, 2}, {3, 3, 2, 3}, 1, 1, Padding::kSame));
  run_op_case(conv_case("valid stride 2, non-square kernel", {2, 7, 6, 3}, {3, 2, 3, 5}, 2, 2, Padding::kValid));
  run_op_case(conv_case("same stride 2, even kernel", {1, 6, 7, 4}, {2, 3, 4, 2}, 2, 2, Padding::kSame));
  run_op_case(conv_case("same strides (2, 1), tall kernel", {2, 7, 5, 2}, {4, 1, 2, 3}, 2, 1, Padding::kSame));
  run_op_case(conv_case("valid strides (1, 3)", {1, 5, 9, 2}, {2, 2, 2, 3}, 1, 3, Padding::kValid));
  run_op_case(conv_case("pointwise 1x1", {2, 4, 4, 5}, {1, 1, 5, 3}, 1, 1, Padding::kValid));
  run_op_case(conv_case("1x1 stride 2", {2, 5, 5, 3}, {1, 1, 3, 4}, 2, 2, Padding::kSame));
  run_op_case(conv_case("kernel as large as the input", {2, 3, 4, 2}, {3, 4, 2, 3}, 1, 1, Padding::kValid));
  run_op_case(conv_case("kernel larger than the input, SAME", {1, 2, 3, 2}, {4, 4, 2, 2}, 1, 1, Padding::kSame));
}

// Geometries for the float32 direct kernels (ops/cpu/conv_direct.h: output channels a multiple
// of 16), covering their cases: one to few input channels (dot-product backprop input), 16k input
// channels (backprop input as a flipped forward), 16, 32 and 64-channel register blocks and their
// mixes, padding rows and edge columns (SAME), strides, and windows wider than the input. Every
// case also runs through the float64 GEMM path and its gradient check.
struct DirectGeometry {
  const char* name;
  Shape x, f;
  std::int64_t s_h, s_w;
  Padding p;
};
const DirectGeometry kDirectGeometries[] = {
    {"cin 1, 32 filters, valid", {3, 8, 9, 1}, {3, 3, 1, 32}, 1, 1, Padding::kValid},
    {"cin 1, 32 filters, same", {2, 8, 9, 1}, {3, 3, 1, 32}, 1, 1, Padding::kSame},
    {"cin 1, 16 filters, same stride 2", {2, 9, 8, 1}, {3, 3, 1, 16}, 2, 2, Padding::kSame},
    {"cin 1, 48 filters, 5x3, valid", {2, 7, 6, 1}, {5, 3, 1, 48}, 1, 1, Padding::kValid},
    {"cin 3, 32 filters, same", {2, 6, 6, 3}, {3, 3, 3, 32}, 1, 1, Padding::kSame},
    {"cin 2, 64 filters, same strides (1, 2)", {2, 6, 7, 2}, {3, 3, 2, 64}, 1, 2, Padding::kSame},
    {"cin 16, 16 filters, same", {2, 7, 6, 16}, {3, 3, 16, 16}, 1, 1, Padding::kSame},
    {"cin 16, 80 filters, valid 2x3", {2, 6, 7, 16}, {2, 3, 16, 80}, 1, 1, Padding::kValid},
    {"cin 32, 48 filters, same 5x5", {1, 6, 5, 32}, {5, 5, 32, 48}, 1, 1, Padding::kSame},
    {"cin 5, 32 filters, same 5x5 stride 2", {2, 9, 8, 5}, {5, 5, 5, 32}, 2, 2, Padding::kSame},
    {"cin 6, 16 filters, valid strides (2, 1)", {2, 7, 6, 6}, {2, 3, 6, 16}, 2, 1, Padding::kValid},
    {"cin 16, 16 filters, window wider than the input", {1, 2, 3, 16}, {4, 4, 16, 16}, 1, 1, Padding::kSame},
    {"cin 32, 16 filters, pointwise", {2, 3, 4, 32}, {1, 1, 32, 16}, 1, 1, Padding::kValid},
    {"cin 1, 20 filters (GEMM path in float32 too)", {2, 6, 6, 1}, {3, 3, 1, 20}, 1, 1, Padding::kSame},
};

TEST_CASE("Conv2D at the geometries of the direct float32 kernels") {
  for (const auto& g : kDirectGeometries) run_op_case(conv_case(g.name, g.x, g.f, g.s_h, g.s_w, g.p));
}

TEST_CASE("Conv2DBackpropInput and Conv2DBackpropFilter on their own, with their gradients") {
  for (const auto& g : kDirectGeometries) {
    auto input = backprop_input_case(std::string("backprop input, ") + g.name, g.x, g.f, g.s_h, g.s_w, g.p);
    auto filter = backprop_filter_case(std::string("backprop filter, ") + g.name, g.x, g.f, g.s_h, g.s_w, g.p);
    input.f32_tolerance = filter.f32_tolerance = kLongSumF32Tolerance;
    run_op_case(input);
    run_op_case(filter);
  }
  run_op_case(backprop_input_case("backprop input, valid stride 2", {2, 7, 6, 3}, {3, 2, 3, 5}, 2, 2, Padding::kValid));
  run_op_case(backprop_filter_case("backprop filter, same stride 2", {1, 6, 7, 4}, {2, 3, 4, 2}, 2, 2, Padding::kSame));
}

TEST_CASE("Conv2D and its backprops at the benchmark shapes (float32 fast paths) match the reference") {
  // The two convolutions of the Fashion-MNIST CNN in bench/bench_ops.cc, at its batch of 128:
  // enough pixels for many chunks on every thread.
  struct BenchShape {
    const char* name;
    Shape x, f;
  };
  for (const auto& s : {BenchShape{"28x28x1 -> 32", {128, 28, 28, 1}, {3, 3, 1, 32}},
                        BenchShape{"13x13x32 -> 64", {128, 13, 13, 32}, {3, 3, 32, 64}}}) {
    for (OpCase c : {conv_case(std::string("forward ") + s.name, s.x, s.f, 1, 1, Padding::kValid),
                     backprop_input_case(std::string("backprop input ") + s.name, s.x, s.f, 1, 1, Padding::kValid),
                     backprop_filter_case(std::string("backprop filter ") + s.name, s.x, s.f, 1, 1, Padding::kValid)}) {
      c.check_gradient = false;
      c.f32_tolerance = kLongSumF32Tolerance;
      // The filter gradient sums over 128 * 26 * 26 pixels.
      if (c.name.starts_with("backprop filter")) c.f32_tolerance = 1e-3;
      run_op_case(c);
    }
  }
}

TEST_CASE("MaxPool2D and AvgPool2D, VALID and SAME, strides 1 and 2, with gradients") {
  for (const bool average : {false, true}) {
    const std::string kind = average ? "avg " : "max ";
    run_op_case(pool_case(kind + "valid 2x2 stride 2", {2, 6, 6, 3}, {2, 2, 2, 2, Padding::kValid}, average));
    run_op_case(
        pool_case(kind + "valid 2x2 stride 2, odd input", {2, 7, 5, 3}, {2, 2, 2, 2, Padding::kValid}, average));
    run_op_case(pool_case(kind + "same 3x3 stride 2", {2, 7, 5, 4}, {3, 3, 2, 2, Padding::kSame}, average));
    run_op_case(
        pool_case(kind + "same 3x3 stride 1 (overlapping)", {1, 5, 5, 2}, {3, 3, 1, 1, Padding::kSame}, average));
    run_op_case(pool_case(kind + "valid 3x3 stride 1", {2, 5, 6, 3}, {3, 3, 1, 1, Padding::kValid}, average));
    run_op_case(pool_case(kind + "valid 2x3 strides (1, 2)", {2, 5, 7, 2}, {2, 3, 1, 2, Padding::kValid}, average));
    run_op_case(pool_case(kind + "valid 2x2 stride 3 (gaps between windows)", {2, 8, 7, 3},
                          {2, 2, 3, 3, Padding::kValid}, average));
    run_op_case(pool_case(kind + "same 2x2 stride 3", {1, 7, 8, 2}, {2, 2, 3, 3, Padding::kSame}, average));
    run_op_case(pool_case(kind + "same 2x2 stride 2, one image, 40 channels", {1, 5, 5, 40},
                          {2, 2, 2, 2, Padding::kSame}, average));
  }
}

TEST_CASE("pooling at the benchmark shape (26x26x32, 2x2 stride 2, batch 128)") {
  for (const bool average : {false, true}) {
    OpCase c =
        pool_case(average ? "avg bench" : "max bench", {128, 26, 26, 32}, {2, 2, 2, 2, Padding::kValid}, average);
    c.check_gradient = false;
    run_op_case(c);
  }
}

TEST_CASE("MaxPool2DGrad sends the gradient to the first of tied maxima, like TF's CPU kernel") {
  // One 2x4 image with 2x2 windows: the first window is all ties, the second has its maximum
  // twice (second and fourth cell). With 1 channel and with 9 (8 in a vector, 1 alone).
  for (const std::int64_t channels : {1, 9}) {
    OpCase c;
    c.name = fmt::format("max pool ties, {} channel(s)", channels);
    const std::vector<double> cells{1, 1, 0.5, 3, 1, 1, 0.25, 3};
    InputSpec x{.shape = {1, 2, 4, channels}, .kind = InputSpec::Kind::kValues};
    for (const double v : cells) x.values.insert(x.values.end(), static_cast<std::size_t>(channels), v);
    c.inputs = {x, InputSpec::floats({1, 1, 2, channels})};
    const Window win{2, 2, 2, 2, Padding::kValid};
    c.build = [](const std::vector<Output>& in) {
      graph::Attrs attrs = window_attrs(2, 2, Padding::kValid);
      attrs.set("pool_size", std::vector<std::int64_t>{2, 2});
      const Output y = ops::max_pool2d(in[0]);
      return std::vector<Output>{ops::detail::add_op("MaxPool2DGrad", {in[0], y, in[1]}, attrs)};
    };
    c.reference = [=](const std::vector<RefTensor>& in) {
      return std::vector<RefTensor>{ref_max_pool_grad(in[0], in[1], win)};
    };
    c.check_gradient = false;
    run_op_case(c);
  }
}

TEST_CASE("AvgPool2DGrad on its own, with its gradient (it is linear in dy)") {
  OpCase c;
  c.name = "avg pool grad";
  const Window win{3, 3, 2, 2, Padding::kSame};
  c.inputs = {InputSpec::floats({2, 5, 6, 3}).no_gradient(), InputSpec::floats({2, 3, 3, 3})};
  c.build = [](const std::vector<Output>& in) {
    graph::Attrs attrs = window_attrs(2, 2, Padding::kSame);
    attrs.set("pool_size", std::vector<std::int64_t>{3, 3});
    return std::vector<Output>{ops::detail::add_op("AvgPool2DGrad", {in[0], in[1]}, attrs)};
  };
  c.reference = [=](const std::vector<RefTensor>& in) {
    // The adjoint of average pooling: each dy spreads evenly over its window's cells.
    const RefTensor& x = in[0];
    RefTensor dx(x.shape);
    const Dim dh = window_dim(x.shape[1], 3, 2, Padding::kSame), dw = window_dim(x.shape[2], 3, 2, Padding::kSame);
    for (std::int64_t b = 0; b < x.shape[0]; ++b) {
      for (std::int64_t oh = 0; oh < dh.out; ++oh) {
        for (std::int64_t ow = 0; ow < dw.out; ++ow) {
          std::vector<std::pair<std::int64_t, std::int64_t>> cells;
          for (std::int64_t i = 0; i < win.k_h; ++i) {
            for (std::int64_t j = 0; j < win.k_w; ++j) {
              const auto ih = oh * 2 - dh.pad_before + i, iw = ow * 2 - dw.pad_before + j;
              if (ih >= 0 && ih < x.shape[1] && iw >= 0 && iw < x.shape[2]) cells.emplace_back(ih, iw);
            }
          }
          for (std::int64_t ch = 0; ch < x.shape[3]; ++ch) {
            for (const auto& [ih, iw] : cells) {
              dx[at4(dx.shape, b, ih, iw, ch)] +=
                  in[1][at4(in[1].shape, b, oh, ow, ch)] / static_cast<double>(cells.size());
            }
          }
        }
      }
    }
    return std::vector<RefTensor>{dx};
  };
  run_op_case(c);
}

TEST_CASE("shapes with an unknown batch, and planning with a concrete one") {
  const auto graph_ptr = std::make_shared<Graph>();
  Graph& g = *graph_ptr;
  const Output x = g.placeholder(kFloat32, {-1, 28, 28, 1}, "x");
  const Output f = g.placeholder(kFloat32, {3, 3, 1, 32}, "f");
  const Output valid = ops::conv2d(x, f);
  CHECK(valid.shape() == Shape{-1, 26, 26, 32});
  const Output same2 = ops::conv2d(x, f, {.strides = {2, 2}, .padding = Padding::kSame});
  CHECK(same2.shape() == Shape{-1, 14, 14, 32});
  const Output pooled = ops::max_pool2d(valid);
  CHECK(pooled.shape() == Shape{-1, 13, 13, 32});
  CHECK(ops::avg_pool2d(same2, {.pool_size = {3, 3}, .strides = {2, 2}, .padding = Padding::kSame}).shape() ==
        Shape{-1, 7, 7, 32});
  const Output loss = ops::reduce_sum(pooled);
  const auto grads = graph::gradients({&loss, 1}, std::vector<Output>{x, f});
  CHECK(grads[0].shape() == Shape{-1, 28, 28, 1});
  CHECK(grads[1].shape() == Shape{3, 3, 1, 32});

  // Run with a batch of 2 and compare with the reference.
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(-1, 1);
  RefTensor xv(Shape{2, 28, 28, 1}), fv(Shape{3, 3, 1, 32});
  for (auto& v : xv.values) v = u(rng);
  for (auto& v : fv.values) v = u(rng);
  const auto to_f32 = [](const RefTensor& r) {
    std::vector<float> v(r.values.begin(), r.values.end());
    return Tensor::from_vector<float>(v, r.shape);
  };
  graph::Executor ex(graph_ptr, devices::default_cpu_device());
  const auto out = ex.run({{x, to_f32(xv)}, {f, to_f32(fv)}}, {pooled, grads[1]});
  const RefTensor want = ref_pool(ref_conv2d(xv, fv, 1, 1, Padding::kValid), {2, 2, 2, 2, Padding::kValid}, false);
  const RefTensor got = to_ref(out[0]);
  REQUIRE(got.shape == want.shape);
  for (std::int64_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == doctest::Approx(want[i]).epsilon(1e-4));
  CHECK(out[1].shape() == Shape{3, 3, 1, 32});
}

TEST_CASE("shape errors name the node and the shapes") {
  Graph g;
  const Output x3 = g.placeholder(kFloat32, {-1, 28, 28, 3}, "x");
  const Output f1 = g.placeholder(kFloat32, {3, 3, 1, 32}, "f");
  CHECK_THROWS_WITH_AS(ops::conv2d(x3, f1),
                       doctest::Contains("Conv2D \"Conv2D\": input (None, 28, 28, 3) has 3 channels but the filter "
                                         "(3, 3, 1, 32) expects 1"),
                       InvalidArgument);

  const Output tiny = g.placeholder(kFloat32, {-1, 2, 2, 1}, "tiny");
  CHECK_THROWS_WITH_AS(ops::conv2d(tiny, f1),
                       doctest::Contains("with VALID padding the filter (3, 3, 1, 32) does not fit"), InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::conv2d(tiny, f1), doctest::Contains("(None, 2, 2, 1)"), InvalidArgument);
  CHECK(ops::conv2d(tiny, f1, {.padding = Padding::kSame}).shape() == Shape{-1, 2, 2, 32});  // SAME pads instead
  CHECK_THROWS_WITH_AS(ops::max_pool2d(tiny, {.pool_size = {3, 3}}), doctest::Contains("MaxPool2D \""),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::max_pool2d(tiny, {.pool_size = {3, 3}}),
                       doctest::Contains("pool window 3x3 does not fit in the input (None, 2, 2, 1)"), InvalidArgument);

  const Output x1 = g.placeholder(kFloat32, {-1, 28, 28, 1}, "x1");
  CHECK_THROWS_WITH_AS(ops::conv2d(x1, f1, {.strides = {0, 1}}),
                       doctest::Contains("strides must be two positive integers (height, width), got [0, 1]"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::avg_pool2d(x1, {.strides = {2, -1}}), doctest::Contains("AvgPool2D \""), InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::max_pool2d(x1, {.pool_size = {0, 2}}), doctest::Contains("pool_size must be"),
                       InvalidArgument);

  const Output flat = g.placeholder(kFloat32, {-1, 28, 28}, "flat");
  CHECK_THROWS_WITH_AS(ops::conv2d(flat, f1), doctest::Contains("input must have rank 4"), InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::conv2d(flat, f1), doctest::Contains("(None, 28, 28)"), InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::max_pool2d(flat), doctest::Contains("rank 4"), InvalidArgument);
  const Output f3 = g.placeholder(kFloat32, {3, 3, 1}, "f3");
  CHECK_THROWS_WITH_AS(ops::conv2d(x1, f3), doctest::Contains("filter must have rank 4"), InvalidArgument);

  const Output xd = g.placeholder(kFloat64, {-1, 28, 28, 1}, "xd");
  CHECK_THROWS_WITH_AS(ops::conv2d(xd, f1), doctest::Contains("different dtypes: float64 and float32"),
                       InvalidArgument);
  const Output xi = g.placeholder(kInt32, {-1, 28, 28, 1}, "xi");
  CHECK_THROWS_WITH_AS(ops::max_pool2d(xi), doctest::Contains("expected a floating-point tensor"), InvalidArgument);

  // The backprop ops check dy against the forward shape.
  graph::Attrs attrs;
  attrs.set("strides", std::vector<std::int64_t>{1, 1});
  attrs.set("padding", "VALID");
  const Output dy_bad = g.placeholder(kFloat32, {-1, 27, 26, 32}, "dy");
  CHECK_THROWS_WITH_AS(ops::detail::add_op("Conv2DBackpropInput", {x1, f1, dy_bad}, attrs),
                       doctest::Contains("dy has shape (None, 27, 26, 32), but Conv2D of x_like (None, 28, 28, 1) and "
                                         "filter (3, 3, 1, 32) gives (None, 26, 26, 32)"),
                       InvalidArgument);
  CHECK_THROWS_AS(ops::detail::add_op("Conv2DBackpropFilter", {x1, f1, dy_bad}, attrs), InvalidArgument);

  // Nodes built by name with bad attributes are rejected naming the node.
  graph::Attrs bad_padding;
  bad_padding.set("strides", std::vector<std::int64_t>{1, 1});
  bad_padding.set("padding", "full");
  CHECK_THROWS_WITH_AS(ops::detail::add_op("Conv2D", {x1, f1}, bad_padding), doctest::Contains("Conv2D \"Conv2D_"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::detail::add_op("Conv2D", {x1, f1}, bad_padding), doctest::Contains("padding \"full\""),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::detail::add_op("MaxPool2D", {x1}, attrs), doctest::Contains("MaxPool2D \"MaxPool2D"),
                       InvalidArgument);  // no pool_size
}

TEST_CASE("parse_padding accepts TF's names in any case") {
  CHECK(ops::parse_padding("VALID") == Padding::kValid);
  CHECK(ops::parse_padding("same") == Padding::kSame);
  CHECK(ops::parse_padding("Same") == Padding::kSame);
  CHECK_THROWS_WITH_AS(ops::parse_padding("full"),
                       doctest::Contains("padding \"full\": expected \"valid\" or \"same\""), InvalidArgument);
}

TEST_CASE("FusedConv2D: activation(conv2d + bias), against the reference with gradients") {
  struct Fused {
    const char* name;
    Shape x, f;
    std::int64_t s;
    Padding p;
    ops::Activation activation;
  };
  // Smooth activations get the gradient check; relu is checked forward only (its kink makes
  // finite differences unreliable; its derivative is covered by BiasActivationGrad's own case).
  const Fused cases[] = {
      {"linear, valid", {2, 5, 6, 3}, {3, 3, 3, 4}, 1, Padding::kValid, ops::Activation::kLinear},
      {"tanh, same stride 2", {2, 6, 5, 2}, {3, 3, 2, 3}, 2, Padding::kSame, ops::Activation::kTanh},
      {"sigmoid, direct kernel geometry", {2, 6, 6, 1}, {3, 3, 1, 32}, 1, Padding::kSame, ops::Activation::kSigmoid},
      {"relu, the benchmark's first layer", {3, 28, 28, 1}, {3, 3, 1, 32}, 1, Padding::kValid, ops::Activation::kRelu},
  };
  for (const auto& fc : cases) {
    OpCase c;
    c.name = std::string("FusedConv2D ") + fc.name;
    c.inputs = {InputSpec::floats(fc.x), InputSpec::floats(fc.f), InputSpec::floats({fc.f[3]})};
    const ops::Conv2DOptions options{.strides = {fc.s, fc.s}, .padding = fc.p};
    const auto activation = fc.activation;
    c.build = [options, activation](const std::vector<Output>& in) {
      return std::vector<Output>{ops::fused_conv2d(in[0], in[1], in[2], activation, options)};
    };
    const auto s = fc.s;
    const auto p = fc.p;
    c.reference = [s, p, activation](const std::vector<RefTensor>& in) {
      RefTensor y = ref_conv2d(in[0], in[1], s, s, p);
      const auto channels = in[2].size();
      for (std::int64_t i = 0; i < y.size(); ++i) {
        const double z = y[i] + in[2][i % channels];
        y[i] = activation == ops::Activation::kRelu      ? std::max(z, 0.0)
               : activation == ops::Activation::kSigmoid ? 1.0 / (1.0 + std::exp(-z))
               : activation == ops::Activation::kTanh    ? std::tanh(z)
                                                         : z;
      }
      return std::vector<RefTensor>{y};
    };
    c.f32_tolerance = kLongSumF32Tolerance;
    c.check_gradient = activation != ops::Activation::kRelu;
    run_op_case(c);
  }
  Graph g;
  auto x = g.placeholder(kFloat32, {-1, 8, 8, 1}, "x");
  auto f = g.placeholder(kFloat32, {3, 3, 1, 4}, "f");
  auto b = g.placeholder(kFloat32, {5}, "b");
  CHECK_THROWS_WITH_AS(ops::fused_conv2d(x, f, b, ops::Activation::kRelu), doctest::Contains("bias of shape (5,)"),
                       InvalidArgument);
}

TEST_CASE("MaxPool2DBiasActivationGrad: MaxPool2DGrad then the activation's derivative and the bias sum") {
  struct Geometry {
    const char* name;
    Shape y;
    Window win;
  };
  const Geometry geometries[] = {
      {"valid 2x2 stride 2", {2, 6, 6, 3}, {2, 2, 2, 2, Padding::kValid}},
      {"valid 2x2 stride 2, odd input", {2, 7, 5, 3}, {2, 2, 2, 2, Padding::kValid}},
      {"same 3x3 stride 2", {2, 7, 5, 4}, {3, 3, 2, 2, Padding::kSame}},
      {"same 3x3 stride 1 (overlapping)", {1, 5, 5, 2}, {3, 3, 1, 1, Padding::kSame}},
      {"valid 2x2 stride 3 (gaps between windows)", {2, 8, 7, 3}, {2, 2, 3, 3, Padding::kValid}},
      {"the benchmark's first layer (26x26x32, batch 128)", {128, 26, 26, 32}, {2, 2, 2, 2, Padding::kValid}},
      // Float32 channels go 8 at a time where the CPU level has vectors, the rest one by one.
      {"valid 2x2 stride 2, odd input, 8 + 3 channels", {2, 7, 5, 11}, {2, 2, 2, 2, Padding::kValid}},
      {"same 3x3 stride 1 (overlapping), 16 + 3 channels", {1, 5, 5, 19}, {3, 3, 1, 1, Padding::kSame}},
  };
  for (const auto& geometry : geometries) {
    for (const auto activation : {ops::Activation::kRelu, ops::Activation::kLinear}) {
      OpCase c;
      c.name = fmt::format("MaxPool2DBiasActivationGrad {}, {}", ops::activation_name(activation), geometry.name);
      const Window win = geometry.win;
      const Dim dh = window_dim(geometry.y[1], win.k_h, win.s_h, win.padding);
      const Dim dw = window_dim(geometry.y[2], win.k_w, win.s_w, win.padding);
      // y of both signs, so that relu's derivative is 0 at some winners.
      c.inputs = {InputSpec::floats(geometry.y).with_distinct(),
                  InputSpec::floats({geometry.y[0], dh.out, dw.out, geometry.y[3]})};
      c.build = [win, activation](const std::vector<Output>& in) {
        graph::Attrs attrs = window_attrs(win.s_h, win.s_w, win.padding);
        attrs.set("pool_size", std::vector<std::int64_t>{win.k_h, win.k_w});
        attrs.set("activation", ops::activation_name(activation));
        return ops::detail::add_op_multi("MaxPool2DBiasActivationGrad", {in[0], in[1]}, attrs);
      };
      c.reference = [win, activation](const std::vector<RefTensor>& in) {
        RefTensor dz = ref_max_pool_grad(in[0], in[1], win);
        const std::int64_t channels = in[0].shape[3];
        RefTensor db(Shape{channels});
        for (std::int64_t i = 0; i < dz.size(); ++i) {
          if (activation == ops::Activation::kRelu && !(in[0][i] > 0)) dz[i] = 0;
          db[i % channels] += dz[i];
        }
        return std::vector<RefTensor>{dz, db};
      };
      c.check_gradient = false;  // not differentiable, like MaxPool2DGrad
      c.f32_tolerance = kLongSumF32Tolerance;
      run_op_case(c);
    }
  }
}

namespace {

// Each gradient of act(conv2d(x, f) + b) through a max pool, built from FusedConv2D (which takes
// MaxPool2DBiasActivationGrad when a max pool follows) and from separate Conv2D, BiasAdd and
// activation ops, in float64; and the names of the ops the fused gradient used.
void check_pooled_fused_conv_gradient(ops::Activation activation, const std::string& fused_op,
                                      const ops::Pool2DOptions& pool = {}) {
  CAPTURE(ops::activation_name(activation));
  const auto graph_ptr = std::make_shared<Graph>();
  Graph& g = *graph_ptr;
  const Output x = g.placeholder(kFloat64, {2, 9, 9, 3}, "x");
  const Output f = g.placeholder(kFloat64, {3, 3, 3, 4}, "f");
  const Output b = g.placeholder(kFloat64, {4}, "b");
  const Output w = g.placeholder(kFloat64, ops::max_pool2d(g.placeholder(kFloat64, {2, 7, 7, 4}), pool).shape(), "w");
  const auto loss_of = [&](Output y) { return ops::reduce_sum(ops::mul(ops::max_pool2d(y, pool), w)); };
  const Output fused_loss = loss_of(ops::fused_conv2d(x, f, b, activation));
  const std::size_t first_gradient_node = static_cast<std::size_t>(g.num_nodes());
  const auto fused = graph::gradients({&fused_loss, 1}, std::vector<Output>{x, f, b});
  std::vector<std::string> gradient_ops;
  for (int id = static_cast<int>(first_gradient_node); id < g.num_nodes(); ++id)
    gradient_ops.push_back(g.node(id).op_name());
  const auto uses = [&](const std::string& op) {
    return std::find(gradient_ops.begin(), gradient_ops.end(), op) != gradient_ops.end();
  };
  CHECK(uses(fused_op));
  CHECK(uses("MaxPool2DBiasActivationGrad") == (fused_op == "MaxPool2DBiasActivationGrad"));

  Output z = ops::bias_add(ops::conv2d(x, f), b);
  if (activation == ops::Activation::kRelu) z = ops::relu(z);
  if (activation == ops::Activation::kSigmoid) z = ops::sigmoid(z);
  const Output plain_loss = loss_of(z);
  const auto plain = graph::gradients({&plain_loss, 1}, std::vector<Output>{x, f, b});

  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(-1, 1);
  const auto random = [&](const Shape& shape) {
    std::vector<double> v(static_cast<std::size_t>(shape.num_elements()));
    for (auto& e : v) e = u(rng);
    return Tensor::from_vector<double>(v, shape);
  };
  graph::Executor ex(graph_ptr, devices::default_cpu_device());
  const auto out =
      ex.run({{x, random(x.shape())}, {f, random(f.shape())}, {b, random(b.shape())}, {w, random(w.shape())}},
             {fused[0], fused[1], fused[2], plain[0], plain[1], plain[2]});
  for (int i = 0; i < 3; ++i) {
    const RefTensor got = to_ref(out[static_cast<std::size_t>(i)]), want = to_ref(out[static_cast<std::size_t>(i + 3)]);
    REQUIRE(got.shape == want.shape);
    for (std::int64_t e = 0; e < got.size(); ++e) REQUIRE(got[e] == doctest::Approx(want[e]).epsilon(1e-12));
  }
}

}  // namespace

TEST_CASE("FusedConv2D's gradient through a max pool: the argmax gradient ops for relu and linear") {
  // The pool is fused into the convolution (FusedConv2DMaxPool), whose gradients read its argmax.
  check_pooled_fused_conv_gradient(ops::Activation::kRelu, "Conv2DBackpropInputArgmax");
  check_pooled_fused_conv_gradient(ops::Activation::kLinear, "Conv2DBackpropInputArgmax");
  // sigmoid's derivative is not folded into the pool's gradient.
  check_pooled_fused_conv_gradient(ops::Activation::kSigmoid, "BiasActivationGrad");
  // Overlapping windows keep MaxPool2D, and FusedConv2D's gradient takes MaxPool2DBiasActivationGrad.
  check_pooled_fused_conv_gradient(ops::Activation::kRelu, "MaxPool2DBiasActivationGrad",
                                   {.pool_size = {2, 2}, .strides = {1, 1}});
}

namespace {

struct ConvPoolGeometry {
  const char* name;
  Shape x, f;
  std::int64_t s;
  Padding p;
  Window pool;  // VALID, disjoint
};

// Where FusedConv2DMaxPool runs: the direct kernels' geometries (output channels a multiple of 8
// or 16), the generic path's (5 channels), VALID remainders, gaps, and non-square windows.
const ConvPoolGeometry kConvPoolGeometries[] = {
    {"the benchmark's first layer", {3, 28, 28, 1}, {3, 3, 1, 32}, 1, Padding::kValid, {2, 2, 2, 2, Padding::kValid}},
    {"the benchmark's second layer (a remainder row and column)",
     {2, 13, 13, 32},
     {3, 3, 32, 64},
     1,
     Padding::kValid,
     {2, 2, 2, 2, Padding::kValid}},
    {"SAME stride 2, 24 channels", {2, 11, 9, 3}, {3, 3, 3, 24}, 2, Padding::kSame, {2, 2, 2, 2, Padding::kValid}},
    {"gaps between windows (2x2 stride 3)",
     {2, 12, 11, 2},
     {3, 3, 2, 16},
     1,
     Padding::kValid,
     {2, 2, 3, 3, Padding::kValid}},
    {"3x2 windows, 5 channels", {2, 10, 9, 3}, {3, 3, 3, 5}, 1, Padding::kSame, {3, 2, 3, 2, Padding::kValid}},
    // Input gradients through the direct kernels (16k input channels, stride 1), with padding:
    {"16 input channels, SAME, gaps between windows",
     {2, 9, 10, 16},
     {3, 3, 16, 16},
     1,
     Padding::kSame,
     {2, 2, 3, 3, Padding::kValid}},
    {"32 input channels, 3x2 windows", {2, 8, 7, 32}, {3, 3, 32, 32}, 1, Padding::kSame, {3, 2, 3, 2, Padding::kValid}},
    // The filter gradient over the windows' winners with stride 2 and SAME padding (the padded
    // input), and a patch of 27 (AVX-512) or 54 (AVX2) vectors: several tiles down each channel.
    {"48 input channels, SAME stride 2", {2, 11, 10, 48}, {3, 3, 48, 16}, 2, Padding::kSame, {2, 2, 2, 2, Padding::kValid}},
    // One input channel with 16k output channels: the first layer's filter gradient from the
    // argmax runs in register tiles (filter_tile_argmax). Rows and columns outside every window
    // (gaps, and the VALID remainder) are skipped there, and 3x3 windows give three pixels of one
    // window in a row; the first layer's own geometry has neither.
    {"one input channel, SAME stride 2, gaps between windows and a remainder",
     {2, 15, 14, 1},
     {3, 3, 1, 16},
     2,
     Padding::kSame,
     {2, 2, 3, 3, Padding::kValid}},
    {"one input channel, 3x3 windows, 48 channels (column blocks of several widths)",
     {2, 13, 12, 1},
     {2, 2, 1, 48},
     1,
     Padding::kValid,
     {3, 3, 3, 3, Padding::kValid}},
    {"one pool row per image, 13 channels",
     {3, 6, 8, 2},
     {2, 2, 2, 13},
     1,
     Padding::kValid,
     {5, 2, 5, 2, Padding::kValid}},
};

// Only in the bitwise comparison (too large for the gradient check): backprop-filter's chunks of
// dz rows (32 KiB: 39 rows of 13 pixels x 16 channels) split each thread's rows, and a chunk
// starts inside a pool window (12 rows an image), so the winners' sums carry across chunks.
const ConvPoolGeometry kChunkedConvPoolGeometry{"several chunks of dz rows a thread, one starting inside a window",
                                                {8, 14, 15, 16},
                                                {3, 3, 16, 16},
                                                1,
                                                Padding::kValid,
                                                {2, 2, 2, 2, Padding::kValid}};

ops::Pool2DOptions pool_options(const Window& win) {
  return {.pool_size = {win.k_h, win.k_w}, .strides = {win.s_h, win.s_w}, .padding = win.padding};
}

Tensor float_tensor(DType dtype, const std::vector<double>& v, const Shape& shape) {
  if (dtype == kFloat64) return Tensor::from_vector<double>(v, shape);
  return Tensor::from_vector<float>(std::vector<float>(v.begin(), v.end()), shape);
}

// Small integers (integers = true), so that sums are exact and windows have tied maxima (relu's
// zeros tie too); else uniform in [-1, 1].
Tensor random_tensor(DType dtype, const Shape& shape, bool integers, int low, int high, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> ints(low, high);
  std::uniform_real_distribution<double> reals(-1, 1);
  std::vector<double> v(static_cast<std::size_t>(shape.num_elements()));
  for (auto& e : v) e = integers ? ints(rng) : reals(rng);
  return float_tensor(dtype, v, shape);
}

}  // namespace

TEST_CASE("FusedConv2DMaxPool: bitwise the unfused FusedConv2D, MaxPool2D and their gradients, with its argmax") {
  std::vector<ConvPoolGeometry> geometries(std::begin(kConvPoolGeometries), std::end(kConvPoolGeometries));
  geometries.push_back(kChunkedConvPoolGeometry);
  for (const auto& geometry : geometries) {
    for (const DType dtype : {kFloat32, kFloat64}) {
      for (const auto activation : {ops::Activation::kRelu, ops::Activation::kLinear}) {
        for (const bool integers : {true, false}) {
          CAPTURE(geometry.name);
          CAPTURE(graph::dtype_name(dtype));
          CAPTURE(ops::activation_name(activation));
          CAPTURE(integers);
          const auto graph_ptr = std::make_shared<Graph>();
          Graph& g = *graph_ptr;
          const Output x = g.placeholder(dtype, geometry.x, "x");
          const Output f = g.placeholder(dtype, geometry.f, "f");
          const Output b = g.placeholder(dtype, {geometry.f[3]}, "b");
          const ops::Conv2DOptions conv{.strides = {geometry.s, geometry.s}, .padding = geometry.p};
          const Output fused =
              ops::max_pool2d(ops::fused_conv2d(x, f, b, activation, conv), pool_options(geometry.pool));
          REQUIRE(fused.producer().op_name() == "FusedConv2DMaxPool");
          const Output argmax{&g, fused.node, 1};
          // The same ops unfused: MaxPool2D added directly, without the builder's fusion.
          const Output y = ops::fused_conv2d(x, f, b, activation, conv);
          graph::Attrs pool_attrs = window_attrs(geometry.pool.s_h, geometry.pool.s_w, Padding::kValid);
          pool_attrs.set("pool_size", std::vector<std::int64_t>{geometry.pool.k_h, geometry.pool.k_w});
          const Output plain = g.add("MaxPool2D", {y}, pool_attrs);
          const Output w = g.placeholder(dtype, fused.shape(), "w");
          const Output fused_loss = ops::reduce_sum(ops::mul(fused, w));
          const Output plain_loss = ops::reduce_sum(ops::mul(plain, w));
          const auto fused_grads = graph::gradients({&fused_loss, 1}, std::vector<Output>{x, f, b});
          const auto plain_grads = graph::gradients({&plain_loss, 1}, std::vector<Output>{x, f, b});
          // A first layer's gradients: no dx, so no dz (Conv2DBackpropFilterArgmax alone).
          const auto first_layer_grads = graph::gradients({&fused_loss, 1}, std::vector<Output>{f, b});

          std::mt19937_64 rng(5);
          const auto random = [&](const Shape& shape, int low, int high) {
            return random_tensor(dtype, shape, integers, low, high, rng);
          };
          graph::Executor ex(graph_ptr, devices::default_cpu_device());
          const auto out =
              ex.run({{x, random(x.shape(), -2, 2)},
                      {f, random(f.shape(), -1, 1)},
                      {b, random(b.shape(), -1, 1)},
                      {w, random(fused.shape(), -3, 3)}},
                     {fused, plain, argmax, y, fused_grads[0], fused_grads[1], fused_grads[2], plain_grads[0],
                      plain_grads[1], plain_grads[2], first_layer_grads[0], first_layer_grads[1]});
          // p and every gradient, bit for bit.
          for (const auto& [got, want] : {std::pair{0, 1}, {4, 7}, {5, 8}, {6, 9}, {10, 8}, {11, 9}}) {
            CAPTURE(got);
            const RefTensor a = to_ref(out[static_cast<std::size_t>(got)]),
                            e = to_ref(out[static_cast<std::size_t>(want)]);
            REQUIRE(a.shape == e.shape);
            for (std::int64_t i = 0; i < a.size(); ++i) REQUIRE(a[i] == e[i]);
          }
          // argmax: the first cell of the window holding the maximum, or 255 where relu' is 0.
          const RefTensor p = to_ref(out[0]), winners = to_ref(out[2]), yv = to_ref(out[3]);
          const Window& win = geometry.pool;
          for (std::int64_t i = 0; i < p.size(); ++i) {
            const std::int64_t c = i % p.shape[3], pw = i / p.shape[3] % p.shape[2];
            const std::int64_t ph = i / (p.shape[3] * p.shape[2]) % p.shape[1],
                               n = i / (p.shape[3] * p.shape[2] * p.shape[1]);
            std::int64_t first = -1;
            for (std::int64_t cell = 0; cell < win.k_h * win.k_w && first < 0; ++cell) {
              if (yv[at4(yv.shape, n, ph * win.s_h + cell / win.k_w, pw * win.s_w + cell % win.k_w, c)] == p[i])
                first = cell;
            }
            const bool dead = activation == ops::Activation::kRelu && !(p[i] > 0);
            REQUIRE(winners[i] == (dead ? 255.0 : static_cast<double>(first)));
          }
        }
      }
    }
  }
}

TEST_CASE("FusedConv2DMaxPool against the reference, with the gradient check (linear)") {
  for (const auto& geometry : kConvPoolGeometries) {
    for (const auto activation : {ops::Activation::kLinear, ops::Activation::kRelu}) {
      OpCase c;
      c.name = fmt::format("FusedConv2DMaxPool {}, {}", ops::activation_name(activation), geometry.name);
      // Distinct inputs: a finite-difference step must not change a window's winner.
      c.inputs = {InputSpec::floats(geometry.x).with_distinct(), InputSpec::floats(geometry.f),
                  InputSpec::floats({geometry.f[3]})};
      const auto s = geometry.s;
      const auto p = geometry.p;
      const Window win = geometry.pool;
      c.build = [s, p, win, activation](const std::vector<Output>& in) {
        const Output pooled = ops::max_pool2d(
            ops::fused_conv2d(in[0], in[1], in[2], activation, {.strides = {s, s}, .padding = p}), pool_options(win));
        // 16-bit inputs take FusedConv2D and MaxPool2D.
        const bool wide = in[0].dtype() == kFloat32 || in[0].dtype() == kFloat64;
        CHECK((pooled.producer().op_name() == "FusedConv2DMaxPool") == wide);
        return std::vector<Output>{pooled};
      };
      c.reference = [s, p, win, activation](const std::vector<RefTensor>& in) {
        RefTensor y = ref_conv2d(in[0], in[1], s, s, p);
        const auto channels = in[2].size();
        for (std::int64_t i = 0; i < y.size(); ++i) {
          const double z = y[i] + in[2][i % channels];
          y[i] = activation == ops::Activation::kRelu ? std::max(z, 0.0) : z;
        }
        return std::vector<RefTensor>{ref_pool(y, win, false)};
      };
      c.f32_tolerance = kLongSumF32Tolerance;
      c.check_gradient = activation == ops::Activation::kLinear;  // relu's kink defeats finite differences
      run_op_case(c);
    }
  }
}

TEST_CASE("max_pool2d fuses into FusedConv2D only where FusedConv2DMaxPool applies") {
  Graph g;
  const Output x = g.placeholder(kFloat32, {-1, 12, 12, 3}, "x");
  const Output f = g.placeholder(kFloat32, {3, 3, 3, 8}, "f");
  const Output b = g.placeholder(kFloat32, {8}, "b");
  const auto conv = [&](ops::Activation activation) { return ops::fused_conv2d(x, f, b, activation); };
  const auto pooled_op = [](Output pooled) { return pooled.producer().op_name(); };
  CHECK(pooled_op(ops::max_pool2d(conv(ops::Activation::kRelu))) == "FusedConv2DMaxPool");
  CHECK(pooled_op(ops::max_pool2d(conv(ops::Activation::kLinear), {.pool_size = {3, 3}, .strides = {3, 4}})) ==
        "FusedConv2DMaxPool");
  // Overlapping windows, SAME padding, and an activation whose derivative is not relu's or 1.
  CHECK(pooled_op(ops::max_pool2d(conv(ops::Activation::kRelu), {.strides = {1, 1}})) == "MaxPool2D");
  CHECK(pooled_op(ops::max_pool2d(conv(ops::Activation::kRelu), {.padding = Padding::kSame})) == "MaxPool2D");
  CHECK(pooled_op(ops::max_pool2d(conv(ops::Activation::kTanh))) == "MaxPool2D");
  // The convolution's output is read by another op already: it is stored, and pooled from memory.
  const Output y = conv(ops::Activation::kRelu);
  const Output other = ops::relu(y);
  CHECK(pooled_op(ops::max_pool2d(y)) == "MaxPool2D");
  (void)other;
  // A plain Conv2D, and a window larger than the image's height.
  CHECK(pooled_op(ops::max_pool2d(ops::conv2d(x, f))) == "MaxPool2D");
  CHECK_THROWS_WITH_AS(ops::max_pool2d(conv(ops::Activation::kRelu), {.pool_size = {11, 2}, .strides = {11, 2}}),
                       doctest::Contains("does not fit"), InvalidArgument);
  // The op itself refuses overlapping windows, naming the node.
  graph::Attrs attrs = window_attrs(1, 1, Padding::kValid);
  attrs.set("activation", "relu");
  attrs.set("pool_size", std::vector<std::int64_t>{2, 2});
  attrs.set("pool_strides", std::vector<std::int64_t>{1, 1});
  attrs.set("pool_padding", "VALID");
  CHECK_THROWS_WITH_AS(g.add_node("FusedConv2DMaxPool", {x, f, b}, attrs),
                       doctest::Contains("FusedConv2DMaxPool takes VALID windows that do not overlap"),
                       InvalidArgument);
}
