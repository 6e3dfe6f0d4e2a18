// A small synthetic classification problem for the strategy tests that train the same model under
// several strategies and compare: n examples of 3 classes in 8 features, the same every call.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "tandem/graph/tensor.h"

namespace tandem::testing {

struct ThreeClassData {
  Tensor x, y;  // float32 [n, 8], int64 [n]
};

inline ThreeClassData three_class_data(std::int64_t n = 1000) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> xs(static_cast<std::size_t>(n * 8));
  std::vector<std::int64_t> ys(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    float s = 0;
    for (int f = 0; f < 8; ++f) {
      const float v = normal(rng);
      xs[static_cast<std::size_t>(i * 8 + f)] = v;
      s += (f % 3 == 0 ? 1.0f : -0.5f) * v;
    }
    ys[static_cast<std::size_t>(i)] = s > 0.5f ? 2 : s > -0.5f ? 1 : 0;
  }
  return {Tensor::from_vector(xs, {n, 8}), Tensor::from_vector(ys, {n})};
}

}  // namespace tandem::testing
