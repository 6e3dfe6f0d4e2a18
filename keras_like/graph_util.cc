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

Output class_ids(Output y_true, Output y_pred, std::string_view what) {
  Output labels = y_true;
  const Shape& t = labels.shape();
  TANDEM_REQUIRE(t.rank() == 1 || (t.rank() == 2 && t[1] == 1), InvalidArgument,
                 "{}: class ids must have shape (batch,) or (batch, 1); got {} for predictions {}", what, t,
                 y_pred.shape());
  if (t.rank() == 2) labels = ops::reshape(labels, {-1});
  if (labels.dtype() != DType::kI64 && labels.dtype() != DType::kI32) labels = ops::cast(labels, DType::kI64);
  return labels;
}

}  // namespace tandem::keras::detail
