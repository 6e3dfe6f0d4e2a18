// Training on a GPU (OneDeviceStrategy("GPU:0")) against the same model on the CPU: float32 and
// mixed_bfloat16, SGD with momentum, Adam and AdamW with a schedule, with the fused GPU optimizer
// update; and the same GPU training with and without CUDA graphs. Where no GPU is usable the
// program exits 77, which CTest reports as skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "tandem/base/random.h"
#include "tandem/keras_like/keras.h"

using namespace tandem;
using namespace tandem::keras;

namespace {

struct Data {
  Tensor x, y;
};
Data classification_data(std::int64_t n) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> xs(static_cast<std::size_t>(n * 16));
  std::vector<std::int64_t> ys(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    float score = 0;
    for (int f = 0; f < 16; ++f) {
      const float v = normal(rng);
      xs[static_cast<std::size_t>(i * 16 + f)] = v;
      score += (f % 3 == 0 ? 1.0f : -0.5f) * v;
    }
    ys[static_cast<std::size_t>(i)] = score > 1.0f ? 2 : score > -1.0f ? 1 : 0;
  }
  return {Tensor::from_vector(xs, {n, 16}), Tensor::from_vector(ys, {n})};
}

struct Run {
  std::vector<double> loss;
  std::vector<Tensor> weights;
};

Model make_model(OptimizerRef optimizer, bool cuda_graphs, bool batch_norm = false) {
  set_global_seed(3);
  Model model = batch_norm
                    ? Sequential({Input({16}), Dense(64, "relu"), BatchNormalization(), Dense(64, "tanh"), Dense(3)})
                    : Sequential({Input({16}), Dense(64, "relu"), Dense(64, "tanh"), Dense(3)});
  model.compile(optimizer, SparseCategoricalCrossentropy{.from_logits = true}, {"accuracy"},
                {.cuda_graphs = cuda_graphs});
  return model;
}

Run train(const std::string& device, const char* policy, OptimizerRef optimizer, bool cuda_graphs = true,
          bool batch_norm = false) {
  mixed_precision::PolicyScope scope(policy);
  OneDeviceStrategy strategy(device);
  Model model;
  {
    auto s = strategy.scope();
    model = make_model(optimizer, cuda_graphs, batch_norm);
  }
  const auto data = classification_data(1024);
  auto history = model.fit(data.x, data.y, {.batch_size = 64, .epochs = 3, .verbose = 0, .shuffle = false});
  return {history.at("loss"), model.get_weights()};
}

void check_close(const Run& gpu, const Run& cpu, double loss_tolerance, double weight_tolerance) {
  REQUIRE(gpu.loss.size() == cpu.loss.size());
  for (std::size_t e = 0; e < gpu.loss.size(); ++e) {
    CAPTURE(e);
    CHECK(std::abs(gpu.loss[e] - cpu.loss[e]) <= loss_tolerance * (1 + std::abs(cpu.loss[e])));
  }
  REQUIRE(gpu.weights.size() == cpu.weights.size());
  for (std::size_t i = 0; i < gpu.weights.size(); ++i) {
    const auto a = gpu.weights[i].to_vector<float>();
    const auto b = cpu.weights[i].to_vector<float>();
    double diff = 0, norm = 0;
    for (std::size_t k = 0; k < a.size(); ++k) {
      diff += (a[k] - b[k]) * (a[k] - b[k]);
      norm += b[k] * b[k];
    }
    CAPTURE(i);
    CHECK(std::sqrt(diff) <= weight_tolerance * std::sqrt(norm) + 1e-6);
  }
}

}  // namespace

TEST_CASE("float32 training on the GPU follows the CPU (SGD with momentum, Adam)") {
  check_close(train("GPU:0", "float32", SGD{.learning_rate = 0.05, .momentum = 0.9}),
              train("CPU:0", "float32", SGD{.learning_rate = 0.05, .momentum = 0.9}), 1e-4, 1e-3);
  check_close(train("GPU:0", "float32", Adam{.learning_rate = 0.005}),
              train("CPU:0", "float32", Adam{.learning_rate = 0.005}), 1e-4, 1e-3);
}

TEST_CASE("mixed_bfloat16 training on the GPU stays close to the CPU's") {
  const Run gpu = train("GPU:0", "mixed_bfloat16", Adam{.learning_rate = 0.005});
  const Run cpu = train("CPU:0", "mixed_bfloat16", Adam{.learning_rate = 0.005});
  CHECK(gpu.loss.back() < gpu.loss.front());
  check_close(gpu, cpu, 3e-2, 5e-2);
}

TEST_CASE("CUDA graphs replay what the eager runs compute: the same losses and weights") {
  // 16 steps an epoch: the graph is recorded at the third step and replayed after.
  const Run graphs = train("GPU:0", "float32", Adam{.learning_rate = 0.005}, /*cuda_graphs=*/true);
  const Run eager = train("GPU:0", "float32", Adam{.learning_rate = 0.005}, /*cuda_graphs=*/false);
  check_close(graphs, eager, 1e-6, 1e-6);
}

TEST_CASE("whole-step graphs (update and moving statistics inside the graph) match eager steps") {
  // The graph holds forward, backward, the optimizer launch reading its step's learning rate and
  // bias corrections from device memory, and the moving statistics' copies.
  for (const bool batch_norm : {false, true}) {
    CAPTURE(batch_norm);
    check_close(train("GPU:0", "float32", SGD{.learning_rate = 0.05, .momentum = 0.9}, true, batch_norm),
                train("GPU:0", "float32", SGD{.learning_rate = 0.05, .momentum = 0.9}, false, batch_norm), 1e-6, 1e-6);
    check_close(train("GPU:0", "float32", Adam{.learning_rate = 0.005}, true, batch_norm),
                train("GPU:0", "float32", Adam{.learning_rate = 0.005}, false, batch_norm), 1e-6, 1e-6);
  }
}

TEST_CASE("a learning-rate schedule and AdamW's exclusions: GPU (graphs and eager) follows the CPU") {
  // The whole-step graph reads each step's rate from the staged numbers; the fused kernel decays
  // only the kernels (biases excluded per tensor).
  const AdamW adamw{.learning_rate = CosineDecay{.initial_learning_rate = 0.0, .decay_steps = 40,
                                                 .warmup_target = 0.01, .warmup_steps = 8},
                    .weight_decay = 0.1, .exclude_from_weight_decay = {"bias"}};
  const Run graphs = train("GPU:0", "float32", adamw, /*cuda_graphs=*/true);
  check_close(graphs, train("GPU:0", "float32", adamw, /*cuda_graphs=*/false), 1e-6, 1e-6);
  check_close(graphs, train("CPU:0", "float32", adamw), 1e-4, 1e-3);
}

TEST_CASE("a bad label inside a replayed whole-step graph: a clear error, and the update is skipped") {
  const auto good = classification_data(1024);
  // The same rows again, with a label out of range in the fifth batch of 64.
  auto labels = good.y.to_vector<std::int64_t>();
  labels[4 * 64 + 9] = 7;
  const Tensor bad_y = Tensor::from_vector(labels, {1024});
  OneDeviceStrategy strategy("GPU:0");
  const auto first_rows = [](const Tensor& t, std::int64_t n) {
    auto v = t.to_vector<float>();
    return Tensor::from_vector(std::vector<float>(v.begin(), v.begin() + n * 16), {n, 16});
  };
  const auto first_labels = [](const Tensor& t, std::int64_t n) {
    auto v = t.to_vector<std::int64_t>();
    return Tensor::from_vector(std::vector<std::int64_t>(v.begin(), v.begin() + n), {n});
  };
  Model failing, reference;
  {
    auto s = strategy.scope();
    failing = make_model(Adam{.learning_rate = 0.005}, true);
    reference = make_model(Adam{.learning_rate = 0.005}, true);
  }
  const FitOptions once{.batch_size = 64, .epochs = 1, .verbose = 0, .shuffle = false};
  failing.fit(good.x, good.y, once);  // records the step's graph and replays it
  reference.fit(good.x, good.y, once);
  CHECK_THROWS_WITH_AS(failing.fit(good.x, bad_y, once), doctest::Contains("outside the valid class ids"),
                       InvalidArgument);
  reference.fit(first_rows(good.x, 4 * 64), first_labels(good.y, 4 * 64), once);  // the four good batches
  const auto a = failing.get_weights();
  const auto b = reference.get_weights();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto wa = a[i].to_vector<float>();
    const auto wb = b[i].to_vector<float>();
    CAPTURE(i);
    CHECK(std::all_of(wa.begin(), wa.end(), [](float v) { return std::isfinite(v); }));
    CHECK(wa == wb);
  }
}

int main(int argc, char** argv) {
  if (devices::num_gpus() == 0) {
    std::printf("skipped: no GPU (%s)\n", devices::gpu_discovery_message().c_str());
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
