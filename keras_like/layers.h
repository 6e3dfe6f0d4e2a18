// tandem/keras_like/layers.h — the built-in layers, with Keras's names, arguments and defaults.
//
// Each is a Layer handle constructed like its Keras counterpart:
//   keras::Dense(128, "relu")                   keras::Dense(10, {.use_bias = false})
//   keras::Conv2D(32, {3, 3}, "relu")           keras::MaxPooling2D()   (pool 2x2, strides = pool)
//   keras::Dropout(0.2)                         keras::BatchNormalization()
//   keras::Embedding(vocab, 128)                keras::LayerNormalization()
//   keras::MultiHeadAttention(4, 32)            called as mha({x, x}, {.use_causal_mask = true})
// Activations by name: "linear" (None), "relu", "sigmoid", "tanh", "softmax", "gelu" (exact:
// x * Phi(x), Keras's default) and "gelu_approximate" (the tanh form, Keras's
// gelu(approximate=True)).
//
// Constructors check their arguments and throw InvalidArgument naming the layer; calls check the
// inputs' shapes when the layer is called on a KerasTensor, so a model that cannot run fails where
// it is built. Nothing here blocks.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

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

// One axis or several, as Keras takes them: `.axis = -1` or `.axis = {-2, -1}`.
struct AxisList {
  AxisList(int axis) : axes{axis} {}                                 // NOLINT: Keras's int form
  AxisList(std::initializer_list<int> list) : axes(list) {}          // NOLINT
  std::vector<int> axes;
};

struct LayerNormalizationOptions {
  // The axes normalised over: the last (-1), or several trailing ones ({-2, -1}: gamma and beta
  // then have those dimensions). Other sets of axes throw Unimplemented when the layer is built.
  AxisList axis = -1;
  double epsilon = 1e-3;
  bool center = true;  // learn beta
  bool scale = true;   // learn gamma
  Initializer beta_initializer = "zeros";
  Initializer gamma_initializer = "ones";
  std::string name;
};
// Normalises each example over `axis` (Keras 3's LayerNormalization): (x - mean) / sqrt(variance +
// epsilon) * gamma + beta, with the biased variance, in one fused op (forward and backward). Under
// a mixed policy it computes in float32 and returns the compute dtype, as Keras does.
class LayerNormalization : public Layer {
 public:
  explicit LayerNormalization(LayerNormalizationOptions options = {});
};

struct EmbeddingOptions {
  Initializer embeddings_initializer = "uniform";  // Keras's RandomUniform(-0.05, 0.05)
  std::string name;
};
// Integer ids of any shape -> their rows of `embeddings` [input_dim, output_dim]: output shape
// ids.shape + [output_dim] (Keras 3's Embedding). Float ids are cast to int32, as Keras does. The
// gradient is a scatter-add into the rows looked up. An id outside [0, input_dim) is an
// InvalidArgument when the step runs, naming the lookup and the id. Under a mixed policy the
// table stays float32 and the rows are returned in the compute dtype.
class Embedding : public Layer {
 public:
  Embedding(std::int64_t input_dim, std::int64_t output_dim, EmbeddingOptions options = {});
};

struct MultiHeadAttentionOptions {
  std::optional<std::int64_t> value_dim;  // default: key_dim
  double dropout = 0.0;                   // on the attention probabilities, in training only
  bool use_bias = true;
  // The output's feature dimensions, e.g. {64} or {4, 16}; default: the query's last dimension.
  std::vector<std::int64_t> output_shape;
  Initializer kernel_initializer = "glorot_uniform";
  Initializer bias_initializer = "zeros";
  std::optional<std::uint64_t> seed;  // dropout's; default: drawn from the global seed
  std::string name;
};
// Keras 3's MultiHeadAttention call arguments besides query, value and key. TensorType is
// KerasTensor for the functional API and Output inside another layer's call().
template <class TensorType>
struct AttentionCallOptions {
  // [B, T, S] (or [T, S], shared by the batch): non-zero where query position t may attend to key
  // position s. Any integer, boolean (uint8) or float dtype.
  TensorType attention_mask;
  // Query t attends to key positions s <= t only (a decoder's self-attention); combined with
  // attention_mask when both are given.
  bool use_causal_mask = false;
  // Also return the attention probabilities [B, heads, T, S] (before dropout): two outputs.
  bool return_attention_scores = false;
};
// Multi-head scaled dot-product attention (Keras 3's MultiHeadAttention) over inputs [B, T, C]
// (query) and [B, S, Cv] (value; key defaults to value). Weights, named as Keras names them:
// query/kernel [C, heads, key_dim], query/bias [heads, key_dim], key/kernel [Ck, heads, key_dim],
// key/bias, value/kernel [Cv, heads, value_dim], value/bias, attention_output/kernel [heads,
// value_dim, *output_shape], attention_output/bias [*output_shape]. Probabilities are
// softmax(q k^T / sqrt(key_dim)) over the key positions the masks allow; a query position with
// none to attend to gets zeros (no NaN). The sequence lengths T and S must be known.
//
//   auto y = mha({x, x}, {.use_causal_mask = true});         // self-attention, causal
//   auto y = mha({q, v, k}, {.attention_mask = mask});       // mask = keras::Input({T, S}, kInt32)
//   auto outs = mha({q, v}, {.return_attention_scores = true});   // outs[0], outs[1]
class MultiHeadAttention : public Layer {
 public:
  MultiHeadAttention(std::int64_t num_heads, std::int64_t key_dim, MultiHeadAttentionOptions options = {});

  // The functional API: inputs {query, value} or {query, value, key}.
  LayerOutputs operator()(const std::vector<KerasTensor>& inputs,
                          const AttentionCallOptions<KerasTensor>& options = {}) const;
  // Inside another layer's call() (a transformer block): the output, and the probabilities when
  // asked.
  std::vector<Output> operator()(CallContext& ctx, const std::vector<Output>& inputs,
                                 const AttentionCallOptions<Output>& options = {}) const;
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
// "sigmoid", "tanh", "gelu", "gelu_approximate"); nullopt for "softmax", which spans the last axis.
std::optional<ops::Activation> fusable_activation(std::string_view activation);

}  // namespace tandem::keras
