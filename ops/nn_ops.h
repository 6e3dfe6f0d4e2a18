// tandem/ops/nn_ops.h — activations, losses, normalisation, dropout.
#pragma once

#include <cstdint>

#include "tandem/graph/graph.h"

namespace tandem::ops {

using graph::Output;

enum class Activation { kLinear, kRelu, kSigmoid, kTanh };
// "linear", "relu", "sigmoid", "tanh"; throws InvalidArgument listing the known names.
Activation parse_activation(std::string_view name);
std::string_view activation_name(Activation activation);  // "relu", ...

Output relu(Output x);
Output sigmoid(Output x);
Output tanh(Output x);
// Softmax and log-softmax over the last axis.
Output softmax(Output x);
Output log_softmax(Output x);

// x + bias, bias along the last axis of x.
Output bias_add(Output x, Output bias);
// activation(x + bias) in one pass, with a fused gradient (bias gradient and activation
// derivative in one sweep over the output gradient).
Output bias_activation(Output x, Output bias, Activation activation);
// activation(x @ kernel + bias): the fused dense layer (x rank 2).
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

}  // namespace tandem::ops
