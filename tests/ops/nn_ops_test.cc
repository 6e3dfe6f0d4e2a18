// The nn family: every op through the OpCase harness (float64 reference written as loops,
// float32 forward, gradient check), plus shape errors, run-time errors, dropout's statistics,
// fully masked softmax rows and sums that do not depend on the thread count.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>

#include "op_test_harness.h"
#include "tandem/devices/detail/cpu_device.h"
#include "tandem/graph/executor.h"
#include "tandem/ops/ops.h"

using namespace tandem;
using graph::Executor;
using graph::Feed;
using ops::Activation;
using testing::InputSpec;
using testing::OpCase;
using testing::RefTensor;
using testing::run_op_case;

namespace {

using Refs = std::vector<RefTensor>;

RefTensor map_ref(const RefTensor& x, double (*f)(double)) {
  RefTensor y(x.shape);
  for (std::int64_t i = 0; i < x.size(); ++i) y[i] = f(x[i]);
  return y;
}

double relu_ref(double z) { return std::max(z, 0.0); }
double sigmoid_ref(double z) { return 1.0 / (1.0 + std::exp(-z)); }
double tanh_ref(double z) { return std::tanh(z); }
double linear_ref(double z) { return z; }
double gelu_ref(double z) { return 0.5 * z * (1.0 + std::erf(z / std::sqrt(2.0))); }
double gelu_approximate_ref(double z) {
  return 0.5 * z * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (z + 0.044715 * z * z * z)));
}

double (*activation_ref(Activation a))(double) {
  switch (a) {
    case Activation::kRelu: return relu_ref;
    case Activation::kSigmoid: return sigmoid_ref;
    case Activation::kTanh: return tanh_ref;
    case Activation::kGelu: return gelu_ref;
    case Activation::kGeluApproximate: return gelu_approximate_ref;
    case Activation::kLinear: break;
  }
  return linear_ref;
}

std::string activation_label(Activation a) { return std::string(ops::activation_name(a)); }

constexpr Activation kAllActivations[] = {Activation::kLinear, Activation::kRelu,
                                          Activation::kSigmoid, Activation::kTanh,
                                          Activation::kGelu,    Activation::kGeluApproximate};

std::int64_t last_dim(const RefTensor& t) { return t.shape[t.shape.rank() - 1]; }

// Softmax or log-softmax of each row (last axis), the textbook way in float64.
RefTensor softmax_ref(const RefTensor& x, bool log) {
  RefTensor y(x.shape);
  const std::int64_t cols = last_dim(x);
  for (std::int64_t r = 0; r * cols < x.size(); ++r) {
    double max = -INFINITY;
    for (std::int64_t c = 0; c < cols; ++c) max = std::max(max, x[r * cols + c]);
    double sum = 0.0;
    for (std::int64_t c = 0; c < cols; ++c) sum += std::exp(x[r * cols + c] - max);
    for (std::int64_t c = 0; c < cols; ++c) {
      const double z = x[r * cols + c] - max;
      y[r * cols + c] = log ? z - std::log(sum) : std::exp(z) / sum;
    }
  }
  return y;
}

// act(x + bias) with bias along the last axis.
RefTensor bias_activation_ref(const RefTensor& x, const RefTensor& bias, Activation a) {
  RefTensor y(x.shape);
  const std::int64_t cols = last_dim(x);
  for (std::int64_t i = 0; i < x.size(); ++i) y[i] = activation_ref(a)(x[i] + bias[i % cols]);
  return y;
}

std::vector<double> uniform_values(std::int64_t n, double lo, double hi, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

InputSpec values(const Shape& shape, std::vector<double> v) {
  return InputSpec{.shape = shape, .kind = InputSpec::Kind::kValues, .values = std::move(v)};
}

// The message of the InvalidArgument that f throws ("" and a failed check when none is thrown).
template <class F>
std::string invalid_argument_message(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  FAIL_CHECK("expected InvalidArgument");
  return {};
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

// ---- Activations ----------------------------------------------------------------------------------

// The standalone activation op of a (Gelu for both GELU forms).
Output activation_op(Activation a, Output x) {
  switch (a) {
    case Activation::kRelu: return ops::relu(x);
    case Activation::kSigmoid: return ops::sigmoid(x);
    case Activation::kTanh: return ops::tanh(x);
    case Activation::kGelu: return ops::gelu(x);
    case Activation::kGeluApproximate: return ops::gelu(x, true);
    case Activation::kLinear: break;
  }
  return x;
}

TEST_CASE("Relu, Sigmoid, Tanh and Gelu match the reference and differentiate") {
  for (const Activation a : {Activation::kRelu, Activation::kSigmoid, Activation::kTanh, Activation::kGelu,
                             Activation::kGeluApproximate}) {
    OpCase c;
    c.name = "activation " + activation_label(a);
    c.inputs = {InputSpec::floats({4, 7})};  // |x| >= 0.1: away from relu's kink
    c.inputs[0].max_abs = 4.0;               // GELU's curve and both of its tails
    c.build = [a](const std::vector<Output>& in) { return std::vector<Output>{activation_op(a, in[0])}; };
    c.reference = [a](const Refs& in) { return Refs{map_ref(in[0], activation_ref(a))}; };
    run_op_case(c);
  }
}

TEST_CASE("Sigmoid, Tanh and Gelu saturate without NaN") {
  for (const Activation a : {Activation::kSigmoid, Activation::kTanh, Activation::kGelu, Activation::kGeluApproximate}) {
    OpCase c;
    c.name = "saturated " + activation_label(a);
    c.inputs = {values({6}, {-800.0, -60.0, -20.0, 20.0, 60.0, 800.0})};
    c.build = [a](const std::vector<Output>& in) { return std::vector<Output>{activation_op(a, in[0])}; };
    c.reference = [a](const Refs& in) { return Refs{map_ref(in[0], activation_ref(a))}; };
    c.check_gradient = false;
    run_op_case(c);
  }
}

// ---- Softmax --------------------------------------------------------------------------------------

TEST_CASE("Softmax and LogSoftmax over the last axis") {
  for (const bool log : {false, true}) {
    for (const Shape& shape : {Shape{5, 7}, Shape{2, 3, 4}, Shape{9}}) {
      OpCase c;
      c.name = fmt::format("{} {}", log ? "log_softmax" : "softmax", shape);
      c.inputs = {InputSpec::floats(shape)};
      c.build = [log](const std::vector<Output>& in) {
        return std::vector<Output>{log ? ops::log_softmax(in[0]) : ops::softmax(in[0])};
      };
      c.reference = [log](const Refs& in) { return Refs{softmax_ref(in[0], log)}; };
      run_op_case(c);
    }
  }
}

TEST_CASE("Softmax is stable for large logits") {
  OpCase c;
  c.name = "softmax large logits";
  c.inputs = {values({2, 3}, {1000.0, 1001.0, 1002.0, -1000.0, -1001.0, -1e30})};
  c.build = [](const std::vector<Output>& in) {
    return std::vector<Output>{ops::softmax(in[0]), ops::log_softmax(in[0])};
  };
  c.reference = [](const Refs& in) { return Refs{softmax_ref(in[0], false), softmax_ref(in[0], true)}; };
  c.check_gradient = false;
  c.f32_tolerance = 1e-5;
  run_op_case(c);
}

// ---- Bias, bias + activation, dense -----------------------------------------------------------------

TEST_CASE("BiasAdd adds along the last axis; its bias gradient sums the rest") {
  // Small; many rows and few channels (row partitions); many channels (channel blocks).
  for (const Shape& shape : {Shape{3, 4, 5}, Shape{1100, 70}, Shape{300, 270}}) {
    OpCase c;
    c.name = fmt::format("bias_add {}", shape);
    c.inputs = {InputSpec::floats(shape), InputSpec::floats({shape[shape.rank() - 1]})};
    c.build = [](const std::vector<Output>& in) { return std::vector<Output>{ops::bias_add(in[0], in[1])}; };
    c.reference = [](const Refs& in) { return Refs{bias_activation_ref(in[0], in[1], Activation::kLinear)}; };
    c.max_checked_elements = 24;
    run_op_case(c);
  }
}

TEST_CASE("BiasActivation fuses bias and activation, forward and backward") {
  for (const Activation a : kAllActivations) {
    for (const Shape& shape : {Shape{6, 5}, Shape{2, 3, 5}, Shape{1100, 70}, Shape{300, 270}}) {
      OpCase c;
      c.name = fmt::format("bias_activation {} {}", activation_label(a), shape);
      // |x| >= 0.1 and |bias| <= 0.05 keep x + bias away from relu's kink.
      c.inputs = {InputSpec::floats(shape), InputSpec::floats({shape[shape.rank() - 1]})};
      c.inputs[1].min_abs = 0.01;
      c.inputs[1].max_abs = 0.05;
      c.build = [a](const std::vector<Output>& in) {
        return std::vector<Output>{ops::bias_activation(in[0], in[1], a)};
      };
      c.reference = [a](const Refs& in) { return Refs{bias_activation_ref(in[0], in[1], a)}; };
      c.max_checked_elements = 24;
      run_op_case(c);
    }
  }
}

namespace {

// Inputs of a dense case whose pre-activations stay at least ~0.02 away from zero: positive x,
// kernel columns alternately positive and negative, a tiny bias.
std::vector<InputSpec> dense_inputs(std::int64_t batch, std::int64_t features, std::int64_t units, std::uint64_t seed) {
  auto x = uniform_values(batch * features, 0.1, 1.0, seed);
  auto w = uniform_values(features * units, 0.1, 1.0, seed + 1);
  for (std::int64_t k = 0; k < features; ++k) {
    for (std::int64_t j = 1; j < units; j += 2) w[static_cast<std::size_t>(k * units + j)] *= -1.0;
  }
  auto b = uniform_values(units, -0.005, 0.005, seed + 2);
  return {values({batch, features}, x), values({features, units}, w), values({units}, b)};
}

RefTensor dense_ref(const RefTensor& x, const RefTensor& w, const RefTensor& b, Activation a) {
  const std::int64_t n = x.shape[0], k = x.shape[1], m = w.shape[1];
  RefTensor y(Shape{n, m});
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < m; ++j) {
      double z = b[j];
      for (std::int64_t p = 0; p < k; ++p) z += x[i * k + p] * w[p * m + j];
      y[i * m + j] = activation_ref(a)(z);
    }
  }
  return y;
}

}  // namespace

TEST_CASE("FusedMatMul (dense) = act(x @ kernel + bias)") {
  struct Size {
    std::int64_t batch, features, units;
  };
  // Small (one thread); wide output (split by columns); tall output (split by rows).
  for (const Size s : {Size{4, 3, 5}, Size{64, 96, 64}, Size{160, 64, 40}}) {
    for (const Activation a : kAllActivations) {
      OpCase c;
      c.name = fmt::format("dense {} {}x{}x{}", activation_label(a), s.batch, s.features, s.units);
      c.inputs = dense_inputs(s.batch, s.features, s.units, static_cast<std::uint64_t>(s.batch * 31 + s.units));
      c.build = [a](const std::vector<Output>& in) { return std::vector<Output>{ops::dense(in[0], in[1], in[2], a)}; };
      c.reference = [a](const Refs& in) { return Refs{dense_ref(in[0], in[1], in[2], a)}; };
      c.max_checked_elements = 16;
      run_op_case(c);
    }
  }
}

TEST_CASE("FusedMatMul over several row blocks and epilogue parts: bitwise MatMul then BiasActivation") {
  // 2100 rows of depth 256: three blocks of rows for the register tiles (1 MiB of x each), each
  // handed to bias and activation in parts of whole rows (341 rows of 48 units: the last panel
  // partial), every element checked against the unfused ops.
  const std::int64_t rows = 2100, features = 256, units = 48;
  std::vector<float> x(static_cast<std::size_t>(rows * features)), w(static_cast<std::size_t>(features * units)),
      bias(static_cast<std::size_t>(units));
  std::uint32_t state = 2100;
  const auto next = [&] {  // in [-1, 1)
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) / 8388608.0f - 1.0f;
  };
  for (auto* v : {&x, &w, &bias})
    for (float& e : *v) e = next();
  const Tensor xt = Tensor::from_vector(x, {rows, features}), wt = Tensor::from_vector(w, {features, units}),
               bt = Tensor::from_vector(bias, {units});
  for (const Activation a : kAllActivations) {
    INFO(activation_label(a));
    auto g = std::make_shared<Graph>();
    auto xp = g->placeholder(kFloat32, {rows, features}, "x");
    auto wp = g->placeholder(kFloat32, {features, units}, "w");
    auto bp = g->placeholder(kFloat32, {units}, "b");
    auto fused = ops::dense(xp, wp, bp, a);
    auto separate = ops::bias_activation(ops::matmul(xp, wp), bp, a);
    graph::Executor ex(g, devices::default_cpu_device());
    const auto out = ex.run({{xp, xt}, {wp, wt}, {bp, bt}}, {fused, separate});
    const auto y = out[0].to_vector<float>(), expected = out[1].to_vector<float>();
    REQUIRE(y.size() == expected.size());
    std::size_t differing = 0;
    for (std::size_t i = 0; i < y.size(); ++i) differing += std::memcmp(&y[i], &expected[i], sizeof(float)) != 0;
    CHECK(differing == 0);
  }
}

TEST_CASE("relu epilogues pass NaN through and clamp the rest at +0, fused into products or not") {
  // std::max(z, 0)'s semantics (Eigen's max, the activation op's): a NaN pre-activation stays NaN,
  // so that a diverging run shows in its loss, and negatives give +0.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::int64_t rows = 64, features = 32, units = 32;  // big enough for the register tiles
  std::vector<float> x(static_cast<std::size_t>(rows * features), 0.0f), w(static_cast<std::size_t>(features * units));
  for (std::int64_t j = 0; j < units; ++j) w[static_cast<std::size_t>(j)] = j % 2 == 0 ? 1.0f : -1.0f;  // row 0 of w
  for (std::int64_t r = 0; r < rows; ++r) x[static_cast<std::size_t>(r * features)] = r == 5 ? nan : 0.5f;
  std::vector<float> bias(static_cast<std::size_t>(units), 0.25f);
  auto g = std::make_shared<Graph>();
  auto xp = g->placeholder(kFloat32, {rows, features}, "x");
  auto wp = g->placeholder(kFloat32, {features, units}, "w");
  auto bp = g->placeholder(kFloat32, {units}, "b");
  auto fused = ops::dense(xp, wp, bp, Activation::kRelu);
  auto separate = ops::bias_activation(ops::matmul(xp, wp), bp, Activation::kRelu);
  graph::Executor ex(g, devices::default_cpu_device());
  const auto out = ex.run({{xp, Tensor::from_vector(x, {rows, features})},
                           {wp, Tensor::from_vector(w, {features, units})},
                           {bp, Tensor::from_vector(bias, {units})}},
                          {fused, separate});
  for (const auto& t : out) {
    const auto y = t.to_vector<float>();
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t j = 0; j < units; ++j) {
        const float v = y[static_cast<std::size_t>(r * units + j)];
        INFO("row ", r, ", unit ", j);
        if (r == 5) {
          CHECK(std::isnan(v));
        } else if (j % 2 == 0) {
          CHECK(v == 0.75f);
        } else {
          CHECK((v == 0.0f && !std::signbit(v)));  // -0.5 + 0.25 clamped to +0
        }
      }
    }
  }
}

// ---- Losses -----------------------------------------------------------------------------------------

TEST_CASE("SparseSoftmaxCrossEntropyWithLogits: loss and backprop, int32 and int64 labels") {
  for (const DType label_dtype : {DType::kI64, DType::kI32}) {
    for (const Shape& shape : {Shape{6, 5}, Shape{700, 50}}) {
      OpCase c;
      c.name = fmt::format("sparse xent {} {}", label_dtype, shape);
      c.inputs = {InputSpec::floats(shape), InputSpec::indices({shape[0]}, shape[1], label_dtype)};
      c.build = [](const std::vector<Output>& in) {
        const Output loss = ops::sparse_softmax_cross_entropy_with_logits(in[0], in[1]);
        return std::vector<Output>{loss, Output{loss.graph, loss.node, 1}};
      };
      c.reference = [](const Refs& in) {
        const RefTensor log_p = softmax_ref(in[0], true);
        const std::int64_t rows = in[0].shape[0], classes = in[0].shape[1];
        RefTensor loss(Shape{rows});
        RefTensor backprop(in[0].shape);
        for (std::int64_t r = 0; r < rows; ++r) {
          const auto label = static_cast<std::int64_t>(in[1][r]);
          loss[r] = -log_p[r * classes + label];
          for (std::int64_t j = 0; j < classes; ++j) {
            backprop[r * classes + j] = std::exp(log_p[r * classes + j]) - (j == label ? 1.0 : 0.0);
          }
        }
        return Refs{loss, backprop};
      };
      c.gradient_outputs = {0};  // backprop is itself a gradient
      c.max_checked_elements = 32;
      run_op_case(c);
    }
  }
}

namespace {

// Rows of positive numbers that sum to one.
InputSpec distribution_input(std::int64_t rows, std::int64_t classes, std::uint64_t seed) {
  auto v = uniform_values(rows * classes, 0.05, 1.0, seed);
  for (std::int64_t r = 0; r < rows; ++r) {
    double sum = 0.0;
    for (std::int64_t j = 0; j < classes; ++j) sum += v[static_cast<std::size_t>(r * classes + j)];
    for (std::int64_t j = 0; j < classes; ++j) v[static_cast<std::size_t>(r * classes + j)] /= sum;
  }
  return values({rows, classes}, v);
}

}  // namespace

TEST_CASE("SoftmaxCrossEntropyWithLogits: loss, backprop, gradients for logits and labels") {
  OpCase c;
  c.name = "softmax xent";
  c.inputs = {InputSpec::floats({5, 4}), distribution_input(5, 4, 11)};
  c.build = [](const std::vector<Output>& in) {
    const Output loss = ops::softmax_cross_entropy_with_logits(in[0], in[1]);
    return std::vector<Output>{loss, Output{loss.graph, loss.node, 1}};
  };
  c.reference = [](const Refs& in) {
    const RefTensor log_p = softmax_ref(in[0], true);
    const std::int64_t classes = in[0].shape[1];
    RefTensor loss(Shape{in[0].shape[0]});
    RefTensor backprop(in[0].shape);
    for (std::int64_t i = 0; i < in[0].size(); ++i) {
      loss[i / classes] -= in[1][i] * log_p[i];
      backprop[i] = std::exp(log_p[i]) - in[1][i];
    }
    return Refs{loss, backprop};
  };
  c.gradient_outputs = {0};
  run_op_case(c);
}

TEST_CASE("SigmoidCrossEntropyWithLogits: stable, with gradients for logits and labels") {
  OpCase c;
  c.name = "sigmoid xent";
  c.inputs = {InputSpec::floats({4, 6}), InputSpec::positive_floats({4, 6}, 0.05, 0.95)};
  c.build = [](const std::vector<Output>& in) {
    return std::vector<Output>{ops::sigmoid_cross_entropy_with_logits(in[0], in[1])};
  };
  c.reference = [](const Refs& in) {
    RefTensor loss(in[0].shape);
    for (std::int64_t i = 0; i < loss.size(); ++i) {
      const double p = sigmoid_ref(in[0][i]);
      loss[i] = -(in[1][i] * std::log(p) + (1.0 - in[1][i]) * std::log(1.0 - p));
    }
    return Refs{loss};
  };
  run_op_case(c);

  OpCase extreme;
  extreme.name = "sigmoid xent extreme logits";
  extreme.inputs = {values({4}, {-900.0, -50.0, 50.0, 900.0}), values({4}, {0.0, 1.0, 0.0, 1.0})};
  extreme.build = c.build;
  extreme.reference = [](const Refs& in) {
    RefTensor loss(in[0].shape);
    for (std::int64_t i = 0; i < loss.size(); ++i) {
      const double x = in[0][i], z = in[1][i];
      loss[i] = std::max(x, 0.0) - x * z + std::log1p(std::exp(-std::abs(x)));
    }
    return Refs{loss};
  };
  extreme.check_gradient = false;
  run_op_case(extreme);
}

// ---- Dropout ----------------------------------------------------------------------------------------

namespace {

// The mask Dropout draws for node 1 of a graph at random_step 7, which is the node and the step
// the harness's graphs use (input placeholder first, then the op): the reference needs it.
RefTensor dropout_mask_like_harness(const RefTensor& x, const ops::DropoutOptions& options) {
  auto g = std::make_shared<Graph>();
  const Output in = g->placeholder(DType::kF64, x.shape, "input");
  const Output y = ops::dropout(in, options);
  REQUIRE(y.node == 1);
  Executor ex(g, devices::default_cpu_device());
  const auto out = ex.run({Feed{in, Tensor::from_vector<double>(x.values, x.shape)}}, {Output{y.graph, y.node, 1}},
                          graph::RunOptions{.random_step = 7});
  return testing::to_ref(out[0]);
}

}  // namespace

TEST_CASE("Dropout through the harness: y = x * mask, gradient = dy * mask") {
  for (const bool training : {true, false}) {
    const ops::DropoutOptions options{.rate = 0.25, .seed = 3, .training = training};
    OpCase c;
    c.name = training ? "dropout training" : "dropout inference";
    c.inputs = {InputSpec::floats({16, 9})};
    c.build = [options](const std::vector<Output>& in) {
      const Output y = ops::dropout(in[0], options);
      return std::vector<Output>{y, Output{y.graph, y.node, 1}};
    };
    c.reference = [options](const Refs& in) {
      const RefTensor mask = dropout_mask_like_harness(in[0], options);
      RefTensor y(in[0].shape);
      for (std::int64_t i = 0; i < y.size(); ++i) y[i] = in[0][i] * mask[i];
      return Refs{y, mask};
    };
    c.gradient_outputs = {0};
    run_op_case(c);
  }
}

TEST_CASE("Dropout statistics and determinism") {
  constexpr std::int64_t kElements = 1 << 20;
  constexpr double kRate = 0.3;
  auto g = std::make_shared<Graph>();
  const Output x = g->placeholder(DType::kF32, {-1}, "x");
  const Output y = ops::dropout(x, {.rate = kRate, .seed = 1});
  const Output mask{y.graph, y.node, 1};
  const Output y_other_seed = ops::dropout(x, {.rate = kRate, .seed = 2});
  const Output y_inference = ops::dropout(x, {.rate = kRate, .training = false});
  Executor ex(g, devices::default_cpu_device());
  const Tensor ones = Tensor::filled<float>(Shape{kElements}, 1.0f);
  const std::vector<Feed> feeds{{x, ones}};
  const std::vector<Output> fetches{y, mask, y_other_seed, y_inference};

  const auto step1 = ex.run(feeds, fetches, {.random_step = 1});
  const auto ys = step1[0].to_vector<float>();
  const auto masks = step1[1].to_vector<float>();
  std::int64_t zeros = 0;
  std::int64_t bad_masks = 0;
  std::int64_t bad_ys = 0;
  double sum = 0.0;
  const auto scale = static_cast<float>(1.0 / (1.0 - kRate));
  for (std::size_t i = 0; i < ys.size(); ++i) {
    zeros += ys[i] == 0.0f;
    sum += ys[i];
    bad_masks += !(masks[i] == 0.0f || masks[i] == scale);
    bad_ys += ys[i] != masks[i];  // x is all ones
  }
  CHECK(bad_masks == 0);
  CHECK(bad_ys == 0);
  const double fraction = static_cast<double>(zeros) / static_cast<double>(kElements);
  CHECK(std::abs(fraction - kRate) < 0.003);                           // ~6 standard deviations
  CHECK(std::abs(sum / static_cast<double>(kElements) - 1.0) < 0.01);  // E[y] = x

  SUBCASE("inference is the identity") { CHECK(step1[3].to_vector<float>() == ones.to_vector<float>()); }
  SUBCASE("the same step replays the same mask; other steps and seeds differ") {
    const auto again = ex.run(feeds, fetches, {.random_step = 1});
    CHECK(again[1].to_vector<float>() == masks);
    const auto step2 = ex.run(feeds, fetches, {.random_step = 2});
    CHECK(step2[1].to_vector<float>() != masks);
    CHECK(step1[2].to_vector<float>() != ys);
    const std::vector<Output> mask_only{mask};
    const auto unfixed_a = ex.run(feeds, mask_only);
    const auto unfixed_b = ex.run(feeds, mask_only);
    CHECK(unfixed_a[0].to_vector<float>() != unfixed_b[0].to_vector<float>());
  }
}

TEST_CASE("Dropout rejects a rate outside [0, 1)") {
  Graph g;
  const Output x = g.placeholder(DType::kF32, {-1, 4}, "x");
  for (const double rate : {1.0, -0.1, 1.5}) {
    CHECK_THROWS_AS(ops::dropout(x, {.rate = rate}), InvalidArgument);
  }
  CHECK_NOTHROW(ops::dropout(x, {.rate = 0.0}));
}

// ---- Batch normalisation ----------------------------------------------------------------------------

namespace {

// y, batch_mean, batch_variance, computed the textbook way.
Refs batch_norm_ref(const Refs& in, bool training, double epsilon) {
  const RefTensor& x = in[0];
  const std::int64_t channels = last_dim(x);
  const std::int64_t rows = x.size() / channels;
  RefTensor mean(Shape{channels}), variance(Shape{channels});
  if (training) {
    for (std::int64_t i = 0; i < x.size(); ++i) mean[i % channels] += x[i] / static_cast<double>(rows);
    for (std::int64_t i = 0; i < x.size(); ++i) {
      const double d = x[i] - mean[i % channels];
      variance[i % channels] += d * d / static_cast<double>(rows);
    }
  } else {
    mean = in[3];
    variance = in[4];
  }
  RefTensor y(x.shape);
  for (std::int64_t i = 0; i < x.size(); ++i) {
    const std::int64_t c = i % channels;
    y[i] = (x[i] - mean[c]) / std::sqrt(variance[c] + epsilon) * in[1][c] + in[2][c];
  }
  return {y, mean, variance};
}

}  // namespace

TEST_CASE("FusedBatchNorm in training and inference mode") {
  struct Variant {
    Shape shape;
    bool training;
    std::vector<int> gradient_outputs;
  };
  const Variant variants[] = {
      {{4, 3, 5}, true, {0}},         {{4, 3, 5}, true, {0, 1, 2}},  // batch statistics differentiated too
      {{6, 5}, false, {0}},           {{2, 3, 2, 5}, false, {0, 1, 2}},
      {{1100, 70}, true, {0, 1, 2}},  // row partitions
      {{300, 270}, true, {0}},        // channel blocks
      {{300, 270}, false, {0, 1, 2}},
  };
  for (const auto& v : variants) {
    const ops::BatchNormOptions options{.epsilon = 1e-3, .training = v.training};
    const std::int64_t channels = v.shape[v.shape.rank() - 1];
    OpCase c;
    c.name = fmt::format("batch_norm {} {} grads of {} outputs", v.training ? "training" : "inference", v.shape,
                         v.gradient_outputs.size());
    // The data's mean is far from zero: the statistics must not lose precision to cancellation.
    c.inputs = {InputSpec::positive_floats(v.shape, 3.0, 5.0), InputSpec::floats({channels}),
                InputSpec::floats({channels}), InputSpec::floats({channels}),
                InputSpec::positive_floats({channels}, 0.5, 2.0)};
    c.build = [options](const std::vector<Output>& in) {
      const auto bn = ops::fused_batch_norm(in[0], in[1], in[2], in[3], in[4], options);
      return std::vector<Output>{bn.y, bn.batch_mean, bn.batch_variance};
    };
    c.reference = [options](const Refs& in) { return batch_norm_ref(in, options.training, options.epsilon); };
    c.gradient_outputs = v.gradient_outputs;
    c.gradient_tolerance = 1e-5;
    c.max_checked_elements = 24;
    run_op_case(c);
  }
}

// ---- Layer normalisation ------------------------------------------------------------------------------

namespace {

// y of LayerNorm over the last axis, the textbook way; gamma and beta may be absent (nullptr).
RefTensor layer_norm_ref(const RefTensor& x, const RefTensor* gamma, const RefTensor* beta, double epsilon) {
  const std::int64_t cols = last_dim(x);
  RefTensor y(x.shape);
  for (std::int64_t r = 0; r * cols < x.size(); ++r) {
    double mean = 0.0, variance = 0.0;
    for (std::int64_t c = 0; c < cols; ++c) mean += x[r * cols + c] / static_cast<double>(cols);
    for (std::int64_t c = 0; c < cols; ++c) {
      const double d = x[r * cols + c] - mean;
      variance += d * d / static_cast<double>(cols);
    }
    for (std::int64_t c = 0; c < cols; ++c) {
      double v = (x[r * cols + c] - mean) / std::sqrt(variance + epsilon);
      if (gamma != nullptr) v *= (*gamma)[c];
      if (beta != nullptr) v += (*beta)[c];
      y[r * cols + c] = v;
    }
  }
  return y;
}

}  // namespace

TEST_CASE("LayerNorm over the last axis, with and without gamma and beta") {
  struct Variant {
    Shape shape;
    bool scale, center;
  };
  const Variant variants[] = {
      {{4, 7}, true, true},     {{2, 3, 5}, true, true},   {{6, 5}, true, false},  {{6, 5}, false, true},
      {{6, 5}, false, false},   {{1100, 70}, true, true},  // row partitions of dgamma, dbeta
      {{96, 128}, true, true},  // the GPT's rows
  };
  for (const auto& v : variants) {
    const double epsilon = 1e-3;
    const std::int64_t channels = v.shape[v.shape.rank() - 1];
    OpCase c;
    c.name = fmt::format("layer_norm {} scale={} center={}", v.shape, v.scale, v.center);
    // The data's mean is far from zero: the variance must not lose precision to cancellation.
    c.inputs = {InputSpec::positive_floats(v.shape, 3.0, 5.0)};
    if (v.scale) c.inputs.push_back(InputSpec::floats({channels}));
    if (v.center) c.inputs.push_back(InputSpec::floats({channels}));
    c.build = [v, epsilon](const std::vector<Output>& in) {
      const Output gamma = v.scale ? in[1] : Output{};
      const Output beta = v.center ? in[v.scale ? 2 : 1] : Output{};
      return std::vector<Output>{ops::layer_norm(in[0], gamma, beta, {.epsilon = epsilon})};
    };
    c.reference = [v, epsilon](const Refs& in) {
      const RefTensor* gamma = v.scale ? &in[1] : nullptr;
      const RefTensor* beta = v.center ? &in[v.scale ? 2 : 1] : nullptr;
      return Refs{layer_norm_ref(in[0], gamma, beta, epsilon)};
    };
    c.gradient_tolerance = 1e-5;
    c.max_checked_elements = 24;
    run_op_case(c);
  }
}

TEST_CASE("LayerNorm's dgamma and dbeta are bitwise the same on 1 and 3 threads") {
  devices::detail::CpuDevice one(0, 1), three(0, 3);
  auto g = std::make_shared<Graph>();
  const Shape shape{1100, 70};
  const Output x = g->placeholder(DType::kF32, shape, "x");
  const Output gamma = g->placeholder(DType::kF32, {70}, "gamma");
  const Output beta = g->placeholder(DType::kF32, {70}, "beta");
  const Output y = ops::layer_norm(x, gamma, beta);
  const Output loss = ops::reduce_sum(ops::mul(y, y));
  const auto grads = graph::gradients({&loss, 1}, std::vector<Output>{x, gamma, beta});
  const std::vector<Feed> feeds{
      {x, Tensor::from_vector<float>(
              [&] {
                std::vector<float> v;
                for (const double d : uniform_values(shape.num_elements(), -3.0, 3.0, 5)) v.push_back(static_cast<float>(d));
                return v;
              }(),
              shape)},
      {gamma, Tensor::filled<float>(Shape{70}, 1.5f)},
      {beta, Tensor::filled<float>(Shape{70}, 0.25f)}};
  Executor on_one(g, one), on_three(g, three);
  const auto a = on_one.run(feeds, grads);
  const auto b = on_three.run(feeds, grads);
  for (std::size_t i = 0; i < grads.size(); ++i) CHECK(a[i].to_vector<float>() == b[i].to_vector<float>());
}

// ---- Masked softmax -----------------------------------------------------------------------------------

namespace {

// softmax(scale * x) over the entries of each row where the mask (broadcast to x, right-aligned;
// absent when null) is non-zero and, when causal, key j <= query i; zeros elsewhere and in rows
// with nothing to attend.
RefTensor masked_softmax_ref(const RefTensor& x, const RefTensor* mask, double scale, bool causal) {
  const int rank = x.shape.rank();
  const std::int64_t cols = x.shape[rank - 1];
  RefTensor y(x.shape);
  std::vector<std::int64_t> index(static_cast<std::size_t>(rank));
  const auto allowed = [&](std::int64_t flat) {
    std::int64_t rest = flat;
    for (int d = rank - 1; d >= 0; --d) {
      index[static_cast<std::size_t>(d)] = rest % x.shape[d];
      rest /= x.shape[d];
    }
    if (causal && index[static_cast<std::size_t>(rank - 1)] > index[static_cast<std::size_t>(rank - 2)]) return false;
    if (mask == nullptr) return true;
    std::int64_t offset = 0;
    const int mr = mask->shape.rank();
    for (int d = 0; d < mr; ++d) {
      const std::int64_t md = mask->shape[d];
      offset = offset * md + (md == 1 ? 0 : index[static_cast<std::size_t>(d + rank - mr)]);
    }
    return (*mask)[offset] != 0.0;
  };
  for (std::int64_t r = 0; r * cols < x.size(); ++r) {
    double max = -INFINITY;
    for (std::int64_t c = 0; c < cols; ++c) {
      if (allowed(r * cols + c)) max = std::max(max, scale * x[r * cols + c]);
    }
    if (max == -INFINITY) continue;  // nothing to attend: zeros
    double sum = 0.0;
    for (std::int64_t c = 0; c < cols; ++c) {
      if (allowed(r * cols + c)) sum += std::exp(scale * x[r * cols + c] - max);
    }
    for (std::int64_t c = 0; c < cols; ++c) {
      y[r * cols + c] = allowed(r * cols + c) ? std::exp(scale * x[r * cols + c] - max) / sum : 0.0;
    }
  }
  return y;
}

InputSpec mask_values(const Shape& shape, std::vector<double> v, DType dtype) {
  return InputSpec{.shape = shape,
                   .kind = InputSpec::Kind::kValues,
                   .differentiable = false,
                   .index_dtype = dtype,
                   .integral = true,
                   .values = std::move(v)};
}

// A 0/1 mask with about one entry in three masked, and every row of `empty_rows` masked entirely.
std::vector<double> random_mask(const Shape& shape, std::uint64_t seed, std::vector<std::int64_t> empty_rows = {}) {
  const auto u = uniform_values(shape.num_elements(), 0.0, 1.0, seed);
  std::vector<double> m(u.size());
  for (std::size_t i = 0; i < u.size(); ++i) m[i] = u[i] < 0.35 ? 0.0 : 1.0;
  const std::int64_t cols = shape[shape.rank() - 1];
  for (const std::int64_t r : empty_rows) std::fill_n(m.begin() + r * cols, cols, 0.0);
  return m;
}

}  // namespace

TEST_CASE("MaskedSoftmax: scale, causal, broadcast masks of every integer type, fully masked rows") {
  struct Variant {
    std::string name;
    Shape x;
    std::optional<Shape> mask;
    DType mask_dtype;
    double scale;
    bool causal;
    std::vector<std::int64_t> empty_mask_rows;
  };
  const double attention_scale = 1.0 / std::sqrt(32.0);
  const Variant variants[] = {
      {"plain", {2, 3, 5}, std::nullopt, DType::kI32, 0.7, false, {}},
      {"causal square", {2, 2, 4, 4}, std::nullopt, DType::kI32, attention_scale, true, {}},
      {"causal T < S", {2, 3, 5}, std::nullopt, DType::kI32, 1.0, true, {}},
      {"causal T > S", {5, 3}, std::nullopt, DType::kI32, 1.0, true, {}},
      {"Keras mask [B, 1, T, S]", {2, 3, 4, 5}, Shape{2, 1, 4, 5}, DType::kI32, attention_scale, false, {1, 6}},
      {"mask and causal", {2, 3, 4, 4}, Shape{2, 1, 4, 4}, DType::kI64, 0.5, true, {2}},
      {"key padding mask uint8", {3, 4, 6}, Shape{6}, DType::kU8, 1.0, false, {}},
      {"full mask, causal, negative scale", {2, 4, 4}, Shape{2, 4, 4}, DType::kU8, -0.8, true, {0, 5}},
      {"GPT rows", {1, 2, 128, 128}, std::nullopt, DType::kI32, attention_scale, true, {}},
  };
  for (const auto& v : variants) {
    OpCase c;
    c.name = fmt::format("masked_softmax {} x {}", v.name, v.x);
    c.inputs = {InputSpec::floats(v.x)};
    c.inputs[0].max_abs = 3.0;
    if (v.mask) c.inputs.push_back(mask_values(*v.mask, random_mask(*v.mask, 17, v.empty_mask_rows), v.mask_dtype));
    const ops::MaskedSoftmaxOptions options{.scale = v.scale, .causal = v.causal};
    const bool has_mask = v.mask.has_value();
    c.build = [options, has_mask](const std::vector<Output>& in) {
      return std::vector<Output>{ops::masked_softmax(in[0], has_mask ? in[1] : Output{}, options)};
    };
    c.reference = [options, has_mask](const Refs& in) {
      return Refs{masked_softmax_ref(in[0], has_mask ? &in[1] : nullptr, options.scale, options.causal)};
    };
    c.max_checked_elements = 32;
    run_op_case(c);
  }
}

TEST_CASE("MaskedSoftmax: a fully masked row gives zeros and a zero, finite gradient") {
  for (const bool causal : {false, true}) {
    auto g = std::make_shared<Graph>();
    const Output x = g->placeholder(DType::kF32, {2, 3, 3}, "x");
    const Output mask = g->placeholder(DType::kI32, {2, 1, 3}, "mask");
    const Output y = ops::masked_softmax(x, mask, {.scale = 0.5, .causal = causal});
    const Output weights = g->constant(Tensor::filled<float>(Shape{2, 3, 3}, 0.75f), "w");
    const Output loss = ops::reduce_sum(ops::mul(y, ops::add(y, weights)));
    const auto dx = graph::gradients({&loss, 1}, std::vector<Output>{x});
    Executor ex(g, devices::default_cpu_device());
    // Batch 0 attends to key 2 only (under causal, rows 0 and 1 then have nothing); batch 1 to none.
    std::vector<float> xv(18);
    for (std::size_t i = 0; i < xv.size(); ++i) xv[i] = static_cast<float>(i % 5) * 40.0f - 80.0f;
    const auto out = ex.run({{x, Tensor::from_vector<float>(xv, {2, 3, 3})},
                             {mask, Tensor::from_vector<std::int32_t>({0, 0, 7, 0, 0, 0}, {2, 1, 3})}},
                            {y, dx[0]});
    const auto yv = out[0].to_vector<float>();
    const auto dxv = out[1].to_vector<float>();
    for (std::size_t i = 0; i < yv.size(); ++i) {
      CHECK(std::isfinite(dxv[i]));
      const std::size_t row = i / 3, col = i % 3;
      const bool attends = row < 3 && col == 2 && (!causal || row == 2);
      CHECK(yv[i] == (attends ? 1.0f : 0.0f));
      if (!attends) CHECK(dxv[i] == 0.0f);
    }
  }
}

// ---- Errors and unknown dimensions --------------------------------------------------------------------

TEST_CASE("shape errors name the node and both shapes") {
  Graph g;
  const Output x = g.placeholder(DType::kF32, {-1, 128}, "x");

  std::string msg = invalid_argument_message([&] { ops::bias_add(x, g.placeholder(DType::kF32, {10}, "b")); });
  CHECK(contains(msg, "BiasAdd \"BiasAdd\""));
  CHECK(contains(msg, "(10,)"));
  CHECK(contains(msg, "(None, 128)"));

  msg = invalid_argument_message([&] {
    ops::bias_activation(x, g.placeholder(DType::kF32, {3, 128}, "b2"), Activation::kRelu);
  });
  CHECK(contains(msg, "BiasActivation"));
  CHECK(contains(msg, "(3, 128)"));

  msg = invalid_argument_message([&] {
    ops::dense(x, g.placeholder(DType::kF32, {100, 10}, "kernel"), g.placeholder(DType::kF32, {10}, "bias"),
               Activation::kRelu);
  });
  CHECK(contains(msg, "FusedMatMul \"FusedMatMul"));
  CHECK(contains(msg, "(None, 128)"));
  CHECK(contains(msg, "(100, 10)"));

  msg = invalid_argument_message([&] {
    ops::dense(x, g.placeholder(DType::kF32, {128, 10}, "kernel"), g.placeholder(DType::kF32, {12}, "bias"),
               Activation::kLinear);
  });
  CHECK(contains(msg, "(12,)"));
  CHECK(contains(msg, "(128, 10)"));

  const Output logits = g.placeholder(DType::kF32, {-1, 10}, "logits");
  msg = invalid_argument_message([&] {
    ops::sparse_softmax_cross_entropy_with_logits(logits, g.placeholder(DType::kI64, {-1, 10}, "labels"));
  });
  CHECK(contains(msg, "SparseSoftmaxCrossEntropyWithLogits"));
  CHECK(contains(msg, "(None, 10)"));
  msg = invalid_argument_message(
      [&] { ops::sparse_softmax_cross_entropy_with_logits(logits, g.placeholder(DType::kF32, {-1}, "float_labels")); });
  CHECK(contains(msg, "int32 or int64"));
  msg = invalid_argument_message([&] {
    ops::softmax_cross_entropy_with_logits(logits, g.placeholder(DType::kF32, {-1, 9}, "labels9"));
  });
  CHECK(contains(msg, "(None, 9)"));
  CHECK(contains(msg, "(None, 10)"));
  msg = invalid_argument_message([&] {
    ops::sigmoid_cross_entropy_with_logits(logits, g.placeholder(DType::kF32, {-1, 3}, "labels3"));
  });
  CHECK(contains(msg, "(None, 3)"));

  const Output images = g.placeholder(DType::kF32, {-1, 8, 8, 4}, "images");
  const Output c4 = g.placeholder(DType::kF32, {4}, "c4");
  const Output c3 = g.placeholder(DType::kF32, {3}, "c3");
  msg = invalid_argument_message([&] { ops::fused_batch_norm(images, c4, c4, c3, c4); });
  CHECK(contains(msg, "FusedBatchNorm"));
  CHECK(contains(msg, "mean"));
  CHECK(contains(msg, "(3,)"));
  CHECK(contains(msg, "(None, 8, 8, 4)"));
  CHECK_THROWS_AS(ops::fused_batch_norm(images, c4, c4, c4, c4, {.epsilon = 0.0}), InvalidArgument);

  CHECK_THROWS_AS(ops::softmax(g.placeholder(DType::kF32, {}, "scalar")), InvalidArgument);

  msg = invalid_argument_message([&] { ops::layer_norm(x, g.placeholder(DType::kF32, {64}, "gamma"), Output{}); });
  CHECK(contains(msg, "LayerNorm \"LayerNorm"));
  CHECK(contains(msg, "gamma"));
  CHECK(contains(msg, "(64,)"));
  CHECK(contains(msg, "(None, 128)"));
  CHECK_THROWS_AS(ops::layer_norm(x, Output{}, Output{}, {.epsilon = 0.0}), InvalidArgument);

  const Output scores = g.placeholder(DType::kF32, {-1, 4, 16, 16}, "scores");
  msg = invalid_argument_message(
      [&] { ops::masked_softmax(scores, g.placeholder(DType::kI32, {-1, 1, 16, 8}, "mask"), {}); });
  CHECK(contains(msg, "MaskedSoftmax \"MaskedSoftmax"));
  CHECK(contains(msg, "(None, 1, 16, 8)"));
  CHECK(contains(msg, "(None, 4, 16, 16)"));
  msg = invalid_argument_message(
      [&] { ops::masked_softmax(scores, g.placeholder(DType::kF32, {16, 16}, "float_mask"), {}); });
  CHECK(contains(msg, "int32, int64 or uint8"));
  msg = invalid_argument_message(
      [&] { ops::masked_softmax(g.placeholder(DType::kF32, {16}, "vector"), Output{}, {.causal = true}); });
  CHECK(contains(msg, "(16,)"));
  CHECK(contains(msg, "rank 2"));

  // GELU is never fused into a convolution: its gradient needs the pre-activation.
  const Output f = g.placeholder(DType::kF32, {3, 3, 4, 5}, "filter");
  const Output fb = g.placeholder(DType::kF32, {5}, "fb");
  CHECK(ops::fused_conv2d(images, f, fb, Activation::kGelu).shape() == Shape{-1, 6, 6, 5});
  graph::Attrs conv_attrs;
  conv_attrs.set("strides", std::vector<std::int64_t>{1, 1}).set("padding", "VALID").set("activation", "gelu");
  msg = invalid_argument_message([&] { g.add_node("FusedConv2D", {images, f, fb}, conv_attrs); });
  CHECK(contains(msg, "gelu"));
}

TEST_CASE("wrong dtypes are rejected") {
  Graph g;
  const Output ints = g.placeholder(DType::kI32, {-1, 4}, "ints");
  const std::string msg = invalid_argument_message([&] { ops::relu(ints); });
  CHECK(contains(msg, "Relu"));
  CHECK(contains(msg, "int32"));
  CHECK_THROWS_AS(ops::softmax(ints), InvalidArgument);
  CHECK_THROWS_AS(ops::dropout(ints), InvalidArgument);
  const Output x = g.placeholder(DType::kF32, {-1, 4}, "x");
  CHECK_THROWS_AS(ops::bias_add(x, g.placeholder(DType::kF64, {4}, "b64")), InvalidArgument);
}

TEST_CASE("parse_activation lists the known names") {
  CHECK(ops::parse_activation("relu") == Activation::kRelu);
  CHECK(ops::parse_activation("linear") == Activation::kLinear);
  CHECK(ops::parse_activation("sigmoid") == Activation::kSigmoid);
  CHECK(ops::parse_activation("tanh") == Activation::kTanh);
  CHECK(ops::parse_activation("gelu") == Activation::kGelu);
  CHECK(ops::parse_activation("gelu_approximate") == Activation::kGeluApproximate);
  for (const Activation a : kAllActivations) CHECK(ops::parse_activation(ops::activation_name(a)) == a);
  const std::string msg = invalid_argument_message([] { ops::parse_activation("swiglu"); });
  CHECK(contains(msg, "swiglu"));
  CHECK(contains(msg, "linear, relu, sigmoid, tanh, gelu, gelu_approximate"));
  // A graph built by op name with a bad activation fails when the node is added.
  ops::register_all();
  Graph g;
  const Output x = g.placeholder(DType::kF32, {-1, 4}, "x");
  const Output b = g.placeholder(DType::kF32, {4}, "b");
  graph::Attrs attrs;
  attrs.set("activation", "swish");
  CHECK_THROWS_AS(g.add("BiasActivation", {x, b}, attrs), InvalidArgument);
}

TEST_CASE("an out-of-range label fails at run time, naming the node, the row and the value") {
  auto g = std::make_shared<Graph>();
  const Output logits = g->placeholder(DType::kF32, {-1, 4}, "logits");
  const Output labels = g->placeholder(DType::kI64, {-1}, "labels");
  const Output loss = ops::sparse_softmax_cross_entropy_with_logits(logits, labels);
  Executor ex(g, devices::default_cpu_device());
  const Tensor x = Tensor::filled<float>(Shape{3, 4}, 0.5f);
  const auto ok = ex.run({{logits, x}, {labels, Tensor::from_vector<std::int64_t>({0, 3, 1}, {3})}}, {loss});
  CHECK(ok[0].to_vector<float>()[1] == doctest::Approx(std::log(4.0)));
  for (const std::int64_t bad : {7, -1, 4}) {
    const std::string msg = invalid_argument_message([&] {
      ex.run({{logits, x}, {labels, Tensor::from_vector<std::int64_t>({0, bad, 1}, {3})}}, {loss});
    });
    CHECK(contains(msg, "SparseSoftmaxCrossEntropyWithLogits"));
    CHECK(contains(msg, "row 1"));
    CHECK(contains(msg, fmt::format("label {}", bad)));
  }
}

TEST_CASE("unknown batch dimensions at construction, concrete at run time") {
  auto g = std::make_shared<Graph>();
  const Output x = g->placeholder(DType::kF32, {-1, 6}, "x");
  const Output kernel = g->placeholder(DType::kF32, {6, 3}, "kernel");
  const Output bias = g->placeholder(DType::kF32, {3}, "bias");
  const Output labels = g->placeholder(DType::kI32, {-1}, "labels");
  const Output h = ops::dense(x, kernel, bias, Activation::kTanh);
  CHECK(h.shape() == Shape{-1, 3});
  const Output loss = ops::sparse_softmax_cross_entropy_with_logits(h, labels);
  CHECK(loss.shape() == Shape{-1});
  const auto bn =
      ops::fused_batch_norm(x, g->placeholder(DType::kF32, {-1}, "scale"), g->placeholder(DType::kF32, {6}, "o"),
                            g->placeholder(DType::kF32, {6}, "m"), g->placeholder(DType::kF32, {6}, "v"));
  CHECK(bn.y.shape() == Shape{-1, 6});
  CHECK(bn.batch_mean.shape() == Shape{6});
  CHECK(ops::bias_add(g->placeholder(DType::kF32, {-1, -1}, "any"), bias).shape() == Shape{-1, 3});
  CHECK(ops::softmax(x).shape() == Shape{-1, 6});
  const Output normalised = ops::layer_norm(x, g->placeholder(DType::kF32, {6}, "gamma"), Output{});
  CHECK(normalised.shape() == Shape{-1, 6});
  CHECK(ops::masked_softmax(g->placeholder(DType::kF32, {-1, 2, -1, 4}, "s"), Output{}, {.causal = true}).shape() ==
        Shape{-1, 2, -1, 4});

  Executor ex(g, devices::default_cpu_device());
  for (const std::int64_t batch : {1, 5}) {
    const auto out = ex.run({{x, Tensor::filled<float>(Shape{batch, 6}, 0.25f)},
                             {kernel, Tensor::filled<float>(Shape{6, 3}, 0.5f)},
                             {bias, Tensor::filled<float>(Shape{3}, 0.0f)},
                             {labels, Tensor::filled<std::int32_t>(Shape{batch}, 2)}},
                            {h, loss});
    CHECK(out[0].shape() == Shape{batch, 3});
    CHECK(out[0].to_vector<float>()[0] == doctest::Approx(std::tanh(0.75)));
    CHECK(out[1].shape() == Shape{batch});
    CHECK(out[1].to_vector<float>()[0] == doctest::Approx(std::log(3.0)));
  }
}
