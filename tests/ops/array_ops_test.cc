// Array family: reshape, transpose, cast, argmax, equal, one-hot, fills, identity, copy.
#include <doctest/doctest.h>

#include "op_test_harness.h"
#include "tandem/graph/autodiff.h"
#include "tandem/graph/detail/low_precision_types.h"

#include <cmath>
#include <limits>

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
        for (int d = 0; d < out.rank(); ++d)
          o = o * out[d] + idx[static_cast<std::size_t>(perm[static_cast<std::size_t>(d)])];
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

TEST_CASE(
    "Cast to and from float16 and bfloat16: round to nearest even, overflow, NaN, gradients in the source dtype") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {8}, "x");
  auto h = ops::cast(x, DType::kF16);
  auto b = ops::cast(x, DType::kBF16);
  auto h_back = ops::cast(h, kFloat32);
  auto b_back = ops::cast(b, kFloat32);
  auto b_to_h = ops::cast(b, DType::kF16);  // 16 bits to 16 bits, through float
  auto b_to_i = ops::cast(b, kInt32);
  graph::Executor ex(g, devices::default_cpu_device());
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // 1 + 2^-11 is halfway between two float16 values (ties to even: 1); 1 + 3 * 2^-11 rounds up.
  // 1 + 2^-8 is halfway between two bfloat16 values. 70000 overflows float16 but not bfloat16.
  const std::vector<float> values{1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 1.0f + 0x1p-8f, 70000.0f, -2.5f, nan, -inf,
                                  3.0e38f};
  auto out = ex.run({{x, Tensor::from_vector<float>(values, {8})}}, {h_back, b_back, b_to_h, b_to_i, h, b});
  const auto hv = out[0].to_vector<float>();
  const auto bv = out[1].to_vector<float>();
  CHECK(hv[0] == 1.0f);
  CHECK(hv[1] == 1.0f + 0x1p-9f);
  CHECK(hv[3] == inf);
  CHECK(hv[4] == -2.5f);
  CHECK(std::isnan(hv[5]));
  CHECK(hv[6] == -inf);
  CHECK(bv[2] == 1.0f);
  CHECK(bv[3] == 70144.0f);  // bfloat16 keeps float32's range: 70000 rounds to 137 * 2^9
  CHECK(std::isnan(bv[5]));
  CHECK(std::isfinite(bv[7]));
  CHECK(out[2].dtype() == DType::kF16);
  CHECK(static_cast<float>(out[2].to_vector<graph::float16>()[4]) == -2.5f);
  CHECK(out[3].to_vector<std::int32_t>()[4] == -2);
  CHECK(out[4].nbytes() == 16);
  CHECK(out[5].nbytes() == 16);

  // The gradient of a cast comes back in the source dtype.
  auto loss = ops::reduce_sum(ops::mul(b, b));
  const std::vector<Output> xs{x};
  auto grads = graph::gradients({&loss, 1}, xs);
  CHECK(grads[0].dtype() == kFloat32);
  graph::Executor grad_ex(g, devices::default_cpu_device());
  const std::vector<float> ramp{1, 2, 3, 4, 5, 6, 7, 8};
  auto grad = grad_ex.run({{x, Tensor::from_vector<float>(ramp, {8})}}, {grads[0]});
  CHECK(grad[0].to_vector<float>() == std::vector<float>{2, 4, 6, 8, 10, 12, 14, 16});
}

TEST_CASE("a kernel without 16-bit code runs on float32 copies and rounds once: same result, every run") {
  // MatMul has no 16-bit CPU code: the executor widens its inputs, runs the float32 kernel and
  // rounds the output. Compare with the float32 product rounded once.
  auto g = std::make_shared<Graph>();
  auto a = g->placeholder(DType::kBF16, {3, 5}, "a");
  auto b = g->placeholder(DType::kBF16, {5, 2}, "b");
  auto c = ops::matmul(a, b);
  CHECK(c.dtype() == DType::kBF16);
  std::vector<graph::bfloat16> av, bv;
  std::vector<float> af, bf;
  for (int i = 0; i < 15; ++i) {
    av.emplace_back(0.37f * static_cast<float>(i) - 2.0f);
    af.push_back(static_cast<float>(av.back()));
  }
  for (int i = 0; i < 10; ++i) {
    bv.emplace_back(0.71f - 0.13f * static_cast<float>(i));
    bf.push_back(static_cast<float>(bv.back()));
  }
  graph::Executor ex(g, devices::default_cpu_device());
  const Tensor at = Tensor::from_vector(av, {3, 5}), bt = Tensor::from_vector(bv, {5, 2});
  for (int run = 0; run < 2; ++run) {  // the second run reuses the float32 copies
    const auto got = ex.run({{a, at}, {b, bt}}, {c})[0].to_vector<graph::bfloat16>();
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 2; ++j) {
        float want = 0;
        for (int k = 0; k < 5; ++k)
          want += af[static_cast<std::size_t>(i * 5 + k)] * bf[static_cast<std::size_t>(k * 2 + j)];
        CHECK(static_cast<float>(got[static_cast<std::size_t>(i * 2 + j)]) ==
              doctest::Approx(static_cast<float>(graph::bfloat16(want))).epsilon(1e-6));
      }
    }
  }
}

TEST_CASE("ArgMax, Equal and OneHot (no gradients)") {
  OpCase argmax;
  argmax.name = "ArgMax axis 1";
  argmax.inputs = {InputSpec::floats({6, 5}).with_distinct()};
  argmax.build = [](const std::vector<Output>& in) {
    return std::vector<Output>{ops::argmax(in[0], 1), ops::argmax(in[0], 0)};
  };
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
