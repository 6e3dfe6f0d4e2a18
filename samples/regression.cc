// The seed's regression example: compile("adam", "mse") and fit on generated data.
//
//   build/samples/regression [--epochs 10] [--batch 32] [--seed 0] [--strategy one|mirrored|multiworker]
//       [--cpu-devices N] [--dtype-policy P] [--backup DIR] [--checkpoint PATH] [--collective-timeout S]
//
// y = x . w_true + 0.5 + noise (sigma 0.1) with 8 features and w_true in [-1, 1]: the noise floor
// of the MSE is 0.01. Adam at Keras's default learning rate (1e-3) moves each weight by about
// 1e-3 a step, so the data has enough examples for ~5000 steps in 10 epochs.
#include <tandem/keras_like/keras.h>

#include <cstdio>
#include <random>

#include "common/args.h"

int main(int argc, char** argv) try {
  using namespace tandem;
  const auto args = samples::parse_args(argc, argv, {.epochs = 10, .batch = 32},
                                        "regression: a linear model fitted with Adam and MSE on generated data");
  if (args.exit_code) return *args.exit_code;
  set_global_seed(args.seed);
  auto strategy = samples::make_strategy(args);  // OneDeviceStrategy or MirroredStrategy (before any tensor)

  constexpr int kFeatures = 8;
  constexpr int kExamples = 16384;
  constexpr double kNoiseStddev = 0.1;
  std::mt19937_64 rng(args.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> w_true(kFeatures), xs(kExamples * kFeatures), ys(kExamples);
  for (auto& w : w_true) w = uniform(rng);
  for (int i = 0; i < kExamples; ++i) {
    float y = 0.5f;
    for (int f = 0; f < kFeatures; ++f) {
      xs[static_cast<std::size_t>(i * kFeatures + f)] = normal(rng);
      y += xs[static_cast<std::size_t>(i * kFeatures + f)] * w_true[static_cast<std::size_t>(f)];
    }
    ys[static_cast<std::size_t>(i)] = y + static_cast<float>(kNoiseStddev) * normal(rng);
  }
  const Tensor x = Tensor::from_vector(xs, {kExamples, kFeatures});
  const Tensor y = Tensor::from_vector(ys, {kExamples, 1});

  keras::Model model;
  {
    auto scope = strategy->scope();
    model = keras::Sequential({keras::Input({kFeatures}), keras::Dense(1)});
    model.compile("adam", "mse");
  }
  samples::print_plan_if_asked(args, model);  // --print-plan
  auto dataset = data::Dataset::from_tensor_slices({x, y}).shuffle(kExamples).batch(args.batch);
  const auto history = model.fit(
      dataset, {.epochs = args.epochs, .verbose = args.verbose, .callbacks = samples::fit_callbacks(args, *strategy)});
  const double mse = history.at("loss").back();
  const double floor = kNoiseStddev * kNoiseStddev;
  std::printf("final training MSE %.5f (noise floor %.5f, ratio %.2f)\n", mse, floor, mse / floor);
  return 0;
} catch (const tandem::Error& e) {
  std::fprintf(stderr, "regression: %s\n", e.what());
  return 1;
}
