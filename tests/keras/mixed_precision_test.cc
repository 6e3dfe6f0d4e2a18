// Mixed precision: dtype policies with Keras semantics (layers compute in 16 bits, variables stay
// float32, losses, metrics, softmax and predict in float32), automatic loss scaling under
// mixed_float16, BatchNormalization in float32, mixed-precision checkpoints loading into a
// float32 model, and gradient all-reduce in 16 bits under MirroredStrategy on 2 logical CPU
// devices (CTest sets TANDEM_NUM_CPU_DEVICES=2). The Fashion-MNIST accuracy criterion runs as the
// sample_fashion_mnist_mlp_mixed_bfloat16 test (samples/CMakeLists.txt).
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <random>

#include <unistd.h>

#include "tandem/base/random.h"
#include "tandem/keras_like/keras.h"

using namespace tandem;
using namespace tandem::keras;
using graph::DType;

namespace {

// A noisy non-linear target in 8 features: regression a small MLP fits in a few epochs.
struct Data {
  Tensor x, y;
};
Data regression_data(std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> xs(static_cast<std::size_t>(n * 8)), ys(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    float target = 0;
    for (int f = 0; f < 8; ++f) {
      const float v = normal(rng);
      xs[static_cast<std::size_t>(i * 8 + f)] = v;
      target += (f % 2 == 0 ? 0.5f : -0.25f) * v + 0.1f * v * v;
    }
    ys[static_cast<std::size_t>(i)] = target + 0.05f * normal(rng);
  }
  return {Tensor::from_vector(xs, {n, 8}), Tensor::from_vector(ys, {n, 1})};
}

// With a name, the layers are named after it, so that saved weights match between models.
Model regression_model(std::uint64_t seed, const std::string& name = "") {
  set_global_seed(seed);
  const auto layer = [&](const char* suffix) { return name.empty() ? std::string() : name + suffix; };
  return Sequential({Input({8}), Dense(32, "relu", {.name = layer("_a")}), Dense(32, "tanh", {.name = layer("_b")}),
                     Dense(1, {.name = layer("_c")})},
                    name);
}

double max_relative_difference(const Tensor& a, const Tensor& b) {
  const auto va = a.to_vector<float>();
  const auto vb = b.to_vector<float>();
  REQUIRE(va.size() == vb.size());
  double worst = 0;
  for (std::size_t i = 0; i < va.size(); ++i) {
    worst =
        std::max(worst, std::abs(static_cast<double>(va[i]) - vb[i]) / (1.0 + std::abs(static_cast<double>(vb[i]))));
  }
  return worst;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / fmt::format("tandem_mixed_{}_{}", ::getpid(), name)).string();
}

}  // namespace

TEST_CASE("dtype policies: Keras's names, the global policy, and a clear error for an unknown name") {
  CHECK(mixed_precision::global_policy().name() == "float32");
  const mixed_precision::Policy bf16("mixed_bfloat16");
  CHECK(bf16.compute_dtype() == DType::kBF16);
  CHECK(bf16.variable_dtype() == DType::kF32);
  CHECK(bf16.is_mixed());
  const mixed_precision::Policy f16("mixed_float16");
  CHECK(f16.compute_dtype() == DType::kF16);
  CHECK(f16.variable_dtype() == DType::kF32);
  const mixed_precision::Policy plain("float16");
  CHECK(plain.compute_dtype() == DType::kF16);
  CHECK(plain.variable_dtype() == DType::kF16);
  CHECK_FALSE(plain.is_mixed());
  try {
    mixed_precision::set_global_policy("mixed_bf16");
    FAIL("an unknown policy was accepted");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()).find("unknown dtype policy \"mixed_bf16\"; expected one of float32, mixed_float16, "
                                     "mixed_bfloat16") != std::string::npos);
  }
  CHECK(mixed_precision::global_policy().name() == "float32");  // unchanged by the failed call
  {
    mixed_precision::PolicyScope scope("mixed_bfloat16");
    CHECK(mixed_precision::global_policy() == bf16);
  }
  CHECK(mixed_precision::global_policy().name() == "float32");
}

TEST_CASE(
    "under mixed_bfloat16 layers compute in bfloat16, keep float32 weights, and softmax and outputs are float32") {
  mixed_precision::PolicyScope scope("mixed_bfloat16");
  auto x = Input({8});
  Dense hidden(16, "relu");
  const KerasTensor h = hidden(x);
  CHECK(h.dtype() == DType::kBF16);
  for (const auto& w : hidden->weights()) CHECK(w->dtype() == DType::kF32);
  CHECK(hidden->dtype_policy().name() == "mixed_bfloat16");
  // Softmax computes and returns float32 (Keras's advice for output layers, done for the user).
  const KerasTensor probabilities = Dense(3, "softmax")(h);
  CHECK(probabilities.dtype() == DType::kF32);
  // A layer given the float32 policy takes the 16-bit input up to float32.
  Dense head(3);
  head.set_dtype_policy("float32");
  const KerasTensor logits = head(h);
  CHECK(logits.dtype() == DType::kF32);
  // Layers made after the scope take the float32 policy again.
  {
    mixed_precision::PolicyScope back("float32");
    CHECK(Dense(4)(x).dtype() == DType::kF32);
  }

  // predict() hands out float32 even when the last layer computes in bfloat16.
  Model model(x, Dense(2)(h));
  CHECK(model.outputs()[0].dtype() == DType::kBF16);
  const Tensor out = model.predict(regression_data(16, 1).x);
  CHECK(out.dtype() == DType::kF32);
  CHECK(out.shape() == Shape{16, 2});
}

TEST_CASE("mixed_bfloat16 training follows float32 training; the predictions differ by bfloat16 rounding only") {
  const auto data = regression_data(512, 3);
  const auto train = [&](const char* policy) {
    mixed_precision::PolicyScope scope(policy);
    auto model = regression_model(11);
    model.compile(Adam{.learning_rate = 0.01}, "mse");
    auto history = model.fit(data.x, data.y, {.batch_size = 32, .epochs = 6, .verbose = 0});
    return std::pair{history, model};
  };
  auto [f32_history, f32_model] = train("float32");
  auto [bf16_history, bf16_model] = train("mixed_bfloat16");
  const auto& f32_loss = f32_history.at("loss");
  const auto& bf16_loss = bf16_history.at("loss");
  INFO("float32 losses ", f32_loss.front(), " .. ", f32_loss.back(), "; mixed_bfloat16 ", bf16_loss.front(), " .. ",
       bf16_loss.back());
  CHECK(bf16_loss.back() < 0.5 * bf16_loss.front());
  CHECK(std::abs(bf16_loss.back() - f32_loss.back()) <= 0.15 * f32_loss.back() + 0.01);
  for (const auto& w : bf16_model.get_weights()) CHECK(w.dtype() == DType::kF32);

  // The same float32 weights in a float32 model and in a mixed model: the outputs differ (the
  // mixed one really computes in bfloat16) by about bfloat16's precision (2^-8), no more.
  mixed_precision::PolicyScope scope("float32");
  auto reference = regression_model(11);
  reference.set_weights(bf16_model.get_weights());
  const Tensor exact = reference.predict(data.x);
  const Tensor mixed = bf16_model.predict(data.x);
  const double difference = max_relative_difference(mixed, exact);
  CHECK(difference > 0.0);
  CHECK(difference < 0.05);
}

TEST_CASE("compile wraps the optimizer in a LossScaleOptimizer under mixed_float16 only") {
  const auto optimizer_name = [](const char* policy, OptimizerRef optimizer) {
    mixed_precision::PolicyScope scope(policy);
    auto model = regression_model(5);
    model.compile(optimizer, "mse");
    return std::pair{model.optimizer().name(), model.optimizer().loss_scale_optimizer().has_value()};
  };
  CHECK(optimizer_name("mixed_float16", "adam") == std::pair{std::string("loss_scale_optimizer(adam)"), true});
  CHECK(optimizer_name("mixed_bfloat16", "adam") == std::pair{std::string("adam"), false});
  CHECK(optimizer_name("float32", "sgd") == std::pair{std::string("sgd"), false});
  // Already a LossScaleOptimizer: kept as given (its own initial scale).
  {
    mixed_precision::PolicyScope scope("mixed_float16");
    auto model = regression_model(5);
    model.compile(LossScaleOptimizer{.inner_optimizer = SGD{}, .initial_scale = 256.0}, "mse");
    CHECK(model.optimizer().name() == "loss_scale_optimizer(sgd)");
    CHECK(model.optimizer().loss_scale(0) == 256.0);
  }
}

TEST_CASE("mixed_float16 trains with dynamic loss scaling and float32 gradients") {
  mixed_precision::PolicyScope scope("mixed_float16");
  const auto data = regression_data(256, 4);
  auto model = regression_model(8);
  model.compile(Adam{.learning_rate = 0.01}, "mse");
  auto history = model.fit(data.x, data.y, {.batch_size = 32, .epochs = 4, .verbose = 0});
  const auto& loss = history.at("loss");
  CHECK(std::isfinite(loss.back()));
  CHECK(loss.back() < 0.5 * loss.front());
  CHECK(model.optimizer().iterations() > 0);
  CHECK(model.optimizer().loss_scale(0) >= 1.0);
  for (const auto& w : model.get_weights()) CHECK(w.dtype() == DType::kF32);
}

TEST_CASE("BatchNormalization under mixed_bfloat16 computes in float32 and keeps float32 statistics") {
  mixed_precision::PolicyScope scope("mixed_bfloat16");
  set_global_seed(9);
  auto x = Input({8});
  BatchNormalization norm;
  const KerasTensor normalized = norm(Dense(16, "relu")(x));
  CHECK(normalized.dtype() == DType::kBF16);  // cast back to the compute dtype
  Model model(x, Dense(1)(normalized));
  model.compile(Adam{.learning_rate = 0.01}, "mse");
  const auto data = regression_data(256, 6);
  const auto before = norm->weights()[3]->read_value().to_vector<float>();  // moving_variance
  auto history = model.fit(data.x, data.y, {.batch_size = 32, .epochs = 3, .verbose = 0});
  CHECK(history.at("loss").back() < history.at("loss").front());
  for (const auto& w : norm->weights()) CHECK(w->dtype() == DType::kF32);
  CHECK(norm->weights()[3]->read_value().to_vector<float>() != before);
}

TEST_CASE("mixed-precision weights and training checkpoints load into a float32 model") {
  const auto data = regression_data(256, 12);
  const std::string weights_path = temp_path("weights.safetensors");
  const std::string checkpoint_path = temp_path("checkpoint.safetensors");
  std::vector<Tensor> trained;
  std::int64_t iterations = 0;
  Tensor mixed_prediction;
  {
    mixed_precision::PolicyScope scope("mixed_float16");
    auto model = regression_model(21, "saved");
    model.compile("adam", "mse");  // loss-scaled automatically
    model.fit(data.x, data.y, {.batch_size = 32, .epochs = 2, .verbose = 0});
    model.save_weights(weights_path);
    save_training_checkpoint(model, checkpoint_path, {.epoch = 2, .step = 0});
    trained = model.get_weights();
    iterations = model.optimizer().iterations();
    mixed_prediction = model.predict(data.x);
  }
  // Weights: the float32 model gets bitwise the same float32 weights, and predicts what the
  // mixed model predicted up to float16 rounding.
  auto plain = regression_model(99, "saved");
  plain.load_weights(weights_path);
  const auto loaded = plain.get_weights();
  REQUIRE(loaded.size() == trained.size());
  for (std::size_t i = 0; i < loaded.size(); ++i) CHECK(loaded[i].to_vector<float>() == trained[i].to_vector<float>());
  CHECK(max_relative_difference(plain.predict(data.x), mixed_prediction) < 0.01);

  // A training checkpoint of loss_scale_optimizer(adam) into a float32 model compiled with adam:
  // weights, slots and iterations load; the loss scale state is left behind.
  auto resumed = regression_model(77, "saved");
  resumed.compile("adam", "mse");
  const auto state = load_training_checkpoint(resumed, checkpoint_path);
  CHECK(state.epoch == 2);
  CHECK(resumed.optimizer().iterations() == iterations);
  const auto restored = resumed.get_weights();
  for (std::size_t i = 0; i < restored.size(); ++i)
    CHECK(restored[i].to_vector<float>() == trained[i].to_vector<float>());
  resumed.fit(data.x, data.y, {.batch_size = 32, .epochs = 1, .verbose = 0});  // and trains on
  std::filesystem::remove(weights_path);
  std::filesystem::remove(checkpoint_path);
}

TEST_CASE("gradient all-reduce in bfloat16 under MirroredStrategy stays close to the float32 all-reduce") {
  REQUIRE(devices::list_logical_devices(devices::DeviceType::kCPU).size() >= 2);
  const auto data = regression_data(512, 14);
  const auto train = [&](std::optional<DType> wire) {
    mixed_precision::PolicyScope scope("mixed_bfloat16");
    MirroredStrategy strategy(
        strategy::MirroredOptions{.devices = {"CPU:0", "CPU:1"}, .distribution = {.gradient_all_reduce_dtype = wire}});
    Model model;
    {
      auto s = strategy.scope();
      model = regression_model(31);
      model.compile(Adam{.learning_rate = 0.01}, "mse");
    }
    auto history = model.fit(data.x, data.y, {.batch_size = 64, .epochs = 5, .verbose = 0, .shuffle = false});
    return std::pair{history.at("loss"), model.get_weights()};
  };
  const auto [f32_loss, f32_weights] = train(std::nullopt);
  const auto [bf16_loss, bf16_weights] = train(DType::kBF16);
  INFO("float32 all-reduce loss ", f32_loss.back(), ", bfloat16 all-reduce loss ", bf16_loss.back());
  CHECK(bf16_loss.back() < 0.5 * bf16_loss.front());
  CHECK(std::abs(bf16_loss.back() - f32_loss.back()) <= 0.15 * f32_loss.back() + 0.01);
  // Compressed: the weights differ (the gradients really travelled in 16 bits), a little.
  bool any_difference = false;
  for (std::size_t i = 0; i < f32_weights.size(); ++i) {
    any_difference = any_difference || f32_weights[i].to_vector<float>() != bf16_weights[i].to_vector<float>();
  }
  CHECK(any_difference);

  // A dtype that is not 16-bit is refused with a message naming the option.
  mixed_precision::PolicyScope scope("mixed_bfloat16");
  MirroredStrategy strategy(strategy::MirroredOptions{.devices = {"CPU:0", "CPU:1"},
                                                      .distribution = {.gradient_all_reduce_dtype = DType::kI32}});
  Model model;
  {
    auto s = strategy.scope();
    model = regression_model(31);
    model.compile("sgd", "mse");
  }
  try {
    model.fit(data.x, data.y, {.batch_size = 64, .epochs = 1, .verbose = 0});
    FAIL("an int32 gradient all-reduce was accepted");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()).find("gradient_all_reduce_dtype is int32; expected float16 or bfloat16") !=
          std::string::npos);
  }
}
