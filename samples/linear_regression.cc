// Fits y = 3x + 2 with plain gradient descent through tandem's graph API: placeholders for the
// data, variables for the weights, autodiff for the gradients, an executor to run it.
//
//   build/samples/linear_regression [--steps N] [--learning-rate LR]
//
// One device, no strategy; custom_training_loop.cc is the same kind of loop under MirroredStrategy.
#include <tandem/tandem.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <random>

namespace {

struct Options {
  int steps = 200;
  float learning_rate = 0.1f;
  int examples = 1024;
};

}  // namespace

int main(int argc, char** argv) try {
  using namespace tandem;
  Options options;
  CLI::App app("linear_regression: fits y = 3x + 2 with gradient descent through the graph API");
  app.add_option("--steps", options.steps, "gradient descent steps")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  app.add_option("--learning-rate", options.learning_rate, "step size")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  // Data: y = 3x + 2 plus a little noise.
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::normal_distribution<float> noise(0.0f, 0.01f);
  std::vector<float> xs(static_cast<std::size_t>(options.examples)), ys(xs.size());
  for (std::size_t i = 0; i < xs.size(); ++i) {
    xs[i] = uniform(rng);
    ys[i] = 3.0f * xs[i] + 2.0f + noise(rng);
  }

  // The model and its loss: pred = x * w + b; loss = mean((pred - y)^2).
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {-1, 1}, "x");
  auto y = g->placeholder(kFloat32, {-1, 1}, "y");
  auto w = g->variable(kFloat32, {1, 1}, "w");
  auto b = g->variable(kFloat32, {1}, "b");
  auto prediction = ops::matmul(x, w) + b;
  auto loss = ops::reduce_mean(ops::square(prediction - y));
  std::vector<Output> weights{w, b};
  auto grads = graph::gradients({&loss, 1}, weights);

  auto& device = devices::default_cpu_device();
  graph::Executor executor(g, device);
  auto w_value = Tensor::zeros({1, 1}, kFloat32, device);
  auto b_value = Tensor::zeros({1}, kFloat32, device);
  executor.bind_variable(w, w_value);
  executor.bind_variable(b, b_value);

  const auto n = static_cast<std::int64_t>(xs.size());
  const std::vector<graph::Feed> feeds{{x, Tensor::from_vector(xs, {n, 1})}, {y, Tensor::from_vector(ys, {n, 1})}};
  std::printf("fitting y = 3x + 2 on %s with %d examples\n", device.full_name().c_str(), options.examples);
  float last_loss = 0;
  for (int step = 1; step <= options.steps; ++step) {
    const auto out = executor.run(feeds, {loss, grads[0], grads[1]});
    // Plain gradient descent, applied in place to the bound variables.
    w_value.data<float>()[0] -= options.learning_rate * out[1].data<float>()[0];
    b_value.data<float>()[0] -= options.learning_rate * out[2].data<float>()[0];
    last_loss = out[0].item<float>();
    if (step == 1 || step % 50 == 0 || step == options.steps) {
      std::printf("step %4d  loss %.6f  w %.4f  b %.4f\n", step, last_loss, w_value.data<float>()[0],
                  b_value.data<float>()[0]);
    }
  }
  const float w_final = w_value.data<float>()[0], b_final = b_value.data<float>()[0];
  const bool converged = std::abs(w_final - 3.0f) < 0.05f && std::abs(b_final - 2.0f) < 0.05f;
  std::printf("%s: w = %.4f (want 3), b = %.4f (want 2), loss %.6f\n", converged ? "converged" : "did NOT converge",
              w_final, b_final, last_loss);
  return converged ? 0 : 1;
} catch (const tandem::Error& e) {
  std::fprintf(stderr, "linear_regression: %s\n", e.what());
  return 2;
}
