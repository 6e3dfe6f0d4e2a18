// The transformer layers (Embedding, LayerNormalization, MultiHeadAttention, the gelu
// activations), the initializers they use, the sparse cross-entropy on sequences, and a custom
// layer holding them: a pre-LN transformer block in a functional model that trains.
//
// Forward passes are compared with float64 references written as plain loops; gradients of a
// random projection of the output with respect to every float input and every trainable weight
// are compared with central differences. Both run with the layers under the "float64" policy
// (float64 weights and computation), so the comparisons measure the formulas, not rounding:
// outputs agree to 1e-6 (relative, plus 1e-6 absolute), and a central difference with step 1e-5
// is exact to about 1e-9 on these smooth functions (truncation ~h^2, rounding ~1e-16 / h), so each
// gradient element must agree within 1e-6 of the larger of its size and a tenth of the largest
// element of its tensor.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>

#include "common/error_message.h"
#include "common/temp_dir.h"
#include "layer_checks.h"
#include "ops/op_test_harness.h"
#include "tandem/base/random.h"
#include "tandem/data/dataset.h"
#include "tandem/graph/autodiff.h"
#include "tandem/graph/executor.h"
#include "tandem/keras_like/keras.h"
#include "tandem/ops/ops.h"

using namespace tandem;
using graph::DType;
using graph::Shape;
using graph::Tensor;
using graph::TensorSpec;
using keras::CallContext;
using keras::mixed_precision::PolicyScope;
using tandem::testing::check_close;
using tandem::testing::RefTensor;
using tandem::testing::to_ref;

namespace {

constexpr std::int64_t kNone = Shape::kUnknown;
// Outputs of the float64 layers against the float64 references.
constexpr double kTolerance = 1e-6;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// ---- Harness -------------------------------------------------------------------------------

using CallFn = std::function<std::vector<Output>(CallContext&, const std::vector<Output>&)>;

// A layer call on placeholders (batch dimension unknown) in its own graph, made the way a custom
// layer calls the layers it holds (Layer::operator()(CallContext&, ...)).
struct Harness {
  std::shared_ptr<Graph> graph = std::make_shared<Graph>();
  CallContext::VariableNodes variables;
  CallContext ctx;
  std::vector<Output> inputs;
  std::vector<Output> outputs;
  std::unique_ptr<graph::Executor> executor;

  Harness(const CallFn& fn, const std::vector<TensorSpec>& specs, bool training = false)
      : ctx(*graph, training, variables) {
    for (const auto& spec : specs) inputs.push_back(graph->placeholder(spec.dtype, spec.shape.with_dim(0, kNone), "in"));
    outputs = fn(ctx, inputs);
  }

  std::vector<Tensor> run(const std::vector<Tensor>& feeds, const std::vector<Output>& fetches) {
    if (!executor) {
      executor = std::make_unique<graph::Executor>(graph, devices::default_cpu_device());
      for (const auto& v : variables.variables) executor->bind_variable(variables.nodes.at(v.get()), v->value(0));
    }
    std::vector<graph::Feed> f;
    for (std::size_t i = 0; i < feeds.size(); ++i) f.emplace_back(inputs[i], feeds[i]);
    return executor->run(f, fetches, graph::RunOptions{.random_step = 3});
  }
  std::vector<Tensor> run(const std::vector<Tensor>& feeds) { return run(feeds, outputs); }
};

Tensor random_doubles(const Shape& shape, std::mt19937_64& rng, double lo = -1.0, double hi = 1.0) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(static_cast<std::size_t>(shape.num_elements()));
  for (auto& e : v) e = u(rng);
  return Tensor::from_vector<double>(v, shape);
}

Tensor random_ids(const Shape& shape, std::int64_t limit, std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int32_t> u(0, static_cast<std::int32_t>(limit - 1));
  std::vector<std::int32_t> v(static_cast<std::size_t>(shape.num_elements()));
  for (auto& e : v) e = u(rng);
  return Tensor::from_vector<std::int32_t>(v, shape);
}

// Every weight of the layer set to random values (biases too, so that they matter).
void randomize_weights(const keras::Layer& layer, std::mt19937_64& rng, double scale = 0.5) {
  for (const auto& w : layer->weights()) w->assign(random_doubles(w->shape(), rng, -scale, scale));
}

// d(loss)/d(each float input) and d(loss)/d(each trainable weight of `layer`), loss =
// sum(y * P) for a random P, against central differences (see the top of the file).
void check_gradients(Harness& h, const keras::Layer& layer, const std::vector<Tensor>& feeds, std::mt19937_64& rng) {
  Graph& g = *h.graph;
  const Output y = h.outputs[0];
  const Shape y_shape = y.shape().with_dim(0, feeds[0].shape()[0]);
  const Output projection = g.constant(random_doubles(y_shape, rng), "projection");
  const Output loss = ops::reduce_sum(ops::mul(ops::cast(y, DType::kF64), projection));

  std::vector<Output> xs;
  std::vector<std::string> names;
  std::vector<double*> data;
  std::vector<Tensor> perturbed;
  for (const auto& f : feeds) perturbed.push_back(f.clone());
  for (std::size_t i = 0; i < feeds.size(); ++i) {
    if (feeds[i].dtype() != DType::kF64) continue;
    xs.push_back(h.inputs[i]);
    names.push_back(fmt::format("input {}", i));
    data.push_back(perturbed[i].data<double>());
  }
  for (const auto& w : layer->trainable_weights()) {
    xs.push_back(h.variables.nodes.at(w.get()));
    names.push_back(w->name());
    data.push_back(w->value(0).data<double>());
  }
  const auto grads = graph::gradients({&loss, 1}, xs);
  std::vector<Output> fetches{loss};
  for (const auto& gr : grads) {
    REQUIRE(gr.defined());
    fetches.push_back(gr);
  }
  const auto analytic = h.run(perturbed, fetches);
  const auto loss_at = [&] { return h.run(perturbed, {loss})[0].item<double>(); };
  constexpr double kStep = 1e-5;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    INFO("gradient with respect to ", names[k]);
    const RefTensor grad = to_ref(analytic[k + 1]);
    double largest = 0.0;
    for (double v : grad.values) largest = std::max(largest, std::abs(v));
    std::vector<std::int64_t> elements(static_cast<std::size_t>(grad.size()));
    for (std::size_t i = 0; i < elements.size(); ++i) elements[i] = static_cast<std::int64_t>(i);
    std::shuffle(elements.begin(), elements.end(), rng);
    elements.resize(std::min<std::size_t>(elements.size(), 40));
    int failures = 0;
    for (const auto e : elements) {
      double& value = data[k][e];
      const double x0 = value;
      value = x0 + kStep;
      const double plus = loss_at();
      value = x0 - kStep;
      const double minus = loss_at();
      value = x0;
      const double numeric = (plus - minus) / (2 * kStep);
      const bool ok = std::abs(numeric - grad[e]) <= 1e-6 * std::max({std::abs(numeric), 0.1 * largest, 1e-3});
      if (!ok && failures++ < 5) CHECK_MESSAGE(ok, "element ", e, ": autodiff ", grad[e], ", finite difference ", numeric);
    }
    CHECK_MESSAGE(failures == 0, failures, " gradient element(s) outside tolerance");
  }
}

// ---- References ------------------------------------------------------------------------------

// Layer normalization of each row of `features` values.
RefTensor ref_layer_norm(const RefTensor& x, std::int64_t features, const std::vector<double>& gamma,
                         const std::vector<double>& beta, double epsilon) {
  RefTensor y(x.shape);
  for (std::int64_t row = 0; row < x.size() / features; ++row) {
    double mean = 0, var = 0;
    for (std::int64_t j = 0; j < features; ++j) mean += x[row * features + j];
    mean /= static_cast<double>(features);
    for (std::int64_t j = 0; j < features; ++j) var += std::pow(x[row * features + j] - mean, 2);
    var /= static_cast<double>(features);
    for (std::int64_t j = 0; j < features; ++j) {
      const auto i = row * features + j;
      const auto u = static_cast<std::size_t>(j);
      y[i] = (x[i] - mean) / std::sqrt(var + epsilon) * (gamma.empty() ? 1.0 : gamma[u]) + (beta.empty() ? 0.0 : beta[u]);
    }
  }
  return y;
}

struct AttentionRef {
  RefTensor output;  // [B, T, *out]
  RefTensor scores;  // [B, H, T, S]
};

// Keras 3's MultiHeadAttention, written out: projections, softmax over the allowed key positions
// (none allowed: zeros), the weighted values, the output projection. weights: the layer's, in
// Keras's order (query kernel, query bias, key ..., value ..., output kernel, output bias); no
// biases when use_bias is false. mask: [B, T, S] or empty.
AttentionRef ref_attention(const RefTensor& q_in, const RefTensor& v_in, const RefTensor& k_in,
                           const std::vector<RefTensor>& w, bool use_bias, const RefTensor* mask, bool causal) {
  const auto b_n = q_in.shape[0], t_n = q_in.shape[1], c_q = q_in.shape[2];
  const auto s_n = v_in.shape[1], c_v = v_in.shape[2], c_k = k_in.shape[2];
  const std::size_t step = use_bias ? 2 : 1;
  const RefTensor& wq = w[0];
  const RefTensor& wk = w[step];
  const RefTensor& wv = w[2 * step];
  const RefTensor& wo = w[3 * step];
  const auto heads = wq.shape[1], dk = wq.shape[2], dv = wv.shape[2];
  const std::int64_t out_n = wo.size() / (heads * dv);
  const auto proj = [&](const RefTensor& x, const RefTensor& kernel, const RefTensor* bias, std::int64_t len,
                        std::int64_t c, std::int64_t d) {
    RefTensor p(Shape{b_n, heads, len, d});
    for (std::int64_t b = 0; b < b_n; ++b)
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::int64_t l = 0; l < len; ++l)
          for (std::int64_t e = 0; e < d; ++e) {
            double sum = bias != nullptr ? bias->at({h, e}) : 0.0;
            for (std::int64_t i = 0; i < c; ++i) sum += x.at({b, l, i}) * kernel.at({i, h, e});
            p.at({b, h, l, e}) = sum;
          }
    return p;
  };
  const RefTensor q = proj(q_in, wq, use_bias ? &w[1] : nullptr, t_n, c_q, dk);
  const RefTensor k = proj(k_in, wk, use_bias ? &w[step + 1] : nullptr, s_n, c_k, dk);
  const RefTensor v = proj(v_in, wv, use_bias ? &w[2 * step + 1] : nullptr, s_n, c_v, dv);
  AttentionRef r{RefTensor(Shape{b_n, t_n, out_n}), RefTensor(Shape{b_n, heads, t_n, s_n})};
  RefTensor combined(Shape{b_n, t_n, heads, dv});
  for (std::int64_t b = 0; b < b_n; ++b)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t t = 0; t < t_n; ++t) {
        std::vector<double> logits(static_cast<std::size_t>(s_n));
        std::vector<bool> allowed(static_cast<std::size_t>(s_n));
        double largest = -INFINITY;
        for (std::int64_t s = 0; s < s_n; ++s) {
          const auto u = static_cast<std::size_t>(s);
          double dot = 0;
          for (std::int64_t e = 0; e < dk; ++e) dot += q.at({b, h, t, e}) * k.at({b, h, s, e});
          logits[u] = dot / std::sqrt(static_cast<double>(dk));
          allowed[u] = (mask == nullptr || mask->at({b, t, s}) != 0.0) && (!causal || s <= t);
          if (allowed[u]) largest = std::max(largest, logits[u]);
        }
        double total = 0;
        for (std::int64_t s = 0; s < s_n; ++s) {
          const auto u = static_cast<std::size_t>(s);
          total += allowed[u] ? std::exp(logits[u] - largest) : 0.0;
        }
        for (std::int64_t s = 0; s < s_n; ++s) {
          const auto u = static_cast<std::size_t>(s);
          r.scores.at({b, h, t, s}) = allowed[u] ? std::exp(logits[u] - largest) / total : 0.0;
        }
        for (std::int64_t e = 0; e < dv; ++e) {
          double sum = 0;
          for (std::int64_t s = 0; s < s_n; ++s) sum += r.scores.at({b, h, t, s}) * v.at({b, h, s, e});
          combined.at({b, t, h, e}) = sum;
        }
      }
  for (std::int64_t b = 0; b < b_n; ++b)
    for (std::int64_t t = 0; t < t_n; ++t)
      for (std::int64_t o = 0; o < out_n; ++o) {
        double sum = use_bias ? w[3 * step + 1][o] : 0.0;
        for (std::int64_t h = 0; h < heads; ++h)
          for (std::int64_t e = 0; e < dv; ++e) sum += combined.at({b, t, h, e}) * wo[(h * dv + e) * out_n + o];
        r.output.at({b, t, o}) = sum;
      }
  return r;
}

std::vector<RefTensor> weights_of(const keras::Layer& layer) {
  std::vector<RefTensor> out;
  for (const auto& w : layer->weights()) out.push_back(to_ref(w->value(0)));
  return out;
}

double gelu_exact(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }
double gelu_tanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

// ---- The custom layer ------------------------------------------------------------------------

// A pre-LN transformer block, as a user writes one: x + MHA(LN(x)) with a causal mask, then
// h + Dense(Dense(LN(h), gelu)). Its layers are tracked, so their weights are the block's.
class TransformerBlock final : public keras::LayerImpl {
 public:
  TransformerBlock(std::int64_t width, std::int64_t heads, double dropout = 0.0)
      : LayerImpl("TransformerBlock", ""),
        attention_(heads, width / heads, {.dropout = dropout}),
        up_(4 * width, "gelu"),
        down_(width) {
    track(norm1_);
    track(attention_);
    track(norm2_);
    track(up_);
    track(down_);
  }

  std::vector<Output> call(CallContext& ctx, const std::vector<Output>& inputs) override {
    const Output x = inputs[0];
    const Output a = norm1_(ctx, x);
    const Output h = x + attention_(ctx, {a, a}, {.use_causal_mask = true})[0];
    return {h + down_(ctx, up_(ctx, norm2_(ctx, h)))};
  }

 private:
  keras::LayerNormalization norm1_, norm2_;
  keras::MultiHeadAttention attention_;
  keras::Dense up_, down_;
};

// Learned position embeddings added to [B, T, C]: a custom layer with a weight of its own.
class PositionEmbedding final : public keras::LayerImpl {
 public:
  PositionEmbedding() : LayerImpl("PositionEmbedding", "") {}
  void build(const std::vector<TensorSpec>& inputs) override {
    const Shape& in = inputs[0].shape;
    positions_ = add_weight({.name = "embeddings", .shape = {in[1], in[2]}, .initializer = "uniform"});
  }
  std::vector<Output> call(CallContext& ctx, const std::vector<Output>& inputs) override {
    return {inputs[0] + ctx.read(positions_)};
  }

 private:
  keras::VariablePtr positions_;
};

keras::Model gpt_like(std::int64_t vocab, std::int64_t length, std::int64_t width) {
  auto tokens = keras::Input({length}, DType::kI32, "tokens");
  auto h = keras::Embedding(vocab, width)(tokens);
  h = keras::Layer(std::make_shared<PositionEmbedding>())(h);
  h = keras::Layer(std::make_shared<TransformerBlock>(width, 2))(h);
  auto logits = keras::Dense(vocab)(keras::LayerNormalization()(h));
  return keras::Model(tokens, logits);
}

// Sequences of random ids whose target at t is the id at t - 1 (0 first): attention must look
// one position back.
std::pair<Tensor, Tensor> previous_token_task(std::int64_t n, std::int64_t length, std::int64_t vocab,
                                              std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const Tensor x = random_ids({n, length}, vocab, rng);
  std::vector<std::int32_t> y(static_cast<std::size_t>(n * length), 0);
  const auto xs = x.to_vector<std::int32_t>();
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t t = 1; t < length; ++t)
      y[static_cast<std::size_t>(i * length + t)] = xs[static_cast<std::size_t>(i * length + t - 1)];
  return {x, Tensor::from_vector<std::int32_t>(y, {n, length})};
}

}  // namespace

// ---- Initializers ----------------------------------------------------------------------------

TEST_CASE("initializers: random_uniform and random_normal with parameters, Keras's names and fans") {
  const auto values = [](const keras::Initializer& init, const Shape& shape) {
    return init(shape, DType::kF64, 7).to_vector<double>();
  };
  const auto u = values(keras::Initializer::random_uniform(-0.3, 0.1), {4000});
  CHECK(*std::min_element(u.begin(), u.end()) >= -0.3);
  CHECK(*std::max_element(u.begin(), u.end()) < 0.1);
  CHECK(*std::min_element(u.begin(), u.end()) < -0.29);
  CHECK(*std::max_element(u.begin(), u.end()) > 0.09);
  // Keras's "uniform" is RandomUniform(-0.05, 0.05), the same as "random_uniform".
  const auto named = values("uniform", {1000});
  CHECK(named == values("random_uniform", {1000}));
  CHECK(named == values(keras::Initializer::random_uniform(), {1000}));
  CHECK(*std::max_element(named.begin(), named.end()) <= 0.05);
  CHECK(*std::max_element(named.begin(), named.end()) > 0.049);

  const auto n = values(keras::Initializer::random_normal(1.0, 0.5), {20000});
  double mean = 0, var = 0;
  for (double v : n) mean += v / static_cast<double>(n.size());
  for (double v : n) var += (v - mean) * (v - mean) / static_cast<double>(n.size());
  CHECK(mean == doctest::Approx(1.0).epsilon(0.02));
  CHECK(std::sqrt(var) == doctest::Approx(0.5).epsilon(0.02));
  const auto t = values(keras::Initializer::truncated_normal(0.0, 0.1), {5000});
  CHECK(*std::max_element(t.begin(), t.end()) <= 0.2);
  CHECK(values("normal", {100}) == values("random_normal", {100}));

  // glorot_uniform on MultiHeadAttention's 3-D kernels: Keras's compute_fans multiplies both
  // fans by the leading dimensions. [C=16, H=4, D=8]: fan_in 64, fan_out 128.
  const auto g = values("glorot_uniform", {16, 4, 8});
  const double limit = std::sqrt(6.0 / (64 + 128));
  CHECK(*std::max_element(g.begin(), g.end()) <= limit);
  CHECK(*std::max_element(g.begin(), g.end()) > 0.95 * limit);

  CHECK_THROWS_WITH_AS(keras::Initializer::random_uniform(1.0, 1.0), doctest::Contains("minval"), InvalidArgument);
  CHECK_THROWS_WITH_AS(keras::Initializer::random_normal(0.0, 0.0), doctest::Contains("stddev"), InvalidArgument);
  CHECK_THROWS_WITH_AS(keras::Initializer("unifrom"), doctest::Contains("uniform, truncated_normal"),
                       InvalidArgument);
}

// ---- Activations -----------------------------------------------------------------------------

TEST_CASE("gelu and gelu_approximate in Activation and Dense (fused) against the formulas") {
  PolicyScope policy("float64");
  std::mt19937_64 rng(1);
  const Tensor x = random_doubles({3, 5}, rng, -3.0, 3.0);
  for (const bool approximate : {false, true}) {
    const std::string name = approximate ? "gelu_approximate" : "gelu";
    INFO(name);
    const auto f = approximate ? gelu_tanh : gelu_exact;
    keras::Activation activation(name);
    Harness h([&](CallContext& ctx, const std::vector<Output>& in) { return activation(ctx, in); },
              {{DType::kF64, x.shape()}});
    RefTensor want = to_ref(x);
    for (auto& v : want.values) v = f(v);
    check_close(to_ref(h.run({x})[0]), want, 1e-9);

    keras::Dense dense(4, name.c_str());
    Harness hd([&](CallContext& ctx, const std::vector<Output>& in) { return dense(ctx, in); },
               {{DType::kF64, x.shape()}});
    randomize_weights(dense, rng);
    // The activation rides in the dense op's epilogue: no separate Gelu node.
    CHECK(!contains(hd.graph->to_string(), "Gelu("));
    const RefTensor kernel = to_ref(dense->weights()[0]->value(0)), bias = to_ref(dense->weights()[1]->value(0));
    const RefTensor xr = to_ref(x);
    RefTensor want_dense(Shape{3, 4});
    for (std::int64_t i = 0; i < 3; ++i)
      for (std::int64_t j = 0; j < 4; ++j) {
        double z = bias[j];
        for (std::int64_t c = 0; c < 5; ++c) z += xr.at({i, c}) * kernel.at({c, j});
        want_dense.at({i, j}) = f(z);
      }
    check_close(to_ref(hd.run({x})[0]), want_dense, 1e-9);
    check_gradients(hd, dense, {x}, rng);
  }
  CHECK_THROWS_WITH_AS(keras::Activation("gelu_tanh"), doctest::Contains("gelu, gelu_approximate"), InvalidArgument);
}

// ---- Embedding -------------------------------------------------------------------------------

TEST_CASE("Embedding: Keras's weight, default initializer and shapes; ids of any shape") {
  keras::Embedding embedding(10, 4);
  auto ids = keras::Input({3, 2}, DType::kI32);
  auto out = embedding(ids);
  CHECK(out.shape() == Shape{kNone, 3, 2, 4});
  CHECK(out.dtype() == DType::kF32);
  const auto w = embedding->weights();
  REQUIRE(w.size() == 1);
  CHECK(w[0]->name() == embedding.name() + "/embeddings");
  CHECK(w[0]->shape() == Shape{10, 4});
  const auto values = w[0]->read_value().to_vector<float>();
  CHECK(*std::max_element(values.begin(), values.end()) <= 0.05f);
  CHECK(*std::min_element(values.begin(), values.end()) >= -0.05f);
  CHECK(*std::max_element(values.begin(), values.end()) > 0.02f);
  CHECK(embedding.name().rfind("embedding", 0) == 0);

  CHECK(contains(testing::error_message([] { keras::Embedding(0, 4, {.name = "emb"}); }), "Embedding \"emb\""));
  CHECK(contains(testing::error_message([] { keras::Embedding(4, -1); }), "output_dim (-1)"));
  CHECK_THROWS_AS(keras::Embedding(4, 2, {.embeddings_initializer = "unknown"}), InvalidArgument);
}

TEST_CASE("Embedding lookup, its gradient (a scatter-add, no one-hot product), float ids, bad ids") {
  PolicyScope policy("float64");
  std::mt19937_64 rng(2);
  keras::Embedding embedding(7, 3);
  // Repeated ids: their rows' gradients add up.
  const Tensor ids = Tensor::from_vector<std::int32_t>({1, 4, 1, 6, 0, 1}, {2, 3});
  Harness h([&](CallContext& ctx, const std::vector<Output>& in) { return embedding(ctx, in); },
            {{DType::kI32, ids.shape()}});
  randomize_weights(embedding, rng);
  const RefTensor table = to_ref(embedding->weights()[0]->value(0));
  const RefTensor got = to_ref(h.run({ids})[0]);
  REQUIRE(got.shape == Shape{2, 3, 3});
  const auto id = ids.to_vector<std::int32_t>();
  for (std::int64_t i = 0; i < 6; ++i)
    for (std::int64_t j = 0; j < 3; ++j) CHECK(got[i * 3 + j] == table.at({id[static_cast<std::size_t>(i)], j}));
  check_gradients(h, embedding, {ids}, rng);
  const std::string g = h.graph->to_string();
  CHECK(!contains(g, "OneHot"));
  CHECK(!contains(g, "MatMul"));

  // Keras casts float ids to int32.
  Harness hf([&](CallContext& ctx, const std::vector<Output>& in) { return embedding(ctx, in); },
             {{DType::kF64, Shape{2}}});
  const RefTensor rows = to_ref(hf.run({Tensor::from_vector<double>({4.0, 6.0}, {2})})[0]);
  CHECK(rows.at({1, 2}) == table.at({6, 2}));

  // An id outside [0, input_dim) is reported when the step runs, naming the id.
  const auto m = testing::error_message([&] { h.run({Tensor::from_vector<std::int32_t>({1, 7, 0, 0, 0, 0}, {2, 3})}); });
  CHECK(contains(m, "7"));
}

TEST_CASE("Embedding under mixed_bfloat16: a float32 table, rows in bfloat16") {
  PolicyScope policy("mixed_bfloat16");
  keras::Embedding embedding(5, 4);
  auto out = embedding(keras::Input({3}, DType::kI32));
  CHECK(out.dtype() == DType::kBF16);
  CHECK(embedding->weights()[0]->dtype() == DType::kF32);
}

// ---- LayerNormalization ----------------------------------------------------------------------

TEST_CASE("LayerNormalization: gamma and beta, output against the reference, gradients (axis -1)") {
  PolicyScope policy("float64");
  std::mt19937_64 rng(3);
  keras::LayerNormalization norm;
  auto out = norm(keras::Input({4, 6}, DType::kF64));
  CHECK(out.shape() == Shape{kNone, 4, 6});
  const auto w = norm->weights();
  REQUIRE(w.size() == 2);
  CHECK(w[0]->name() == norm.name() + "/gamma");
  CHECK(w[1]->name() == norm.name() + "/beta");
  CHECK(w[0]->shape() == Shape{6});
  CHECK(w[0]->read_value().to_vector<double>() == std::vector<double>(6, 1.0));
  CHECK(w[1]->read_value().to_vector<double>() == std::vector<double>(6, 0.0));

  const Tensor x = random_doubles({2, 4, 6}, rng, -2.0, 2.0);
  Harness h([&](CallContext& ctx, const std::vector<Output>& in) { return norm(ctx, in); },
            {{DType::kF64, x.shape()}});
  randomize_weights(norm, rng);
  const auto gamma = to_ref(w[0]->value(0)).values, beta = to_ref(w[1]->value(0)).values;
  check_close(to_ref(h.run({x})[0]), ref_layer_norm(to_ref(x), 6, gamma, beta, 1e-3), kTolerance);
  check_gradients(h, norm, {x}, rng);
}

TEST_CASE("LayerNormalization over several trailing axes, and without center and scale") {
  PolicyScope policy("float64");
  std::mt19937_64 rng(4);
  keras::LayerNormalization norm({.axis = {-2, -1}, .epsilon = 1e-5});
  const Tensor x = random_doubles({3, 2, 3, 4}, rng, -2.0, 2.0);
  Harness h([&](CallContext& ctx, const std::vector<Output>& in) { return norm(ctx, in); },
            {{DType::kF64, x.shape()}});
  const auto w = norm->weights();
  REQUIRE(w.size() == 2);
  CHECK(w[0]->shape() == Shape{3, 4});  // Keras: the normalised dimensions
  randomize_weights(norm, rng);
  const auto gamma = to_ref(w[0]->value(0)).values, beta = to_ref(w[1]->value(0)).values;
  check_close(to_ref(h.run({x})[0]), ref_layer_norm(to_ref(x), 12, gamma, beta, 1e-5), kTolerance);
  check_gradients(h, norm, {x}, rng);

  keras::LayerNormalization plain({.center = false, .scale = false});
  Harness hp([&](CallContext& ctx, const std::vector<Output>& in) { return plain(ctx, in); },
             {{DType::kF64, x.shape()}});
  CHECK(plain->weights().empty());
  check_close(to_ref(hp.run({x})[0]), ref_layer_norm(to_ref(x), 4, {}, {}, 1e-3), kTolerance);
  check_gradients(hp, plain, {x}, rng);
}

TEST_CASE("LayerNormalization: axes it does not implement, bad axes and epsilon are errors naming the layer") {
  auto x = keras::Input({4, 6});
  const auto m = testing::error_message<Unimplemented>(
      [&] { keras::LayerNormalization({.axis = 1, .name = "ln_mid"})(x); });
  CHECK(contains(m, "LayerNormalization \"ln_mid\""));
  CHECK(contains(m, "(None, 4, 6)"));
  CHECK_THROWS_AS(keras::LayerNormalization({.axis = {0, 1, 2}})(x), Unimplemented);
  CHECK(contains(testing::error_message([&] { keras::LayerNormalization({.axis = 3, .name = "ln_far"})(x); }),
                 "LayerNormalization \"ln_far\": axis 3 is out of range"));
  CHECK(contains(testing::error_message([] { keras::LayerNormalization({.epsilon = 0, .name = "ln0"}); }),
                 "LayerNormalization \"ln0\": epsilon"));
  // Built for 6 features, called on 5.
  keras::LayerNormalization built({.name = "ln6"});
  built(x);
  CHECK(contains(testing::error_message([&] { built(keras::Input({4, 5})); }), "LayerNormalization \"ln6\""));
}

TEST_CASE("LayerNormalization under mixed_bfloat16 normalises in float32 and returns bfloat16") {
  PolicyScope policy("mixed_bfloat16");
  keras::LayerNormalization norm;
  auto out = norm(keras::Input({3, 8}, DType::kBF16));
  CHECK(out.dtype() == DType::kBF16);
  for (const auto& w : norm->weights()) CHECK(w->dtype() == DType::kF32);
  Harness h([&](CallContext& ctx, const std::vector<Output>& in) { return norm(ctx, in); },
            {{DType::kBF16, Shape{2, 3, 8}}});
  CHECK(contains(h.graph->to_string(), "LayerNorm("));
  CHECK(h.outputs[0].dtype() == DType::kBF16);
}

// ---- MultiHeadAttention ----------------------------------------------------------------------

TEST_CASE("MultiHeadAttention: Keras's weight names and shapes, output shapes, glorot fans") {
  keras::MultiHeadAttention mha(4, 8, {.name = "mha"});
  auto x = keras::Input({5, 16});
  auto y = mha({x, x}, {.use_causal_mask = true});
  CHECK(keras::KerasTensor(y).shape() == Shape{kNone, 5, 16});
  const auto w = mha->weights();
  const std::vector<std::pair<std::string, Shape>> expected = {
      {"mha/query/kernel", {16, 4, 8}},  {"mha/query/bias", {4, 8}},
      {"mha/key/kernel", {16, 4, 8}},    {"mha/key/bias", {4, 8}},
      {"mha/value/kernel", {16, 4, 8}},  {"mha/value/bias", {4, 8}},
      {"mha/attention_output/kernel", {4, 8, 16}}, {"mha/attention_output/bias", {16}},
  };
  REQUIRE(w.size() == expected.size());
  for (std::size_t i = 0; i < w.size(); ++i) {
    CHECK(w[i]->name() == expected[i].first);
    CHECK(w[i]->shape() == expected[i].second);
  }
  // glorot_uniform with Keras's fans: query kernel [16, 4, 8] fan_in 64, fan_out 128; the output
  // kernel [4, 8, 16] fan_in 32, fan_out 64.
  const auto largest = [](const keras::VariablePtr& v) {
    double m = 0;
    for (float e : v->read_value().to_vector<float>()) m = std::max(m, std::abs(static_cast<double>(e)));
    return m;
  };
  CHECK(largest(w[0]) <= std::sqrt(6.0 / 192));
  CHECK(largest(w[0]) > 0.9 * std::sqrt(6.0 / 192));
  CHECK(largest(w[6]) <= std::sqrt(6.0 / 96));
  CHECK(largest(w[6]) > 0.9 * std::sqrt(6.0 / 96));
  CHECK(largest(w[1]) == 0.0);

  // Cross-attention with value_dim, output_shape, no biases; the scores as a second output.
  keras::MultiHeadAttention cross(2, 3, {.value_dim = 5, .use_bias = false, .output_shape = {2, 7}});
  auto q = keras::Input({6, 4});
  auto v = keras::Input({9, 3});
  auto k = keras::Input({9, 2});
  auto outs = cross({q, v, k}, {.return_attention_scores = true});
  REQUIRE(outs.size() == 2);
  CHECK(outs[0].shape() == Shape{kNone, 6, 2, 7});
  CHECK(outs[1].shape() == Shape{kNone, 2, 6, 9});
  const auto cw = cross->weights();
  REQUIRE(cw.size() == 4);
  CHECK(cw[1]->shape() == Shape{2, 2, 3});  // key kernel: key's features
  CHECK(cw[2]->shape() == Shape{3, 2, 5});  // value kernel: value_dim
  CHECK(cw[3]->shape() == Shape{2, 5, 2, 7});
}

TEST_CASE("MultiHeadAttention with a causal mask equals the float64 reference; no NaN") {
  PolicyScope policy("float64");
  std::mt19937_64 rng(5);
  keras::MultiHeadAttention mha(2, 3, {.value_dim = 4});
  const Tensor x = random_doubles({2, 5, 6}, rng);
  Harness h(
      [&](CallContext& ctx, const std::vector<Output>& in) {
        return mha(ctx, {in[0], in[0]}, {.use_causal_mask = true, .return_attention_scores = true});
      },
      {{DType::kF64, x.shape()}});
  randomize_weights(mha, rng);
  const auto got = h.run({x});
  const RefTensor xr = to_ref(x);
  const auto want = ref_attention(xr, xr, xr, weights_of(mha), true, nullptr, true);
  check_close(to_ref(got[0]), want.output, kTolerance);
  check_close(to_ref(got[1]), want.scores, kTolerance);
  check_gradients(h, mha, {x}, rng);
}

TEST_CASE("MultiHeadAttention: attention_mask with fully masked rows, combined with causal; key, no biases") {
  PolicyScope policy("float64");
  std::mt19937_64 rng(6);
  constexpr std::int64_t B = 2, T = 4, S = 5;
  // Query rows 1 (batch 0) and 3 (batch 1) attend to nothing; with the causal mask, row 0 of
  // batch 1 has only key 1 masked in and s <= 0 out: nothing either.
  std::vector<std::int32_t> mask(B * T * S, 1);
  const auto at = [&](std::int64_t b, std::int64_t t, std::int64_t s) -> std::int32_t& {
    return mask[static_cast<std::size_t>((b * T + t) * S + s)];
  };
  for (std::int64_t s = 0; s < S; ++s) at(0, 1, s) = at(1, 3, s) = 0;
  at(1, 0, 0) = 0;
  at(0, 2, 1) = 0;
  const Tensor mask_t = Tensor::from_vector<std::int32_t>(mask, {B, T, S});
  const RefTensor mask_ref = to_ref(mask_t);
  for (const bool causal : {false, true}) {
    for (const bool use_bias : {true, false}) {
      INFO("causal ", causal, ", use_bias ", use_bias);
      keras::MultiHeadAttention mha(3, 2, {.use_bias = use_bias, .output_shape = {3}});
      const Tensor q = random_doubles({B, T, 4}, rng), v = random_doubles({B, S, 3}, rng),
                   k = random_doubles({B, S, 2}, rng);
      Harness h(
          [&](CallContext& ctx, const std::vector<Output>& in) {
            return mha(ctx, {in[0], in[1], in[2]},
                       {.attention_mask = in[3], .use_causal_mask = causal, .return_attention_scores = true});
          },
          {{DType::kF64, q.shape()}, {DType::kF64, v.shape()}, {DType::kF64, k.shape()}, {DType::kI32, mask_t.shape()}});
      randomize_weights(mha, rng);
      const auto got = h.run({q, v, k, mask_t});
      const auto want = ref_attention(to_ref(q), to_ref(v), to_ref(k), weights_of(mha), use_bias, &mask_ref, causal);
      check_close(to_ref(got[0]), want.output, kTolerance);
      const RefTensor scores = to_ref(got[1]);
      check_close(scores, want.scores, kTolerance);
      // A fully masked query row: zero probabilities, the output bias alone.
      for (std::int64_t s = 0; s < S; ++s) CHECK(scores.at({0, 1, 1, s}) == 0.0);
      check_gradients(h, mha, {q, v, k, mask_t}, rng);
    }
  }
}

TEST_CASE("MultiHeadAttention: the [T, S] and float masks Keras takes; float32 agrees with the reference") {
  std::mt19937_64 rng(7);
  keras::MultiHeadAttention mha(2, 4);
  constexpr std::int64_t T = 3;
  const Tensor x = random_doubles({2, T, 8}, rng);
  const Tensor x32 = Tensor::from_vector<float>(
      [&] {
        std::vector<float> v;
        for (double e : x.to_vector<double>()) v.push_back(static_cast<float>(e));
        return v;
      }(),
      x.shape());
  // A float [T, S] mask shared by the batch: the lower triangle, i.e. the causal mask.
  const Tensor tri = Tensor::from_vector<float>({1, 0, 0, 1, 1, 0, 1, 1, 1}, {T, T});
  Harness masked(
      [&](CallContext& ctx, const std::vector<Output>& in) {
        return mha(ctx, {in[0], in[0]}, {.attention_mask = ctx.graph().constant(tri, "tri")});
      },
      {{DType::kF32, x.shape()}});
  Harness causal([&](CallContext& ctx, const std::vector<Output>& in) {
    return mha(ctx, {in[0], in[0]}, {.use_causal_mask = true});
  },
                 {{DType::kF32, x.shape()}});
  const RefTensor a = to_ref(masked.run({x32})[0]), b = to_ref(causal.run({x32})[0]);
  check_close(a, b, 1e-6);
  const RefTensor xr = to_ref(x32);
  check_close(a, ref_attention(xr, xr, xr, weights_of(mha), true, nullptr, true).output, 2e-5);
}

TEST_CASE("MultiHeadAttention dropout: on the probabilities in training only; the scores returned are before it") {
  PolicyScope policy("float64");
  std::mt19937_64 rng(8);
  keras::MultiHeadAttention mha(2, 4, {.dropout = 0.5});
  const Tensor x = random_doubles({2, 6, 8}, rng);
  const auto call = [&](CallContext& ctx, const std::vector<Output>& in) {
    return mha(ctx, {in[0], in[0]}, {.return_attention_scores = true});
  };
  Harness training(call, {{DType::kF64, x.shape()}}, /*training=*/true);
  Harness inference(call, {{DType::kF64, x.shape()}}, /*training=*/false);
  CHECK(contains(training.graph->to_string(), "Dropout"));
  CHECK(!contains(inference.graph->to_string(), "Dropout"));
  const auto t = training.run({x}), i = inference.run({x});
  CHECK(t[1].to_vector<double>() == i[1].to_vector<double>());
  CHECK(t[0].to_vector<double>() != i[0].to_vector<double>());
  const RefTensor xr = to_ref(x);
  check_close(to_ref(i[0]), ref_attention(xr, xr, xr, weights_of(mha), true, nullptr, false).output, kTolerance);
}

TEST_CASE("MultiHeadAttention: bad arguments and shapes are errors naming the layer") {
  const auto message = [](auto fn) { return testing::error_message(fn); };
  CHECK(contains(message([] { keras::MultiHeadAttention(0, 4, {.name = "a0"}); }), "MultiHeadAttention \"a0\""));
  CHECK(contains(message([] { keras::MultiHeadAttention(2, 4, {.dropout = 1.0, .name = "a1"}); }), "dropout"));
  CHECK(contains(message([] { keras::MultiHeadAttention(2, 4, {.output_shape = {0}}); }), "output_shape"));
  auto x = keras::Input({5, 8});
  keras::MultiHeadAttention mha(2, 4, {.name = "att"});
  CHECK(contains(message([&] { mha({x}); }), "MultiHeadAttention \"att\": called on 1 tensor(s)"));
  CHECK(contains(message([&] { mha({x, keras::Input({6, 8}), keras::Input({7, 8})}); }),
                 "MultiHeadAttention \"att\": value (None, 6, 8) and key (None, 7, 8)"));
  auto flat = keras::Input({8});
  CHECK(contains(testing::error_message<Unimplemented>([&] { keras::MultiHeadAttention(2, 4, {.name = "a2"})({flat, flat}); }),
                 "MultiHeadAttention \"a2\": query has shape (None, 8)"));
  mha({x, x});
  CHECK(contains(message([&] { mha({x, x}, {.attention_mask = keras::Input({5, 4}, DType::kI32)}); }),
                 "MultiHeadAttention \"att\": attention_mask has shape (None, 5, 4)"));
  auto wide = keras::Input({5, 9});
  CHECK(contains(message([&] { mha({wide, wide}); }), "MultiHeadAttention \"att\": query has 9 features"));
}

// ---- Sparse cross-entropy on sequences ---------------------------------------------------------

TEST_CASE("SparseCategoricalCrossentropy and accuracy on logits [B, T, V] with ids [B, T]") {
  std::mt19937_64 rng(9);
  constexpr std::int64_t B = 2, T = 3, V = 4;
  const Tensor logits = random_doubles({B, T, V}, rng, -2, 2);
  const Tensor ids = random_ids({B, T}, V, rng);
  const auto g = std::make_shared<Graph>();
  const Output y_pred = g->placeholder(DType::kF64, Shape{kNone, T, V}, "y_pred");
  const Output y_true = g->placeholder(DType::kI32, Shape{kNone, T}, "y_true");
  const Output from_logits = keras::per_example_loss(keras::SparseCategoricalCrossentropy{.from_logits = true}, y_true, y_pred);
  const Output probs = ops::softmax(y_pred);
  const Output from_probs = keras::per_example_loss(keras::SparseCategoricalCrossentropy{}, y_true, probs);
  const Output column = keras::per_example_loss(keras::SparseCategoricalCrossentropy{.from_logits = true},
                                                ops::reshape(y_true, {-1, T, 1}), y_pred);
  const Output accuracy = keras::metric_sum(keras::Accuracy{}, y_true, y_pred);
  graph::Executor ex(g, devices::default_cpu_device());
  const auto out = ex.run({{y_pred, logits}, {y_true, ids}}, {from_logits, from_probs, column, accuracy});
  const RefTensor l = to_ref(logits);
  const auto id = ids.to_vector<std::int32_t>();
  double correct = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    double mean = 0;
    for (std::int64_t t = 0; t < T; ++t) {
      double m = -INFINITY, s = 0;
      std::int64_t best = 0;
      for (std::int64_t v = 0; v < V; ++v) {
        m = std::max(m, l.at({b, t, v}));
        if (l.at({b, t, v}) > l.at({b, t, best})) best = v;
      }
      for (std::int64_t v = 0; v < V; ++v) s += std::exp(l.at({b, t, v}) - m);
      const auto label = id[static_cast<std::size_t>(b * T + t)];
      mean += -(l.at({b, t, label}) - m - std::log(s)) / T;
      correct += best == label ? 1.0 / T : 0.0;
    }
    CHECK(out[0].to_vector<double>()[static_cast<std::size_t>(b)] == doctest::Approx(mean).epsilon(1e-12));
    CHECK(out[1].to_vector<double>()[static_cast<std::size_t>(b)] == doctest::Approx(mean).epsilon(1e-6));
    CHECK(out[2].to_vector<double>()[static_cast<std::size_t>(b)] == doctest::Approx(mean).epsilon(1e-12));
  }
  CHECK(out[3].item<float>() == doctest::Approx(correct).epsilon(1e-6));

  // Ids of another shape are refused, saying which shapes would do.
  const Output wrong = g->placeholder(DType::kI32, Shape{kNone, T + 1}, "wrong");
  CHECK(contains(testing::error_message([&] {
                   keras::per_example_loss(keras::SparseCategoricalCrossentropy{.from_logits = true}, wrong, y_pred);
                 }),
                 "(None, 3) or (None, 3, 1)"));
  CHECK(keras::target_shape_requirement(keras::SparseCategoricalCrossentropy{}, Shape{kNone, T}, Shape{kNone, T, V}) ==
        std::nullopt);
  CHECK(keras::target_shape_requirement(keras::SparseCategoricalCrossentropy{}, Shape{kNone}, Shape{kNone, T, V})
            .value_or("")
            .find("(None, 3) or (None, 3, 1)") != std::string::npos);
}

// ---- A custom transformer block in a model -----------------------------------------------------

TEST_CASE("a custom pre-LN transformer block: its layers' weights are its own; gradients against differences") {
  PolicyScope policy("float64");
  std::mt19937_64 rng(10);
  auto impl = std::make_shared<TransformerBlock>(8, 2);
  keras::Layer block(impl);
  const Tensor x = random_doubles({2, 4, 8}, rng);
  Harness h([&](CallContext& ctx, const std::vector<Output>& in) { return block(ctx, in); },
            {{DType::kF64, x.shape()}});
  const auto w = block->weights();
  // LN (2) + MHA (8) + LN (2) + Dense (2) + Dense (2), named under the block.
  REQUIRE(w.size() == 16);
  for (const auto& v : w) CHECK(v->name().rfind(block.name() + "/", 0) == 0);
  CHECK(contains(w[2]->name(), "/multi_head_attention"));
  CHECK(contains(w[2]->name(), "/query/kernel"));
  CHECK(block->count_params() == 2 * 8 + (3 * (8 * 8 + 8) + 8 * 8 + 8) + 2 * 8 + (8 * 32 + 32) + (32 * 8 + 8));
  block->set_trainable(false);
  CHECK(block->trainable_weights().empty());
  CHECK(block->non_trainable_weights().size() == 16);
  block->set_trainable(true);
  randomize_weights(block, rng, 0.3);
  check_gradients(h, block, {x}, rng);

  // The block's attention is causal: changing the last position changes no earlier output.
  Tensor changed = x.clone();
  for (std::int64_t c = 0; c < 8; ++c) changed.data<double>()[(0 * 4 + 3) * 8 + c] += 1.0;
  const auto before = h.run({x})[0].to_vector<double>(), after = h.run({changed})[0].to_vector<double>();
  for (std::size_t i = 0; i < 3 * 8; ++i) CHECK(before[i] == after[i]);
  CHECK(before[3 * 8] != after[3 * 8]);
}

TEST_CASE("a functional GPT-like model with the custom block fits int32 tokens [B, T] to int32 targets [B, T]") {
  set_global_seed(11);
  constexpr std::int64_t kVocab = 6, kLength = 8;
  auto [x, y] = previous_token_task(512, kLength, kVocab, 12);
  auto model = gpt_like(kVocab, kLength, 16);
  // Embedding (1) + positions (1) + block (16) + LayerNormalization (2) + Dense (2).
  CHECK(model.weights().size() == 22);
  model.compile(keras::Adam{.learning_rate = 0.01}, keras::SparseCategoricalCrossentropy{.from_logits = true},
                {"accuracy"});
  const auto history = model.fit(x, y, {.batch_size = 32, .epochs = 6, .verbose = 0});
  const auto& loss = history.at("loss");
  INFO("losses: ", fmt::format("{}", fmt::join(loss, ", ")));
  CHECK(loss.back() < 0.5 * loss.front());
  CHECK(history.at("accuracy").back() > 0.8);
  const Tensor logits = model.predict(x, {.batch_size = 128});
  CHECK(logits.shape() == Shape{512, kLength, kVocab});

  // Saved and loaded into the same model built again (its layers numbered otherwise).
  testing::TempDir dir;
  const std::string path = dir.file("gpt.weights.safetensors");
  model.save_weights(path);
  auto again = gpt_like(kVocab, kLength, 16);
  again.load_weights(path);
  CHECK(again.predict(x, {.batch_size = 128}).to_vector<float>() == logits.to_vector<float>());
}

TEST_CASE("the custom block under mixed_bfloat16 trains with float32 weights") {
  set_global_seed(13);
  PolicyScope policy("mixed_bfloat16");
  auto [x, y] = previous_token_task(64, 8, 6, 14);
  auto model = gpt_like(6, 8, 16);
  for (const auto& w : model.weights()) CHECK(w->dtype() == DType::kF32);
  model.compile(keras::Adam{.learning_rate = 0.01}, keras::SparseCategoricalCrossentropy{.from_logits = true});
  const auto history = model.fit(x, y, {.batch_size = 32, .epochs = 2, .verbose = 0});
  for (double l : history.at("loss")) CHECK(std::isfinite(l));
}
