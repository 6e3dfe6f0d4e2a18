// Array family: reshape, transpose, cast, argmax, equal, one-hot, fills, identity, copy.
#include <doctest/doctest.h>

#include "op_test_harness.h"
#include "tandem/graph/autodiff.h"

using namespace tandem;
using namespace tandem::testing;

namespace {
RefTensor with_shape(RefTensor r, const Shape& s) {
  r.shape = s;
  return r;
}
}  // namespace

TEST_CASE("Reshape (with an inferred dimension) and its gradient") {
  OpCase c;
  c.name = "Reshape";
  c.inputs = {InputSpec::floats({2, 3, 4})};
  c.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::reshape(in[0], {4, -1})}; };
  c.reference = [](const std::vector<RefTensor>& in) { return std::vector<RefTensor>{with_shape(in[0], {4, 6})}; };
  run_op_case(c);
}

TEST_CASE("Reshape with an unknown batch dimension resolves when run") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {-1, 28, 28}, "x");
  auto flat = ops::reshape(x, {-1, 784});
  CHECK(flat.shape() == Shape{-1, 784});
  graph::Executor ex(g, devices::default_cpu_device());
  auto out = ex.run({{x, Tensor::zeros({3, 28, 28}, kFloat32)}}, {flat});
  CHECK(out[0].shape() == Shape{3, 784});
  Graph bad;
  auto y = bad.placeholder(kFloat32, {2, 3}, "y");
  CHECK_THROWS_WITH_AS(ops::reshape(y, {4, 2}), doctest::Contains("cannot reshape (2, 3) (6 elements) to (4, 2)"),
                       InvalidArgument);
}

TEST_CASE("Transpose") {
  for (const auto& perm : std::vector<std::vector<std::int64_t>>{{1, 0}, {2, 0, 1}, {0, 2, 1}, {1, 2, 0}}) {
    OpCase c;
    c.name = fmt::format("Transpose [{}]", fmt::join(perm, ","));
    const Shape in = perm.size() == 2 ? Shape{3, 5} : Shape{2, 3, 4};
    c.inputs = {InputSpec::floats(in)};
    c.build = [perm](const std::vector<Output>& x) { return std::vector<Output>{ops::transpose(x[0], perm)}; };
    c.reference = [perm](const std::vector<RefTensor>& x) {
      const Shape& s = x[0].shape;
      Shape out;
      for (auto p : perm) out.push_back(s[static_cast<int>(p)]);
      RefTensor r(out);
      std::vector<std::int64_t> idx(static_cast<std::size_t>(s.rank()));
      for (std::int64_t i = 0; i < x[0].size(); ++i) {
        std::int64_t rest = i;
        for (int d = s.rank() - 1; d >= 0; --d) {
          idx[static_cast<std::size_t>(d)] = rest % s[d];
          rest /= s[d];
        }
        std::int64_t o = 0;
        for (int d = 0; d < out.rank(); ++d) o = o * out[d] + idx[static_cast<std::size_t>(perm[static_cast<std::size_t>(d)])];
        r[o] = x[0][i];
      }
      return std::vector<RefTensor>{r};
    };
    run_op_case(c);
  }
  Graph g;
  auto x = g.placeholder(kFloat32, {2, 3}, "x");
  CHECK_THROWS_WITH_AS(ops::transpose(x, {0, 0}), doctest::Contains("not a permutation"), InvalidArgument);
}

TEST_CASE("Cast between float types carries the gradient; to int truncates") {
  OpCase c;
  c.name = "Cast float to float64 and back";
  c.inputs = {InputSpec::floats({3, 4})};
  c.build = [](const std::vector<Output>& in) {
    const DType other = in[0].dtype() == kFloat32 ? kFloat64 : kFloat32;
    return std::vector<Output>{ops::cast(ops::mul(ops::cast(in[0], other), ops::cast(in[0], other)), in[0].dtype())};
  };
  c.reference = [](const std::vector<RefTensor>& in) {
    RefTensor r(in[0].shape);
    for (std::int64_t i = 0; i < r.size(); ++i) r[i] = in[0][i] * in[0][i];
    return std::vector<RefTensor>{r};
  };
  // The product runs in float32 in the float64 pass: compare loosely, and take finite
  // differences with a step float32 resolves (exact for a quadratic).
  c.f64_tolerance = 1e-6;
  c.finite_difference_step = 1e-2;
  c.gradient_tolerance = 1e-4;
  run_op_case(c);

  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {4}, "x");
  auto i = ops::cast(x, kInt32);
  auto u = ops::cast(ops::cast(i, kInt64), kUInt8);
  graph::Executor ex(g, devices::default_cpu_device());
  auto out = ex.run({{x, Tensor::from_vector<float>({1.9f, -1.9f, 0.2f, 7.0f}, {4})}}, {i, u});
  CHECK(out[0].to_vector<std::int32_t>() == std::vector<std::int32_t>{1, -1, 0, 7});
  CHECK(out[1].to_vector<std::uint8_t>() == std::vector<std::uint8_t>{1, 255, 0, 7});
}

TEST_CASE("ArgMax, Equal and OneHot (no gradients)") {
  OpCase argmax;
  argmax.name = "ArgMax axis 1";
  argmax.inputs = {InputSpec::floats({6, 5}).with_distinct()};
  argmax.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::argmax(in[0], 1), ops::argmax(in[0], 0)}; };
  argmax.reference = [](const std::vector<RefTensor>& in) {
    RefTensor rows(Shape{6}), cols(Shape{5});
    for (int r = 0; r < 6; ++r) {
      int best = 0;
      for (int k = 1; k < 5; ++k) best = in[0].at({r, k}) > in[0].at({r, best}) ? k : best;
      rows[r] = best;
    }
    for (int k = 0; k < 5; ++k) {
      int best = 0;
      for (int r = 1; r < 6; ++r) best = in[0].at({r, k}) > in[0].at({best, k}) ? r : best;
      cols[k] = best;
    }
    return std::vector<RefTensor>{rows, cols};
  };
  argmax.check_gradient = false;
  run_op_case(argmax);

  OpCase eq;
  eq.name = "Equal with broadcasting";
  eq.inputs = {InputSpec{.shape = {2, 3}, .kind = InputSpec::Kind::kValues, .values = {1, 2, 3, 4, 5, 6}},
               InputSpec{.shape = {3}, .kind = InputSpec::Kind::kValues, .values = {1, 5, 6}}};
  eq.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::equal(in[0], in[1])}; };
  eq.reference = [](const std::vector<RefTensor>&) {
    RefTensor r(Shape{2, 3});
    r.values = {1, 0, 0, 0, 1, 1};
    return std::vector<RefTensor>{r};
  };
  eq.check_gradient = false;
  run_op_case(eq);

  OpCase oh;
  oh.name = "OneHot";
  oh.inputs = {InputSpec{.shape = {4}, .kind = InputSpec::Kind::kValues, .integral = true, .values = {0, 2, 5, -1}}};
  oh.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::one_hot(in[0], 3, 1.0, 0.0)}; };
  oh.reference = [](const std::vector<RefTensor>&) {
    RefTensor r(Shape{4, 3});
    r.values = {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0};  // out-of-range rows are all off
    return std::vector<RefTensor>{r};
  };
  oh.check_gradient = false;
  run_op_case(oh);
}

TEST_CASE("non-differentiable ops stop gradients") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {3}, "x");
  auto y = ops::reduce_sum(ops::cast(ops::equal(x, x), kFloat32));
  auto z = ops::reduce_sum(ops::stop_gradient(x));
  auto w = ops::reduce_sum(ops::mul(x, ops::cast(ops::argmax(ops::reshape(x, {1, 3}), 1), kFloat32)));
  std::vector<Output> ys{y, z};
  auto grads = graph::gradients(ys, {&x, 1});
  CHECK_FALSE(grads[0].defined());
  auto zero = graph::gradients({&y, 1}, {&x, 1}, {}, {.unconnected = graph::UnconnectedGradients::kZero});
  auto gw = graph::gradients({&w, 1}, {&x, 1});
  graph::Executor ex(g, devices::default_cpu_device());
  auto out = ex.run({{x, Tensor::from_vector<float>({1, 5, 2}, {3})}}, {zero[0], gw[0]});
  CHECK(out[0].to_vector<float>() == std::vector<float>{0, 0, 0});
  CHECK(out[1].to_vector<float>() == std::vector<float>{1, 1, 1});  // argmax is 1, a constant
}

TEST_CASE("Fill, ZerosLike, OnesLike, Identity") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat64, {2, 2}, "x");
  auto f = ops::fill(*g, {2, 3}, 2.5, kFloat32);
  auto z = ops::zeros_like(x);
  auto o = ops::ones_like(x);
  auto i = ops::identity(x);
  graph::Executor ex(g, devices::default_cpu_device());
  auto out = ex.run({{x, Tensor::from_vector<double>({1, 2, 3, 4}, {2, 2})}}, {f, z, o, i});
  CHECK(out[0].to_vector<float>() == std::vector<float>(6, 2.5f));
  CHECK(out[1].to_vector<double>() == std::vector<double>(4, 0.0));
  CHECK(out[2].to_vector<double>() == std::vector<double>(4, 1.0));
  CHECK(out[3].to_vector<double>() == std::vector<double>{1, 2, 3, 4});

  OpCase id;
  id.name = "Identity gradient";
  id.inputs = {InputSpec::floats({3, 2})};
  id.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::identity(in[0])}; };
  id.reference = [](const std::vector<RefTensor>& in) { return std::vector<RefTensor>{in[0]}; };
  run_op_case(id);
}

TEST_CASE("Copy: its own buffer, the input's values, the incoming gradient") {
  OpCase c;
  c.name = "Copy";
  c.inputs = {InputSpec::floats({3, 4})};
  c.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::copy(in[0])}; };
  c.reference = [](const std::vector<RefTensor>& in) { return std::vector<RefTensor>{in[0]}; };
  run_op_case(c);

  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {2, 2}, "x");
  auto copied = ops::copy(x);
  graph::Executor ex(g, devices::default_cpu_device());
  const Tensor input = Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2});
  auto out = ex.run({{x, input}}, {copied});
  CHECK(out[0].to_vector<float>() == std::vector<float>{1, 2, 3, 4});
  CHECK(out[0].raw_data() != input.raw_data());  // not a view of the fed tensor
}
