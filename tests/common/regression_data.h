// A small regression data set the Keras tests train on (3 features, 2 targets, y a fixed linear
// function of x, so that a model can learn it and losses fall), and a model for it.
#pragma once

#include <cstdint>
#include <vector>

#include "tandem/graph/tensor.h"
#include "tandem/keras_like/keras.h"

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

// 3 -> Dense 4 relu "hidden" -> Dense 2 "out", compiled with SGD 0.05, mse and mae (under the
// current strategy scope).
inline keras::Model compiled_regression_model() {
  auto x = keras::Input({3});
  auto y = keras::Dense(2, {.name = "out"})(keras::Dense(4, "relu", {.name = "hidden"})(x));
  keras::Model model(x, y);
  model.compile(keras::SGD{.learning_rate = 0.05}, "mse", {"mae"});
  return model;
}

}  // namespace tandem::testing
