// Callbacks, driven hook by hook with made-up logs (exact, fast), then through fit().
#include <doctest/doctest.h>

#include "common/error_message.h"
#include "common/temp_dir.h"
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tandem/base/log.h"
#include "tandem/keras_like/keras.h"
#include "common/regression_data.h"

using namespace tandem;
namespace fs = std::filesystem;
using keras::Logs;

namespace {

// Files are written in a fresh directory per test.
struct TempDir : testing::TempDir {
  TempDir() : testing::TempDir("tandem_callbacks_test") {}
};

std::string read_text(const std::string& path) { return testing::read_file_bytes(path); }

// Captures what the callbacks print to std::cout.
class CaptureCout {
 public:
  CaptureCout() : previous_(std::cout.rdbuf(buffer_.rdbuf())) {}
  ~CaptureCout() { std::cout.rdbuf(previous_); }
  std::string text() const { return buffer_.str(); }

 private:
  std::ostringstream buffer_;
  std::streambuf* previous_;
};

Logs logs_of(std::initializer_list<std::pair<const char*, double>> items) {
  Logs logs;
  for (const auto& [k, v] : items) logs.set(k, v);
  return logs;
}

keras::Model small_model() {
  auto x = keras::Input({3});
  auto y = keras::Dense(2)(keras::Dense(4, "relu")(x));
  return keras::Model(x, y);
}

keras::Model compiled_model(double learning_rate = 0.1) {
  auto model = small_model();
  model.compile(keras::SGD{.learning_rate = learning_rate}, "mse");
  return model;
}

// Gives every weight the value `v`, so the weights tell which epoch they are from.
void mark_weights(keras::Model& model, float v) {
  std::vector<Tensor> values;
  for (const auto& w : model.weights()) values.push_back(Tensor::filled<float>(w->shape(), v));
  model.set_weights(values);
}

float weight_mark(const keras::Model& model) { return model.get_weights().front().to_vector<float>().front(); }

// Runs epochs of a fake training: each epoch marks the weights with its index, then reports
// `monitor` = values[epoch]. Returns the number of epochs run (stops like fit() does).
int run_epochs(keras::Model& model, const std::vector<keras::CallbackPtr>& callbacks, const std::string& monitor,
               const std::vector<double>& values, std::vector<Logs>* epoch_logs = nullptr) {
  keras::CallbackList list(callbacks, &model, {.epochs = static_cast<int>(values.size()), .steps = 1, .verbose = 0});
  model.set_stop_training(false);
  Logs train_logs;
  list.on_train_begin(train_logs);
  int run = 0;
  for (int epoch = 0; epoch < static_cast<int>(values.size()) && !model.stop_training(); ++epoch) {
    Logs logs;
    list.on_epoch_begin(epoch, logs);
    mark_weights(model, static_cast<float>(epoch));
    logs = logs_of({{"loss", 1.0}});
    logs.set(monitor, values[static_cast<std::size_t>(epoch)]);
    list.on_epoch_end(epoch, logs);
    if (epoch_logs) epoch_logs->push_back(logs);
    ++run;
  }
  list.on_train_end(train_logs);
  return run;
}

// A strategy that, like a non-chief worker, must not write checkpoints.
class NonChiefStrategy final : public Strategy {
 public:
  NonChiefStrategy() : Strategy("NonChiefStrategy", {&devices::default_cpu_device()}) {}
  bool should_checkpoint() const override { return false; }
};

}  // namespace

// ----- Callback, CallbackList, History, LambdaCallback -----

TEST_CASE("Callback: model() outside fit is FailedPrecondition; CallbackList refuses null callbacks") {
  keras::History history;
  CHECK_THROWS_AS(history.model(), FailedPrecondition);
  CHECK_THROWS_AS(keras::CallbackList({nullptr}, nullptr, {}), InvalidArgument);
}

TEST_CASE("History records the logs of every epoch; at() names what it has") {
  auto history = std::make_shared<keras::History>();
  keras::CallbackList list({history}, nullptr, {.epochs = 2});
  Logs none;
  list.on_train_begin(none);
  auto l0 = logs_of({{"loss", 1.0}, {"val_loss", 2.0}});
  auto l1 = logs_of({{"loss", 0.5}, {"val_loss", 1.5}});
  list.on_epoch_end(0, l0);
  list.on_epoch_end(1, l1);
  CHECK(history->epoch == std::vector<int>{0, 1});
  CHECK(history->at("loss") == std::vector<double>{1.0, 0.5});
  CHECK(history->at("val_loss") == std::vector<double>{2.0, 1.5});
  try {
    history->at("accuracy");
    FAIL("expected NotFound");
  } catch (const NotFound& e) {
    const std::string m = e.what();
    CHECK(m.find("accuracy") != std::string::npos);
    CHECK(m.find("loss, val_loss") != std::string::npos);
  }
}

TEST_CASE("LambdaCallback calls the functions it was given, in CallbackList order") {
  std::vector<std::string> calls;
  auto a = std::make_shared<keras::LambdaCallback>(keras::LambdaCallbackOptions{
      .on_epoch_begin = [&](int e, Logs&) { calls.push_back("a.epoch_begin " + std::to_string(e)); },
      .on_epoch_end =
          [&](int e, Logs& logs) {
            calls.push_back("a.epoch_end " + std::to_string(e));
            logs.set("extra", 7.0);
          },
      .on_train_batch_end = [&](std::int64_t b, Logs&) { calls.push_back("a.batch_end " + std::to_string(b)); },
  });
  auto b = std::make_shared<keras::LambdaCallback>(keras::LambdaCallbackOptions{
      .on_epoch_end = [&](int, Logs& logs) { calls.push_back("b sees extra=" + std::to_string(logs.at("extra"))); },
      .on_train_begin = [&](Logs&) { calls.push_back("b.train_begin"); },
      .on_train_end = [&](Logs&) { calls.push_back("b.train_end"); },
  });
  keras::CallbackList list({a, b}, nullptr, {});
  Logs logs;
  list.on_train_begin(logs);
  list.on_epoch_begin(0, logs);
  list.on_train_batch_begin(0, logs);
  list.on_train_batch_end(0, logs);
  list.on_epoch_end(0, logs);
  list.on_train_end(logs);
  CHECK(calls == std::vector<std::string>{"b.train_begin", "a.epoch_begin 0", "a.batch_end 0", "a.epoch_end 0",
                                          "b sees extra=7.000000", "b.train_end"});
}

// ----- EarlyStopping -----

TEST_CASE("EarlyStopping stops after `patience` epochs without improvement and restores the best weights") {
  auto model = small_model();
  auto es = std::make_shared<keras::EarlyStopping>(
      keras::EarlyStoppingOptions{.patience = 2, .verbose = 1, .restore_best_weights = true});
  CaptureCout out;
  const int run = run_epochs(model, {es}, "val_loss", {1.0, 0.8, 0.9, 0.95, 0.7, 0.6});
  CHECK(run == 4);  // epochs 2 and 3 did not improve on epoch 1
  CHECK(es->stopped_epoch() == 3);
  CHECK(es->best_epoch() == 1);
  CHECK(model.stop_training());
  CHECK(weight_mark(model) == 1.0f);  // epoch 1's weights
  CHECK(out.text() == "Epoch 4: early stopping\nRestoring model weights from the end of the best epoch: 2.\n");
}

TEST_CASE("EarlyStopping: min_delta, modes, baseline, start_from_epoch") {
  auto model = small_model();
  SUBCASE("an improvement smaller than min_delta does not count") {
    auto es = std::make_shared<keras::EarlyStopping>(keras::EarlyStoppingOptions{.min_delta = 0.1, .patience = 1});
    CHECK(run_epochs(model, {es}, "val_loss", {1.0, 0.95, 0.85}) == 2);
    CHECK(es->stopped_epoch() == 1);
  }
  SUBCASE("min_delta's sign does not matter") {
    auto es = std::make_shared<keras::EarlyStopping>(keras::EarlyStoppingOptions{.min_delta = -0.1, .patience = 1});
    CHECK(run_epochs(model, {es}, "val_loss", {1.0, 0.95, 0.85}) == 2);
  }
  SUBCASE("auto mode maximizes accuracy") {
    auto es =
        std::make_shared<keras::EarlyStopping>(keras::EarlyStoppingOptions{.monitor = "val_accuracy", .patience = 1});
    CHECK(run_epochs(model, {es}, "val_accuracy", {0.5, 0.6, 0.7, 0.65, 0.8}) == 4);
    CHECK(es->best_epoch() == 2);
  }
  SUBCASE("explicit max mode") {
    auto es = std::make_shared<keras::EarlyStopping>(
        keras::EarlyStoppingOptions{.monitor = "score", .patience = 1, .mode = keras::MonitorMode::kMax});
    CHECK(run_epochs(model, {es}, "score", {1, 2, 1}) == 3);
    CHECK(es->stopped_epoch() == 2);
  }
  SUBCASE("patience 0 stops at the first epoch that does not improve (never epoch 0)") {
    auto es = std::make_shared<keras::EarlyStopping>();
    CHECK(run_epochs(model, {es}, "val_loss", {1.0, 0.9, 0.9}) == 3);
    CHECK(es->stopped_epoch() == 2);
  }
  SUBCASE("with a baseline, patience runs until the baseline is beaten") {
    auto es = std::make_shared<keras::EarlyStopping>(keras::EarlyStoppingOptions{.patience = 2, .baseline = 0.5});
    // Improving but above the baseline: wait keeps growing, and the first epoch that does not
    // improve ends training.
    CHECK(run_epochs(model, {es}, "val_loss", {0.9, 0.8, 0.85, 0.4}) == 3);
    CHECK(es->stopped_epoch() == 2);
  }
  SUBCASE("beating the baseline resets patience") {
    auto es = std::make_shared<keras::EarlyStopping>(keras::EarlyStoppingOptions{.patience = 2, .baseline = 0.5});
    CHECK(run_epochs(model, {es}, "val_loss", {0.4, 0.45, 0.3, 0.35, 0.36, 0.2}) == 5);
    CHECK(es->stopped_epoch() == 4);
  }
  SUBCASE("start_from_epoch ignores the warm-up epochs") {
    auto es = std::make_shared<keras::EarlyStopping>(keras::EarlyStoppingOptions{.patience = 1, .start_from_epoch = 3});
    CHECK(run_epochs(model, {es}, "val_loss", {1.0, 2.0, 3.0, 4.0, 5.0, 6.0}) == 5);
    CHECK(es->stopped_epoch() == 4);
  }
  SUBCASE("restore_best_weights restores at the end even without an early stop") {
    auto es = std::make_shared<keras::EarlyStopping>(
        keras::EarlyStoppingOptions{.patience = 10, .restore_best_weights = true});
    CHECK(run_epochs(model, {es}, "val_loss", {1.0, 0.5, 0.7}) == 3);
    CHECK(es->stopped_epoch() == 0);
    CHECK(weight_mark(model) == 1.0f);
  }
  SUBCASE("NaN never counts as an improvement") {
    auto es = std::make_shared<keras::EarlyStopping>(keras::EarlyStoppingOptions{.patience = 1});
    const double nan = std::numeric_limits<double>::quiet_NaN();
    CHECK(run_epochs(model, {es}, "val_loss", {1.0, nan, 0.5}) == 2);
  }
  SUBCASE("a missing monitor does nothing") {
    auto es = std::make_shared<keras::EarlyStopping>(keras::EarlyStoppingOptions{.monitor = "val_missing"});
    CHECK(run_epochs(model, {es}, "val_loss", {1.0, 2.0, 3.0}) == 3);
  }
  SUBCASE("an instance is reusable: on_train_begin resets it") {
    auto es = std::make_shared<keras::EarlyStopping>(keras::EarlyStoppingOptions{.patience = 1});
    CHECK(run_epochs(model, {es}, "val_loss", {0.1, 0.2}) == 2);
    CHECK(run_epochs(model, {es}, "val_loss", {1.0, 0.9, 0.8}) == 3);
    CHECK(es->stopped_epoch() == 0);
  }
  CHECK_THROWS_AS(keras::EarlyStopping({.patience = -1}), InvalidArgument);
}

// ----- ReduceLROnPlateau, LearningRateScheduler -----

TEST_CASE("ReduceLROnPlateau reduces the learning rate with patience, cooldown and min_lr") {
  auto model = compiled_model(1.0);
  auto cb = std::make_shared<keras::ReduceLROnPlateau>(
      keras::ReduceLROnPlateauOptions{.factor = 0.5, .patience = 1, .verbose = 1, .cooldown = 2, .min_lr = 0.2});
  std::vector<Logs> logs;
  CaptureCout out;
  run_epochs(model, {cb}, "val_loss", std::vector<double>(8, 1.0), &logs);
  std::vector<double> rates;
  for (const auto& l : logs) rates.push_back(l.at("learning_rate"));
  // Epoch 0 sets the best; 1 reduces; 2 cools down; 3 reduces; 4 cools down; 5 reduces to
  // min_lr; 6 cools down; 7 is at min_lr already.
  CHECK(rates == std::vector<double>{1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.2, 0.2});
  CHECK(model.optimizer().learning_rate() == 0.2);
  CHECK(out.text() ==
        "\nEpoch 2: ReduceLROnPlateau reducing learning rate to 0.5.\n"
        "\nEpoch 4: ReduceLROnPlateau reducing learning rate to 0.25.\n"
        "\nEpoch 6: ReduceLROnPlateau reducing learning rate to 0.2.\n");
}

TEST_CASE("ReduceLROnPlateau: improvements by more than min_delta reset the wait") {
  auto model = compiled_model(1.0);
  auto cb = std::make_shared<keras::ReduceLROnPlateau>(
      keras::ReduceLROnPlateauOptions{.factor = 0.1, .patience = 2, .min_delta = 0.01});
  run_epochs(model, {cb}, "val_loss", {1.0, 0.9, 0.8, 0.795, 0.7});
  CHECK(model.optimizer().learning_rate() == 1.0);
  run_epochs(model, {cb}, "val_loss", {1.0, 0.995, 0.999});  // two epochs within min_delta
  CHECK(model.optimizer().learning_rate() == doctest::Approx(0.1));
  CHECK_THROWS_AS(keras::ReduceLROnPlateau({.factor = 1.0}), InvalidArgument);
}

TEST_CASE("LearningRateScheduler sets the rate each epoch and logs it") {
  auto model = compiled_model(0.1);
  std::vector<std::pair<int, double>> seen;
  auto cb = std::make_shared<keras::LearningRateScheduler>(
      [&](int epoch, double lr) {
        seen.emplace_back(epoch, lr);
        return epoch < 2 ? lr : lr * 0.5;
      },
      1);
  std::vector<Logs> logs;
  CaptureCout out;
  run_epochs(model, {cb}, "val_loss", {1, 1, 1, 1}, &logs);
  CHECK(seen == std::vector<std::pair<int, double>>{{0, 0.1}, {1, 0.1}, {2, 0.1}, {3, 0.05}});
  CHECK(logs[2].at("learning_rate") == 0.05);
  CHECK(logs[3].at("learning_rate") == 0.025);
  CHECK(model.optimizer().learning_rate() == 0.025);
  CHECK(out.text().find("\nEpoch 4: LearningRateScheduler setting learning rate to 0.025.\n") != std::string::npos);

  auto bad = std::make_shared<keras::LearningRateScheduler>([](int, double) { return -1.0; });
  CHECK_THROWS_AS(run_epochs(model, {bad}, "val_loss", {1}), InvalidArgument);
}

TEST_CASE("ReduceLROnPlateau and LearningRateScheduler refuse an optimizer with a schedule before training") {
  // Keras's optimizer raises TypeError when they set a float over its schedule; here fit() fails
  // in on_train_begin, before the first step, rather than epochs in.
  const keras::PiecewiseConstantDecay schedule{.boundaries = {10}, .values = {0.1, 0.01}};
  const std::vector<std::pair<std::string, keras::CallbackPtr>> callbacks{
      {"ReduceLROnPlateau", std::make_shared<keras::ReduceLROnPlateau>()},
      {"LearningRateScheduler",
       std::make_shared<keras::LearningRateScheduler>([](int, double lr) { return lr; })}};
  for (const auto& [name, callback] : callbacks) {
    CAPTURE(name);
    auto model = small_model();
    model.compile(keras::SGD{.learning_rate = schedule}, "mse");
    const auto x = Tensor::from_vector<float>({0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f}, {2, 3});
    const auto y = Tensor::from_vector<float>({1, 0, 0, 1}, {2, 2});
    const auto message = tandem::testing::error_message<FailedPrecondition>(
        [&] { model.fit(x, y, {.epochs = 2, .verbose = 0, .callbacks = {callback}}); });
    CHECK(message.find(name + ": the optimizer (sgd) was created with a learning-rate schedule "
                              "(PiecewiseConstantDecay)") == 0);
    CHECK(model.optimizer().iterations() == 0);
  }
}

// ----- TerminateOnNaN -----

TEST_CASE("TerminateOnNaN stops training on a NaN or infinite loss") {
  auto model = small_model();
  auto cb = std::make_shared<keras::TerminateOnNaN>();
  keras::CallbackList list({cb}, &model, {});
  CaptureCout out;
  model.set_stop_training(false);
  auto fine = logs_of({{"loss", 0.5}});
  list.on_train_batch_end(0, fine);
  CHECK_FALSE(model.stop_training());
  auto no_loss = logs_of({{"accuracy", std::numeric_limits<double>::quiet_NaN()}});
  list.on_train_batch_end(1, no_loss);
  CHECK_FALSE(model.stop_training());
  auto nan = logs_of({{"loss", std::numeric_limits<double>::quiet_NaN()}});
  list.on_train_batch_end(2, nan);
  CHECK(model.stop_training());
  CHECK(out.text() == "Batch 2: Invalid loss, terminating training\n");
  model.set_stop_training(false);
  auto inf = logs_of({{"loss", std::numeric_limits<double>::infinity()}});
  list.on_train_batch_end(3, inf);
  CHECK(model.stop_training());
}

// ----- CSVLogger -----

TEST_CASE("CSVLogger writes a header and one flushed row per epoch") {
  TempDir dir;
  const auto path = dir.file("log.csv");
  auto model = small_model();
  auto csv = std::make_shared<keras::CSVLogger>(path);
  keras::CallbackList list({csv}, &model, {.epochs = 2});
  Logs none;
  list.on_train_begin(none);
  auto e0 = logs_of({{"loss", 0.5}, {"accuracy", 0.75}, {"val_loss", 0.25}, {"val_accuracy", 1.0}});
  list.on_epoch_end(0, e0);
  // Flushed per row: readable before training ends.
  CHECK(read_text(path) == "epoch,accuracy,loss,val_accuracy,val_loss\n0,0.75,0.5,1.0,0.25\n");
  auto e1 = logs_of({{"loss", 0.125}, {"accuracy", 1e-05}, {"val_loss", 3.0}});  // no val_accuracy this time
  list.on_epoch_end(1, e1);
  list.on_train_end(none);
  CHECK(read_text(path) == "epoch,accuracy,loss,val_accuracy,val_loss\n0,0.75,0.5,1.0,0.25\n1,1e-05,0.125,NA,3.0\n");

  SUBCASE("append adds rows under the existing header") {
    auto again = std::make_shared<keras::CSVLogger>(path, keras::CsvLoggerOptions{.append = true});
    keras::CallbackList list2({again}, &model, {.epochs = 1});
    list2.on_train_begin(none);
    auto e2 = logs_of({{"loss", 0.0625}, {"accuracy", 0.5}, {"val_loss", 2.0}, {"val_accuracy", 0.5}});
    list2.on_epoch_end(2, e2);
    list2.on_train_end(none);
    CHECK(
        read_text(path) ==
        "epoch,accuracy,loss,val_accuracy,val_loss\n0,0.75,0.5,1.0,0.25\n1,1e-05,0.125,NA,3.0\n2,0.5,0.0625,0.5,2.0\n");
  }
  SUBCASE("without append the file starts over") {
    auto fresh = std::make_shared<keras::CSVLogger>(path, keras::CsvLoggerOptions{.separator = ';'});
    keras::CallbackList list2({fresh}, &model, {.epochs = 1});
    list2.on_train_begin(none);
    auto e = logs_of({{"loss", 1.5}});  // no validation: room is made for val_loss anyway
    list2.on_epoch_end(0, e);
    list2.on_train_end(none);
    CHECK(read_text(path) == "epoch;loss;val_loss\n0;1.5;NA\n");
  }
  SUBCASE("append to a file that does not exist writes the header") {
    const auto other = dir.file("new.csv");
    auto fresh = std::make_shared<keras::CSVLogger>(other, keras::CsvLoggerOptions{.append = true});
    keras::CallbackList list2({fresh}, &model, {.epochs = 1});
    list2.on_train_begin(none);
    auto e = logs_of({{"loss", 2.0}, {"val_loss", 1.0}});
    list2.on_epoch_end(0, e);
    list2.on_train_end(none);
    CHECK(read_text(other) == "epoch,loss,val_loss\n0,2.0,1.0\n");
  }
  SUBCASE("a file that cannot be opened is Unavailable naming it") {
    const auto bad = dir.file("no/such/dir/log.csv");
    auto cb = std::make_shared<keras::CSVLogger>(bad);
    keras::CallbackList list2({cb}, &model, {});
    try {
      list2.on_train_begin(none);
      FAIL("expected Unavailable");
    } catch (const Unavailable& e) {
      CHECK(std::string(e.what()).find(bad) != std::string::npos);
    }
  }
}

// ----- ModelCheckpoint -----

TEST_CASE("ModelCheckpoint fills the path's fields and saves every epoch") {
  TempDir dir;
  auto model = small_model();
  auto cb = std::make_shared<keras::ModelCheckpoint>(dir.file("ckpt/ep{epoch:02d}-{val_loss:.2f}-{epoch}.safetensors"),
                                                     keras::ModelCheckpointOptions{.verbose = 1});
  CaptureCout out;
  run_epochs(model, {cb}, "val_loss", {0.5, 0.625, 0.25});
  CHECK(fs::exists(dir.path() / "ckpt" / "ep01-0.50-1.safetensors"));
  CHECK(fs::exists(dir.path() / "ckpt" / "ep02-0.62-2.safetensors"));
  CHECK(fs::exists(dir.path() / "ckpt" / "ep03-0.25-3.safetensors"));
  // The file holds that epoch's weights.
  const auto content = keras::read_safetensors(dir.file("ckpt/ep02-0.62-2.safetensors"));
  CHECK(content.metadata.at("format") == "tandem.weights");
  CHECK(content.tensors.front().second.to_vector<float>().front() == 1.0f);
  CHECK(out.text().find("\nEpoch 2: saving model to " + dir.file("ckpt/ep02-0.62-2.safetensors") + "\n") !=
        std::string::npos);
}

TEST_CASE("ModelCheckpoint save_best_only keeps the best epoch, with Keras's messages") {
  TempDir dir;
  auto model = small_model();
  const auto path = dir.file("best.safetensors");
  auto cb = std::make_shared<keras::ModelCheckpoint>(
      path, keras::ModelCheckpointOptions{.verbose = 1, .save_best_only = true});
  CaptureCout out;
  run_epochs(model, {cb}, "val_loss", {0.52, 0.6, 0.48, 0.5});
  REQUIRE(cb->best().has_value());
  CHECK(*cb->best() == 0.48);
  const auto content = keras::read_safetensors(path);
  CHECK(content.tensors.front().second.to_vector<float>().front() == 2.0f);  // epoch 2's weights
  CHECK(out.text() == "\nEpoch 1: val_loss improved from inf to 0.52000, saving model to " + path +
                          "\n"
                          "\nEpoch 2: val_loss did not improve from 0.52000\n"
                          "\nEpoch 3: val_loss improved from 0.52000 to 0.48000, saving model to " +
                          path +
                          "\n"
                          "\nEpoch 4: val_loss did not improve from 0.48000\n");

  SUBCASE("max mode for accuracy") {
    auto acc = std::make_shared<keras::ModelCheckpoint>(
        dir.file("acc.safetensors"), keras::ModelCheckpointOptions{.monitor = "val_accuracy", .save_best_only = true});
    run_epochs(model, {acc}, "val_accuracy", {0.5, 0.9, 0.7});
    CHECK(*acc->best() == 0.9);
    CHECK(keras::read_safetensors(dir.file("acc.safetensors")).tensors.front().second.to_vector<float>().front() ==
          1.0f);
  }
  SUBCASE("a missing monitor saves nothing") {
    auto missing = std::make_shared<keras::ModelCheckpoint>(
        dir.file("m.safetensors"), keras::ModelCheckpointOptions{.monitor = "val_nothing", .save_best_only = true});
    run_epochs(model, {missing}, "val_loss", {0.5});
    CHECK_FALSE(fs::exists(dir.path() / "m.safetensors"));
  }
}

TEST_CASE("ModelCheckpoint save_freq saves every N batches, counted across epochs") {
  TempDir dir;
  auto model = small_model();
  auto cb = std::make_shared<keras::ModelCheckpoint>(dir.file("e{epoch}-b{batch}.safetensors"),
                                                     keras::ModelCheckpointOptions{.save_freq = 2});
  keras::CallbackList list({cb}, &model, {.epochs = 2, .steps = 3});
  Logs none;
  list.on_train_begin(none);
  for (int epoch = 0; epoch < 2; ++epoch) {
    list.on_epoch_begin(epoch, none);
    for (int batch = 0; batch < 3; ++batch) {
      auto logs = logs_of({{"loss", 1.0}});
      list.on_train_batch_end(batch, logs);
    }
    auto logs = logs_of({{"loss", 1.0}, {"val_loss", 1.0}});
    list.on_epoch_end(epoch, logs);
  }
  list.on_train_end(none);
  CHECK(dir.entries() == std::vector<std::string>{"e1-b2.safetensors", "e2-b1.safetensors", "e2-b3.safetensors"});
}

TEST_CASE("ModelCheckpoint save_weights_only=false writes a training checkpoint") {
  TempDir dir;
  auto model = compiled_model(0.1);
  auto cb = std::make_shared<keras::ModelCheckpoint>(dir.file("train-{epoch}.safetensors"),
                                                     keras::ModelCheckpointOptions{.save_weights_only = false});
  run_epochs(model, {cb}, "val_loss", {1.0, 0.5});
  const auto content = keras::read_safetensors(dir.file("train-2.safetensors"));
  CHECK(content.metadata.at("format") == "tandem.checkpoint");
  CHECK(content.metadata.at("epoch") == "2");
  auto restored = model;  // same handle: loading its own checkpoint must work
  const auto state = keras::load_training_checkpoint(restored, dir.file("train-2.safetensors"));
  CHECK(state.epoch == 2);
}

TEST_CASE("ModelCheckpoint: bad paths are InvalidArgument naming the path; non-chief workers write nothing") {
  TempDir dir;
  CHECK_THROWS_AS(keras::ModelCheckpoint(dir.file("x{epoch.safetensors")), InvalidArgument);
  CHECK_THROWS_AS(keras::ModelCheckpoint(dir.file("x}.safetensors")), InvalidArgument);
  CHECK_THROWS_AS(keras::ModelCheckpoint(""), InvalidArgument);
  CHECK_THROWS_AS(keras::ModelCheckpoint("x", {.save_freq = -1}), InvalidArgument);
  auto model = small_model();
  const auto pattern = dir.file("x-{val_acc:.2f}.safetensors");
  auto unknown = std::make_shared<keras::ModelCheckpoint>(pattern);
  try {
    run_epochs(model, {unknown}, "val_loss", {1.0});
    FAIL("expected InvalidArgument");
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    CHECK(m.find(pattern) != std::string::npos);
    CHECK(m.find("val_acc") != std::string::npos);
    CHECK(m.find("val_loss") != std::string::npos);  // what is present
  }
  auto wrong_type = std::make_shared<keras::ModelCheckpoint>(dir.file("x-{val_loss:03d}.safetensors"));
  CHECK_THROWS_AS(run_epochs(model, {wrong_type}, "val_loss", {1.0}), InvalidArgument);
  // Braces doubled are literal; an integer field takes a float format, as in Python.
  auto literal = std::make_shared<keras::ModelCheckpoint>(dir.file("{{x}}-{epoch:.1f}.safetensors"));
  run_epochs(model, {literal}, "val_loss", {1.0});
  CHECK(fs::exists(dir.path() / "{x}-1.0.safetensors"));

  NonChiefStrategy worker;
  keras::Model worker_model;
  {
    auto scope = worker.scope();
    worker_model = small_model();
  }
  CHECK_FALSE(worker_model.distribute_strategy().should_checkpoint());
  const auto before = dir.entries();
  auto cb = std::make_shared<keras::ModelCheckpoint>(dir.file("worker-{epoch}.safetensors"),
                                                     keras::ModelCheckpointOptions{.save_best_only = true});
  run_epochs(worker_model, {cb}, "val_loss", {1.0, 0.5});
  CHECK(dir.entries() == before);
  CHECK(*cb->best() == 0.5);  // it still tracks the best value, like the chief
}

// ----- ProgbarLogger -----

namespace {

struct Bar {
  std::ostringstream out;
  std::shared_ptr<keras::ProgbarLogger> logger;
  keras::CallbackList list;
  Bar(bool interactive, keras::TrainingParams params)
      : logger(std::make_shared<keras::ProgbarLogger>(keras::ProgbarOptions{.out = &out, .interactive = interactive})),
        list({logger}, nullptr, params) {}
};

// "3/3 [====...] - 0s 12us/step": the time fields vary, so the lines are matched with these.
const std::string kSeconds = R"(\d+s)";
const std::string kPerStep = R"( \d+(s|ms|us)/step)";

}  // namespace

TEST_CASE("ProgbarLogger, not interactive: the header and one final line per epoch") {
  Bar bar(false, {.epochs = 2, .steps = 3, .verbose = 1});
  Logs none;
  bar.list.on_train_begin(none);
  for (int epoch = 0; epoch < 2; ++epoch) {
    bar.list.on_epoch_begin(epoch, none);
    for (int b = 0; b < 3; ++b) {
      auto logs = logs_of({{"loss", 0.75}, {"accuracy", 0.5}});
      bar.list.on_train_batch_end(b, logs);
    }
    // Validation inside the epoch draws no bar of its own.
    bar.list.on_test_begin(none);
    auto vlogs = logs_of({{"loss", 9.0}});
    bar.list.on_test_batch_end(0, vlogs);
    bar.list.on_test_end(vlogs);
    auto logs = logs_of({{"loss", 0.5}, {"accuracy", 0.82}, {"val_loss", 0.0001}, {"val_accuracy", 0.0}});
    bar.list.on_epoch_end(epoch, logs);
  }
  bar.list.on_train_end(none);
  const std::string line =
      R"(3/3 \[==============================\] - )" + kSeconds + kPerStep +
      R"( - loss: 0\.5000 - accuracy: 0\.8200 - val_loss: 1\.0000e-04 - val_accuracy: 0\.0000e\+00\n)";
  const std::regex expected("Epoch 1/2\n" + line + "Epoch 2/2\n" + line);
  INFO(bar.out.str());
  CHECK(std::regex_match(bar.out.str(), expected));
  CHECK(bar.out.str().find('\r') == std::string::npos);
}

TEST_CASE("ProgbarLogger, interactive: redraws in place with '\\r', an ETA, and at most every 50 ms") {
  Bar bar(true, {.epochs = 1, .steps = 10, .verbose = 1});
  Logs none;
  bar.list.on_train_begin(none);
  bar.list.on_epoch_begin(0, none);
  auto logs = logs_of({{"loss", 2.0}});
  bar.list.on_train_batch_end(0, logs);  // the first step draws at once
  bar.list.on_train_batch_end(1, logs);  // too soon to redraw
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  bar.list.on_train_batch_end(2, logs);
  bar.list.on_train_batch_end(3, logs);  // too soon again
  for (int b = 4; b < 10; ++b) bar.list.on_train_batch_end(b, logs);
  auto final_logs = logs_of({{"loss", 1.0}});
  bar.list.on_epoch_end(0, final_logs);
  const std::string text = bar.out.str();
  INFO(text);
  CHECK(text.find("Epoch") == std::string::npos);  // one epoch: no header, as in Keras
  const std::regex expected(R"(\r 1/10 \[==>\.{27}\] - ETA: \d+s - loss: 2\.0000)"
                            R"(\r 3/10 \[========>\.{21}\] - ETA: \d+s - loss: 2\.0000)"
                            R"(\r10/10 \[={30}\] - \d+s \d+(s|ms|us)/step - loss: 1\.0000\n)");
  CHECK(std::regex_match(text, expected));
}

TEST_CASE("ProgbarLogger, interactive: a shorter line is padded over the longer one") {
  Bar bar(true, {.epochs = 1, .steps = 2, .verbose = 1});
  Logs none;
  bar.list.on_train_begin(none);
  bar.list.on_epoch_begin(0, none);
  auto logs = logs_of({{"loss", 2.0}, {"a_long_metric_name", 1.0}});
  bar.list.on_train_batch_end(0, logs);
  auto final_logs = logs_of({{"loss", 1.0}});
  bar.list.on_epoch_end(0, final_logs);
  const std::string text = bar.out.str();
  const auto first = text.substr(1, text.find('\r', 1) - 1);
  const auto second = text.substr(text.find('\r', 1) + 1);
  CHECK(second.size() == first.size() + 1);  // padded to the old width, plus the newline
  CHECK(second.back() == '\n');
}

TEST_CASE("ProgbarLogger, verbose 2: one line per epoch") {
  Bar bar(true, {.epochs = 2, .steps = 469, .verbose = 2});
  Logs none;
  bar.list.on_train_begin(none);
  for (int epoch = 0; epoch < 2; ++epoch) {
    bar.list.on_epoch_begin(epoch, none);
    for (int b = 0; b < 469; ++b) {
      auto logs = logs_of({{"loss", 1.0}});
      bar.list.on_train_batch_end(b, logs);
    }
    auto logs = logs_of({{"loss", 0.5}, {"val_loss", 0.25}});
    bar.list.on_epoch_end(epoch, logs);
  }
  const std::string line = "469/469 - " + kSeconds + " -" + kPerStep + R"( - loss: 0\.5000 - val_loss: 0\.2500\n)";
  INFO(bar.out.str());
  CHECK(std::regex_match(bar.out.str(), std::regex("Epoch 1/2\n" + line + "Epoch 2/2\n" + line)));
}

TEST_CASE("ProgbarLogger: unknown steps show a count, then the length learned from the first epoch") {
  Bar bar(true, {.epochs = 2, .steps = -1, .verbose = 1});
  Logs none;
  bar.list.on_train_begin(none);
  for (int epoch = 0; epoch < 2; ++epoch) {
    bar.list.on_epoch_begin(epoch, none);
    for (int b = 0; b < 4; ++b) {
      auto logs = logs_of({{"loss", 1.0}});
      bar.list.on_train_batch_end(b, logs);
    }
    auto logs = logs_of({{"loss", 0.5}});
    bar.list.on_epoch_end(epoch, logs);
  }
  const std::string text = bar.out.str();
  INFO(text);
  CHECK(std::regex_match(text, std::regex(R"(Epoch 1/2\n\r      1/Unknown - \d+s \d+(s|ms|us)/step - loss: 1\.0000)"
                                          R"(\r4/4 \[={30}\] - \d+s \d+(s|ms|us)/step - loss: 0\.5000 *\n)"
                                          R"(Epoch 2/2\n\r1/4 \[======>\.{23}\] - ETA: \d+s - loss: 1\.0000)"
                                          R"(\r4/4 \[={30}\] - \d+s \d+(s|ms|us)/step - loss: 0\.5000 *\n)")));
}

TEST_CASE("ProgbarLogger: evaluate and predict bars; verbose 0 prints nothing") {
  SUBCASE("evaluate") {
    Bar bar(false, {.epochs = 1, .steps = 2, .verbose = 1});
    Logs none;
    bar.list.on_test_begin(none);
    for (int b = 0; b < 2; ++b) {
      auto logs = logs_of({{"loss", 1.0}});
      bar.list.on_test_batch_end(b, logs);
    }
    auto result = logs_of({{"loss", 0.25}, {"accuracy", 0.5}});
    bar.list.on_test_end(result);
    INFO(bar.out.str());
    CHECK(std::regex_match(
        bar.out.str(), std::regex(R"(2/2 \[={30}\] - \d+s \d+(s|ms|us)/step - loss: 0\.2500 - accuracy: 0\.5000\n)")));
  }
  SUBCASE("predict") {
    Bar bar(false, {.epochs = 1, .steps = 12, .verbose = 1});
    Logs none;
    bar.list.on_predict_begin(none);
    for (int b = 0; b < 12; ++b) bar.list.on_predict_batch_end(b, none);
    bar.list.on_predict_end(none);
    INFO(bar.out.str());
    CHECK(std::regex_match(bar.out.str(), std::regex(R"(12/12 \[={30}\] - \d+s \d+(s|ms|us)/step\n)")));
  }
  SUBCASE("verbose 0") {
    Bar bar(true, {.epochs = 3, .steps = 2, .verbose = 0});
    Logs none;
    bar.list.on_train_begin(none);
    bar.list.on_epoch_begin(0, none);
    auto logs = logs_of({{"loss", 1.0}});
    bar.list.on_train_batch_end(0, logs);
    bar.list.on_epoch_end(0, logs);
    CHECK(bar.out.str().empty());
  }
}

TEST_CASE("ProgbarLogger: the time per step leaves out the first step and picks its unit") {
  Bar bar(false, {.epochs = 1, .steps = 3, .verbose = 1});
  Logs none;
  bar.list.on_train_begin(none);
  bar.list.on_epoch_begin(0, none);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // a slow first step
  bar.list.on_train_batch_end(0, none);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  bar.list.on_train_batch_end(1, none);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  bar.list.on_train_batch_end(2, none);
  bar.list.on_epoch_end(0, none);
  INFO(bar.out.str());
  // 1 s in all, but ~20 ms per step after the first.
  CHECK(std::regex_match(bar.out.str(), std::regex(R"(3/3 \[={30}\] - 1s [1-9]\d+ms/step\n)")));
}

// ----- Through fit() -----

namespace {

using testing::regression_data;

}  // namespace

TEST_CASE("fit() with callbacks: History, CSVLogger, ModelCheckpoint, EarlyStopping, LearningRateScheduler") {
  TempDir dir;
  const auto data = regression_data(64);
  auto model = compiled_model(0.05);
  auto csv = std::make_shared<keras::CSVLogger>(dir.file("train.csv"));
  auto ckpt = std::make_shared<keras::ModelCheckpoint>(
      dir.file("best.safetensors"), keras::ModelCheckpointOptions{.monitor = "loss", .save_best_only = true});
  // First in the list, so the callbacks after it see the "learning_rate" it logs.
  auto schedule = std::make_shared<keras::LearningRateScheduler>([](int, double lr) { return lr; });
  std::vector<std::int64_t> batches;
  auto counter = std::make_shared<keras::LambdaCallback>(
      keras::LambdaCallbackOptions{.on_train_batch_end = [&](std::int64_t b, Logs&) { batches.push_back(b); }});
  CaptureCout out;
  const auto history = model.fit(data.x, data.y,
                                 {.batch_size = 16,
                                  .epochs = 3,
                                  .verbose = 0,
                                  .callbacks = {schedule, csv, ckpt, counter},
                                  .validation_split = 0.25});
  CHECK(out.text().empty());  // verbose 0
  CHECK(history.epoch == std::vector<int>{0, 1, 2});
  CHECK(history.at("loss").size() == 3);
  CHECK(history.at("val_loss").size() == 3);
  CHECK(history.at("learning_rate") == std::vector<double>{0.05, 0.05, 0.05});
  CHECK(batches == std::vector<std::int64_t>{0, 1, 2, 0, 1, 2, 0, 1, 2});  // 48 training examples, batches of 16
  const std::string text = read_text(dir.file("train.csv"));
  CHECK(text.rfind("epoch,learning_rate,loss,val_loss\n0,0.05,", 0) == 0);
  CHECK(std::count(text.begin(), text.end(), '\n') == 4);
  REQUIRE(ckpt->best().has_value());
  CHECK(*ckpt->best() == *std::min_element(history.at("loss").begin(), history.at("loss").end()));
  CHECK(fs::exists(dir.path() / "best.safetensors"));
}

TEST_CASE("fit() stops early and restores the best weights; the bar goes to std::cout") {
  const auto data = regression_data(32);
  auto model = compiled_model(0.05);
  int epochs_seen = 0;
  // A made-up monitored value that is best at epoch 1 and worse after.
  const std::vector<double> fake = {1.0, 0.5, 0.7, 0.8, 0.9, 1.0, 1.1};
  std::vector<std::vector<float>> weights_at_end;
  auto inject =
      std::make_shared<keras::LambdaCallback>(keras::LambdaCallbackOptions{.on_epoch_end = [&](int e, Logs& logs) {
        logs.set("score", fake[static_cast<std::size_t>(e)]);
        weights_at_end.push_back(model.get_weights().front().to_vector<float>());
        ++epochs_seen;
      }});
  auto es = std::make_shared<keras::EarlyStopping>(
      keras::EarlyStoppingOptions{.monitor = "score", .patience = 2, .restore_best_weights = true});
  CaptureCout out;
  const auto history = model.fit(data.x, data.y, {.batch_size = 8, .epochs = 7, .callbacks = {inject, es}});
  CHECK(epochs_seen == 4);
  CHECK(history.epoch.size() == 4);
  CHECK(es->stopped_epoch() == 3);
  CHECK(model.get_weights().front().to_vector<float>() == weights_at_end[1]);
  const std::string text = out.text();
  INFO(text);
  CHECK(text.rfind("Epoch 1/7\n", 0) == 0);
  CHECK(text.find("4/4 [==============================] - ") != std::string::npos);
  CHECK(text.find("Epoch 4/7\n") != std::string::npos);
  CHECK(text.find("Epoch 5/7") == std::string::npos);
}

TEST_CASE("fit() with TerminateOnNaN stops within the epoch") {
  const auto data = regression_data(32);
  auto model = compiled_model(0.05);
  std::int64_t last_batch = -1;
  auto poison = std::make_shared<keras::LambdaCallback>(
      keras::LambdaCallbackOptions{.on_train_batch_end = [&](std::int64_t b, Logs& logs) {
        last_batch = b;
        if (b == 1) logs.set("loss", std::numeric_limits<double>::quiet_NaN());
      }});
  CaptureCout out;
  const auto history = model.fit(
      data.x, data.y,
      {.batch_size = 8, .epochs = 5, .verbose = 0, .callbacks = {poison, std::make_shared<keras::TerminateOnNaN>()}});
  CHECK(last_batch == 1);
  CHECK(history.epoch.size() == 1);
  CHECK(out.text() == "Batch 1: Invalid loss, terminating training\n");
}

namespace {

// A run of `epochs` epochs on shuffled data with Dropout (so the data order and the random masks
// both matter), stopped by an exception after `stop_after` steps when given; backed up to `dir`.
struct BackupRun {
  std::vector<Tensor> weights;
  int steps = 0;              // steps this run trained
  std::string restored_from;  // the backup it resumed from ("" if none)
};

BackupRun run_with_backup(const std::string& dir, std::optional<int> stop_after, keras::BackupAndRestoreOptions options,
                          std::optional<std::int64_t> steps_per_epoch,
                          const keras::OptimizerRef& optimizer = keras::Adam{.learning_rate = 0.01}) {
  set_global_seed(5);
  auto x = keras::Input({3});
  // Fixed names: the resumed model must match the backup's names (a new process would give the
  // same automatic names; a second model in this process would not).
  auto y = keras::Dense(2, {.name = "out"})(keras::Dropout(0.3)(keras::Dense(8, "relu", {.name = "hidden"})(x)));
  keras::Model model(x, y);
  model.compile(optimizer, "mse");
  std::vector<float> xs, ys;
  for (int i = 0; i < 40; ++i) {
    xs.insert(xs.end(), {0.1f * static_cast<float>(i % 7), 0.05f * static_cast<float>(i % 5), 0.3f});
    ys.insert(ys.end(), {0.2f * static_cast<float>(i % 3), -0.1f});
  }
  const auto data = data::Dataset::from_tensor_slices(
                        {Tensor::from_vector<float>(xs, {40, 3}), Tensor::from_vector<float>(ys, {40, 2})})
                        .shuffle(40, 9)
                        .batch(4);
  int steps = 0;
  keras::FitOptions fit{.epochs = 3, .verbose = 0, .steps_per_epoch = steps_per_epoch};
  auto backup = std::make_shared<keras::BackupAndRestore>(dir, options);
  fit.callbacks.push_back(backup);
  fit.callbacks.push_back(std::make_shared<keras::LambdaCallback>(
      keras::LambdaCallbackOptions{.on_train_batch_end = [&](std::int64_t, Logs&) {
        ++steps;
        if (stop_after && steps == *stop_after) throw Unavailable("simulated crash");
      }}));
  try {
    model.fit(data, fit);
  } catch (const Unavailable&) {
    CHECK(stop_after.has_value());
  }
  return {model.get_weights(), steps, backup->restored_from()};
}

void check_same_weights(const BackupRun& run, const BackupRun& reference) {
  const auto& a = run.weights;
  const auto& b = reference.weights;
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(a[i].to_vector<float>() == b[i].to_vector<float>());
}

}  // namespace

TEST_CASE("BackupAndRestore: a run interrupted mid-epoch and resumed ends exactly as an uninterrupted one") {
  for (const std::optional<std::int64_t> steps_per_epoch :
       {std::optional<std::int64_t>{}, std::optional<std::int64_t>{7}}) {
    CAPTURE(steps_per_epoch.value_or(0));
    TempDir reference_dir, dir;
    const auto reference =
        run_with_backup(reference_dir.path().string(), std::nullopt, {.save_freq = 3}, steps_per_epoch);
    // Nothing left behind by a finished run (delete_checkpoint).
    CHECK(reference_dir.entries().empty());
    // Crash after 13 steps (mid second epoch); backups at 3, 6, 9, 12 and at each epoch's end.
    (void)run_with_backup(dir.path().string(), 13, {.save_freq = 3}, steps_per_epoch);
    CHECK(fs::exists(dir.path() / "backup.safetensors"));
    const auto resumed = run_with_backup(dir.path().string(), std::nullopt, {.save_freq = 3}, steps_per_epoch);
    // It resumed from the backup at step 12 (not from the start) and trained only what was left.
    CHECK(resumed.restored_from == (dir.path() / "backup.safetensors").string());
    CHECK(resumed.steps == reference.steps - 12);
    check_same_weights(resumed, reference);
    CHECK_FALSE(fs::exists(dir.path() / "backup.safetensors"));
  }
}

TEST_CASE("BackupAndRestore: AdamW with a warmup cosine schedule and exclusions resumes exactly") {
  const keras::AdamW adamw{.learning_rate = keras::CosineDecay{.initial_learning_rate = 0.0,
                                                               .decay_steps = 25,
                                                               .warmup_target = 0.02,
                                                               .warmup_steps = 5},
                           .weight_decay = 0.05,
                           .exclude_from_weight_decay = {"bias"}};
  TempDir reference_dir, dir;
  const auto reference = run_with_backup(reference_dir.path().string(), std::nullopt, {.save_freq = 3}, {}, adamw);
  // A crash inside the warmup's first decay steps (step 7), resumed from the backup at step 6.
  (void)run_with_backup(dir.path().string(), 7, {.save_freq = 3}, {}, adamw);
  const auto resumed = run_with_backup(dir.path().string(), std::nullopt, {.save_freq = 3}, {}, adamw);
  CHECK(resumed.steps == reference.steps - 6);
  check_same_weights(resumed, reference);
}

TEST_CASE("BackupAndRestore: a corrupt newest backup is reported and the previous one used") {
  TempDir reference_dir, dir;
  const auto reference = run_with_backup(reference_dir.path().string(), std::nullopt, {}, std::nullopt);
  (void)run_with_backup(dir.path().string(), 25, {}, std::nullopt);  // epochs 1 and 2 backed up, then a crash
  const auto latest = dir.path() / "backup.safetensors";
  REQUIRE(fs::exists(latest));
  REQUIRE(fs::exists(dir.path() / "backup.previous.safetensors"));
  {
    std::fstream f(latest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');  // one flipped byte in the data: the checksum no longer matches
  }
  std::string captured;
  auto previous = logging::set_sink([&](logging::Level level, std::string_view message) {
    if (level == logging::Level::kWarn) captured += message;
  });
  const auto resumed = run_with_backup(dir.path().string(), std::nullopt, {}, std::nullopt);
  logging::set_sink(std::move(previous));
  CHECK(captured.find("ignoring the backup") != std::string::npos);
  CHECK(captured.find("checksum") != std::string::npos);
  CHECK(resumed.restored_from == (dir.path() / "backup.previous.safetensors").string());
  CHECK(resumed.steps == reference.steps - 10);  // the previous backup: the end of epoch 1
  check_same_weights(resumed, reference);
}

TEST_CASE("BackupAndRestore: a backup of another model is an error, not a reason to start afresh") {
  TempDir dir;
  (void)run_with_backup(dir.path().string(), 25, {}, std::nullopt);
  auto x = keras::Input({3});
  keras::Model other(x, keras::Dense(2, {.name = "out"})(keras::Dense(9, "relu", {.name = "hidden"})(x)));
  other.compile(keras::Adam{.learning_rate = 0.01}, "mse");
  const auto data =
      data::Dataset::from_tensor_slices({Tensor::zeros({8, 3}, DType::kF32), Tensor::zeros({8, 2}, DType::kF32)})
          .batch(4);
  keras::FitOptions fit{.epochs = 3, .verbose = 0};
  fit.callbacks.push_back(std::make_shared<keras::BackupAndRestore>(dir.path().string()));
  CHECK_THROWS_AS(other.fit(data, fit), InvalidArgument);
}

TEST_CASE("BackupAndRestore: bad options") {
  CHECK_THROWS_AS(keras::BackupAndRestore(""), InvalidArgument);
  CHECK_THROWS_AS(keras::BackupAndRestore("dir", {.save_freq = -1}), InvalidArgument);
}
