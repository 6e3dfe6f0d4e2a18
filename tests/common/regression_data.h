// A small regression data set the Keras tests train on: 3 features, 2 targets, y a fixed linear
// function of x, so that a model can learn it and losses fall.
#pragma once

#include <cstdint>
#include <vector>

#include "tandem/graph/tensor.h"

namespace tandem::testing {

struct RegressionData {
  Tensor x, y;
};

inline RegressionData regression_data(std::int64_t n) {
  std::vector<float> xs, ys;
  for (std::int64_t i = 0; i < n; ++i) {
    const float a = static_cast<float>(i % 7) / 7.0f, b = static_cast<float>(i % 5) / 5.0f,
                c = static_cast<float>(i % 3) / 3.0f;
    xs.insert(xs.end(), {a, b, c});
    ys.insert(ys.end(), {a + 2 * b - c, 0.5f * a - b});
  }
  return {Tensor::from_vector<float>(xs, {n, 3}), Tensor::from_vector<float>(ys, {n, 2})};
}

}  // namespace tandem::testing
