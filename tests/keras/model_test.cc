// Models: Sequential and functional construction, compile/fit/evaluate/predict, summary,
// strategies, and the errors users meet.
#include <doctest/doctest.h>

#include <random>

#include "common/error_message.h"
#include "tandem/base/random.h"
#include "tandem/keras_like/keras.h"
#include "tandem/ops/ops.h"

using namespace tandem;

namespace {

// Two Gaussian blobs per class in 4 dimensions: easy to separate.
struct Blobs {
  Tensor x, y;
};
Blobs blobs(std::int64_t n, int classes, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> noise(0.0f, 0.3f);
  std::vector<float> xs(static_cast<std::size_t>(n * 4));
  std::vector<std::int64_t> ys(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const auto c = static_cast<int>(i % classes);
    ys[static_cast<std::size_t>(i)] = c;
    for (int f = 0; f < 4; ++f) xs[static_cast<std::size_t>(i * 4 + f)] = (f == c % 4 ? 2.0f : 0.0f) + noise(rng);
  }
  return {Tensor::from_vector(xs, {n, 4}), Tensor::from_vector(ys, {n})};
}

}  // namespace

TEST_CASE("the Keras tutorial model: summary table and parameter counts") {
  auto model = keras::Sequential({keras::Input({28, 28}), keras::Flatten("flatten_t"),
                                  keras::Dense(128, "relu", {.name = "hidden"}), keras::Dense(10, {.name = "logits"})},
                                 "tutorial");
  CHECK(model.count_params() == 101770);
  const std::string expected =
      "Model: \"tutorial\"\n"
      "_________________________________________________________________\n"
      " Layer (type)                Output Shape              Param #   \n"
      "=================================================================\n"
      " flatten_t (Flatten)         (None, 784)               0         \n"
      "                                                                 \n"
      " hidden (Dense)              (None, 128)               100480    \n"
      "                                                                 \n"
      " logits (Dense)              (None, 10)                1290      \n"
      "                                                                 \n"
      "=================================================================\n"
      "Total params: 101770 (397.54 KB)\n"
      "Trainable params: 101770 (397.54 KB)\n"
      "Non-trainable params: 0 (0.00 Byte)\n"
      "_________________________________________________________________\n";
  CHECK(model.summary_string() == expected);
}

TEST_CASE("layers get unique Keras-style names") {
  keras::Dense a(2), b(2);
  const std::string first = a.name(), second = b.name();
  CHECK(first.rfind("dense", 0) == 0);
  CHECK(second.rfind("dense_", 0) == 0);
  CHECK(first != second);
}

TEST_CASE("fit learns, evaluate and predict agree, and the same seed repeats the run") {
  const auto run = [] {
    set_global_seed(42);
    auto [x, y] = blobs(512, 3, 7);
    auto model = keras::Sequential({keras::Input({4}), keras::Dense(16, "relu"), keras::Dense(3)});
    model.compile(keras::Adam{.learning_rate = 0.01}, keras::SparseCategoricalCrossentropy{.from_logits = true},
                  {"accuracy"});
    auto history = model.fit(x, y, {.batch_size = 32, .epochs = 5, .verbose = 0, .validation_split = 0.25});
    return std::pair{history, model};
  };
  auto [history, model] = run();
  const auto& loss = history.at("loss");
  REQUIRE(loss.size() == 5);
  CHECK(loss.back() < loss.front());
  CHECK(history.at("accuracy").back() > 0.9);
  CHECK(history.at("val_accuracy").back() > 0.9);
  CHECK(history.epoch == std::vector<int>{0, 1, 2, 3, 4});

  auto [x, y] = blobs(300, 3, 8);
  const auto logs = model.evaluate(x, y, {.batch_size = 64, .verbose = 0});
  CHECK(logs.at("accuracy") > 0.9);
  const Tensor logits = model.predict(x, {.batch_size = 64});
  CHECK(logits.shape() == Shape{300, 3});
  // Accuracy recomputed from predict() matches evaluate().
  const auto l = logits.to_vector<float>();
  const auto labels = y.to_vector<std::int64_t>();
  int correct = 0;
  for (int i = 0; i < 300; ++i) {
    const auto row = l.begin() + i * 3;
    correct += std::max_element(row, row + 3) - row == labels[static_cast<std::size_t>(i)];
  }
  CHECK(correct / 300.0 == doctest::Approx(logs.at("accuracy")));

  auto [again, unused] = run();
  CHECK(again.at("loss") == loss);
}

TEST_CASE("the regression example: compile(\"adam\", \"mse\") on a dataset") {
  set_global_seed(1);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> xs(2048 * 2), ys(2048);
  for (int i = 0; i < 2048; ++i) {
    xs[static_cast<std::size_t>(2 * i)] = normal(rng);
    xs[static_cast<std::size_t>(2 * i + 1)] = normal(rng);
    ys[static_cast<std::size_t>(i)] =
        0.5f * xs[static_cast<std::size_t>(2 * i)] - 0.25f * xs[static_cast<std::size_t>(2 * i + 1)] + 0.1f;
  }
  auto dataset =
      data::Dataset::from_tensor_slices({Tensor::from_vector(xs, {2048, 2}), Tensor::from_vector(ys, {2048})})
          .shuffle(2048)
          .batch(16);
  auto model = keras::Sequential({keras::Input({2}), keras::Dense(1)});
  model.compile(keras::Adam{.learning_rate = 0.01}, "mse", {"mae"});
  auto history = model.fit(dataset, {.epochs = 10, .verbose = 0});
  CHECK(history.at("loss").back() < 1e-3);
  CHECK(history.history.contains("mae"));
}

TEST_CASE("functional models: several inputs and outputs, a shared layer, per-output losses") {
  set_global_seed(5);
  auto a = keras::Input({4}, kFloat32, "a");
  auto b = keras::Input({4}, kFloat32, "b");
  keras::Dense shared(8, "tanh", {.name = "shared"});
  keras::KerasTensor merged = keras::Add("merge")({shared(a), shared(b)});
  auto class_out = keras::Dense(3, {.name = "classes"})(merged);
  auto value_out = keras::Dense(1, {.name = "value"})(merged);
  keras::Model model({a, b}, {class_out, value_out}, "two_heads");
  CHECK(model.layers().size() == 4);  // shared counted once
  CHECK(model.count_params() == 4 * 8 + 8 + 8 * 3 + 3 + 8 + 1);
  model.compile("adam", {keras::SparseCategoricalCrossentropy{.from_logits = true}, "mse"}, {"accuracy"},
                {.loss_weights = {1.0, 0.5}});
  auto [x, y] = blobs(256, 3, 9);
  auto values = Tensor::filled<float>({256, 1}, 0.5f);
  auto dataset = data::Dataset::from_tensor_slices({x, x, y, values}).batch(32);
  auto history = model.fit(dataset, {.epochs = 3, .verbose = 0});
  CHECK(history.history.contains("classes_loss"));
  CHECK(history.history.contains("value_loss"));
  CHECK(history.history.contains("classes_accuracy"));
  // The total is the weighted sum of the parts.
  CHECK(history.at("loss").back() ==
        doctest::Approx(history.at("classes_loss").back() + 0.5 * history.at("value_loss").back()).epsilon(1e-4));
  const auto outputs = model.predict_outputs(data::Dataset::from_tensor_slices({x, x}).batch(100));
  CHECK(outputs.size() == 2);
  CHECK(outputs[0].shape() == Shape{256, 3});
  CHECK(outputs[1].shape() == Shape{256, 1});
  CHECK(model.summary_string().find("a (InputLayer)") != std::string::npos);
}

TEST_CASE("a Sequential without an Input builds on its first data") {
  auto model = keras::Sequential({keras::Dense(5, "relu"), keras::Dense(2)});
  CHECK_FALSE(model.built());
  model.compile("sgd", keras::SparseCategoricalCrossentropy{.from_logits = true});
  auto [x, y] = blobs(64, 2, 1);
  model.fit(x, y, {.epochs = 1, .verbose = 0});
  CHECK(model.built());
  CHECK(model.weights().size() == 4);
  CHECK(model.inputs().front().shape() == Shape{-1, 4});
}

TEST_CASE("get_weights / set_weights round trip and check shapes") {
  auto model = keras::Sequential({keras::Input({3}), keras::Dense(2)});
  auto weights = model.get_weights();
  REQUIRE(weights.size() == 2);
  weights[0].data<float>()[0] = 7.0f;
  model.set_weights(weights);
  CHECK(model.get_weights()[0].to_vector<float>()[0] == 7.0f);
  weights[1] = Tensor::zeros({3}, kFloat32);
  CHECK_THROWS_WITH_AS(model.set_weights(weights), doctest::Contains("/bias"), InvalidArgument);
}

TEST_CASE("user mistakes get clear errors") {
  // Shapes that do not fit, at construction.
  auto x = keras::Input({28});
  keras::Dense wants_784(4);
  auto big = keras::Input({784});
  wants_784(big);  // builds with 784 features
  CHECK_THROWS_WITH_AS(wants_784(x), doctest::Contains("input has 28 features, kernel expects 784"), InvalidArgument);
  CHECK_THROWS_WITH_AS(keras::Dense(4, "swish"), doctest::Contains("unknown activation \"swish\""), InvalidArgument);
  CHECK_THROWS_WITH_AS(keras::Dense(0), doctest::Contains("units must be positive"), InvalidArgument);

  auto model = keras::Sequential({keras::Input({4}), keras::Dense(2)});
  auto [xs, ys] = blobs(16, 2, 2);
  CHECK_THROWS_WITH_AS(model.fit(xs, ys), doctest::Contains("call compile() before fit()"), FailedPrecondition);
  model.compile("adam", keras::SparseCategoricalCrossentropy{.from_logits = true});
  auto wrong = Tensor::zeros({16, 5}, kFloat32);
  CHECK_THROWS_WITH_AS(model.fit(wrong, ys, {.verbose = 0}),
                       doctest::Contains("expects shape (None, 4); the data gives (None, 5)"), InvalidArgument);
  CHECK_THROWS_WITH_AS(model.fit(xs, Tensor::zeros({3}, kInt64), {.verbose = 0}),
                       doctest::Contains("same number of examples"), InvalidArgument);
  CHECK_THROWS_WITH_AS(model.compile("adam", "hinge"), doctest::Contains("unknown loss"), InvalidArgument);
  CHECK_THROWS_WITH_AS(model.get_layer("nope"), doctest::Contains("has no layer \"nope\""), NotFound);
  keras::Model empty;
  CHECK_THROWS_AS(empty.fit(xs, ys), FailedPrecondition);
}

TEST_CASE("a model is used under the strategy that made it") {
  OneDeviceStrategy first("CPU:0");
  OneDeviceStrategy second("CPU:0");
  keras::Model model;
  {
    auto scope = first.scope();
    model = keras::Sequential({keras::Input({4}), keras::Dense(2)});
    model.compile("adam", keras::SparseCategoricalCrossentropy{.from_logits = true});
  }
  CHECK(&model.distribute_strategy() == &first);
  CHECK(&model.weights().front()->strategy() == &first);
  auto [x, y] = blobs(32, 2, 3);
  model.fit(x, y, {.verbose = 0});  // outside any scope: runs under `first`
  auto scope = second.scope();
  try {
    model.fit(x, y, {.verbose = 0});
    FAIL("expected FailedPrecondition");
  } catch (const FailedPrecondition& e) {
    const std::string what = e.what();
    CHECK(what.find(first.name()) != std::string::npos);
    CHECK(what.find(second.name()) != std::string::npos);
  }
  CHECK_THROWS_WITH_AS(first.scope(), doctest::Contains("mixing different strategies"), FailedPrecondition);
}

TEST_CASE("fit honours steps_per_epoch, initial_epoch and stop_training") {
  auto model = keras::Sequential({keras::Input({4}), keras::Dense(2)});
  model.compile("sgd", keras::SparseCategoricalCrossentropy{.from_logits = true}, {"accuracy"});
  auto [x, y] = blobs(64, 2, 4);
  auto data = data::Dataset::from_tensor_slices({x, y}).batch(8).repeat();
  int batches = 0;
  auto counter = std::make_shared<keras::LambdaCallback>(
      keras::LambdaCallbackOptions{.on_train_batch_end = [&](std::int64_t, keras::Logs&) { ++batches; }});
  auto history =
      model.fit(data, {.epochs = 3, .verbose = 0, .callbacks = {counter}, .initial_epoch = 1, .steps_per_epoch = 5});
  CHECK(batches == 10);
  CHECK(history.epoch == std::vector<int>{1, 2});
  const auto before = model.optimizer().iterations();
  auto stopper = std::make_shared<keras::LambdaCallback>(
      keras::LambdaCallbackOptions{.on_train_batch_end = [&](std::int64_t batch, keras::Logs&) {
        if (batch == 2) model.set_stop_training(true);
      }});
  model.fit(data, {.epochs = 5, .verbose = 0, .callbacks = {stopper}, .steps_per_epoch = 5});
  CHECK(model.optimizer().iterations() == before + 3);
}

TEST_CASE("after its first steps a training step allocates only its batch: nothing holds on to the arena") {
  // An executor whose previous step's values are still referenced (a gradient kept past its
  // step) moves to a fresh arena: an allocation, and page faults, every step.
  const auto data = blobs(640, 3, 5);
  OneDeviceStrategy one("CPU:0");
  keras::Model model;
  {
    auto scope = one.scope();
    model = keras::Sequential({keras::Input({4}), keras::Dense(16, "relu"), keras::Dense(3)});
    model.compile("adam", keras::SparseCategoricalCrossentropy{.from_logits = true});
  }
  auto& allocator = devices::get_device("CPU:0").allocator();
  std::vector<std::int64_t> counts;
  auto recorder = std::make_shared<keras::LambdaCallback>(keras::LambdaCallbackOptions{
      .on_train_batch_end = [&](std::int64_t, keras::Logs&) { counts.push_back(allocator.stats().num_allocations); }});
  model.fit(data.x, data.y, {.batch_size = 32, .epochs = 1, .verbose = 0, .callbacks = {recorder}});
  REQUIRE(counts.size() == 20);
  // Each batch is two new tensors (its rows of x and y, copied by the input pipeline).
  for (std::size_t s = 4; s < counts.size(); ++s) CHECK_MESSAGE(counts[s] - counts[s - 1] <= 2, "step ", s);
}

TEST_CASE("no data is an error naming what was empty: fit, evaluate and predict alike") {
  auto model = keras::Sequential({keras::Input({4}), keras::Dense(3)}, "nodata");
  model.compile("adam", keras::SparseCategoricalCrossentropy{.from_logits = true}, {"accuracy"});
  const Tensor no_x = Tensor::zeros({0, 4}, kFloat32);
  const Tensor no_y = Tensor::zeros({0}, kInt64);
  const auto empty = data::Dataset::from_tensor_slices({no_x, no_y}).batch(8);
  // A pipeline whose length is known only by running it, and which yields nothing.
  const auto empty_unknown = data::Dataset::from_files({"a", "b"}, [&](const std::string&) {
                               return data::Dataset::from_tensor_slices({no_x, no_y});
                             }).batch(8);
  REQUIRE(empty_unknown.cardinality() < 0);

  // evaluate() returned loss 0 here.
  for (const auto* data : {&empty, &empty_unknown}) {
    const auto m = testing::error_message([&] { model.evaluate(*data, {.verbose = 0}); });
    CHECK(m.find("model \"nodata\"") != std::string::npos);
    CHECK(m.find("evaluate()") != std::string::npos);
    CHECK(m.find("no batches") != std::string::npos);
    CHECK_THROWS_WITH_AS(model.fit(*data, {.verbose = 0}), doctest::Contains("no batches"), InvalidArgument);
    CHECK_THROWS_WITH_AS(model.predict(*data), doctest::Contains("no batches"), InvalidArgument);
  }
  // Empty validation data is named as such.
  auto [x, y] = blobs(16, 3, 1);
  CHECK_THROWS_WITH_AS(model.fit(x, y, {.verbose = 0, .validation_data = empty}), doctest::Contains("validation_data"),
                       InvalidArgument);

  // fit(x, y) with no rows reported a shuffle buffer of 0; the arrays are what is empty.
  for (const bool shuffle : {true, false}) {
    const auto m = testing::error_message([&] { model.fit(no_x, no_y, {.verbose = 0, .shuffle = shuffle}); });
    CHECK(m.find("fit(x, y): x has 0 rows") != std::string::npos);
    CHECK(m.find("shuffle") == std::string::npos);
  }
  CHECK_THROWS_WITH_AS(model.evaluate(no_x, no_y, {.verbose = 0}), doctest::Contains("evaluate(x, y): x has 0 rows"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(model.predict(no_x), doctest::Contains("predict(x): x has 0 rows"), InvalidArgument);
}

TEST_CASE("targets whose shape does not suit the loss are reported at the loss, before any graph is built") {
  const Tensor x = Tensor::zeros({10, 4}, kFloat32);
  const auto model_with = [](keras::LossRef loss, std::int64_t units) {
    auto model = keras::Sequential({keras::Input({4}), keras::Dense(8, "relu"), keras::Dense(units, {.name = "head"})},
                                   "shapes");
    model.compile("adam", std::move(loss));
    return model;
  };
  struct Case {
    keras::LossRef loss;
    std::int64_t units;
    Shape y;
    std::string expected;  // what the message must say the loss needs
  };
  const std::vector<Case> cases = {
      // These failed inside the Dense layer's FusedMatMul, or broadcast silently.
      {"mse", 3, {10}, "(None, 3)"},
      {"mse", 3, {10, 5}, "(None, 3)"},
      {"mse", 3, {10, 1}, "(None, 3)"},
      {"mae", 3, {10, 3, 2}, "(None, 3)"},
      {keras::CategoricalCrossentropy{.from_logits = true}, 3, {10}, "(None, 3)"},
      {keras::CategoricalCrossentropy{.from_logits = true}, 3, {10, 5}, "(None, 3)"},
      {"binary_crossentropy", 1, {10, 2}, "(None, 1)"},
      {keras::SparseCategoricalCrossentropy{.from_logits = true}, 3, {10, 3}, "(None,) or (None, 1)"},
  };
  for (const auto& c : cases) {
    auto model = model_with(c.loss, c.units);
    const Tensor y = Tensor::zeros(c.y, kFloat32);
    Shape fed = c.y;
    fed[0] = Shape::kUnknown;
    const auto m = testing::error_message([&] { model.fit(x, y, {.verbose = 0}); });
    INFO(c.loss.name(), " ", fmt::format("{}", c.y), ": ", m);
    CHECK(m.find(c.loss.name()) != std::string::npos);
    CHECK(m.find("\"head\"") != std::string::npos);
    CHECK(m.find(fmt::format("{}", fed)) != std::string::npos);
    CHECK(m.find(c.expected) != std::string::npos);
    CHECK(m.find("MatMul") == std::string::npos);
    // evaluate() checks the same.
    CHECK_THROWS_AS(model.evaluate(x, y, {.verbose = 0}), InvalidArgument);
  }
  // One-hot targets with the sparse loss: the message points to the loss that takes them.
  auto sparse = model_with(keras::SparseCategoricalCrossentropy{.from_logits = true}, 3);
  CHECK_THROWS_WITH_AS(sparse.fit(x, Tensor::zeros({10, 3}, kFloat32), {.verbose = 0}),
                       doctest::Contains("categorical_crossentropy"), InvalidArgument);
  // What Keras accepts still trains: (batch,) targets against a (batch, 1) output, class ids as
  // (batch,) or (batch, 1), and probabilities of the output's shape.
  model_with("mse", 1).fit(x, Tensor::zeros({10}, kFloat32), {.verbose = 0});
  model_with("binary_crossentropy", 1).fit(x, Tensor::zeros({10, 1}, kFloat32), {.verbose = 0});
  model_with(keras::SparseCategoricalCrossentropy{.from_logits = true}, 3)
      .fit(x, Tensor::zeros({10, 1}, kInt64), {.verbose = 0});
  model_with(keras::CategoricalCrossentropy{.from_logits = true}, 3)
      .fit(x, Tensor::zeros({10, 3}, kFloat32), {.verbose = 0});
  // A custom loss decides for itself.
  model_with(keras::CustomLoss{.name = "first_column",
                               .fn =
                                   [](graph::Output y_true, graph::Output y_pred) {
                                     return ops::reduce_sum(ops::square(y_pred - y_true), {.axes = {-1}});
                                   }},
             3)
      .fit(x, Tensor::zeros({10, 1}, kFloat32), {.verbose = 0});
}
