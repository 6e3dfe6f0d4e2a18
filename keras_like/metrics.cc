// Keras's accuracy and error metrics, as a per-batch sum of per-example values.
#include "tandem/keras_like/metrics.h"

#include "tandem/keras_like/detail/graph_util.h"
#include "tandem/ops/ops.h"

namespace tandem::keras {
namespace {

constexpr std::string_view kKnownMetrics =
    "accuracy, acc, sparse_categorical_accuracy, categorical_accuracy, binary_accuracy, mse, mean_squared_error, mae, "
    "mean_absolute_error";

Output sum_f32(Output per_example) { return ops::reduce_sum(ops::cast(per_example, DType::kF32)); }

Output sparse_categorical_accuracy(Output y_true, Output y_pred) {
  const Output labels = ops::cast(detail::class_ids(y_true, y_pred, "sparse_categorical_accuracy"), DType::kI64);
  // Per example, the fraction of its positions right (one position for [batch, classes]).
  return sum_f32(detail::mean_over_non_batch_axes(ops::cast(ops::equal(ops::argmax(y_pred, -1), labels), DType::kF32)));
}

Output categorical_accuracy(Output y_true, Output y_pred) {
  return sum_f32(ops::equal(ops::argmax(y_pred, -1), ops::argmax(y_true, -1)));
}

Output binary_accuracy(Output y_true, Output y_pred, double threshold) {
  const Output y = detail::targets_like_predictions(y_true, y_pred);
  // 1 where y_pred > threshold: sign is 1 above, 0 at and -1 below; relu keeps the 1.
  const Output predicted = ops::relu(ops::sign(y_pred - ops::scalar_like(y_pred, threshold)));
  const Output match = ops::cast(ops::equal(y, predicted), y_pred.dtype());
  return sum_f32(detail::mean_over_non_batch_axes(match));
}

}  // namespace

std::pair<MetricSpec, std::string> MetricRef::resolve() const {
  if (resolved_) {
    const std::string name = std::visit(
        [](const auto& m) -> std::string {
          using M = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<M, Accuracy>) return "accuracy";
          if constexpr (std::is_same_v<M, SparseCategoricalAccuracy>) return "sparse_categorical_accuracy";
          if constexpr (std::is_same_v<M, CategoricalAccuracy>) return "categorical_accuracy";
          if constexpr (std::is_same_v<M, BinaryAccuracy>) return "binary_accuracy";
          if constexpr (std::is_same_v<M, MeanSquaredErrorMetric>) return "mean_squared_error";
          if constexpr (std::is_same_v<M, MeanAbsoluteErrorMetric>) return "mean_absolute_error";
          if constexpr (std::is_same_v<M, LossMetric>) return LossRef(m.loss).name();
        },
        spec_);
    return {spec_, name};
  }
  const std::string& n = name_;
  if (n == "accuracy" || n == "acc") return {Accuracy{}, n};
  if (n == "sparse_categorical_accuracy") return {SparseCategoricalAccuracy{}, n};
  if (n == "categorical_accuracy") return {CategoricalAccuracy{}, n};
  if (n == "binary_accuracy") return {BinaryAccuracy{}, n};
  if (n == "mse" || n == "mean_squared_error") return {MeanSquaredErrorMetric{}, n};
  if (n == "mae" || n == "mean_absolute_error") return {MeanAbsoluteErrorMetric{}, n};
  throw InvalidArgument(fmt::format("unknown metric \"{}\"; known: {}", n, kKnownMetrics));
}

Output metric_sum(const MetricSpec& metric, Output y_true, Output y_pred) {
  return std::visit(
      [&](const auto& m) -> Output {
        using M = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<M, Accuracy>) {
          // Keras 3's choice (compile_utils.get_metric): one output unit -> binary; targets with one
          // fewer dimension, or a single column against several classes -> sparse; else categorical.
          const Shape& t = y_true.shape();
          const Shape& p = y_pred.shape();
          const bool binary = p.rank() <= 1 || p.dim(-1) == 1;
          const bool sparse = t.rank() == p.rank() - 1 || (t.rank() == p.rank() && t.dim(-1) == 1 && p.dim(-1) != 1);
          if (binary) return binary_accuracy(y_true, y_pred, 0.5);
          if (sparse) return sparse_categorical_accuracy(y_true, y_pred);
          return categorical_accuracy(y_true, y_pred);
        } else if constexpr (std::is_same_v<M, SparseCategoricalAccuracy>) {
          return sparse_categorical_accuracy(y_true, y_pred);
        } else if constexpr (std::is_same_v<M, CategoricalAccuracy>) {
          return categorical_accuracy(y_true, y_pred);
        } else if constexpr (std::is_same_v<M, BinaryAccuracy>) {
          return binary_accuracy(y_true, y_pred, m.threshold);
        } else if constexpr (std::is_same_v<M, MeanSquaredErrorMetric>) {
          return sum_f32(per_example_loss(MeanSquaredError{}, y_true, y_pred));
        } else if constexpr (std::is_same_v<M, MeanAbsoluteErrorMetric>) {
          return sum_f32(per_example_loss(MeanAbsoluteError{}, y_true, y_pred));
        } else {
          return sum_f32(per_example_loss(m.loss, y_true, y_pred));
        }
      },
      metric);
}

}  // namespace tandem::keras
