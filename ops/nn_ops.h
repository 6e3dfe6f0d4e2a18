// tandem/ops/nn_ops.h — activations, losses, normalisation, attention softmax, dropout.
//
// Builders add nodes to the graph of their first input (nothing runs); a bad shape, dtype or
// option throws InvalidArgument naming the node and the shapes involved.
#pragma once

#include <cstdint>

#include "tandem/graph/graph.h"

namespace tandem::ops {

using graph::Output;

// kGelu: x * Phi(x), Phi the standard normal CDF (Keras 3's gelu, approximate=False);
// kGeluApproximate: its tanh form 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
enum class Activation { kLinear, kRelu, kSigmoid, kTanh, kGelu, kGeluApproximate };
// "linear", "relu", "sigmoid", "tanh", "gelu", "gelu_approximate"; throws InvalidArgument listing
// the known names.
Activation parse_activation(std::string_view name);
std::string_view activation_name(Activation activation);  // "relu", ...
// Whether the activation's derivative needs its input z rather than its output y. Relu, sigmoid
// and tanh differentiate through y (y is kept for the next layer anyway); GELU is not invertible,
// so the fused ops keep z as well when their activation is GELU.
bool activation_gradient_needs_input(Activation activation);

Output relu(Output x);
Output sigmoid(Output x);
Output tanh(Output x);
// tf.nn.gelu / keras.activations.gelu: exact (erf) or, with `approximate`, the tanh form.
Output gelu(Output x, bool approximate = false);
// Softmax and log-softmax over the last axis.
Output softmax(Output x);
Output log_softmax(Output x);

// x + bias, bias along the last axis of x.
Output bias_add(Output x, Output bias);
// activation(x + bias) in one pass, with a fused gradient (bias gradient and activation
// derivative in one sweep over the output gradient). The node's second output is the
// pre-activation x + bias for GELU (activation_gradient_needs_input) and empty otherwise.
Output bias_activation(Output x, Output bias, Activation activation);
// activation(x @ kernel + bias): the fused dense layer (x rank 2); second output as above.
Output dense(Output x, Output kernel, Output bias, Activation activation);

// Per-example losses, shape [batch]. Softmax and cross-entropy are fused: the forward pass
// writes the gradient too, so the backward pass is one multiply.
// labels: int32/int64 class ids in [0, classes); an id out of range raises InvalidArgument.
Output sparse_softmax_cross_entropy_with_logits(Output logits, Output labels);
// labels: a probability distribution per row, same shape as logits.
Output softmax_cross_entropy_with_logits(Output logits, Output labels);
// Element-wise, numerically stable: max(x, 0) - x * z + log(1 + exp(-|x|)).
Output sigmoid_cross_entropy_with_logits(Output logits, Output labels);

struct DropoutOptions {
  double rate = 0.5;       // fraction of elements zeroed, in [0, 1)
  std::uint64_t seed = 0;  // combined with the executor's seed and the step
  bool training = true;    // false: identity
};
// Zeroes each element with probability `rate` and scales the rest by 1 / (1 - rate).
Output dropout(Output x, const DropoutOptions& options = {});

struct BatchNormOptions {
  double epsilon = 1e-3;  // Keras's default
  bool training = true;   // true: normalise with the batch's statistics
};
struct BatchNormOutputs {
  Output y;
  Output batch_mean;      // per channel (training); the given mean otherwise
  Output batch_variance;  // biased (divides by the count), as Keras 3 uses for moving averages
};
// Normalises over every axis but the last (channels): NHWC images or [batch, features].
BatchNormOutputs fused_batch_norm(Output x, Output scale, Output offset, Output mean, Output variance,
                                  const BatchNormOptions& options = {});

struct LayerNormOptions {
  double epsilon = 1e-3;  // Keras's default; must be positive
};
// keras.layers.LayerNormalization over the last axis: y = (x - mean) / sqrt(var + epsilon) * gamma
// + beta, with the biased variance of each row. gamma and beta are vectors of the last dimension,
// or undefined Outputs when absent (Keras's scale=False / center=False). One fused forward kernel,
// which also keeps each row's mean and 1/sqrt(var + epsilon) (in float32 for 16-bit x), and one
// fused backward kernel giving dx, dgamma and dbeta.
Output layer_norm(Output x, Output gamma, Output beta, const LayerNormOptions& options = {});

struct MaskedSoftmaxOptions {
  double scale = 1.0;   // softmax(scale * x): attention's 1 / sqrt(key_dim)
  bool causal = false;  // query i attends to keys j <= i (Keras's use_causal_mask)
};
// Softmax over the last axis of scale * x [..., T, S], where the mask allows, as one fused op with
// a fused gradient (dx = scale * y * (dy - sum(dy * y))). mask: an undefined Output (none), or an
// int32/int64/uint8 tensor broadcastable to x (non-zero = attend; Keras's attention_mask [B, T, S]
// arrives as [B, 1, T, S]). causal is the lower triangle of [T, S] (key j <= query i), combined
// with the mask. Masked entries are exactly 0; a row with nothing to attend is all zeros, and its
// gradient is zero (no NaN, no inf).
Output masked_softmax(Output x, Output mask, const MaskedSoftmaxOptions& options = {});

}  // namespace tandem::ops
