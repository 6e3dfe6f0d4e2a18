#include "tandem/keras_like/detail/graph_util.h"

#include "tandem/ops/ops.h"

namespace tandem::keras::detail {

Output clip_by_value(Output x, double lo, double hi) {
  const Output lower = ops::scalar_like(x, lo);
  const Output upper = ops::scalar_like(x, hi);
  const Output at_least_lo = lower + ops::relu(x - lower);
  return upper - ops::relu(upper - at_least_lo);
}

Output clip_probabilities(Output p) { return clip_by_value(p, kProbabilityEpsilon, 1.0 - kProbabilityEpsilon); }

Output mean_over_non_batch_axes(Output x) {
  if (x.shape().rank() <= 1) return x;
  std::vector<std::int64_t> axes;
  for (int i = 1; i < x.shape().rank(); ++i) axes.push_back(i);
  return ops::reduce_mean(x, {.axes = axes});
}

Shape adapted_target_shape(const Shape& y_true, const Shape& y_pred) {
  Shape t = y_true;
  if (t.rank() == y_pred.rank() - 1 && y_pred.rank() > 0 && y_pred.dim(-1) == 1) t.push_back(1);
  return t;
}

Output targets_like_predictions(Output y_true, Output y_pred) {
  Output y = ops::cast(y_true, y_pred.dtype());
  const Shape& t = y.shape();
  const Shape& p = y_pred.shape();
  if (adapted_target_shape(t, p).rank() != t.rank()) {
    Shape target = p;
    target[0] = Shape::kUnknown;
    y = ops::reshape(y, target);
  }
  // The trainer checked the loss's targets (target_shape_requirement); a metric's may still differ.
  TANDEM_REQUIRE(y.shape().rank() == p.rank(), InvalidArgument,
                 "targets of shape {} do not match predictions of shape {}", t, p);
  return y;
}

Shape class_ids_shape(const Shape& y_pred) {
  Shape ids;
  for (int i = 0; i + 1 < y_pred.rank(); ++i) ids.push_back(y_pred[i]);
  return ids;
}

bool are_class_ids(const Shape& y_true, const Shape& y_pred) {
  const Shape ids = class_ids_shape(y_pred);
  if (y_true.rank() == 0 || ids.rank() == 0) return false;
  Shape t = y_true;
  if (t.rank() == ids.rank() + 1 && (t.dim(-1) == 1 || t.dim(-1) == Shape::kUnknown)) {
    Shape trimmed;
    for (int i = 0; i + 1 < t.rank(); ++i) trimmed.push_back(t[i]);
    t = trimmed;
  }
  // The batch dimension is the data's business; the others must match.
  return t.rank() == ids.rank() && t.with_dim(0, Shape::kUnknown).compatible_with(ids.with_dim(0, Shape::kUnknown));
}

std::string class_ids_shapes(const Shape& y_pred) {
  if (y_pred.rank() < 2) return fmt::format("none (predictions {} have no classes axis)", y_pred);
  Shape ids = class_ids_shape(y_pred).with_dim(0, Shape::kUnknown);
  const std::string without = ids.to_string();
  ids.push_back(1);
  return fmt::format("{} or {}", without, ids);
}

Output class_ids(Output y_true, Output y_pred, std::string_view what) {
  Output labels = y_true;
  const Shape& t = labels.shape();
  const Shape ids = class_ids_shape(y_pred.shape());
  TANDEM_REQUIRE(are_class_ids(t, y_pred.shape()), InvalidArgument,
                 "{}: class ids must have shape {}; got {} for predictions {}", what, class_ids_shapes(y_pred.shape()),
                 t, y_pred.shape());
  if (t.rank() > ids.rank()) labels = ops::reshape(labels, ids.with_dim(0, Shape::kUnknown));
  if (labels.dtype() != DType::kI64 && labels.dtype() != DType::kI32) labels = ops::cast(labels, DType::kI64);
  return labels;
}

}  // namespace tandem::keras::detail
