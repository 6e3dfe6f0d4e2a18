// The GPU kernels' index arithmetic, run on the CPU: every kernel of ops/cuda/kernels.cu that
// moves elements around (broadcasting, transposes, reductions over any axes, SumToShape, column
// sums in row chunks, im2col and col2im, pooling and its gradients, cuBLAS's column-major call) is emulated here by
// looping over its threads with the same element functions (ops/cuda/element_math.h) and argument builders
// (ops/cuda/index_args.h), and compared with the CPU kernels. It needs no GPU and no CUDA, so it runs in every build;
// ops_gpu_test then checks the arithmetic itself on a GPU.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "common/random_values.h"
#include "tandem/graph/executor.h"
#include "tandem/graph/graph.h"
#include "tandem/ops/cuda/element_math.h"
#include "tandem/ops/cuda/index_args.h"
#include "tandem/ops/detail/kernel_args.h"
#include "tandem/ops/ops.h"

using namespace tandem;
using namespace tandem::ops::cuda;
using graph::Executor;
using testing::random_values;

namespace {

Tensor tensor(const std::vector<float>& v, const Shape& s) { return Tensor::from_vector<float>(v, s); }

// Runs `fetch` of `g` on the CPU with the given feeds.
std::vector<float> run_cpu(const std::shared_ptr<Graph>& g, const std::vector<graph::Feed>& feeds, Output fetch) {
  Executor e(g, devices::default_cpu_device());
  return e.run(feeds, {fetch})[0].to_vector<float>();
}

void check_close(const std::vector<float>& got, const std::vector<float>& want, double tolerance = 1e-5) {
  REQUIRE(got.size() == want.size());
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::abs(got[i] - want[i]) > tolerance * (1.0 + std::abs(want[i])) && bad++ < 5) {
      CHECK_MESSAGE(false, "element ", i, ": emulated GPU ", got[i], ", CPU kernel ", want[i]);
    }
  }
  CHECK(bad == 0);
}

// Row-major C[m, n] = A[m, k] B[k, n].
std::vector<float> matmul(const std::vector<float>& a, const std::vector<float>& b, std::int64_t m, std::int64_t k,
                          std::int64_t n) {
  std::vector<float> c(static_cast<std::size_t>(m * n), 0.0f);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::int64_t l = 0; l < k; ++l)
        s += static_cast<double>(a[static_cast<std::size_t>(i * k + l)]) * b[static_cast<std::size_t>(l * n + j)];
      c[static_cast<std::size_t>(i * n + j)] = static_cast<float>(s);
    }
  }
  return c;
}

std::vector<float> transposed(const std::vector<float>& a, std::int64_t rows, std::int64_t cols) {
  std::vector<float> t(a.size());
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j)
      t[static_cast<std::size_t>(j * rows + i)] = a[static_cast<std::size_t>(i * cols + j)];
  }
  return t;
}

struct ConvCase {
  Shape x;       // NHWC
  Shape filter;  // HWIO
  ops::Conv2DOptions options;
};

const ConvCase kConvCases[] = {
    {{2, 7, 6, 3}, {3, 3, 3, 4}, {}},
    {{2, 7, 6, 3}, {3, 3, 3, 4}, {.strides = {2, 2}, .padding = ops::Padding::kSame}},
    {{1, 8, 9, 2}, {2, 3, 2, 5}, {.strides = {2, 1}, .padding = ops::Padding::kSame}},
    {{3, 5, 5, 1}, {1, 1, 1, 2}, {}},
    {{1, 6, 6, 2}, {3, 2, 2, 3}, {.strides = {3, 2}, .padding = ops::Padding::kValid}},
};

WindowGeometry conv_geometry(const Shape& x, const Shape& filter, const ops::Conv2DOptions& o) {
  ops::detail::WindowAttrs attrs;
  attrs.strides = o.strides;
  attrs.padding = o.padding;
  return flatten(ops::detail::make_window_geometry(x, filter[0], filter[1], filter[3], attrs));
}

// The patch matrix, as im2col_kernel writes it.
std::vector<float> im2col(const WindowGeometry& g, const std::vector<float>& x) {
  const std::int64_t total = g.batch * g.out_h * g.out_w * g.k_h * g.k_w * g.in_c;
  std::vector<float> col(static_cast<std::size_t>(total));
  for (std::int64_t i = 0; i < total; ++i) {
    const std::int64_t source = im2col_source(g, i);
    col[static_cast<std::size_t>(i)] = source >= 0 ? x[static_cast<std::size_t>(source)] : 0.0f;
  }
  return col;
}

}  // namespace

TEST_CASE("broadcasting binary ops: every output element reads the operands' elements the CPU kernel reads") {
  const std::vector<std::pair<Shape, Shape>> cases = {{{2, 3, 4}, {3, 1}}, {{4}, {2, 3, 4}}, {{2, 1, 4}, {1, 3, 1}},
                                                      {{}, {5, 2}},        {{3, 1}, {1, 1}}, {{2, 3, 4, 5}, {3, 1, 5}}};
  int seed = 0;
  for (const auto& [sa, sb] : cases) {
    CAPTURE(sa.to_string());
    CAPTURE(sb.to_string());
    auto g = std::make_shared<Graph>();
    auto a = g->placeholder(kFloat32, sa, "a");
    auto b = g->placeholder(kFloat32, sb, "b");
    auto sum = ops::sub(a, b);
    const auto av = random_values(sa.num_elements(), ++seed), bv = random_values(sb.num_elements(), ++seed);
    const auto want = run_cpu(g, {{a, tensor(av, sa)}, {b, tensor(bv, sb)}}, sum);
    const Shape out = sum.shape();
    const BroadcastArgs args = broadcast_args(out, sa, &sb);
    std::vector<float> got(static_cast<std::size_t>(args.elements));
    for (std::int64_t i = 0; i < args.elements; ++i) {
      got[static_cast<std::size_t>(i)] = av[static_cast<std::size_t>(broadcast_offset(args, i, 0))] -
                                         bv[static_cast<std::size_t>(broadcast_offset(args, i, 1))];
    }
    check_close(got, want, 0.0);
  }
}

TEST_CASE("transposes: the permuted strides read what the CPU kernel reads") {
  const std::vector<std::pair<Shape, std::vector<std::int64_t>>> cases = {
      {{3, 4}, {1, 0}}, {{2, 3, 4}, {2, 0, 1}}, {{2, 3, 4, 5}, {0, 3, 1, 2}}, {{5}, {0}}};
  for (const auto& [shape, perm] : cases) {
    CAPTURE(shape.to_string());
    auto g = std::make_shared<Graph>();
    auto x = g->placeholder(kFloat32, shape, "x");
    auto y = ops::transpose(x, perm);
    const auto xv = random_values(shape.num_elements(), 3);
    const auto want = run_cpu(g, {{x, tensor(xv, shape)}}, y);
    const BroadcastArgs args = transpose_args(shape, y.shape(), perm);
    std::vector<float> got(static_cast<std::size_t>(args.elements));
    for (std::int64_t i = 0; i < args.elements; ++i)
      got[static_cast<std::size_t>(i)] = xv[static_cast<std::size_t>(broadcast_offset(args, i, 0))];
    check_close(got, want, 0.0);
  }
}

TEST_CASE("reductions over any set of axes, and SumToShape, visit what the CPU kernels sum") {
  const Shape shape{3, 4, 5, 2};
  const auto xv = random_values(shape.num_elements(), 5);
  const auto emulate = [&](const std::vector<int>& axes) {
    const ReduceArgs args = reduce_args(shape, axes);
    std::vector<float> out(static_cast<std::size_t>(args.out_elements));
    for (std::int64_t o = 0; o < args.out_elements; ++o) {
      const std::int64_t base = reduce_base(args, o);
      double s = 0;
      for (std::int64_t r = 0; r < args.reduced_elements; ++r)
        s += xv[static_cast<std::size_t>(reduce_offset(args, base, r))];
      out[static_cast<std::size_t>(o)] = static_cast<float>(s);
    }
    return out;
  };
  const std::vector<std::vector<int>> axis_sets = {{0}, {1}, {3}, {0, 2}, {1, 3}, {0, 1, 2, 3}, {2}, {0, 1, 3}};
  for (const auto& axes : axis_sets) {
    CAPTURE(axes.size());
    auto g = std::make_shared<Graph>();
    auto x = g->placeholder(kFloat32, shape, "x");
    std::vector<std::int64_t> list(axes.begin(), axes.end());
    auto y = ops::reduce_sum(x, {.axes = list});
    check_close(emulate(axes), run_cpu(g, {{x, tensor(xv, shape)}}, y));
  }
  // SumToShape for the shapes broadcasting produces.
  for (const Shape& like : {Shape{4, 1, 2}, Shape{1, 5, 1}, Shape{2}, Shape{3, 1, 1, 2}, Shape{}}) {
    CAPTURE(like.to_string());
    auto g = std::make_shared<Graph>();
    auto x = g->placeholder(kFloat32, shape, "x");
    auto l = g->placeholder(kFloat32, like, "like");
    auto y = ops::sum_to_shape_of(x, l);
    const auto want = run_cpu(g, {{x, tensor(xv, shape)}, {l, Tensor::zeros(like, kFloat32)}}, y);
    check_close(emulate(ops::detail::sum_to_shape_axes(shape, like)), want);
  }
}

TEST_CASE("MaxGrad: each output's thread splits its gradient between the ties, as the CPU kernel does") {
  const Shape shape{3, 4, 5};
  std::vector<float> xv(static_cast<std::size_t>(shape.num_elements()));
  std::mt19937_64 rng(9);
  std::uniform_int_distribution<int> small(0, 3);  // many ties
  for (auto& v : xv) v = static_cast<float>(small(rng));
  for (const std::vector<int>& axes : std::vector<std::vector<int>>{{1}, {0, 2}, {2}, {0, 1, 2}}) {
    CAPTURE(axes.size());
    auto g = std::make_shared<Graph>();
    auto x = g->placeholder(kFloat32, shape, "x");
    std::vector<std::int64_t> list(axes.begin(), axes.end());
    auto y = ops::reduce_max(x, {.axes = list});
    auto dy = g->placeholder(kFloat32, y.shape(), "dy");
    auto dx = g->add("MaxGrad", {dy, x, y}, g->node(y.node).attrs);
    const auto dyv = random_values(y.shape().num_elements(), 11);
    const std::vector<graph::Feed> feeds{{x, tensor(xv, shape)}, {dy, tensor(dyv, y.shape())}};
    const auto yv = run_cpu(g, feeds, y);
    const ReduceArgs args = reduce_args(shape, axes);
    std::vector<float> got(xv.size(), -1.0f);
    for (std::int64_t o = 0; o < args.out_elements; ++o) {
      const std::int64_t base = reduce_base(args, o);
      const float best = yv[static_cast<std::size_t>(o)];
      std::int64_t ties = 0;
      for (std::int64_t r = 0; r < args.reduced_elements; ++r)
        ties += xv[static_cast<std::size_t>(reduce_offset(args, base, r))] == best;
      const float share = dyv[static_cast<std::size_t>(o)] / static_cast<float>(ties);
      for (std::int64_t r = 0; r < args.reduced_elements; ++r) {
        const auto i = static_cast<std::size_t>(reduce_offset(args, base, r));
        got[i] = xv[i] == best ? share : 0.0f;
      }
    }
    check_close(got, run_cpu(g, feeds, dx));
  }
}

TEST_CASE("column sums in row chunks: each row counted once per column, totals equal to the CPU's column sums") {
  // The chunked two-pass scheme of bias gradients and batch-norm sums (column_partials_kernel,
  // column_totals_kernel), block by block and thread by thread.
  for (const std::int64_t rows : {std::int64_t{0}, std::int64_t{1}, std::int64_t{7}, kRowsPerChunk, kRowsPerChunk + 1,
                                  std::int64_t{128 * 28 * 28}, kRowsPerChunk * kMaxRowChunks + 3}) {
    const std::int64_t cols = rows > 200000 ? 3 : 37;  // 37: two column blocks, the second partly idle
    CAPTURE(rows);
    const ColumnChunks split = column_chunks(rows);
    CHECK(split.chunks >= 1);
    CHECK(split.chunks <= kMaxRowChunks);
    if (rows > 0) CHECK(chunk_end(split, split.chunks - 1, rows) == rows);
    const auto values = random_values(rows * cols, 21);
    std::vector<double> totals(static_cast<std::size_t>(cols), 0.0);
    std::vector<int> visits(static_cast<std::size_t>(rows * cols), 0);
    std::vector<double> partial(static_cast<std::size_t>(split.chunks * cols), 0.0);
    const std::int64_t column_blocks = (cols + kColumnsPerBlock - 1) / kColumnsPerBlock;
    for (std::int64_t bx = 0; bx < column_blocks; ++bx) {  // pass 1: blocks (column block, chunk)
      for (std::int64_t chunk = 0; chunk < split.chunks; ++chunk) {
        double shared[kRowGroups][kColumnsPerBlock] = {};
        for (int ty = 0; ty < kRowGroups; ++ty) {
          for (int tx = 0; tx < kColumnsPerBlock; ++tx) {
            const std::int64_t c = bx * kColumnsPerBlock + tx;
            if (c >= cols) continue;
            const std::int64_t end = chunk_end(split, chunk, rows);
            for (std::int64_t r = chunk_begin(split, chunk) + ty; r < end; r += kRowGroups) {
              ++visits[static_cast<std::size_t>(r * cols + c)];
              shared[ty][tx] += values[static_cast<std::size_t>(r * cols + c)];
            }
          }
        }
        for (int tx = 0; tx < kColumnsPerBlock; ++tx) {
          const std::int64_t c = bx * kColumnsPerBlock + tx;
          if (c >= cols) continue;
          double total = 0;
          for (int g = 0; g < kRowGroups; ++g) total += shared[g][tx];
          partial[static_cast<std::size_t>(chunk * cols + c)] = total;
        }
      }
    }
    for (std::int64_t c = 0; c < cols; ++c) {  // pass 2
      for (std::int64_t chunk = 0; chunk < split.chunks; ++chunk)
        totals[static_cast<std::size_t>(c)] += partial[static_cast<std::size_t>(chunk * cols + c)];
    }
    CHECK(std::all_of(visits.begin(), visits.end(), [](int v) { return v == 1; }));
    if (rows == 0) {
      CHECK(std::all_of(totals.begin(), totals.end(), [](double t) { return t == 0.0; }));
      continue;
    }
    auto g = std::make_shared<Graph>();
    auto x = g->placeholder(kFloat32, {rows, cols}, "x");
    const auto want = run_cpu(g, {{x, tensor(values, {rows, cols})}}, ops::reduce_sum(x, {.axes = {0}}));
    std::vector<float> got(totals.begin(), totals.end());
    check_close(got, want, 1e-4);
  }
}

TEST_CASE("cuBLAS's column-major call computes the row-major product for every transpose combination") {
  const std::int64_t m = 5, n = 3, k = 4;
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      CAPTURE(ta);
      CAPTURE(tb);
      const auto a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
      const auto av = random_values(a_rows * a_cols, 7), bv = random_values(b_rows * b_cols, 8);
      const auto want =
          matmul(ta ? transposed(av, a_rows, a_cols) : av, tb ? transposed(bv, b_rows, b_cols) : bv, m, k, n);
      // What cublasGemmEx computes with these arguments: column-major C = op(X) op(Y), X = the
      // first operand (B's memory), Y = the second (A's memory).
      const ColumnMajorGemm cm = column_major_gemm(ta, tb, m, n, k, a_cols, b_cols);
      const auto element = [](const std::vector<float>& data, std::int64_t ld, bool transpose, std::int64_t row,
                              std::int64_t col) {
        // op(M)[row, col] of a column-major M with leading dimension ld.
        return transpose ? data[static_cast<std::size_t>(row * ld + col)]
                         : data[static_cast<std::size_t>(col * ld + row)];
      };
      std::vector<float> c(static_cast<std::size_t>(m * n));
      for (std::int64_t i = 0; i < cm.m; ++i) {
        for (std::int64_t j = 0; j < cm.n; ++j) {
          double s = 0;
          for (std::int64_t l = 0; l < cm.k; ++l) {
            s += static_cast<double>(element(bv, cm.ld_first, cm.transpose_first, i, l)) *
                 element(av, cm.ld_second, cm.transpose_second, l, j);
          }
          c[static_cast<std::size_t>(j * cm.ldc + i)] = static_cast<float>(s);  // column-major C
        }
      }
      check_close(c, want);
    }
  }
}

TEST_CASE("convolution as im2col + GEMM, its input gradient by col2im and its filter gradient match the CPU kernels") {
  int seed = 10;
  for (const auto& cc : kConvCases) {
    CAPTURE(cc.x.to_string());
    CAPTURE(cc.filter.to_string());
    CAPTURE(cc.options.strides[0]);
    const WindowGeometry geo = conv_geometry(cc.x, cc.filter, cc.options);
    const std::int64_t pixels = geo.batch * geo.out_h * geo.out_w, patch = geo.k_h * geo.k_w * geo.in_c,
                       out_c = cc.filter[3];
    auto g = std::make_shared<Graph>();
    auto x = g->placeholder(kFloat32, cc.x, "x");
    auto w = g->placeholder(kFloat32, cc.filter, "w");
    auto y = ops::conv2d(x, w, cc.options);
    const Shape out_shape = y.shape();
    REQUIRE(out_shape[1] == geo.out_h);
    REQUIRE(out_shape[2] == geo.out_w);
    auto dy = g->placeholder(kFloat32, out_shape, "dy");
    const auto attrs = g->node(y.node).attrs;
    auto dx = g->add("Conv2DBackpropInput", {x, w, dy}, attrs);
    auto dw = g->add("Conv2DBackpropFilter", {x, w, dy}, attrs);
    const auto xv = random_values(cc.x.num_elements(), ++seed), wv = random_values(cc.filter.num_elements(), ++seed),
               dyv = random_values(out_shape.num_elements(), ++seed);
    const std::vector<graph::Feed> feeds{
        {x, tensor(xv, cc.x)}, {w, tensor(wv, cc.filter)}, {dy, tensor(dyv, out_shape)}};

    const auto col = im2col(geo, xv);
    check_close(matmul(col, wv, pixels, patch, out_c), run_cpu(g, feeds, y));  // y = col @ W

    // dx: dcol = dy @ W^T, then every input element gathers its patch entries.
    const auto dcol = matmul(dyv, transposed(wv, patch, out_c), pixels, out_c, patch);
    std::vector<float> dx_got(static_cast<std::size_t>(cc.x.num_elements()));
    for (std::int64_t i = 0; i < cc.x.num_elements(); ++i) {
      double s = 0;
      for_each_col2im_source(geo, i, [&](std::int64_t source) { s += dcol[static_cast<std::size_t>(source)]; });
      dx_got[static_cast<std::size_t>(i)] = static_cast<float>(s);
    }
    check_close(dx_got, run_cpu(g, feeds, dx), 1e-4);

    // dW = col^T @ dy.
    check_close(matmul(transposed(col, pixels, patch), dyv, patch, pixels, out_c), run_cpu(g, feeds, dw), 1e-4);
  }
}

TEST_CASE("pooling windows and their gradients: what the pooling kernels compute, against the CPU kernels") {
  struct PoolCase {
    Shape x;
    ops::Pool2DOptions options;
  };
  const PoolCase cases[] = {
      {{2, 6, 6, 3}, {}},
      {{1, 7, 5, 2}, {.pool_size = {3, 3}, .strides = {2, 2}, .padding = ops::Padding::kSame}},
      {{2, 5, 6, 1}, {.pool_size = {2, 3}, .strides = {1, 2}, .padding = ops::Padding::kValid}},
      {{1, 4, 4, 2}, {.pool_size = {3, 3}, .strides = {1, 1}, .padding = ops::Padding::kSame}},
  };
  int seed = 40;
  for (const auto& pc : cases) {
    CAPTURE(pc.x.to_string());
    ops::detail::WindowAttrs attrs;
    attrs.strides = pc.options.strides;
    attrs.pool_size = pc.options.pool_size;
    attrs.padding = pc.options.padding;
    const WindowGeometry geo =
        flatten(ops::detail::make_window_geometry(pc.x, attrs.pool_size[0], attrs.pool_size[1], pc.x[3], attrs));
    auto g = std::make_shared<Graph>();
    auto x = g->placeholder(kFloat32, pc.x, "x");
    auto max = ops::max_pool2d(x, pc.options);
    auto avg = ops::avg_pool2d(x, pc.options);
    const Shape out_shape = max.shape();
    auto dy = g->placeholder(kFloat32, out_shape, "dy");
    auto max_grad = g->add("MaxPool2DGrad", {x, max, dy}, g->node(max.node).attrs);
    auto avg_grad = g->add("AvgPool2DGrad", {x, dy}, g->node(avg.node).attrs);
    const auto xv = random_values(pc.x.num_elements(), ++seed), dyv = random_values(out_shape.num_elements(), ++seed);
    const std::vector<graph::Feed> feeds{{x, tensor(xv, pc.x)}, {dy, tensor(dyv, out_shape)}};
    const auto value = [&](std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c) {
      return xv[static_cast<std::size_t>(((n * geo.in_h + h) * geo.in_w + w) * geo.in_c + c)];
    };

    // Forward: pool_kernel's loop over its window.
    std::vector<float> max_got(static_cast<std::size_t>(out_shape.num_elements())), avg_got(max_got.size());
    for (std::int64_t i = 0; i < out_shape.num_elements(); ++i) {
      const Pixel p = pixel_of(i, geo.out_h, geo.out_w, geo.in_c);
      const Window win = window_at(geo, p.h, p.w);
      float best = -INFINITY;
      double sum = 0;
      for (std::int64_t h = win.h0; h < win.h1; ++h) {
        for (std::int64_t w = win.w0; w < win.w1; ++w) {
          best = std::max(best, value(p.n, h, w, p.c));
          sum += value(p.n, h, w, p.c);
        }
      }
      max_got[static_cast<std::size_t>(i)] = best;
      avg_got[static_cast<std::size_t>(i)] = static_cast<float>(sum / static_cast<double>(win.count()));
    }
    check_close(max_got, run_cpu(g, feeds, max), 0.0);
    check_close(avg_got, run_cpu(g, feeds, avg));

    // Gradients: pool_grad_kernel's gather over the windows containing each input element.
    std::vector<float> max_grad_got(static_cast<std::size_t>(pc.x.num_elements())), avg_grad_got(max_grad_got.size());
    for (std::int64_t i = 0; i < pc.x.num_elements(); ++i) {
      const Pixel p = pixel_of(i, geo.in_h, geo.in_w, geo.in_c);
      double max_sum = 0, avg_sum = 0;
      for_each_pool_window_of(geo, i, [&](std::int64_t out, const Window& win) {
        const double grad = dyv[static_cast<std::size_t>(out)];
        avg_sum += grad / static_cast<double>(win.count());
        float best = -INFINITY;
        std::int64_t best_h = -1, best_w = -1;
        for (std::int64_t h = win.h0; h < win.h1; ++h) {
          for (std::int64_t w = win.w0; w < win.w1; ++w) {
            if (value(p.n, h, w, p.c) > best) {
              best = value(p.n, h, w, p.c);
              best_h = h;
              best_w = w;
            }
          }
        }
        if (best_h == p.h && best_w == p.w) max_sum += grad;
      });
      max_grad_got[static_cast<std::size_t>(i)] = static_cast<float>(max_sum);
      avg_grad_got[static_cast<std::size_t>(i)] = static_cast<float>(avg_sum);
    }
    check_close(max_grad_got, run_cpu(g, feeds, max_grad), 1e-5);
    check_close(avg_grad_got, run_cpu(g, feeds, avg_grad), 1e-5);
  }
}
