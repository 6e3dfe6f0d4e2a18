// Math family: every op against a float64 reference, with a finite-difference gradient check.
#include <doctest/doctest.h>

#include <cmath>

#include "op_test_harness.h"

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
  run_op_case(c);
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
