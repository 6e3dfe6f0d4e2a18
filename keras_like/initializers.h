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
// "lecun_uniform", "zeros", "ones", "random_normal", "random_uniform". Fans follow Keras: a
// kernel [in, out] has fan_in = in; a conv kernel [kh, kw, in, out] has fan_in = kh * kw * in.
class Initializer {
 public:
  Initializer(const char* name) : Initializer(std::string_view(name)) {}  // NOLINT: used like Keras strings
  Initializer(std::string_view name);                                     // NOLINT
  static Initializer constant(double value);

  // A host tensor of `shape` and `dtype` drawn with `seed` (the same seed gives the same values).
  Tensor operator()(const Shape& shape, DType dtype, std::uint64_t seed) const;
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  double value_ = 0.0;
};

}  // namespace tandem::keras
