// tandem/keras_like/losses.h — losses by Keras name or as typed objects with Keras's defaults.
//
//   model.compile("adam", "mse");
//   model.compile("adam", keras::SparseCategoricalCrossentropy{.from_logits = true});
//
// Every loss is computed per example and reduced like Keras's default ("sum_over_batch_size"):
// the sum over the batch divided by the global batch size, so that under a distribution strategy
// the replicas' gradients add up to the gradient of the mean.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <variant>

#include "tandem/graph/graph.h"

namespace tandem::keras {

using graph::Output;

struct MeanSquaredError {};
struct MeanAbsoluteError {};
// Labels are class ids (any integer dtype, or floats holding integers), predictions [batch, classes].
struct SparseCategoricalCrossentropy {
  bool from_logits = false;
};
// Labels are one-hot (or probability) rows of the predictions' shape.
struct CategoricalCrossentropy {
  bool from_logits = false;
  double label_smoothing = 0.0;
};
// Labels are 0/1 (or probabilities) of the predictions' shape; per example, the mean over the last axis.
struct BinaryCrossentropy {
  bool from_logits = false;
  double label_smoothing = 0.0;
};
// Any per-example loss built from graph ops: fn(y_true, y_pred) -> [batch].
struct CustomLoss {
  std::string name;
  std::function<Output(Output y_true, Output y_pred)> fn;
};

using LossSpec = std::variant<MeanSquaredError, MeanAbsoluteError, SparseCategoricalCrossentropy,
                              CategoricalCrossentropy, BinaryCrossentropy, CustomLoss>;

// A loss as compile() takes it: a Keras identifier ("mse", "mean_squared_error", "mae",
// "sparse_categorical_crossentropy", "categorical_crossentropy", "binary_crossentropy") or an
// object. An unknown name throws InvalidArgument listing the known ones.
class LossRef {
 public:
  LossRef(const char* name) : LossRef(std::string_view(name)) {}         // NOLINT: Keras-style strings
  LossRef(std::string_view name);                                        // NOLINT
  LossRef(const std::string& name) : LossRef(std::string_view(name)) {}  // NOLINT
  template <class L>
  requires std::is_constructible_v<LossSpec, L> LossRef(L loss) : spec_(std::move(loss)) {}  // NOLINT

  const LossSpec& spec() const { return spec_; }
  std::string name() const;  // Keras's snake_case name: "sparse_categorical_crossentropy"

 private:
  LossSpec spec_;
};

// The per-example loss [batch] of y_pred against y_true, added to y_pred's graph. Adapts labels
// like Keras: casts dtypes, and reshapes a [batch] target against a [batch, 1] prediction.
Output per_example_loss(const LossSpec& loss, Output y_true, Output y_pred);

// Whether targets of shape `y_true` suit `loss` against predictions of shape `y_pred` (batch
// dimensions unknown): nullopt when they do, else what the loss needs, e.g. "targets of the
// output's shape (None, 3)". The element-wise losses need the predictions' shape (a [batch] target
// against a [batch, 1] prediction included), as Keras's cross-entropies do ("Arguments `target`
// and `output` must have the same shape"); Keras's MSE and MAE would broadcast a (None, 1) target
// over (None, 3), almost always a mistake, so here they need it too. The sparse cross-entropy
// needs class ids, (None,) or (None, 1). A CustomLoss decides for itself. Callers: the trainer,
// before it builds a model's graph, so that a wrong target is named at the loss rather than in
// whichever node first fails.
std::optional<std::string> target_shape_requirement(const LossSpec& loss, const Shape& y_true, const Shape& y_pred);

}  // namespace tandem::keras
