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
  return out[0].item<float>() == 54.0f ? 0 : 1;
}
