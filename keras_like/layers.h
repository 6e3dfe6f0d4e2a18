// tandem/keras_like/layers.h — the built-in layers, with Keras's names, arguments and defaults.
//
// Each is a Layer handle constructed like its Keras counterpart:
//   keras::Dense(128, "relu")                   keras::Dense(10, {.use_bias = false})
//   keras::Conv2D(32, {3, 3}, "relu")           keras::MaxPooling2D()   (pool 2x2, strides = pool)
//   keras::Dropout(0.2)                         keras::BatchNormalization()
// Activations by name: "linear" (None), "relu", "sigmoid", "tanh", "softmax".
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "tandem/keras_like/layer.h"
#include "tandem/ops/nn_ops.h"

namespace tandem::keras {

struct DenseOptions {
  std::string activation = "linear";
  bool use_bias = true;
  Initializer kernel_initializer = "glorot_uniform";
  Initializer bias_initializer = "zeros";
  std::string name;
};
// activation(x @ kernel + bias) over the last axis; inputs of rank > 2 are applied per position.
class Dense : public Layer {
 public:
  Dense(std::int64_t units, DenseOptions options = {});
  // (A C string rather than std::string: GCC 12 finds Dense(n, {.name = ...}) ambiguous otherwise.)
  Dense(std::int64_t units, const char* activation, DenseOptions options = {});
};

struct Conv2DOptions {
  std::array<std::int64_t, 2> strides{1, 1};
  std::string padding = "valid";  // "valid" or "same"
  std::string activation = "linear";
  bool use_bias = true;
  Initializer kernel_initializer = "glorot_uniform";
  Initializer bias_initializer = "zeros";
  std::string name;
};
// 2-D convolution over NHWC inputs (channels last, Keras's default).
class Conv2D : public Layer {
 public:
  Conv2D(std::int64_t filters, std::array<std::int64_t, 2> kernel_size, Conv2DOptions options = {});
  Conv2D(std::int64_t filters, std::array<std::int64_t, 2> kernel_size, const char* activation,
         Conv2DOptions options = {});
};

struct Pooling2DOptions {
  std::optional<std::array<std::int64_t, 2>> strides;  // default: the pool size
  std::string padding = "valid";
  std::string name;
};
// MaxPooling2D() pools 2x2; MaxPooling2D({3, 3}, {.padding = "same"}) as Keras's arguments.
class MaxPooling2D : public Layer {
 public:
  explicit MaxPooling2D(std::array<std::int64_t, 2> pool_size = {2, 2}, Pooling2DOptions options = {});
  explicit MaxPooling2D(Pooling2DOptions options) : MaxPooling2D({2, 2}, std::move(options)) {}
};
class AveragePooling2D : public Layer {
 public:
  explicit AveragePooling2D(std::array<std::int64_t, 2> pool_size = {2, 2}, Pooling2DOptions options = {});
  explicit AveragePooling2D(Pooling2DOptions options) : AveragePooling2D({2, 2}, std::move(options)) {}
};

// Flattens every dimension but the batch.
class Flatten : public Layer {
 public:
  explicit Flatten(std::string name = "");
};

// Reshapes every dimension but the batch; one entry may be -1.
class Reshape : public Layer {
 public:
  explicit Reshape(const Shape& target_shape, std::string name = "");
};

struct DropoutOptions {
  std::optional<std::uint64_t> seed;  // default: drawn from the global seed
  std::string name;
};
// Zeroes a fraction `rate` of the inputs during training, scaling the rest by 1 / (1 - rate).
class Dropout : public Layer {
 public:
  explicit Dropout(double rate, DropoutOptions options = {});
};

struct BatchNormalizationOptions {
  double momentum = 0.99;
  double epsilon = 1e-3;
  bool center = true;  // learn beta
  bool scale = true;   // learn gamma
  Initializer beta_initializer = "zeros";
  Initializer gamma_initializer = "ones";
  Initializer moving_mean_initializer = "zeros";
  Initializer moving_variance_initializer = "ones";
  std::string name;
};
// Normalises over the last axis (channels): batch statistics while training (and updates the
// moving statistics: moving = moving * momentum + batch * (1 - momentum)), moving statistics
// otherwise.
class BatchNormalization : public Layer {
 public:
  explicit BatchNormalization(BatchNormalizationOptions options = {});
};

class Activation : public Layer {
 public:
  explicit Activation(std::string activation, std::string name = "");
};

// Element-wise sum of several inputs of one shape (for functional models).
class Add : public Layer {
 public:
  explicit Add(std::string name = "");
};

// Applies a named activation to a graph output ("linear" returns x). Throws InvalidArgument
// listing the known names.
Output apply_activation(std::string_view activation, Output x, std::string_view layer_label);
// The activation a fused kernel can apply in its epilogue for this Keras name ("linear", "relu",
// "sigmoid", "tanh"); nullopt for "softmax", which spans the last axis.
std::optional<ops::Activation> fusable_activation(std::string_view activation);

}  // namespace tandem::keras
