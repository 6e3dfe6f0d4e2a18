// tandem/keras_like/initializers.h — how weights start (Keras's initializers, same formulas).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "tandem/graph/tensor.h"

namespace tandem::keras {

// An initializer by Keras name or with parameters. Names: "glorot_uniform" (the default of
// Dense and Conv2D kernels), "glorot_normal", "he_normal", "he_uniform", "lecun_normal",
// "lecun_uniform", "zeros", "ones", "random_normal" or "normal" (mean 0, stddev 0.05),
// "random_uniform" or "uniform" (-0.05 to 0.05: Embedding's default), "truncated_normal" (stddev
// 0.05, redrawn beyond two stddevs). Fans follow Keras's compute_fans: a kernel [in, out] has
// fan_in = in; any kernel of rank 3 or more [..., in, out] multiplies both fans by the product of
// its leading dimensions (a conv kernel [kh, kw, in, out] has fan_in = kh * kw * in;
// MultiHeadAttention's query kernel [C, heads, key_dim] has fan_in = C * heads and fan_out =
// C * key_dim). Throws InvalidArgument for an unknown name or bad parameters.
class Initializer {
 public:
  Initializer(const char* name) : Initializer(std::string_view(name)) {}  // NOLINT: used like Keras strings
  Initializer(std::string_view name);                                     // NOLINT
  static Initializer constant(double value);
  // keras.initializers.RandomUniform(minval, maxval): minval < maxval.
  static Initializer random_uniform(double minval = -0.05, double maxval = 0.05);
  // keras.initializers.RandomNormal(mean, stddev) and TruncatedNormal (draws beyond two
  // standard deviations from the mean are redrawn): stddev > 0.
  static Initializer random_normal(double mean = 0.0, double stddev = 0.05);
  static Initializer truncated_normal(double mean = 0.0, double stddev = 0.05);

  // A host tensor of `shape` and `dtype` drawn with `seed` (the same seed gives the same values).
  Tensor operator()(const Shape& shape, DType dtype, std::uint64_t seed) const;
  const std::string& name() const { return name_; }

 private:
  static Initializer with_parameters(std::string_view name, double a, double b);

  std::string name_;
  // constant: a = the value; random_uniform: [a, b); random_normal, truncated_normal: mean a, stddev b.
  double a_ = 0.0, b_ = 0.0;
};

}  // namespace tandem::keras
