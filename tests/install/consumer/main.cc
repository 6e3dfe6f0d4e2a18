// Uses an installed tandem through both of its APIs: the graph and the Keras-style one.
#include <tandem/keras_like/keras.h>
#include <tandem/tandem.h>

#include <cstdio>

int main() {
  using namespace tandem;
  auto g = std::make_shared<Graph>();
  auto x = g->placeholder(kFloat32, {2, 2}, "x");
  auto y = ops::reduce_sum(ops::matmul(x, x));
  auto dx = graph::gradients({&y, 1}, {&x, 1});
  graph::Executor ex(g, devices::default_cpu_device());
  auto out = ex.run({{x, Tensor::from_vector<float>({1, 2, 3, 4}, {2, 2})}}, {y, dx[0]});
  std::printf("sum(x @ x) = %g, d/dx = %s\n", out[0].item<float>(), out[1].to_string().c_str());

  OneDeviceStrategy strategy("CPU:0");
  keras::Model model;
  {
    auto scope = strategy.scope();
    model = keras::Sequential({keras::Input({3}), keras::Dense(4, "relu"), keras::Dense(1)});
    model.compile("adam", "mse");
  }
  auto xs = Tensor::filled<float>({16, 3}, 0.5f);
  auto ys = Tensor::filled<float>({16, 1}, 1.0f);
  const auto history = model.fit(xs, ys, {.batch_size = 8, .epochs = 2, .verbose = 0});
  std::printf("keras: %zu epochs, loss %g\n", history.at("loss").size(), history.at("loss").back());
  return out[0].item<float>() == 54.0f && history.at("loss").size() == 2 ? 0 : 1;
}
