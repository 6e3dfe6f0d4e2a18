// Math family: every op against a float64 reference, with a finite-difference gradient check.
#include <doctest/doctest.h>

#include <array>
#include <cmath>

#include "op_test_harness.h"
#include "tandem/devices/detail/cpu_device.h"
#include "tandem/ops/cpu/gemm.h"
#include "tandem/ops/detail/batch_matmul_args.h"

using namespace tandem;
using namespace tandem::testing;

namespace {

// Row-major broadcasting of two reference tensors: out[i] = f(a[ia], b[ib]).
template <class F>
RefTensor broadcast_ref(const RefTensor& a, const RefTensor& b, F f) {
  const int rank = std::max(a.shape.rank(), b.shape.rank());
  Shape out;
  for (int d = 0; d < rank; ++d) {
    const int da = d - (rank - a.shape.rank()), db = d - (rank - b.shape.rank());
    const auto sa = da >= 0 ? a.shape[da] : 1, sb = db >= 0 ? b.shape[db] : 1;
    out.push_back(std::max(sa, sb));
  }
  RefTensor r(out);
  for (std::int64_t i = 0; i < r.size(); ++i) {
    std::int64_t rest = i, ia = 0, ib = 0, stride_a = 1, stride_b = 1;
    for (int d = rank - 1; d >= 0; --d) {
      const auto idx = rest % out[d];
      rest /= out[d];
      const int da = d - (rank - a.shape.rank()), db = d - (rank - b.shape.rank());
      if (da >= 0) {
        if (a.shape[da] != 1) ia += idx * stride_a;
        stride_a *= a.shape[da];
      }
      if (db >= 0) {
        if (b.shape[db] != 1) ib += idx * stride_b;
        stride_b *= b.shape[db];
      }
    }
    r[i] = f(a[ia], b[ib]);
  }
  return r;
}

template <class F>
RefTensor map_ref(const RefTensor& x, F f) {
  RefTensor r(x.shape);
  for (std::int64_t i = 0; i < x.size(); ++i) r[i] = f(x[i]);
  return r;
}

// Reduction reference over `axes` (sorted), with keep_dims.
RefTensor reduce_ref(const RefTensor& x, std::vector<int> axes, bool keep_dims, int kind /*0 sum 1 mean 2 max*/) {
  if (axes.empty()) {
    for (int d = 0; d < x.shape.rank(); ++d) axes.push_back(d);
  }
  Shape kept, out;
  for (int d = 0; d < x.shape.rank(); ++d) {
    const bool reduced = std::find(axes.begin(), axes.end(), d) != axes.end();
    kept.push_back(reduced ? 1 : x.shape[d]);
    if (!reduced)
      out.push_back(x.shape[d]);
    else if (keep_dims)
      out.push_back(1);
  }
  RefTensor r(out, kind == 2 ? -1e300 : 0.0);
  std::vector<double> count(static_cast<std::size_t>(r.size()), 0);
  for (std::int64_t i = 0; i < x.size(); ++i) {
    std::int64_t rest = i, o = 0, stride = 1;
    for (int d = x.shape.rank() - 1; d >= 0; --d) {
      const auto idx = rest % x.shape[d];
      rest /= x.shape[d];
      if (kept[d] != 1 || x.shape[d] == 1) o += (kept[d] == 1 ? 0 : idx) * stride;
      stride *= kept[d];
    }
    r[o] = kind == 2 ? std::max(r[o], x[i]) : r[o] + x[i];
    count[static_cast<std::size_t>(o)] += 1;
  }
  if (kind == 1) {
    for (std::int64_t o = 0; o < r.size(); ++o) r[o] /= count[static_cast<std::size_t>(o)];
  }
  return r;
}

RefTensor matmul_ref(const RefTensor& a, const RefTensor& b, bool ta, bool tb) {
  const auto m = ta ? a.shape[1] : a.shape[0], k = ta ? a.shape[0] : a.shape[1];
  const auto n = tb ? b.shape[0] : b.shape[1];
  RefTensor c(Shape{m, n});
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::int64_t p = 0; p < k; ++p) s += (ta ? a.at({p, i}) : a.at({i, p})) * (tb ? b.at({j, p}) : b.at({p, j}));
      c.at({i, j}) = s;
    }
  return c;
}

// Batched product with NumPy broadcasting of the leading axes; adj_x / adj_y transpose the last two.
RefTensor batch_matmul_ref(const RefTensor& a, const RefTensor& b, bool adj_x, bool adj_y) {
  const int ra = a.shape.rank(), rb = b.shape.rank();
  const std::int64_t m = adj_x ? a.shape[ra - 1] : a.shape[ra - 2], k = adj_x ? a.shape[ra - 2] : a.shape[ra - 1];
  const std::int64_t n = adj_y ? b.shape[rb - 2] : b.shape[rb - 1];
  const int rank = std::max(ra, rb) - 2;
  Shape out;
  for (int d = 0; d < rank; ++d) {
    const int da = d - (rank - (ra - 2)), db = d - (rank - (rb - 2));
    out.push_back(std::max(da >= 0 ? a.shape[da] : 1, db >= 0 ? b.shape[db] : 1));
  }
  const std::int64_t batch = out.num_elements();
  out.push_back(m);
  out.push_back(n);
  RefTensor c(out);
  for (std::int64_t i = 0; i < batch; ++i) {
    // The matrix index of a and b for output matrix i: each batch axis of size 1 stays at 0.
    std::int64_t rest = i, ia = 0, ib = 0, sa = 1, sb = 1;
    for (int d = rank - 1; d >= 0; --d) {
      const std::int64_t idx = rest % out[d];
      rest /= out[d];
      const int da = d - (rank - (ra - 2)), db = d - (rank - (rb - 2));
      if (da >= 0) {
        ia += (a.shape[da] == 1 ? 0 : idx) * sa;
        sa *= a.shape[da];
      }
      if (db >= 0) {
        ib += (b.shape[db] == 1 ? 0 : idx) * sb;
        sb *= b.shape[db];
      }
    }
    const std::int64_t a_rows = a.shape[ra - 2], a_cols = a.shape[ra - 1], b_cols = b.shape[rb - 1];
    for (std::int64_t r = 0; r < m; ++r)
      for (std::int64_t col = 0; col < n; ++col) {
        double sum = 0;
        for (std::int64_t p = 0; p < k; ++p) {
          const double av = adj_x ? a[ia * a_rows * a_cols + p * a_cols + r] : a[ia * a_rows * a_cols + r * a_cols + p];
          const double bv = adj_y ? b[ib * b.shape[rb - 2] * b_cols + col * b_cols + p]
                                  : b[ib * b.shape[rb - 2] * b_cols + p * b_cols + col];
          sum += av * bv;
        }
        c[(i * m + r) * n + col] = sum;
      }
  }
  return c;
}

OpCase batch_matmul_case(const Shape& a, const Shape& b, bool adj_x, bool adj_y) {
  OpCase c;
  c.name = fmt::format("BatchMatMul {} @ {} adj_x={} adj_y={}", a, b, adj_x, adj_y);
  c.inputs = {InputSpec::floats(a), InputSpec::floats(b)};
  c.build = [adj_x, adj_y](const std::vector<Output>& in) {
    return std::vector<Output>{ops::batch_matmul(in[0], in[1], {.adj_x = adj_x, .adj_y = adj_y})};
  };
  c.reference = [adj_x, adj_y](const std::vector<RefTensor>& in) {
    return std::vector<RefTensor>{batch_matmul_ref(in[0], in[1], adj_x, adj_y)};
  };
  c.f32_tolerance = 1e-4;
  c.max_checked_elements = 24;
  return c;
}

// Entries (i, j) with j > i of every matrix (the last two axes) set to 0: tf.linalg.band_part(x, -1, 0).
RefTensor lower_triangle_ref(RefTensor x) {
  const int r = x.shape.rank();
  const std::int64_t rows = x.shape[r - 2], cols = x.shape[r - 1];
  for (std::int64_t e = 0; e < x.size(); ++e) {
    if (e % cols > e / cols % rows) x[e] = 0.0;
  }
  return x;
}

// BatchMatMul with causal attention's triangles, against the product of the masked operand (or
// the masked product). The float64 pass runs the library path (which zeroes a copy of a); float32
// at these sizes the register tiles, which skip the triangle.
OpCase triangular_batch_matmul_case(const Shape& a, const Shape& b, bool adj_x, bool adj_y, bool a_lower) {
  OpCase c = batch_matmul_case(a, b, adj_x, adj_y);
  c.name = fmt::format("{} {}", c.name, a_lower ? "a_lower_triangular" : "output_lower_triangular");
  c.build = [=](const std::vector<Output>& in) {
    return std::vector<Output>{ops::batch_matmul(
        in[0], in[1],
        {.adj_x = adj_x, .adj_y = adj_y, .a_lower_triangular = a_lower, .output_lower_triangular = !a_lower})};
  };
  c.reference = [=](const std::vector<RefTensor>& in) {
    if (a_lower) return std::vector<RefTensor>{batch_matmul_ref(lower_triangle_ref(in[0]), in[1], adj_x, adj_y)};
    return std::vector<RefTensor>{lower_triangle_ref(batch_matmul_ref(in[0], in[1], adj_x, adj_y))};
  };
  return c;
}

OpCase binary_case(std::string name, Shape sa, Shape sb, Output (*op)(Output, Output), double (*f)(double, double),
                   bool positive_b = false) {
  OpCase c;
  c.name = std::move(name);
  c.inputs = {InputSpec::floats(sa), positive_b ? InputSpec::positive_floats(sb, 0.5, 2.0) : InputSpec::floats(sb)};
  c.build = [op](const std::vector<Output>& in) { return std::vector<Output>{op(in[0], in[1])}; };
  c.reference = [f](const std::vector<RefTensor>& in) {
    return std::vector<RefTensor>{broadcast_ref(in[0], in[1], f)};
  };
  return c;
}

OpCase unary_case(std::string name, InputSpec input, Output (*op)(Output), double (*f)(double)) {
  OpCase c;
  c.name = std::move(name);
  c.inputs = {std::move(input)};
  c.build = [op](const std::vector<Output>& in) { return std::vector<Output>{op(in[0])}; };
  c.reference = [f](const std::vector<RefTensor>& in) { return std::vector<RefTensor>{map_ref(in[0], f)}; };
  return c;
}

}  // namespace

TEST_CASE("Add, Sub, Mul, Div with broadcasting") {
  const std::vector<std::pair<Shape, Shape>> shapes = {
      {{3, 4}, {3, 4}}, {{3, 4}, {4}}, {{3, 4}, {3, 1}}, {{2, 3, 4}, {1, 3, 1}},
      {{4}, {2, 3, 4}}, {{3, 4}, {}},  {{}, {2, 2}}};
  for (const auto& [sa, sb] : shapes) {
    const std::string suffix = sa.to_string() + " " + sb.to_string();
    run_op_case(binary_case("Add " + suffix, sa, sb, ops::add, [](double a, double b) { return a + b; }));
    run_op_case(binary_case("Sub " + suffix, sa, sb, ops::sub, [](double a, double b) { return a - b; }));
    run_op_case(binary_case("Mul " + suffix, sa, sb, ops::mul, [](double a, double b) { return a * b; }));
    run_op_case(binary_case(
        "Div " + suffix, sa, sb, ops::div, [](double a, double b) { return a / b; }, true));
  }
}

TEST_CASE("operators on outputs build the same ops") {
  OpCase c;
  c.name = "operators";
  c.inputs = {InputSpec::floats({2, 3}), InputSpec::positive_floats({3}, 0.5, 2.0)};
  c.build = [](const std::vector<Output>& in) {
    return std::vector<Output>{(in[0] + in[1]) * in[0] / in[1] - (-in[0])};
  };
  c.reference = [](const std::vector<RefTensor>& in) {
    return std::vector<RefTensor>{broadcast_ref(in[0], in[1], [](double a, double b) { return (a + b) * a / b + a; })};
  };
  run_op_case(c);
}

TEST_CASE("unary element-wise ops") {
  run_op_case(unary_case("Neg", InputSpec::floats({5, 7}), ops::neg, [](double x) { return -x; }));
  run_op_case(unary_case("Square", InputSpec::floats({5, 7}), ops::square, [](double x) { return x * x; }));
  run_op_case(unary_case("Abs", InputSpec::floats({5, 7}), ops::abs, [](double x) { return std::abs(x); }));
  run_op_case(unary_case("Sqrt", InputSpec::positive_floats({5, 7}), ops::sqrt, [](double x) { return std::sqrt(x); }));
  run_op_case(unary_case("Exp", InputSpec::floats({5, 7}), ops::exp, [](double x) { return std::exp(x); }));
  run_op_case(unary_case("Log", InputSpec::positive_floats({5, 7}), ops::log, [](double x) { return std::log(x); }));
  // Large enough to take the multi-threaded path.
  run_op_case(unary_case("Exp large", InputSpec::floats({300, 257}), ops::exp, [](double x) { return std::exp(x); }));
}

TEST_CASE("Sign is not differentiable and gives -1, 0, 1") {
  OpCase c =
      unary_case("Sign", InputSpec::floats({4, 4}), ops::sign, [](double x) { return double((x > 0) - (x < 0)); });
  c.check_gradient = false;
  run_op_case(c);
}

TEST_CASE("AddN") {
  OpCase c;
  c.name = "AddN";
  c.inputs = {InputSpec::floats({3, 5}), InputSpec::floats({3, 5}), InputSpec::floats({3, 5})};
  c.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::add_n(in)}; };
  c.reference = [](const std::vector<RefTensor>& in) {
    RefTensor r(in[0].shape);
    for (std::int64_t i = 0; i < r.size(); ++i) r[i] = in[0][i] + in[1][i] + in[2][i];
    return std::vector<RefTensor>{r};
  };
  run_op_case(c);
}

TEST_CASE("Sum, Mean, Max over axes") {
  struct R {
    Shape shape;
    std::vector<std::int64_t> axes;
    bool keep;
  };
  const std::vector<R> cases = {{{4, 5}, {}, false},        {{4, 5}, {0}, false},      {{4, 5}, {1}, true},
                                {{2, 3, 4}, {1}, false},    {{2, 3, 4}, {0, 2}, true}, {{2, 3, 4}, {-1}, false},
                                {{3, 1, 4}, {0, 1}, false}, {{64, 600}, {0}, false},   {{600, 64}, {1}, false}};
  for (const auto& rc : cases) {
    std::vector<int> axes;
    for (auto a : rc.axes) axes.push_back(static_cast<int>(a < 0 ? a + rc.shape.rank() : a));
    std::sort(axes.begin(), axes.end());
    const std::string suffix = fmt::format("{} axes [{}] keep={}", rc.shape, fmt::join(rc.axes, ","), rc.keep);
    for (int kind = 0; kind < 3; ++kind) {
      OpCase c;
      c.name = std::string(kind == 0 ? "Sum " : kind == 1 ? "Mean " : "Max ") + suffix;
      c.inputs = {kind == 2 ? InputSpec::floats(rc.shape).with_distinct() : InputSpec::floats(rc.shape)};
      const ops::ReduceOptions options{rc.axes, rc.keep};
      c.build = [options, kind](const std::vector<Output>& in) {
        return std::vector<Output>{kind == 0   ? ops::reduce_sum(in[0], options)
                                   : kind == 1 ? ops::reduce_mean(in[0], options)
                                               : ops::reduce_max(in[0], options)};
      };
      c.reference = [axes, rc, kind](const std::vector<RefTensor>& in) {
        return std::vector<RefTensor>{reduce_ref(in[0], axes, rc.keep, kind)};
      };
      c.f32_tolerance = 1e-4;  // long float32 sums
      run_op_case(c);
    }
  }
}

TEST_CASE("Max splits the gradient between tied maxima, like TF") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {4}, "x");
  auto y = ops::reduce_max(x);
  auto dx = graph::gradients({&y, 1}, {&x, 1});
  graph::Executor ex(g, devices::default_cpu_device());
  auto out = ex.run({{x, Tensor::from_vector<float>({1, 3, 3, 2}, {4})}}, {dx[0]});
  CHECK(out[0].to_vector<float>() == std::vector<float>{0, 0.5f, 0.5f, 0});
}

TEST_CASE("MatMul with every transpose combination") {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      OpCase c;
      c.name = fmt::format("MatMul ta={} tb={}", ta, tb);
      const std::int64_t m = 5, k = 7, n = 3;
      c.inputs = {InputSpec::floats(ta ? Shape{k, m} : Shape{m, k}), InputSpec::floats(tb ? Shape{n, k} : Shape{k, n})};
      c.build = [ta, tb](const std::vector<Output>& in) {
        return std::vector<Output>{ops::matmul(in[0], in[1], {.transpose_a = ta, .transpose_b = tb})};
      };
      c.reference = [ta, tb](const std::vector<RefTensor>& in) {
        return std::vector<RefTensor>{matmul_ref(in[0], in[1], ta, tb)};
      };
      run_op_case(c);
    }
  }
}

TEST_CASE("MatMul at an MLP shape takes the threaded GEMM path and matches the reference") {
  OpCase c;
  c.name = "MatMul 128x784x256";
  c.inputs = {InputSpec::floats({128, 784}), InputSpec::floats({784, 256})};
  c.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::matmul(in[0], in[1])}; };
  c.reference = [](const std::vector<RefTensor>& in) {
    return std::vector<RefTensor>{matmul_ref(in[0], in[1], false, false)};
  };
  c.f32_tolerance = 1e-4;
  c.max_checked_elements = 8;
  // MatMul is linear in each input, so central differences have no truncation error at any step;
  // a step of 1e-3 keeps the rounding of the 32768-term loss (its summation order differs between
  // the CPU kernels' instruction-set levels) far below the tolerance, where 1e-6 left it at the
  // edge (1.2e-6 off under TANDEM_CPU_ISA=avx2 with Eigen's GEMM).
  c.finite_difference_step = 1e-3;
  run_op_case(c);
}

TEST_CASE("BatchMatMul with every adjoint combination") {
  for (bool ax : {false, true}) {
    for (bool ay : {false, true}) {
      const Shape a = ax ? Shape{3, 4, 5} : Shape{3, 5, 4};
      const Shape b = ay ? Shape{3, 2, 4} : Shape{3, 4, 2};
      run_op_case(batch_matmul_case(a, b, ax, ay));
    }
  }
}

TEST_CASE("BatchMatMul broadcasts the batch axes, and sums a broadcast operand's gradient") {
  run_op_case(batch_matmul_case({2, 1, 3, 4}, {5, 4, 6}, false, false));
  run_op_case(batch_matmul_case({2, 1, 4, 3}, {5, 6, 4}, true, true));
  run_op_case(batch_matmul_case({3, 4}, {2, 4, 5}, false, false));        // a shared by every product
  run_op_case(batch_matmul_case({2, 3, 4}, {1, 4, 5}, false, false));     // b's batch axis of 1
  run_op_case(batch_matmul_case({2, 3, 4}, {4, 5}, false, false));        // b shared: one folded product
  run_op_case(batch_matmul_case({2, 2, 3, 4}, {5, 4}, false, true));      // folded, b adjoint
  run_op_case(batch_matmul_case({2, 4, 3}, {4, 5}, true, false));         // a adjoint: not folded
  run_op_case(batch_matmul_case({2, 3, 4}, {2, 1, 4, 5}, false, false));  // b's extra leading axis
}

TEST_CASE("BatchMatMul at attention shapes splits the batch over the threads and matches the reference") {
  // 16 products of 32x16x32: enough work for the threaded path of a 2-thread device.
  run_op_case(batch_matmul_case({4, 4, 32, 16}, {4, 4, 32, 16}, false, true));
  run_op_case(batch_matmul_case({4, 4, 32, 32}, {4, 4, 32, 16}, false, false));
  // 3 products on 2 threads: each product split over the threads instead.
  run_op_case(batch_matmul_case({3, 64, 40}, {3, 40, 48}, false, false));
}

TEST_CASE("BatchMatMul gives the same bits on 1, 2 and 3 threads, whether the batch or each product is split") {
  // 8 products of 128 x 32 x 128 (attention's scores, q k^T): 1 thread runs each product through
  // the threaded gemm(), 2 split the batch (gemm_serial per product), 3 split each product again
  // (8 products do not share evenly among 3).
  const std::int64_t batch = 8, t = 128, d = 32;
  std::vector<float> vq(static_cast<std::size_t>(batch * t * d)), vk(vq.size());
  for (std::size_t i = 0; i < vq.size(); ++i) {
    vq[i] = std::sin(static_cast<float>(i) * 0.37f);
    vk[i] = std::cos(static_cast<float>(i) * 0.11f);
  }
  auto g = std::make_shared<Graph>();
  auto q = g->placeholder(kFloat32, {batch, t, d}, "q");
  auto k = g->placeholder(kFloat32, {batch, t, d}, "k");
  auto scores = ops::batch_matmul(q, k, {.adj_y = true});
  std::vector<std::vector<float>> got;
  for (const int threads : {1, 2, 3}) {
    devices::detail::CpuDevice device(200 + threads, threads);
    graph::Executor ex(g, device);
    got.push_back(
        ex.run({{q, Tensor::from_vector<float>(vq, {batch, t, d})}, {k, Tensor::from_vector<float>(vk, {batch, t, d})}},
               {scores})[0]
            .to_vector<float>());
  }
  if (!ops::cpu::gemm_tiles_enabled()) {
    // The library's products (TANDEM_GEMM=openblas|eigen, the baseline level) are cut differently
    // per thread count, and their bits may differ with the cut.
    MESSAGE("skipped: the GEMM tiles are off here (", ops::cpu::gemm_backend_description(), ")");
    return;
  }
  CHECK(got[0] == got[1]);
  CHECK(got[0] == got[2]);
}

TEST_CASE("BatchMatMul's triangles: a lower-triangular a, or a lower-triangular output, with their gradients") {
  // Small: the library on every dtype. Past 12 rows and 32 columns: the register tiles' partial
  // tiles, the masked diagonal blocks and a narrow last panel; rectangular matrices.
  for (const bool big : {false, true}) {
    const std::int64_t m = big ? 40 : 5, k = big ? 50 : 6, n = big ? 33 : 3;
    run_op_case(triangular_batch_matmul_case({2, m, k}, {2, k, n}, false, false, true));
    run_op_case(triangular_batch_matmul_case({2, k, m}, {2, k, n}, true, false, true));  // op(a) upper
    run_op_case(triangular_batch_matmul_case({2, m, k}, {k, n}, false, false, true));    // b shared, not folded
    const std::int64_t d = big ? 24 : 4, s = big ? 37 : 4;
    run_op_case(triangular_batch_matmul_case({2, m, d}, {2, s, d}, false, true, false));
    run_op_case(triangular_batch_matmul_case({2, s, d}, {2, m, d}, false, true, false));
  }
}

TEST_CASE("BatchMatMul's triangles across the tiles' blocks of k (k over 1024)") {
  // Rows below 1024 read nothing of the second block (kLowerA), rows from 1024 nothing of the
  // first (kUpperA, which then starts the chain in the second).
  for (const bool adj_x : {false, true}) {
    OpCase c = triangular_batch_matmul_case({1, 1100, 1100}, {1, 1100, 32}, adj_x, false, true);
    c.check_low_precision = false;
    c.max_checked_elements = 3;
    c.f32_tolerance = 1e-3;
    c.finite_difference_step = 1e-3;  // linear in each input: no truncation error
    run_op_case(c);
  }
}

TEST_CASE("Causal attention's triangles change no bit of the outputs or the gradients, on 1, 2 and 3 threads") {
  // softmax(q k^T) v under a causal mask, with and without the triangles: the scores above the
  // diagonal are never read, the probabilities and dS there are exactly 0, so skipping them must
  // give the same bits for the output and the gradients of q, k and v.
  const std::int64_t batch = 2, heads = 3, t = 45, d = 36;
  const Shape shape{batch, heads, t, d};
  const auto values = [&](float f) {
    std::vector<float> v(static_cast<std::size_t>(shape.num_elements()));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(static_cast<float>(i) * f);
    return v;
  };
  auto g = std::make_shared<Graph>();
  auto q = g->placeholder(kFloat32, shape, "q");
  auto k = g->placeholder(kFloat32, shape, "k");
  auto v = g->placeholder(kFloat32, shape, "v");
  auto w = g->placeholder(kFloat32, shape, "w");
  std::vector<Output> fetch;
  for (const bool triangles : {false, true}) {
    auto scores = ops::batch_matmul(q, k, {.adj_y = true, .output_lower_triangular = triangles});
    auto probs = ops::masked_softmax(scores, Output{}, {.scale = 0.2, .causal = true});
    auto out = ops::batch_matmul(probs, v, {.a_lower_triangular = triangles});
    auto loss = ops::reduce_sum(ops::mul(out, w));
    auto grads = graph::gradients({&loss, 1}, std::vector<Output>{q, k, v});
    fetch.insert(fetch.end(), {out, grads[0], grads[1], grads[2]});
  }
  for (const int threads : {1, 2, 3}) {
    devices::detail::CpuDevice device(300 + threads, threads);
    graph::Executor ex(g, device);
    const auto got = ex.run({{q, Tensor::from_vector<float>(values(0.37f), shape)},
                             {k, Tensor::from_vector<float>(values(0.11f), shape)},
                             {v, Tensor::from_vector<float>(values(0.53f), shape)},
                             {w, Tensor::from_vector<float>(values(0.71f), shape)}},
                            fetch);
    for (std::size_t i = 0; i < 4; ++i) {
      INFO("threads ", threads, ", fetch ", i, " (out, dq, dk, dv)");
      CHECK(got[i].to_vector<float>() == got[i + 4].to_vector<float>());
    }
  }
}

TEST_CASE("BatchMatMul's triangles refuse the combinations their gradients do not cover") {
  ops::register_all();
  Graph g;
  auto a = g.placeholder(kFloat32, {2, 4, 4}, "a");
  CHECK_THROWS_WITH_AS(ops::batch_matmul(a, a, {.adj_y = true, .a_lower_triangular = true}),
                       doctest::Contains("a_lower_triangular needs adj_y false"), InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::batch_matmul(a, a, {.output_lower_triangular = true}),
                       doctest::Contains("output_lower_triangular needs adj_x false and adj_y true"), InvalidArgument);
  CHECK_THROWS_WITH_AS(
      ops::batch_matmul(a, a, {.adj_y = true, .a_lower_triangular = true, .output_lower_triangular = true}),
      doctest::Contains("cannot both be set"), InvalidArgument);
}

TEST_CASE("BatchMatMul of matrices equals MatMul bit for bit") {
  auto g = std::make_shared<Graph>();
  auto a = g->placeholder(kFloat32, {37, 19}, "a");
  auto b = g->placeholder(kFloat32, {23, 19}, "b");
  auto batched = ops::batch_matmul(a, b, {.adj_y = true});
  auto plain = ops::matmul(a, b, {.transpose_b = true});
  auto c = g->placeholder(kFloat32, {19, 37}, "c");
  auto batched_t = ops::batch_matmul(c, b, {.adj_x = true, .adj_y = true});
  auto plain_t = ops::matmul(c, b, {.transpose_a = true, .transpose_b = true});
  CHECK(batched.shape() == Shape{37, 23});
  std::vector<float> va(37 * 19), vb(23 * 19);
  for (std::size_t i = 0; i < va.size(); ++i) va[i] = std::sin(static_cast<float>(i));
  for (std::size_t i = 0; i < vb.size(); ++i) vb[i] = std::cos(static_cast<float>(i));
  graph::Executor ex(g, devices::default_cpu_device());
  auto out = ex.run({{a, Tensor::from_vector<float>(va, {37, 19})},
                     {b, Tensor::from_vector<float>(vb, {23, 19})},
                     {c, Tensor::from_vector<float>(va, {19, 37})}},
                    {batched, plain, batched_t, plain_t});
  CHECK(out[0].to_vector<float>() == out[1].to_vector<float>());
  CHECK(out[2].to_vector<float>() == out[3].to_vector<float>());
}

TEST_CASE("BatchMatMul with an unknown batch dimension resolves when run") {
  auto g = std::make_shared<Graph>();
  auto a = g->placeholder(kFloat32, {-1, 3, 4}, "a");
  auto b = g->placeholder(kFloat32, {4, 2}, "b");
  auto c = ops::batch_matmul(a, b);
  CHECK(c.shape() == Shape{-1, 3, 2});
  auto loss = ops::reduce_sum(c);
  auto grads = graph::gradients({&loss, 1}, std::vector<Output>{a, b});
  graph::Executor ex(g, devices::default_cpu_device());
  auto out = ex.run({{a, Tensor::from_vector(std::vector<float>(60, 1.0f), {5, 3, 4})},
                     {b, Tensor::from_vector(std::vector<float>(8, 1.0f), {4, 2})}},
                    {c, grads[0], grads[1]});
  CHECK(out[0].shape() == Shape{5, 3, 2});
  CHECK(out[0].to_vector<float>() == std::vector<float>(30, 4.0f));
  CHECK(out[1].to_vector<float>() == std::vector<float>(60, 2.0f));  // each a element meets 2 columns
  CHECK(out[2].to_vector<float>() == std::vector<float>(8, 15.0f));  // 5 matrices x 3 rows
}

TEST_CASE("BatchMatMul walks a broadcast batch in strided runs, reading shared operands in place") {
  const auto runs = [](const Shape& a, const Shape& b) {
    const auto args = ops::detail::batch_matmul_args(a, b, false, false);
    std::vector<std::array<std::int64_t, 6>> out;
    ops::detail::for_each_strided_run(args, 0, args.batch, [&](auto c, auto count, auto ai, auto as, auto bi, auto bs) {
      out.push_back({c, count, ai, as, bi, bs});
    });
    return out;
  };
  using Runs = std::vector<std::array<std::int64_t, 6>>;
  // Output batch (2, 5): a steps along the first axis only, b along the second only.
  CHECK(runs({2, 1, 3, 4}, {5, 4, 6}) == Runs{{0, 5, 0, 0, 0, 1}, {5, 5, 1, 0, 0, 1}});
  // Equal batches merge into one run.
  CHECK(runs({4, 3, 2, 2}, {4, 3, 2, 2}) == Runs{{0, 12, 0, 1, 0, 1}});
  // a shared by every product.
  CHECK(runs({3, 4}, {6, 4, 2}) == Runs{{0, 6, 0, 0, 0, 1}});
  const auto folded = ops::detail::batch_matmul_args({2, 3, 4, 5}, {5, 7}, false, false);
  CHECK(folded.fold_batch_into_m);
  CHECK(folded.batch == 6);
  CHECK_FALSE(ops::detail::batch_matmul_args({2, 3, 5, 4}, {5, 7}, true, false).fold_batch_into_m);
  CHECK_FALSE(ops::detail::batch_matmul_args({2, 3, 4}, {2, 4, 7}, false, false).fold_batch_into_m);
}

TEST_CASE("BatchMatMul shape errors name the node and the shapes") {
  ops::register_all();
  Graph g;
  auto a = g.placeholder(kFloat32, {-1, 3, 4}, "a");
  auto b = g.placeholder(kFloat32, {2, 5, 6}, "b");
  CHECK_THROWS_WITH_AS(ops::batch_matmul(a, b),
                       doctest::Contains("BatchMatMul \"BatchMatMul\": inner dimensions differ: a is (None, 3, 4), "
                                         "b is (2, 5, 6) (4 vs 5)"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::batch_matmul(a, b, {.adj_y = true}), doctest::Contains("b is (2, 5, 6) (adjoint) (4 vs 6)"),
                       InvalidArgument);
  auto c = g.placeholder(kFloat32, {3, 2, 4, 5}, "c");
  auto d = g.placeholder(kFloat32, {2, 2, 4, 5}, "d");
  CHECK_THROWS_WITH_AS(ops::batch_matmul(c, d, {.adj_y = true}),
                       doctest::Contains("batch dimensions of a (3, 2, 4, 5) and b (2, 2, 4, 5) do not broadcast "
                                         "(batch axis 0: 3 vs 2)"),
                       InvalidArgument);
  auto v = g.placeholder(kFloat32, {4}, "v");
  CHECK_THROWS_WITH_AS(ops::batch_matmul(v, c), doctest::Contains("rank 2 or more"), InvalidArgument);
  auto i = g.placeholder(kInt32, {2, 4, 4}, "i");
  CHECK_THROWS_AS(ops::batch_matmul(i, i), InvalidArgument);
}

TEST_CASE("shape errors name the node and both shapes") {
  ops::register_all();
  Graph g;
  auto a = g.placeholder(kFloat32, {-1, 28}, "a");
  auto b = g.placeholder(kFloat32, {784, 128}, "b");
  try {
    ops::matmul(a, b);
    FAIL("expected InvalidArgument");
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    CHECK(what.find("MatMul \"MatMul\"") != std::string::npos);
    CHECK(what.find("(None, 28)") != std::string::npos);
    CHECK(what.find("(784, 128)") != std::string::npos);
  }
  auto c = g.placeholder(kFloat32, {3, 4}, "c");
  auto d = g.placeholder(kFloat32, {5}, "d");
  CHECK_THROWS_WITH_AS(ops::add(c, d), doctest::Contains("(3, 4) and (5,) cannot be broadcast"), InvalidArgument);
  CHECK_THROWS_AS(ops::reduce_sum(c, {.axes = {2}}), InvalidArgument);
  CHECK_THROWS_AS(ops::reduce_sum(c, {.axes = {1, -1}}), InvalidArgument);
}

TEST_CASE("wrong dtypes are rejected with the op and the dtypes named") {
  ops::register_all();
  Graph g;
  auto f = g.placeholder(kFloat32, {3}, "f");
  auto i = g.placeholder(kInt64, {3}, "i");
  CHECK_THROWS_WITH_AS(ops::add(f, i), doctest::Contains("different dtypes: float32 and int64"), InvalidArgument);
  CHECK_THROWS_WITH_AS(ops::exp(i), doctest::Contains("expected a floating-point tensor"), InvalidArgument);
  auto u = g.placeholder(kUInt8, {3}, "u");
  CHECK_THROWS_WITH_AS(ops::neg(u), doctest::Contains("uint8"), InvalidArgument);
}

TEST_CASE("integer arithmetic, and integer division by zero is an error") {
  auto g = std::make_shared<Graph>();
  auto a = g->placeholder(kInt64, {3}, "a");
  auto b = g->placeholder(kInt64, {3}, "b");
  auto q = ops::div(a, b);
  auto s = ops::add(a, b);
  graph::Executor ex(g, devices::default_cpu_device());
  auto out = ex.run(
      {{a, Tensor::from_vector<std::int64_t>({7, -8, 9}, {3})}, {b, Tensor::from_vector<std::int64_t>({2, 3, 4}, {3})}},
      {q, s});
  CHECK(out[0].to_vector<std::int64_t>() == std::vector<std::int64_t>{3, -2, 2});
  CHECK(out[1].to_vector<std::int64_t>() == std::vector<std::int64_t>{9, -5, 13});
  CHECK_THROWS_WITH_AS(ex.run({{a, Tensor::from_vector<std::int64_t>({1, 2, 3}, {3})},
                               {b, Tensor::from_vector<std::int64_t>({1, 0, 3}, {3})}},
                              {q}),
                       doctest::Contains("division by zero"), InvalidArgument);
}
