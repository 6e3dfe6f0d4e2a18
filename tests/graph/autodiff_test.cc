#include <doctest/doctest.h>

#include "tandem/graph/autodiff.h"
#include "tandem/graph/executor.h"
#include "tandem/ops/ops.h"

using namespace tandem;
using graph::Executor;

namespace {
std::vector<float> run1(const std::shared_ptr<Graph>& g, Output x, const Tensor& value, Output fetch) {
  Executor ex(g, devices::default_cpu_device());
  return ex.run({{x, value}}, {fetch})[0].to_vector<float>();
}
}  // namespace

TEST_CASE("chain rule through several ops, with a value used twice") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {3}, "x");
  // y = sum(x * x + exp(x) * x): dy/dx = 2x + exp(x) * (x + 1)
  auto y = ops::reduce_sum(x * x + ops::exp(x) * x);
  auto dx = graph::gradients({&y, 1}, {&x, 1});
  REQUIRE(dx[0].defined());
  CHECK(dx[0].producer().name.rfind("gradients/", 0) == 0);
  const std::vector<float> xs{0.5f, -1.0f, 2.0f};
  const auto got = run1(g, x, Tensor::from_vector<float>(xs, {3}), dx[0]);
  for (int i = 0; i < 3; ++i) {
    const float v = xs[static_cast<std::size_t>(i)];
    CHECK(got[static_cast<std::size_t>(i)] == doctest::Approx(2 * v + std::exp(v) * (v + 1)).epsilon(1e-5));
  }
}

TEST_CASE("several ys are summed; grad_ys seed them") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {2}, "x");
  auto a = ops::reduce_sum(x * x);  // 2x
  auto b = ops::reduce_sum(x);      // 1
  std::vector<Output> ys{a, b};
  auto dx = graph::gradients(ys, {&x, 1});
  CHECK(run1(g, x, Tensor::from_vector<float>({1, 3}, {2}), dx[0]) == std::vector<float>{3, 7});

  auto seed = g->constant(Tensor::from_vector<float>({10, 100}, {2}), "seed");
  auto z = x * x;
  auto dz = graph::gradients({&z, 1}, {&x, 1}, {&seed, 1});
  CHECK(run1(g, x, Tensor::from_vector<float>({1, 3}, {2}), dz[0]) == std::vector<float>{20, 600});
}

TEST_CASE("gradients with respect to an intermediate value and to variables") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {2}, "x");
  auto w = g->variable(kFloat32, {2}, "w");
  auto h = x * w;
  auto y = ops::reduce_sum(h * h);
  std::vector<Output> xs{h, w};
  auto grads = graph::gradients({&y, 1}, xs);
  Executor ex(g, devices::default_cpu_device());
  ex.bind_variable(w, Tensor::from_vector<float>({2, 3}, {2}));
  auto out = ex.run({{x, Tensor::from_vector<float>({1, 1}, {2})}}, {grads[0], grads[1]});
  CHECK(out[0].to_vector<float>() == std::vector<float>{4, 6});  // 2h
  CHECK(out[1].to_vector<float>() == std::vector<float>{4, 6});  // 2h * x
}

TEST_CASE("unconnected and integer inputs get no gradient") {
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {2}, "x");
  auto unused = g->placeholder(kFloat32, {2}, "unused");
  auto y = ops::reduce_sum(x);
  std::vector<Output> xs{x, unused};
  auto grads = graph::gradients({&y, 1}, xs);
  CHECK(grads[0].defined());
  CHECK_FALSE(grads[1].defined());
  auto zero = graph::gradients({&y, 1}, {&unused, 1}, {}, {.unconnected = graph::UnconnectedGradients::kZero});
  CHECK(zero[0].defined());
  auto i = g->placeholder(kInt32, {2}, "i");
  auto yi = ops::reduce_sum(ops::cast(i, kFloat32));
  CHECK_FALSE(graph::gradients({&yi, 1}, {&i, 1})[0].defined());
  CHECK_THROWS_WITH_AS(graph::gradients({&i, 1}, {&x, 1}), doctest::Contains("only floating-point values"),
                       InvalidArgument);
}
