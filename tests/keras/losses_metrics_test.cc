// Losses and metrics against hand-computed Keras values.
#include <doctest/doctest.h>

#include <cmath>

#include "tandem/graph/executor.h"
#include "tandem/keras_like/losses.h"
#include "tandem/keras_like/metrics.h"
#include "tandem/ops/ops.h"

using namespace tandem;
using namespace tandem::keras;

namespace {

// Runs fn(y_true, y_pred) on the given values and returns the result as doubles.
template <class F>
std::vector<double> eval(const Tensor& y_true, const Tensor& y_pred, F fn) {
  auto g = std::make_shared<Graph>();
  auto t = g->placeholder(y_true.dtype(), y_true.shape(), "y_true");
  auto p = g->placeholder(y_pred.dtype(), y_pred.shape(), "y_pred");
  const Output out = ops::cast(fn(t, p), kFloat64);
  graph::Executor ex(g, devices::default_cpu_device());
  return ex.run({{t, y_true}, {p, y_pred}}, {out})[0].to_vector<double>();
}

const Tensor kProbs = Tensor::from_vector<float>({0.7f, 0.2f, 0.1f, 0.1f, 0.3f, 0.6f}, {2, 3});
const Tensor kLogits = Tensor::from_vector<float>({2.0f, 1.0f, 0.1f, -1.0f, 0.5f, 2.5f}, {2, 3});
const Tensor kIds = Tensor::from_vector<std::int64_t>({0, 1}, {2});
const Tensor kOneHot = Tensor::from_vector<float>({1, 0, 0, 0, 1, 0}, {2, 3});

double log_softmax_at(const std::vector<double>& row, int k) {
  double m = *std::max_element(row.begin(), row.end()), s = 0;
  for (double v : row) s += std::exp(v - m);
  return row[static_cast<std::size_t>(k)] - m - std::log(s);
}

}  // namespace

TEST_CASE("crossentropies, from probabilities and from logits") {
  const auto sparse =
      eval(kIds, kProbs, [](Output t, Output p) { return per_example_loss(SparseCategoricalCrossentropy{}, t, p); });
  CHECK(sparse[0] == doctest::Approx(-std::log(0.7)));
  CHECK(sparse[1] == doctest::Approx(-std::log(0.3)));
  const auto dense =
      eval(kOneHot, kProbs, [](Output t, Output p) { return per_example_loss(CategoricalCrossentropy{}, t, p); });
  CHECK(dense == sparse);

  const auto sparse_logits = eval(kIds, kLogits, [](Output t, Output p) {
    return per_example_loss(SparseCategoricalCrossentropy{.from_logits = true}, t, p);
  });
  CHECK(sparse_logits[0] == doctest::Approx(-log_softmax_at({2.0, 1.0, 0.1}, 0)).epsilon(1e-5));
  CHECK(sparse_logits[1] == doctest::Approx(-log_softmax_at({-1.0, 0.5, 2.5}, 1)).epsilon(1e-5));
  const auto dense_logits = eval(kOneHot, kLogits, [](Output t, Output p) {
    return per_example_loss(CategoricalCrossentropy{.from_logits = true}, t, p);
  });
  CHECK(dense_logits[0] == doctest::Approx(sparse_logits[0]).epsilon(1e-5));

  // Labels given as floats, and as a column: Keras accepts both for sparse losses.
  const auto float_ids = eval(Tensor::from_vector<float>({0, 1}, {2, 1}), kProbs, [](Output t, Output p) {
    return per_example_loss(SparseCategoricalCrossentropy{}, t, p);
  });
  CHECK(float_ids == sparse);
}

TEST_CASE("binary crossentropy and regression losses") {
  const Tensor y = Tensor::from_vector<float>({1, 0, 1, 1}, {2, 2});
  const Tensor p = Tensor::from_vector<float>({0.9f, 0.2f, 0.6f, 0.3f}, {2, 2});
  const auto bce = eval(y, p, [](Output t, Output q) { return per_example_loss(BinaryCrossentropy{}, t, q); });
  CHECK(bce[0] == doctest::Approx(-(std::log(0.9) + std::log(0.8)) / 2).epsilon(1e-5));
  CHECK(bce[1] == doctest::Approx(-(std::log(0.6) + std::log(0.3)) / 2).epsilon(1e-5));
  const Tensor z = Tensor::from_vector<float>({2.0f, -1.0f, 0.5f, 0.0f}, {2, 2});
  const auto bce_logits =
      eval(y, z, [](Output t, Output q) { return per_example_loss(BinaryCrossentropy{.from_logits = true}, t, q); });
  const auto sig = [](double x) { return 1 / (1 + std::exp(-x)); };
  CHECK(bce_logits[0] == doctest::Approx(-(std::log(sig(2.0)) + std::log(1 - sig(-1.0))) / 2).epsilon(1e-5));

  const Tensor target = Tensor::from_vector<float>({1, 2, 3}, {3});  // (batch,) against (batch, 1)
  const Tensor pred = Tensor::from_vector<float>({1.5f, 1.0f, 3.0f}, {3, 1});
  CHECK(eval(target, pred, [](Output t, Output q) { return per_example_loss(MeanSquaredError{}, t, q); }) ==
        std::vector<double>{0.25, 1.0, 0.0});
  CHECK(eval(target, pred, [](Output t, Output q) { return per_example_loss(MeanAbsoluteError{}, t, q); }) ==
        std::vector<double>{0.5, 1.0, 0.0});
  const Tensor int_target = Tensor::from_vector<std::int32_t>({1, 2, 3}, {3, 1});
  CHECK(eval(int_target, pred, [](Output t, Output q) { return per_example_loss(MeanSquaredError{}, t, q); }) ==
        std::vector<double>{0.25, 1.0, 0.0});
}

TEST_CASE("accuracy metrics, and how \"accuracy\" is resolved from shapes") {
  const auto sum = [](const MetricSpec& m, const Tensor& t, const Tensor& p) {
    return eval(t, p, [&](Output a, Output b) { return metric_sum(m, a, b); })[0];
  };
  CHECK(sum(SparseCategoricalAccuracy{}, kIds, kProbs) == 1.0);  // row 0 right, row 1 wrong
  CHECK(sum(CategoricalAccuracy{}, kOneHot, kProbs) == 1.0);
  CHECK(sum(Accuracy{}, kIds, kProbs) == 1.0);     // sparse by shapes
  CHECK(sum(Accuracy{}, kOneHot, kProbs) == 1.0);  // categorical by shapes
  const Tensor y = Tensor::from_vector<float>({1, 0, 1}, {3, 1});
  const Tensor p = Tensor::from_vector<float>({0.8f, 0.6f, 0.4f}, {3, 1});
  CHECK(sum(BinaryAccuracy{}, y, p) == 1.0);
  CHECK(sum(Accuracy{}, y, p) == 1.0);  // binary by shapes
  CHECK(sum(BinaryAccuracy{.threshold = 0.3}, y, p) == 2.0);
  CHECK(sum(MeanSquaredErrorMetric{}, y, p) == doctest::Approx(0.04 + 0.36 + 0.36));
}

TEST_CASE("Keras names, and unknown names listing the known ones") {
  CHECK(LossRef("mse").name() == "mean_squared_error");
  CHECK(LossRef("sparse_categorical_crossentropy").name() == "sparse_categorical_crossentropy");
  CHECK(std::get<SparseCategoricalCrossentropy>(LossRef(SparseCategoricalCrossentropy{.from_logits = true}).spec())
            .from_logits);
  CHECK_THROWS_WITH_AS(LossRef("hinge"), doctest::Contains("known: mse"), InvalidArgument);
  CHECK(MetricRef("accuracy").resolve().second == "accuracy");
  CHECK(MetricRef("acc").resolve().second == "acc");
  CHECK(MetricRef(BinaryAccuracy{}).resolve().second == "binary_accuracy");
  CHECK_THROWS_WITH_AS(MetricRef("f1").resolve(), doctest::Contains("unknown metric \"f1\""), InvalidArgument);
}
