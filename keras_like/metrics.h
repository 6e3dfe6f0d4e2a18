// tandem/keras_like/metrics.h — metrics by Keras name or as typed objects.
//
// A metric is a running mean over the examples seen (Keras's MeanMetricWrapper): each batch adds
// the sum of its per-example values and the number of examples; reading divides. Under a
// distribution strategy the sums are kept per replica and added when read.
#pragma once

#include <string>
#include <string_view>
#include <variant>

#include "tandem/graph/graph.h"
#include "tandem/keras_like/losses.h"

namespace tandem::keras {

// "accuracy": Keras picks binary, sparse categorical or categorical accuracy from the shapes of
// the targets and predictions.
struct Accuracy {};
struct SparseCategoricalAccuracy {};
struct CategoricalAccuracy {};
struct BinaryAccuracy {
  double threshold = 0.5;
};
struct MeanSquaredErrorMetric {};
struct MeanAbsoluteErrorMetric {};
// The compiled loss of the metric's output, as a metric.
struct LossMetric {
  LossSpec loss;
};

using MetricSpec = std::variant<Accuracy, SparseCategoricalAccuracy, CategoricalAccuracy, BinaryAccuracy,
                                MeanSquaredErrorMetric, MeanAbsoluteErrorMetric, LossMetric>;

// A metric as compile() takes it: a Keras identifier ("accuracy" / "acc", resolved from the loss
// like Keras does; "sparse_categorical_accuracy", "categorical_accuracy", "binary_accuracy",
// "mse", "mae", ...) or an object.
class MetricRef {
 public:
  MetricRef(const char* name) : name_(name) {}             // NOLINT: Keras-style strings
  MetricRef(std::string name) : name_(std::move(name)) {}  // NOLINT
  template <class M>
  requires std::is_constructible_v<MetricSpec, M> MetricRef(M metric)
      : spec_(std::move(metric)), resolved_(true) {}  // NOLINT

  // The metric and the name it is logged under (the string given, as Keras logs "accuracy" or
  // "acc"; an object's snake_case name). Throws InvalidArgument listing the known names.
  std::pair<MetricSpec, std::string> resolve() const;

 private:
  std::string name_;
  MetricSpec spec_;
  bool resolved_ = false;
};

// The sum over the batch of the metric's per-example values: a float32 scalar in y_pred's graph.
Output metric_sum(const MetricSpec& metric, Output y_true, Output y_pred);

}  // namespace tandem::keras
