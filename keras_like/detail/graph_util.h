// tandem/keras_like/detail/graph_util.h — graph helpers shared by losses and metrics.
#pragma once

#include <string>
#include <string_view>

#include "tandem/graph/graph.h"

namespace tandem::keras::detail {

using graph::Output;

// Keras clips probabilities to [epsilon, 1 - epsilon] before taking logs (epsilon = 1e-7).
inline constexpr double kProbabilityEpsilon = 1e-7;

// min(max(x, lo), hi) from ops with gradients: lo + relu(x - lo), then hi - relu(hi - y).
Output clip_by_value(Output x, double lo, double hi);
Output clip_probabilities(Output p);
// The mean over every axis but the first (a [batch] tensor stays as it is).
Output mean_over_non_batch_axes(Output x);
// Targets cast to the predictions' dtype, and a [batch] target reshaped to a [batch, 1] prediction.
Output targets_like_predictions(Output y_true, Output y_pred);
// The shape targets_like_predictions gives targets of shape `y_true`: a [batch] target against a
// [batch, 1] prediction gains the last axis; any other stays as it is.
Shape adapted_target_shape(const Shape& y_true, const Shape& y_pred);
// The shapes of class ids that suit predictions [batch, ..., classes] (Keras's sparse losses and
// metrics): the predictions' shape without the classes, or that with a last dimension of 1.
Shape class_ids_shape(const Shape& y_pred);
bool are_class_ids(const Shape& y_true, const Shape& y_pred);
// Those shapes in words, for errors: "(None,) or (None, 1)".
std::string class_ids_shapes(const Shape& y_pred);
// Class ids for sparse losses and metrics, of any dtype, as int32 or int64 of
// class_ids_shape(y_pred) ([batch] against [batch, classes]; [batch, T] against [batch, T, V]).
Output class_ids(Output y_true, Output y_pred, std::string_view what);

}  // namespace tandem::keras::detail
