// Keras 3's losses (keras/src/losses/losses.py), per example.
#include "tandem/keras_like/losses.h"

#include "tandem/keras_like/detail/graph_util.h"
#include "tandem/ops/ops.h"

namespace tandem::keras {
namespace {

constexpr std::string_view kKnownLosses =
    "mse, mean_squared_error, mae, mean_absolute_error, sparse_categorical_crossentropy, categorical_crossentropy, "
    "binary_crossentropy";

}  // namespace

LossRef::LossRef(std::string_view name) {
  if (name == "mse" || name == "mean_squared_error" || name == "MeanSquaredError") {
    spec_ = MeanSquaredError{};
  } else if (name == "mae" || name == "mean_absolute_error" || name == "MeanAbsoluteError") {
    spec_ = MeanAbsoluteError{};
  } else if (name == "sparse_categorical_crossentropy" || name == "SparseCategoricalCrossentropy") {
    spec_ = SparseCategoricalCrossentropy{};
  } else if (name == "categorical_crossentropy" || name == "CategoricalCrossentropy") {
    spec_ = CategoricalCrossentropy{};
  } else if (name == "binary_crossentropy" || name == "BinaryCrossentropy") {
    spec_ = BinaryCrossentropy{};
  } else {
    throw InvalidArgument(fmt::format("unknown loss \"{}\"; known: {}", name, kKnownLosses));
  }
}

std::string LossRef::name() const {
  return std::visit(
      [](const auto& l) -> std::string {
        using L = std::decay_t<decltype(l)>;
        if constexpr (std::is_same_v<L, MeanSquaredError>) return "mean_squared_error";
        if constexpr (std::is_same_v<L, MeanAbsoluteError>) return "mean_absolute_error";
        if constexpr (std::is_same_v<L, SparseCategoricalCrossentropy>) return "sparse_categorical_crossentropy";
        if constexpr (std::is_same_v<L, CategoricalCrossentropy>) return "categorical_crossentropy";
        if constexpr (std::is_same_v<L, BinaryCrossentropy>) return "binary_crossentropy";
        if constexpr (std::is_same_v<L, CustomLoss>) return l.name.empty() ? std::string("custom_loss") : l.name;
      },
      spec_);
}

Output per_example_loss(const LossSpec& loss, Output y_true, Output y_pred) {
  using detail::clip_probabilities;
  using detail::mean_over_non_batch_axes;
  using detail::targets_like_predictions;
  return std::visit(
      [&](const auto& l) -> Output {
        using L = std::decay_t<decltype(l)>;
        if constexpr (std::is_same_v<L, MeanSquaredError>) {
          return mean_over_non_batch_axes(ops::square(y_pred - targets_like_predictions(y_true, y_pred)));
        } else if constexpr (std::is_same_v<L, MeanAbsoluteError>) {
          return mean_over_non_batch_axes(ops::abs(y_pred - targets_like_predictions(y_true, y_pred)));
        } else if constexpr (std::is_same_v<L, SparseCategoricalCrossentropy>) {
          const Output labels = detail::class_ids(y_true, y_pred, "sparse_categorical_crossentropy");
          // Predictions [batch, ..., classes] (a sequence model's [B, T, V]): one loss per
          // position, and per example their mean (Keras averages over every position of the
          // batch: the same when every example has as many).
          if (l.from_logits && y_pred.shape().rank() == 2)
            return ops::sparse_softmax_cross_entropy_with_logits(y_pred, labels);
          if (l.from_logits) {
            const std::int64_t classes = y_pred.shape().dim(-1);
            const Output per_position = ops::sparse_softmax_cross_entropy_with_logits(ops::reshape(y_pred, {-1, classes}),
                                                                                      ops::reshape(labels, {-1}));
            return mean_over_non_batch_axes(ops::reshape(per_position, labels.shape()));
          }
          // Probabilities: renormalise and clip like Keras, then -log p[label].
          const Output p = clip_probabilities(y_pred / ops::reduce_sum(y_pred, {.axes = {-1}, .keep_dims = true}));
          const Output one_hot = ops::cast(ops::one_hot(labels, y_pred.shape().dim(-1)), y_pred.dtype());
          return mean_over_non_batch_axes(-ops::reduce_sum(one_hot * ops::log(p), {.axes = {-1}}));
        } else if constexpr (std::is_same_v<L, CategoricalCrossentropy>) {
          Output labels = targets_like_predictions(y_true, y_pred);
          if (l.label_smoothing > 0) {
            const double classes = static_cast<double>(y_pred.shape().dim(-1));
            labels = labels * ops::scalar_like(labels, 1.0 - l.label_smoothing) +
                     ops::scalar_like(labels, l.label_smoothing / classes);
          }
          if (l.from_logits) return ops::softmax_cross_entropy_with_logits(y_pred, labels);
          const Output p = clip_probabilities(y_pred / ops::reduce_sum(y_pred, {.axes = {-1}, .keep_dims = true}));
          return -ops::reduce_sum(labels * ops::log(p), {.axes = {-1}});
        } else if constexpr (std::is_same_v<L, BinaryCrossentropy>) {
          Output labels = targets_like_predictions(y_true, y_pred);
          if (l.label_smoothing > 0) {
            labels = labels * ops::scalar_like(labels, 1.0 - l.label_smoothing) +
                     ops::scalar_like(labels, 0.5 * l.label_smoothing);
          }
          if (l.from_logits) return mean_over_non_batch_axes(ops::sigmoid_cross_entropy_with_logits(y_pred, labels));
          const Output p = clip_probabilities(y_pred);
          const Output one = ops::scalar_like(p, 1.0);
          return mean_over_non_batch_axes(-(labels * ops::log(p) + (one - labels) * ops::log(one - p)));
        } else {
          TANDEM_REQUIRE(static_cast<bool>(l.fn), InvalidArgument, "custom loss \"{}\" has no function", l.name);
          const Output per_example = l.fn(y_true, y_pred);
          TANDEM_REQUIRE(per_example.shape().rank() == 1, InvalidArgument,
                         "custom loss \"{}\" must return one value per example (shape (None,)); it returned {}", l.name,
                         per_example.shape());
          return per_example;
        }
      },
      loss);
}

std::optional<std::string> target_shape_requirement(const LossSpec& loss, const Shape& y_true, const Shape& y_pred) {
  if (std::holds_alternative<CustomLoss>(loss)) return std::nullopt;
  if (std::holds_alternative<SparseCategoricalCrossentropy>(loss)) {
    if (detail::are_class_ids(y_true, y_pred)) return std::nullopt;
    return fmt::format("class ids of shape {} for the output's shape {}{}", detail::class_ids_shapes(y_pred), y_pred,
                       y_true.compatible_with(y_pred) ? " (one-hot targets go with categorical_crossentropy)" : "");
  }
  if (detail::adapted_target_shape(y_true, y_pred).compatible_with(y_pred)) return std::nullopt;
  const bool class_ids_given = std::holds_alternative<CategoricalCrossentropy>(loss) && y_true.rank() == 1;
  return fmt::format("targets of the output's shape {}{}", y_pred,
                     class_ids_given ? " (class ids go with sparse_categorical_crossentropy)" : "");
}

}  // namespace tandem::keras
