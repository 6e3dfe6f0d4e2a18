// Keras layers, called directly (no Model): each layer's output against a float64 reference
// written as plain loops, and the gradients of a random projection of the output with respect to
// the input and every trainable weight against central finite differences. Also symbolic
// shapes, weights, default names, BatchNormalization's moving averages, training vs inference,
// and the errors for bad arguments.
//
// Precision of the gradient check: layers make float32 weights, so the layer itself runs in
// float32; only the projection is summed in float64 (the output is cast), which keeps the
// rounding of the loss near float32's epsilon times the output's size. Central differences use
// a step of 1e-2 (measured as the float32 values actually stored, so the rounding of x +- h does
// not bias the quotient) on smooth or piecewise-linear functions whose kinks the inputs avoid;
// the loss rounding then contributes ~1e-4 and the truncation ~1e-4 of a gradient of order 1.
// Each element must agree within 1% of the larger of its own size and a tenth of the largest
// gradient of that tensor: ten times the expected error, while a wrong formula (a missing scale,
// a gradient that ignores the batch statistics, a transposed kernel) is off by far more.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>

#include "layer_checks.h"
#include "ops/op_test_harness.h"
#include "tandem/base/random.h"
#include "tandem/graph/autodiff.h"
#include "tandem/graph/executor.h"
#include "tandem/keras_like/layers.h"
#include "tandem/ops/ops.h"

using namespace tandem;
using graph::DType;
using graph::Shape;
using graph::Tensor;
using graph::TensorSpec;
using keras::CallContext;
using ops::Padding;
using tandem::testing::check_close;
using tandem::testing::RefTensor;
using tandem::testing::to_ref;

namespace {

constexpr std::int64_t kNone = Shape::kUnknown;
// A pool size or strides, where a braced {h, w} cannot deduce the type (std::optional fields).
using Pool = std::array<std::int64_t, 2>;

// ---- Helpers --------------------------------------------------------------------------------

// The message of the InvalidArgument that fn throws ("" if it throws nothing; a FAIL for
// anything else).
std::string invalid_argument_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected InvalidArgument, got: ", e.what());
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Random float32 values in ±[0.1, 2] (never zero).
Tensor random_tensor(const Shape& shape, std::mt19937_64& rng, double lo = 0.1, double hi = 2.0,
                     bool positive = false) {
  std::uniform_real_distribution<double> magnitude(lo, hi);
  std::bernoulli_distribution negative(0.5);
  std::vector<float> v(static_cast<std::size_t>(shape.num_elements()));
  for (auto& e : v) e = static_cast<float>((!positive && negative(rng) ? -1.0 : 1.0) * magnitude(rng));
  return Tensor::from_vector<float>(v, shape);
}

// Pairwise distinct values 0.05 apart, shuffled: a finite-difference step of 1e-2 never changes
// which element of a pooling window is the largest.
Tensor distinct_tensor(const Shape& shape, std::mt19937_64& rng) {
  const auto n = static_cast<std::size_t>(shape.num_elements());
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(0.05 * (static_cast<double>(i) - 0.5 * static_cast<double>(n)));
  std::shuffle(v.begin(), v.end(), rng);
  return Tensor::from_vector<float>(v, shape);
}

void set_weight(const keras::VariablePtr& variable, const Tensor& value) { variable->assign(value); }

void set_weight(const keras::VariablePtr& variable, const std::vector<float>& values) {
  variable->assign(Tensor::from_vector<float>(values, variable->shape()));
}

// A layer called once on placeholders (batch dimension unknown) in its own graph, the way a
// model's replica graph calls it.
struct LayerGraph {
  std::shared_ptr<Graph> graph = std::make_shared<Graph>();
  CallContext::VariableNodes variables;
  CallContext ctx;
  std::vector<Output> inputs;
  std::vector<Output> outputs;
  std::unique_ptr<graph::Executor> executor;

  LayerGraph(const keras::Layer& layer, const std::vector<TensorSpec>& specs, bool training)
      : ctx(*graph, training, variables) {
    std::vector<TensorSpec> unbatched;
    for (const auto& spec : specs) {
      const TensorSpec s{spec.dtype, spec.shape.with_dim(0, kNone)};
      unbatched.push_back(s);
      inputs.push_back(graph->placeholder(s.dtype, s.shape, "input"));
    }
    layer.impl().ensure_built(unbatched);
    outputs = layer.impl().call(ctx, inputs);
  }
  LayerGraph(const keras::Layer& layer, const Shape& input_shape, bool training)
      : LayerGraph(layer, std::vector<TensorSpec>{{DType::kF32, input_shape}}, training) {}

  // Binds the variables the graph reads (their CPU:0 copies under the default strategy). Call
  // once the graph is complete; later writes to the variables are seen by the next run.
  void start() {
    executor = std::make_unique<graph::Executor>(graph, devices::default_cpu_device());
    for (const auto& v : variables.variables) executor->bind_variable(variables.nodes.at(v.get()), v->value(0));
  }

  std::vector<Tensor> run(const std::vector<Tensor>& feeds, const std::vector<Output>& fetches) {
    if (!executor) start();
    std::vector<graph::Feed> f;
    for (std::size_t i = 0; i < feeds.size(); ++i) f.emplace_back(inputs[i], feeds[i]);
    // A fixed step: Dropout draws the same mask in every run (finite differences need that).
    return executor->run(f, fetches, graph::RunOptions{.random_step = 3});
  }
};

struct GradientCheck {
  double step = 1e-2;
  double tolerance = 1e-2;
  int max_elements = 48;  // sampled per tensor, to bound the run time
};

// Checks d(loss)/d(input) and d(loss)/d(each trainable weight), loss = sum(float64(y) * P) for a
// random P, against central differences (see the comment at the top for the tolerances).
void check_gradients(LayerGraph& lg, const keras::Layer& layer, const Tensor& x, std::mt19937_64& rng,
                     const GradientCheck& options = {}) {
  Graph& g = *lg.graph;
  const Output y = lg.outputs[0];
  const Shape y_shape = y.shape().with_dim(0, x.shape()[0]);
  std::uniform_real_distribution<double> uniform(-1.0, 1.0);
  std::vector<double> p(static_cast<std::size_t>(y_shape.num_elements()));
  for (auto& v : p) v = uniform(rng);
  const Output projection = g.constant(Tensor::from_vector<double>(p, y_shape), "projection");
  const Output loss = ops::reduce_sum(ops::mul(ops::cast(y, DType::kF64), projection));

  // What is differentiated, and where its float32 values live for perturbing.
  std::vector<Output> xs{lg.inputs[0]};
  std::vector<std::string> names{"input"};
  Tensor x_copy = x.clone();
  std::vector<float*> data{x_copy.data<float>()};
  std::vector<std::int64_t> sizes{x.num_elements()};
  for (const auto& w : layer.impl().trainable_weights()) {
    xs.push_back(lg.variables.nodes.at(w.get()));
    names.push_back(w->name());
    data.push_back(w->value(0).data<float>());
    sizes.push_back(w->shape().num_elements());
  }
  const auto grads = graph::gradients({&loss, 1}, xs);
  std::vector<Output> fetches{loss};
  for (const auto& gr : grads) {
    REQUIRE(gr.defined());
    fetches.push_back(gr);
  }
  const auto analytic = lg.run({x_copy}, fetches);
  const auto loss_at = [&]() { return lg.run({x_copy}, {loss})[0].item<double>(); };

  for (std::size_t k = 0; k < xs.size(); ++k) {
    INFO("gradient with respect to ", names[k]);
    const RefTensor grad = to_ref(analytic[k + 1]);
    REQUIRE(grad.size() == sizes[k]);
    double largest = 0.0;
    for (double v : grad.values) largest = std::max(largest, std::abs(v));
    std::vector<std::int64_t> elements(static_cast<std::size_t>(sizes[k]));
    for (std::size_t i = 0; i < elements.size(); ++i) elements[i] = static_cast<std::int64_t>(i);
    if (static_cast<int>(elements.size()) > options.max_elements) {
      std::shuffle(elements.begin(), elements.end(), rng);
      elements.resize(static_cast<std::size_t>(options.max_elements));
    }
    int failures = 0;
    for (const auto e : elements) {
      float& value = data[k][e];
      const float x0 = value;
      const auto plus = static_cast<float>(x0 + options.step);
      const auto minus = static_cast<float>(x0 - options.step);
      value = plus;
      const double loss_plus = loss_at();
      value = minus;
      const double loss_minus = loss_at();
      value = x0;
      const double numeric = (loss_plus - loss_minus) / (static_cast<double>(plus) - static_cast<double>(minus));
      const double bound = options.tolerance * std::max(std::abs(numeric), 0.1 * largest);
      const bool ok = std::abs(numeric - grad[e]) <= bound;
      if (!ok && failures++ < 5)
        CHECK_MESSAGE(ok, "element ", e, ": autodiff ", grad[e], ", finite difference ", numeric);
    }
    CHECK_MESSAGE(failures == 0, failures, " gradient element(s) outside tolerance");
  }
}

// ---- References -----------------------------------------------------------------------------

// TF's window arithmetic, written out independently of the library's.
struct Dim {
  std::int64_t out, pad_before;
};
Dim window_dim(std::int64_t in, std::int64_t k, std::int64_t s, Padding p) {
  if (p == Padding::kValid) return {(in - k) / s + 1, 0};
  const std::int64_t out = (in + s - 1) / s;
  return {out, std::max<std::int64_t>((out - 1) * s + k - in, 0) / 2};
}

double activate(const std::string& activation, double z) {
  if (activation == "relu") return std::max(z, 0.0);
  if (activation == "sigmoid") return 1.0 / (1.0 + std::exp(-z));
  if (activation == "tanh") return std::tanh(z);
  return z;
}

// Softmax over the last axis, in place.
void softmax_last_axis(RefTensor& t) {
  const std::int64_t c = t.shape[t.shape.rank() - 1];
  for (std::int64_t row = 0; row < t.size() / c; ++row) {
    double m = -INFINITY, sum = 0.0;
    for (std::int64_t j = 0; j < c; ++j) m = std::max(m, t[row * c + j]);
    for (std::int64_t j = 0; j < c; ++j) sum += std::exp(t[row * c + j] - m);
    for (std::int64_t j = 0; j < c; ++j) t[row * c + j] = std::exp(t[row * c + j] - m) / sum;
  }
}

// activation(conv(x, kernel) + bias), NHWC with an HWIO kernel; bias may be empty.
RefTensor ref_conv2d_layer(const RefTensor& x, const RefTensor& kernel, const RefTensor* bias,
                           std::array<std::int64_t, 2> strides, Padding padding, const std::string& activation) {
  const auto n = x.shape[0], h = x.shape[1], w = x.shape[2], c = x.shape[3];
  const auto kh = kernel.shape[0], kw = kernel.shape[1], o = kernel.shape[3];
  const Dim dh = window_dim(h, kh, strides[0], padding), dw = window_dim(w, kw, strides[1], padding);
  RefTensor y(Shape{n, dh.out, dw.out, o});
  for (std::int64_t b = 0; b < n; ++b) {
    for (std::int64_t oh = 0; oh < dh.out; ++oh) {
      for (std::int64_t ow = 0; ow < dw.out; ++ow) {
        for (std::int64_t oc = 0; oc < o; ++oc) {
          double sum = bias != nullptr ? (*bias)[oc] : 0.0;
          for (std::int64_t i = 0; i < kh; ++i) {
            const auto ih = oh * strides[0] - dh.pad_before + i;
            if (ih < 0 || ih >= h) continue;
            for (std::int64_t j = 0; j < kw; ++j) {
              const auto iw = ow * strides[1] - dw.pad_before + j;
              if (iw < 0 || iw >= w) continue;
              for (std::int64_t ic = 0; ic < c; ++ic) sum += x.at({b, ih, iw, ic}) * kernel.at({i, j, ic, oc});
            }
          }
          y.at({b, oh, ow, oc}) = activation == "softmax" ? sum : activate(activation, sum);
        }
      }
    }
  }
  if (activation == "softmax") softmax_last_axis(y);
  return y;
}

// Max or average over each window's positions inside the input (TF: padding never counts).
RefTensor ref_pool(const RefTensor& x, std::array<std::int64_t, 2> pool, std::array<std::int64_t, 2> strides,
                   Padding padding, bool average) {
  const auto n = x.shape[0], h = x.shape[1], w = x.shape[2], c = x.shape[3];
  const Dim dh = window_dim(h, pool[0], strides[0], padding), dw = window_dim(w, pool[1], strides[1], padding);
  RefTensor y(Shape{n, dh.out, dw.out, c});
  for (std::int64_t b = 0; b < n; ++b) {
    for (std::int64_t oh = 0; oh < dh.out; ++oh) {
      for (std::int64_t ow = 0; ow < dw.out; ++ow) {
        for (std::int64_t ch = 0; ch < c; ++ch) {
          double best = -INFINITY, sum = 0.0;
          int count = 0;
          for (std::int64_t i = 0; i < pool[0]; ++i) {
            const auto ih = oh * strides[0] - dh.pad_before + i;
            if (ih < 0 || ih >= h) continue;
            for (std::int64_t j = 0; j < pool[1]; ++j) {
              const auto iw = ow * strides[1] - dw.pad_before + j;
              if (iw < 0 || iw >= w) continue;
              const double v = x.at({b, ih, iw, ch});
              best = std::max(best, v);
              sum += v;
              ++count;
            }
          }
          y.at({b, oh, ow, ch}) = average ? sum / count : best;
        }
      }
    }
  }
  return y;
}

// Per-channel (last axis) mean and biased variance.
std::pair<std::vector<double>, std::vector<double>> ref_moments(const RefTensor& x) {
  const std::int64_t c = x.shape[x.shape.rank() - 1];
  const std::int64_t rows = x.size() / c;
  std::vector<double> mean(static_cast<std::size_t>(c)), var(static_cast<std::size_t>(c));
  for (std::int64_t j = 0; j < c; ++j) {
    double s = 0.0;
    for (std::int64_t r = 0; r < rows; ++r) s += x[r * c + j];
    const double m = s / static_cast<double>(rows);
    double ss = 0.0;
    for (std::int64_t r = 0; r < rows; ++r) ss += (x[r * c + j] - m) * (x[r * c + j] - m);
    mean[static_cast<std::size_t>(j)] = m;
    var[static_cast<std::size_t>(j)] = ss / static_cast<double>(rows);
  }
  return {mean, var};
}

// gamma * (x - mean) / sqrt(variance + epsilon) + beta per channel.
RefTensor ref_normalize(const RefTensor& x, const std::vector<double>& mean, const std::vector<double>& var,
                        const std::vector<double>& gamma, const std::vector<double>& beta, double epsilon) {
  const std::int64_t c = x.shape[x.shape.rank() - 1];
  RefTensor y(x.shape);
  for (std::int64_t i = 0; i < x.size(); ++i) {
    const auto j = static_cast<std::size_t>(i % c);
    y[i] = gamma[j] * (x[i] - mean[j]) / std::sqrt(var[j] + epsilon) + beta[j];
  }
  return y;
}

std::vector<double> values_of(const keras::VariablePtr& v) { return to_ref(v->value(0)).values; }

// ---- Names, weights, symbolic shapes ---------------------------------------------------------

// The number Keras appends to a default name: "conv2d" -> 0, "conv2d_3" -> 3; -1 for another base.
int name_index(const std::string& name, const std::string& base) {
  if (name == base) return 0;
  if (name.rfind(base + "_", 0) != 0) return -1;
  return std::stoi(name.substr(base.size() + 1));
}

}  // namespace

TEST_CASE("layers get unique default names from their class, as Keras numbers them") {
  // The counters are per process: whatever ran before, two new layers take consecutive numbers.
  // (The two layers are made in order: function arguments are evaluated in any order.)
  const auto consecutive = [](const std::function<keras::Layer()>& make, const std::string& base) {
    const keras::Layer a = make();
    const keras::Layer b = make();
    INFO(base, ": ", a.name(), ", ", b.name());
    const int i = name_index(a.name(), base);
    CHECK(i >= 0);
    CHECK(name_index(b.name(), base) == i + 1);
  };
  consecutive([] { return keras::Conv2D(4, {3, 3}); }, "conv2d");
  consecutive([] { return keras::MaxPooling2D(); }, "max_pooling2d");
  consecutive([] { return keras::AveragePooling2D(); }, "average_pooling2d");
  consecutive([] { return keras::Dropout(0.5); }, "dropout");
  consecutive([] { return keras::BatchNormalization(); }, "batch_normalization");
  CHECK(keras::Conv2D(4, {3, 3}, {.name = "features"}).name() == "features");
  CHECK(keras::Conv2D(4, {3, 3})->class_name() == "Conv2D");
  CHECK(keras::BatchNormalization()->class_name() == "BatchNormalization");
}

TEST_CASE("Conv2D: kernel (kh, kw, in, filters) and bias (filters), named after the layer") {
  keras::Conv2D conv(8, {3, 5}, "relu", {.name = "conv_w"});
  conv->ensure_built({TensorSpec{DType::kF32, Shape{kNone, 28, 28, 3}}});
  const auto& w = conv->weights();
  REQUIRE(w.size() == 2);
  CHECK(w[0]->name() == "conv_w/kernel");
  CHECK(w[0]->shape() == Shape{3, 5, 3, 8});
  CHECK(w[0]->trainable());
  CHECK(w[1]->name() == "conv_w/bias");
  CHECK(w[1]->shape() == Shape{8});
  CHECK(to_ref(w[1]->value(0)).values == std::vector<double>(8, 0.0));  // bias_initializer "zeros"
  CHECK(conv->count_params() == 3 * 5 * 3 * 8 + 8);

  keras::Conv2D no_bias(4, {2, 2}, {.use_bias = false});
  no_bias->ensure_built({TensorSpec{DType::kF32, Shape{kNone, 8, 8, 2}}});
  REQUIRE(no_bias->weights().size() == 1);
  CHECK(no_bias->weights()[0]->shape() == Shape{2, 2, 2, 4});
}

TEST_CASE("BatchNormalization: gamma, beta trainable; moving statistics not; all of shape (channels)") {
  keras::BatchNormalization bn({.name = "bn_w"});
  bn->ensure_built({TensorSpec{DType::kF32, Shape{kNone, 6, 6, 5}}});
  const auto& w = bn->weights();
  REQUIRE(w.size() == 4);
  const std::vector<std::string> names{"bn_w/gamma", "bn_w/beta", "bn_w/moving_mean", "bn_w/moving_variance"};
  const std::vector<bool> trainable{true, true, false, false};
  const std::vector<double> initial{1.0, 0.0, 0.0, 1.0};
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(w[i]->name() == names[i]);
    CHECK(w[i]->shape() == Shape{5});
    CHECK(w[i]->trainable() == trainable[i]);
    CHECK(values_of(w[i]) == std::vector<double>(5, initial[i]));
  }
  CHECK(bn->trainable_weights().size() == 2);
  CHECK(bn->non_trainable_weights().size() == 2);

  keras::BatchNormalization plain({.center = false, .scale = false, .name = "bn_plain"});
  plain->ensure_built({TensorSpec{DType::kF32, Shape{kNone, 7}}});
  REQUIRE(plain->weights().size() == 2);
  CHECK(plain->weights()[0]->name() == "bn_plain/moving_mean");
  CHECK(plain->weights()[1]->name() == "bn_plain/moving_variance");
  CHECK(plain->trainable_weights().empty());

  keras::Dropout dropout(0.3);
  dropout->ensure_built({TensorSpec{DType::kF32, Shape{kNone, 7}}});
  CHECK(dropout->weights().empty());
}

TEST_CASE("symbolic shapes of Conv2D and pooling") {
  const auto x = keras::Input({28, 28, 1});
  const auto shape_after = [&](const keras::Layer& layer) { return layer(x).shape(); };
  CHECK(shape_after(keras::Conv2D(8, {3, 3})) == Shape{kNone, 26, 26, 8});
  CHECK(shape_after(keras::Conv2D(8, {3, 3}, {.padding = "same"})) == Shape{kNone, 28, 28, 8});
  CHECK(shape_after(keras::Conv2D(8, {3, 3}, {.padding = "SAME"})) == Shape{kNone, 28, 28, 8});
  CHECK(shape_after(keras::Conv2D(8, {3, 3}, {.strides = {2, 2}, .padding = "same"})) == Shape{kNone, 14, 14, 8});
  CHECK(shape_after(keras::Conv2D(8, {3, 3}, {.strides = {2, 2}})) == Shape{kNone, 13, 13, 8});
  CHECK(shape_after(keras::Conv2D(4, {5, 1}, {.strides = {1, 3}, .padding = "Valid"})) == Shape{kNone, 24, 10, 4});
  CHECK(shape_after(keras::MaxPooling2D()) == Shape{kNone, 14, 14, 1});
  CHECK(shape_after(keras::MaxPooling2D({3, 3})) == Shape{kNone, 9, 9, 1});
  CHECK(shape_after(keras::MaxPooling2D({3, 3}, {.strides = Pool{2, 2}, .padding = "same"})) ==
        Shape{kNone, 14, 14, 1});
  CHECK(shape_after(keras::AveragePooling2D()) == Shape{kNone, 14, 14, 1});
  CHECK(shape_after(keras::AveragePooling2D({2, 3}, {.strides = Pool{1, 1}})) == Shape{kNone, 27, 26, 1});
  CHECK(shape_after(keras::Dropout(0.5)) == Shape{kNone, 28, 28, 1});
  CHECK(shape_after(keras::BatchNormalization()) == Shape{kNone, 28, 28, 1});

  // Chained: conv -> pool -> conv.
  const auto h = keras::MaxPooling2D()(keras::Conv2D(16, {3, 3}, "relu")(x));
  const auto y = keras::Conv2D(32, {3, 3}, "relu", {.padding = "same"})(h);
  CHECK(h.shape() == Shape{kNone, 13, 13, 16});
  CHECK(y.shape() == Shape{kNone, 13, 13, 32});
  CHECK(y.dtype() == DType::kF32);
}

// ---- Conv2D ---------------------------------------------------------------------------------

TEST_CASE("Conv2D output and gradients (input, kernel, bias) against the reference") {
  struct Case {
    std::string activation;
    std::array<std::int64_t, 2> kernel_size;
    std::array<std::int64_t, 2> strides;
    std::string padding;
    bool use_bias;
    Shape input;
    std::int64_t filters;
    bool check_gradient;  // relu's kink would need inputs placed away from it: forward only
  };
  const std::vector<Case> cases{
      {"tanh", {3, 3}, {1, 1}, "valid", true, Shape{2, 6, 6, 3}, 4, true},
      {"linear", {2, 3}, {2, 1}, "same", false, Shape{2, 5, 7, 2}, 3, true},
      {"linear", {3, 3}, {1, 1}, "same", true, Shape{1, 4, 4, 2}, 2, true},
      {"softmax", {3, 3}, {2, 2}, "same", true, Shape{2, 6, 5, 3}, 5, true},  // bias_add + softmax
      {"sigmoid", {1, 2}, {1, 2}, "valid", true, Shape{2, 3, 6, 2}, 3, true},
      {"relu", {3, 2}, {2, 2}, "valid", true, Shape{3, 7, 6, 4}, 6, false},
      {"relu", {3, 3}, {1, 1}, "same", false, Shape{2, 5, 5, 3}, 4, false},
  };
  std::mt19937_64 rng(20240601);
  for (const auto& c : cases) {
    INFO("Conv2D ", c.filters, " filters, kernel ", c.kernel_size[0], "x", c.kernel_size[1], ", strides ", c.strides[0],
         "x", c.strides[1], ", ", c.padding, ", ", c.activation, c.use_bias ? ", with bias" : ", no bias", ", input ",
         c.input.to_string());
    keras::Conv2D conv(c.filters, c.kernel_size, c.activation.c_str(),
                       {.strides = c.strides, .padding = c.padding, .use_bias = c.use_bias});
    LayerGraph lg(conv, c.input, /*training=*/true);
    // Glorot kernels are small: use values of order 1, and a bias that differs per filter.
    const auto& weights = conv->weights();
    REQUIRE(weights.size() == (c.use_bias ? 2u : 1u));
    set_weight(weights[0], random_tensor(weights[0]->shape(), rng, 0.1, 0.6));
    if (c.use_bias) set_weight(weights[1], random_tensor(weights[1]->shape(), rng, 0.1, 1.0));

    const Tensor x = random_tensor(c.input, rng);
    const RefTensor bias = c.use_bias ? to_ref(weights[1]->value(0)) : RefTensor();
    const RefTensor want = ref_conv2d_layer(to_ref(x), to_ref(weights[0]->value(0)), c.use_bias ? &bias : nullptr,
                                            c.strides, ops::parse_padding(c.padding), c.activation);
    check_close(to_ref(lg.run({x}, {lg.outputs[0]})[0]), want);
    if (c.check_gradient) {
      LayerGraph grad_graph(conv, c.input, /*training=*/true);
      check_gradients(grad_graph, conv, x, rng);
    }
  }
}

TEST_CASE("Conv2D fuses bias and element-wise activations into one op; softmax follows a BiasAdd") {
  const auto last_op = [](const keras::Layer& layer) {
    LayerGraph lg(layer, Shape{1, 5, 5, 2}, /*training=*/false);
    return lg.outputs[0].producer().op_name();
  };
  CHECK(last_op(keras::Conv2D(3, {3, 3}, "relu")) == "FusedConv2D");
  CHECK(last_op(keras::Conv2D(3, {3, 3})) == "FusedConv2D");
  CHECK(last_op(keras::Conv2D(3, {3, 3}, "softmax")) == "Softmax");
  CHECK(last_op(keras::Conv2D(3, {3, 3}, {.use_bias = false})) == "Conv2D");
  CHECK(last_op(keras::Conv2D(3, {3, 3}, "tanh", {.use_bias = false})) == "Tanh");
}

// ---- Pooling --------------------------------------------------------------------------------

TEST_CASE("MaxPooling2D and AveragePooling2D output and input gradient against the reference") {
  struct Case {
    bool average;
    std::array<std::int64_t, 2> pool;
    std::optional<std::array<std::int64_t, 2>> strides;
    std::string padding;
    Shape input;
  };
  const std::vector<Case> cases{
      {false, {2, 2}, std::nullopt, "valid", Shape{2, 6, 6, 3}},
      {false, {3, 3}, Pool{2, 2}, "same", Shape{2, 7, 5, 2}},
      {false, {2, 3}, Pool{1, 2}, "valid", Shape{1, 5, 7, 2}},
      {true, {2, 2}, std::nullopt, "valid", Shape{2, 6, 6, 3}},
      {true, {3, 2}, Pool{1, 2}, "same", Shape{2, 5, 5, 2}},
      {true, {3, 3}, std::nullopt, "same", Shape{1, 7, 8, 1}},
  };
  std::mt19937_64 rng(7);
  for (const auto& c : cases) {
    INFO((c.average ? "AveragePooling2D " : "MaxPooling2D "), c.pool[0], "x", c.pool[1], ", ", c.padding, ", input ",
         c.input.to_string());
    const keras::Pooling2DOptions options{.strides = c.strides, .padding = c.padding};
    const keras::Layer layer = c.average ? keras::Layer(keras::AveragePooling2D(c.pool, options))
                                         : keras::Layer(keras::MaxPooling2D(c.pool, options));
    CHECK(layer->weights().empty());
    const Tensor x = distinct_tensor(c.input, rng);
    LayerGraph lg(layer, c.input, /*training=*/true);
    const RefTensor want =
        ref_pool(to_ref(x), c.pool, c.strides.value_or(c.pool), ops::parse_padding(c.padding), c.average);
    check_close(to_ref(lg.run({x}, {lg.outputs[0]})[0]), want);
    LayerGraph grad_graph(layer, c.input, /*training=*/true);
    check_gradients(grad_graph, layer, x, rng);
  }
}

// ---- Dropout --------------------------------------------------------------------------------

TEST_CASE("Dropout: identity outside training; in training zeroes about `rate` and scales the rest") {
  const double rate = 0.3;
  keras::Dropout dropout(rate, {.seed = 1234});
  const Shape shape{8, 50, 25};

  LayerGraph inference(dropout, shape, /*training=*/false);
  CHECK(inference.outputs[0] == inference.inputs[0]);  // the input itself: no op added

  LayerGraph training(dropout, shape, /*training=*/true);
  const auto& node = training.outputs[0].producer();
  CHECK(node.op_name() == "Dropout");
  CHECK(node.attrs.get_int_or("seed", 0) == 1234);
  CHECK(node.attrs.get_float_or("rate", 0.0) == doctest::Approx(rate));

  std::mt19937_64 rng(3);
  const Tensor x = random_tensor(shape, rng);
  const RefTensor in = to_ref(x);
  const RefTensor out = to_ref(training.run({x}, {training.outputs[0]})[0]);
  std::int64_t dropped = 0, wrong = 0;
  for (std::int64_t i = 0; i < in.size(); ++i) {
    if (out[i] == 0.0) {
      ++dropped;
    } else if (std::abs(out[i] - in[i] / (1.0 - rate)) > 1e-6 * (1.0 + std::abs(in[i]))) {
      ++wrong;
    }
  }
  CHECK(wrong == 0);
  // 10000 draws: the fraction's standard deviation is 0.0046; 0.03 is 6.5 of them.
  CHECK(static_cast<double>(dropped) / static_cast<double>(in.size()) == doctest::Approx(rate).epsilon(0.1));

  // The gradient is the output gradient times the same mask (the step is fixed in every run).
  LayerGraph grad_graph(dropout, Shape{2, 5, 4}, /*training=*/true);
  check_gradients(grad_graph, dropout, random_tensor(Shape{2, 5, 4}, rng), rng);

  // Rate 0 is the identity in training too (Keras returns the inputs).
  keras::Dropout none(0.0);
  LayerGraph zero(none, shape, /*training=*/true);
  CHECK(zero.outputs[0] == zero.inputs[0]);
}

TEST_CASE("Dropout seeds: the given one, else one drawn from the global seed at construction") {
  const auto seed_of = [](const keras::Layer& layer) {
    LayerGraph lg(layer, Shape{2, 3}, /*training=*/true);
    return lg.outputs[0].producer().attrs.get_int_or("seed", -1);
  };
  set_global_seed(99);
  const keras::Dropout a(0.5), b(0.5);
  set_global_seed(99);
  const keras::Dropout c(0.5);
  CHECK(seed_of(a) == seed_of(c));  // repeatable runs
  CHECK(seed_of(a) != seed_of(b));  // distinct layers draw distinct masks
  CHECK(seed_of(a) == seed_of(a));  // one seed per layer, however often it is called
  set_global_seed(0);
}

// ---- BatchNormalization ---------------------------------------------------------------------

namespace {

// Input whose channels have different means and spreads, so the statistics are not trivial.
Tensor shifted_input(const Shape& shape, std::mt19937_64& rng) {
  const std::int64_t c = shape[shape.rank() - 1];
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> v(static_cast<std::size_t>(shape.num_elements()));
  for (std::size_t i = 0; i < v.size(); ++i) {
    const auto j = static_cast<double>(static_cast<std::int64_t>(i) % c);
    v[i] = static_cast<float>((j - 1.0) * 0.7 + (0.5 + 0.4 * j) * normal(rng));
  }
  return Tensor::from_vector<float>(v, shape);
}

}  // namespace

TEST_CASE("BatchNormalization training: batch statistics, gradients, and the moving-average updates") {
  for (const Shape& shape : {Shape{4, 3, 3, 3}, Shape{16, 5}}) {
    INFO("input ", shape.to_string());
    const std::int64_t c = shape[shape.rank() - 1];
    const double momentum = 0.9, epsilon = 1e-3;
    keras::BatchNormalization bn({.momentum = momentum, .epsilon = epsilon});
    LayerGraph lg(bn, shape, /*training=*/true);
    const auto& w = bn->weights();
    REQUIRE(w.size() == 4);
    std::mt19937_64 rng(static_cast<std::uint64_t>(c));
    set_weight(w[0], random_tensor(Shape{c}, rng, 0.5, 1.5, /*positive=*/true));  // gamma
    set_weight(w[1], random_tensor(Shape{c}, rng, 0.1, 1.0));                     // beta
    set_weight(w[2], random_tensor(Shape{c}, rng, 0.1, 1.0));                     // moving_mean
    set_weight(w[3], random_tensor(Shape{c}, rng, 0.5, 2.0, /*positive=*/true));  // moving_variance
    const Tensor x = shifted_input(shape, rng);
    const RefTensor xr = to_ref(x);
    const auto [mean, var] = ref_moments(xr);

    // The updates: moving_mean, then moving_variance, each moving * momentum + batch * (1 - momentum).
    const auto& updates = lg.ctx.updates();
    REQUIRE(updates.size() == 2);
    CHECK(updates[0].first == w[2]);
    CHECK(updates[1].first == w[3]);
    const auto got = lg.run({x}, {lg.outputs[0], updates[0].second, updates[1].second});
    check_close(to_ref(got[0]), ref_normalize(xr, mean, var, values_of(w[0]), values_of(w[1]), epsilon));
    const auto moving_mean = values_of(w[2]), moving_var = values_of(w[3]);
    RefTensor want_mean(Shape{c}), want_var(Shape{c});
    for (std::int64_t j = 0; j < c; ++j) {
      const auto i = static_cast<std::size_t>(j);
      want_mean[j] = moving_mean[i] * momentum + mean[i] * (1.0 - momentum);
      want_var[j] = moving_var[i] * momentum + var[i] * (1.0 - momentum);  // biased batch variance
    }
    check_close(to_ref(got[1]), want_mean);
    check_close(to_ref(got[2]), want_var);
    // The call only computes the updates; the variables change when the trainer applies them.
    CHECK(values_of(w[2]) == moving_mean);

    LayerGraph grad_graph(bn, shape, /*training=*/true);
    check_gradients(grad_graph, bn, x, rng);
  }
}

TEST_CASE("BatchNormalization inference: the moving statistics, no updates") {
  const Shape shape{3, 4, 2, 3};
  const double epsilon = 1e-2;
  keras::BatchNormalization bn({.epsilon = epsilon});
  LayerGraph lg(bn, shape, /*training=*/false);
  CHECK(lg.ctx.updates().empty());
  const auto& w = bn->weights();
  std::mt19937_64 rng(11);
  set_weight(w[0], std::vector<float>{0.5f, 1.5f, -1.0f});
  set_weight(w[1], std::vector<float>{0.25f, -0.5f, 1.0f});
  set_weight(w[2], std::vector<float>{1.0f, -2.0f, 0.5f});
  set_weight(w[3], std::vector<float>{0.5f, 2.0f, 4.0f});
  const Tensor x = shifted_input(shape, rng);
  const RefTensor want =
      ref_normalize(to_ref(x), values_of(w[2]), values_of(w[3]), values_of(w[0]), values_of(w[1]), epsilon);
  check_close(to_ref(lg.run({x}, {lg.outputs[0]})[0]), want);

  LayerGraph grad_graph(bn, shape, /*training=*/false);
  check_gradients(grad_graph, bn, x, rng);
}

TEST_CASE("BatchNormalization without scale and center normalises with constant 1 and 0") {
  const Shape shape{6, 4};
  keras::BatchNormalization bn({.epsilon = 1e-3, .center = false, .scale = false});
  std::mt19937_64 rng(5);
  const Tensor x = shifted_input(shape, rng);
  const RefTensor xr = to_ref(x);
  const std::vector<double> ones(4, 1.0), zeros(4, 0.0);

  LayerGraph training(bn, shape, /*training=*/true);
  const auto [mean, var] = ref_moments(xr);
  check_close(to_ref(training.run({x}, {training.outputs[0]})[0]), ref_normalize(xr, mean, var, ones, zeros, 1e-3));
  CHECK(training.ctx.updates().size() == 2);

  LayerGraph inference(bn, shape, /*training=*/false);
  set_weight(bn->weights()[0], std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f});
  set_weight(bn->weights()[1], std::vector<float>{1.0f, 0.5f, 2.0f, 0.25f});
  check_close(to_ref(inference.run({x}, {inference.outputs[0]})[0]),
              ref_normalize(xr, values_of(bn->weights()[0]), values_of(bn->weights()[1]), ones, zeros, 1e-3));

  LayerGraph grad_graph(bn, shape, /*training=*/true);
  check_gradients(grad_graph, bn, x, rng);  // the input only: there are no trainable weights
}

// ---- Errors ---------------------------------------------------------------------------------

TEST_CASE("bad arguments raise InvalidArgument naming the layer and what was expected") {
  SUBCASE("Dropout rate outside [0, 1)") {
    for (const double rate : {1.0, 1.5, -0.1}) {
      const auto message = invalid_argument_message([&] { keras::Dropout(rate, {.name = "drop"}); });
      INFO(message);
      CHECK(contains(message, "Dropout \"drop\""));
      CHECK(contains(message, "[0, 1)"));
    }
  }
  SUBCASE("padding other than valid / same") {
    for (const auto& make :
         std::vector<std::function<void()>>{[] {
                                              keras::Conv2D(4, {3, 3}, {.padding = "full", .name = "pad"});
                                            },
                                            [] { keras::MaxPooling2D({.padding = "full", .name = "pad"}); },
                                            [] { keras::AveragePooling2D({.padding = "full", .name = "pad"}); }}) {
      const auto message = invalid_argument_message(make);
      INFO(message);
      CHECK(contains(message, "\"pad\""));
      CHECK(contains(message, "\"full\""));
      CHECK(contains(message, "\"valid\""));
      CHECK(contains(message, "\"same\""));
    }
  }
  SUBCASE("Conv2D on a rank-3 input") {
    keras::Conv2D conv(4, {3, 3}, {.name = "conv_rank"});
    const auto x = keras::Input({28, 28});
    const auto message = invalid_argument_message([&] { conv(x); });
    INFO(message);
    CHECK(contains(message, "Conv2D \"conv_rank\""));
    CHECK(contains(message, "(None, 28, 28)"));
    CHECK(contains(message, "rank 4"));
    CHECK_FALSE(conv->built());
  }
  SUBCASE("Conv2D with unknown channels") {
    keras::Conv2D conv(4, {3, 3}, {.name = "conv_unknown"});
    const auto message = invalid_argument_message([&] { conv(keras::Input({28, 28, kNone})); });
    INFO(message);
    CHECK(contains(message, "Conv2D \"conv_unknown\""));
    CHECK(contains(message, "channels"));
  }
  SUBCASE("Conv2D called on other channels than it was built for") {
    keras::Conv2D conv(4, {3, 3});
    conv(keras::Input({8, 8, 1}));
    const auto message = invalid_argument_message([&] { conv(keras::Input({8, 8, 3})); });
    INFO(message);
    CHECK(contains(message, fmt::format("Conv2D \"{}\": input has 3 channels, kernel expects 1", conv.name())));
    // And at graph-building time (a replica graph), not only symbolically.
    const auto direct = invalid_argument_message([&] { LayerGraph lg(conv, Shape{2, 8, 8, 3}, true); });
    CHECK(contains(direct, "input has 3 channels, kernel expects 1"));
  }
  SUBCASE("pooling on a rank-3 input") {
    const auto message = invalid_argument_message([&] {
      keras::MaxPooling2D({.name = "pool_rank"})(keras::Input({8, 8}));
    });
    INFO(message);
    CHECK(contains(message, "MaxPooling2D \"pool_rank\""));
    CHECK(contains(message, "rank 4"));
  }
  SUBCASE("non-positive sizes") {
    CHECK(contains(invalid_argument_message([] { keras::Conv2D(0, {3, 3}, {.name = "f0"}); }), "Conv2D \"f0\""));
    CHECK(contains(invalid_argument_message([] { keras::Conv2D(2, {0, 3}, {.name = "k0"}); }), "kernel_size"));
    CHECK(contains(invalid_argument_message([] {
                     keras::Conv2D(2, {3, 3}, {.strides = {1, 0}, .name = "s0"});
                   }),
                   "strides"));
    CHECK(contains(invalid_argument_message([] { keras::MaxPooling2D({0, 2}, {.name = "p0"}); }), "pool_size"));
  }
  SUBCASE("unknown activation") {
    const auto message = invalid_argument_message([] { keras::Conv2D(2, {3, 3}, "gelu2", {.name = "act"}); });
    CHECK(contains(message, "Conv2D \"act\""));
    CHECK(contains(message, "relu"));
  }
  SUBCASE("BatchNormalization on other channels than it was built for, or bad epsilon") {
    keras::BatchNormalization bn({.name = "bn_err"});
    bn(keras::Input({8, 8, 3}));
    const auto message = invalid_argument_message([&] { bn(keras::Input({8, 8, 4})); });
    INFO(message);
    CHECK(contains(message, "BatchNormalization \"bn_err\""));
    CHECK(contains(message, "4 channels"));
    CHECK(contains(invalid_argument_message([] { keras::BatchNormalization({.epsilon = 0.0, .name = "eps"}); }),
                   "BatchNormalization \"eps\""));
    CHECK(contains(invalid_argument_message([] { keras::BatchNormalization({.name = "bn_rank"})(keras::Input({})); }),
                   "BatchNormalization \"bn_rank\""));
  }
}
