// tests/keras/parallel_fit_mlp.h — the MLP, data and training run that the ModelParallel fit
// tests (model_parallel_fit_test in one process, model_parallel_fit_worker under tandem-run)
// compare with OneDeviceStrategy: Input 8 -> pre (8, tanh) -> fc1 (16, relu) -> fc2 (8, tanh) ->
// head (1), Adam, mean squared error, 50 steps of 32 rows, then an evaluation on a 51st batch.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "tandem/keras_like/distribution.h"
#include "tandem/keras_like/keras.h"

namespace tandem::testing::parallel_fit {

using namespace tandem::keras;

inline constexpr std::int64_t kBatch = 32, kSteps = 50, kIn = 8, kWide = 16;
inline const std::vector<std::string> kFourCpus{"CPU:0", "CPU:1", "CPU:2", "CPU:3"};

// Input 8 -> Dense(8, tanh) "pre" -> Dense(16, relu) "fc1" -> Dense(8, tanh) "fc2" -> Dense(1) "head".
inline Model make_mlp() {
  set_global_seed(7);
  auto x = Input({kIn});
  auto h = Dense(kIn, "tanh", {.name = "pre"})(x);
  h = Dense(kWide, "relu", {.name = "fc1"})(h);
  h = Dense(kIn, "tanh", {.name = "fc2"})(h);
  auto y = Dense(1, {.name = "head"})(h);
  return Model(x, y, "mlp");
}

// kSteps batches of kBatch rows, and one more for evaluation.
inline std::pair<Tensor, Tensor> make_data(std::int64_t batches) {
  std::mt19937 rng(900);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x, y;
  for (std::int64_t i = 0; i < batches * kBatch; ++i) {
    float s = 0;
    for (std::int64_t f = 0; f < kIn; ++f) {
      const float v = normal(rng);
      x.push_back(v);
      s += std::sin(v * (0.7f + 0.1f * static_cast<float>(f)));
    }
    y.push_back(s / 4);
  }
  return {Tensor::from_vector(x, {batches * kBatch, kIn}), Tensor::from_vector(y, {batches * kBatch, 1})};
}

struct Run {
  std::vector<double> losses;  // the epoch's running mean after each step, as fit logs it
  std::vector<std::vector<float>> weights;
  double evaluation = 0;
  TrainingStats stats;
  // plan()'s tensor-parallel bytes per device per step (its per-row figure times the local rows).
  double planned_tensor_parallel_bytes = 0;
};

inline Model model_under(Strategy& strategy) {
  auto scope = strategy.scope();
  return make_mlp();
}

// Trains the model `make` builds under `strategy` on the first kSteps batches of (x, y), logging
// each step's loss, then evaluates it on all of (x, y).
inline Run train_model(Strategy& strategy, const std::function<Model()>& make, const Tensor& x, const Tensor& y,
                       const std::string& save_to = "", OptimizerRef optimizer = Adam{.learning_rate = 0.01}) {
  Model model = [&] {
    auto scope = strategy.scope();
    return make();
  }();
  {
    auto scope = strategy.scope();
    model.compile(std::move(optimizer), "mse");
  }
  Run run;
  auto record = std::make_shared<LambdaCallback>(LambdaCallbackOptions{
      .on_train_batch_end = [&](std::int64_t, Logs& logs) { run.losses.push_back(logs.at("loss")); }});
  model.fit(x, y,
            {.batch_size = kBatch, .epochs = 1, .verbose = 0, .callbacks = {record}, .shuffle = false,
             .steps_per_epoch = kSteps});
  run.stats = model.training_stats();
  if (dynamic_cast<distribution::ModelParallel*>(&strategy) != nullptr) {
    const distribution::Plan plan = distribution::plan(model, {.batch_rows = kBatch});
    run.planned_tensor_parallel_bytes = plan.communication_bytes_per_row * static_cast<double>(plan.local_rows);
  }
  for (const auto& w : model.get_weights()) run.weights.push_back(w.to_vector<float>());
  run.evaluation = model.evaluate(x, y, {.batch_size = kBatch, .verbose = 0}).at("loss");
  if (!save_to.empty()) model.save_weights(save_to);
  return run;
}

// The MLP on kSteps batches and one more.
inline Run train(Strategy& strategy, const std::string& save_to = "") {
  const auto [x, y] = make_data(kSteps + 1);
  return train_model(strategy, make_mlp, x, y, save_to);
}

// The first difference beyond 1e-5 relative between two runs (every step's logged loss, the
// evaluation, every weight), or "" when they are equivalent.
inline std::string difference(const Run& got, const Run& want) {
  if (got.losses.size() != want.losses.size())
    return fmt::format("{} logged losses, {} expected", got.losses.size(), want.losses.size());
  for (std::size_t s = 0; s < got.losses.size(); ++s) {
    if (std::abs(got.losses[s] - want.losses[s]) > 1e-5 * std::abs(want.losses[s]))
      return fmt::format("step {}: loss {} vs {}", s, got.losses[s], want.losses[s]);
  }
  if (std::abs(got.evaluation - want.evaluation) > 1e-5 * std::abs(want.evaluation))
    return fmt::format("evaluation {} vs {}", got.evaluation, want.evaluation);
  if (got.weights.size() != want.weights.size()) return "another number of weights";
  for (std::size_t k = 0; k < want.weights.size(); ++k) {
    if (got.weights[k].size() != want.weights[k].size()) return fmt::format("weight {}: another size", k);
    for (std::size_t i = 0; i < got.weights[k].size(); ++i) {
      const double a = got.weights[k][i], b = want.weights[k][i];
      if (std::abs(a - b) > 1e-5 * std::max(1e-2, std::abs(b)))
        return fmt::format("weight {}[{}]: {} vs {}", k, i, a, b);
    }
  }
  return "";
}

// Megatron's pairing by hand: fc1 column-split, fc2 row-split, over 'model'.
inline distribution::LayoutMap pair_layouts(const distribution::DeviceMesh& mesh) {
  distribution::LayoutMap map(mesh);
  map["fc1/kernel"] = {std::nullopt, "model"};
  map["fc1/bias"] = {"model"};
  map["fc2/kernel"] = {"model", std::nullopt};
  return map;
}

}  // namespace tandem::testing::parallel_fit
