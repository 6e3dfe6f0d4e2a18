// Model::training_stats(): the collectives of fit's steps as the strategy's communicators count
// them, against the ring formula (collective/communicator.h): under MirroredStrategy on N logical
// CPU devices (CTest sets TANDEM_NUM_CPU_DEVICES=4), every replica all-reduces each step its
// gradients, with the layers' moving statistics riding in the last bucket: 2(N-1)/N x those
// bytes sent and received per replica. (The step's log sums ride too only with several workers;
// in one process they are added on the host.)
#include <doctest/doctest.h>

#include <random>

#include "tandem/base/log.h"
#include "tandem/keras_like/keras.h"

using namespace tandem;
using namespace tandem::keras;

namespace {

Tensor random_tensor(std::int64_t rows, std::int64_t cols, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(static_cast<std::size_t>(rows * cols));
  for (auto& v : values) v = normal(rng);
  return Tensor::from_vector(values, {rows, cols});
}

std::int64_t bytes_of(const std::vector<VariablePtr>& variables) {
  std::int64_t bytes = 0;
  for (const auto& v : variables) bytes += v->shape().num_elements() * static_cast<std::int64_t>(dtype_size(v->dtype()));
  return bytes;
}

std::vector<std::string> cpu_devices(int n) {
  std::vector<std::string> names;
  for (int i = 0; i < n; ++i) names.push_back("CPU:" + std::to_string(i));
  return names;
}

// Dense(8, relu) [-> BatchNormalization] -> Dense(3) on 6 features, compiled with SGD and MSE
// under `strategy`.
Model small_model(Strategy& strategy, bool batch_norm) {
  auto scope = strategy.scope();
  std::vector<SequentialItem> layers = {Input({6}), Dense(8, "relu")};
  if (batch_norm) layers.emplace_back(BatchNormalization());
  layers.emplace_back(Dense(3));
  Model model = Sequential(std::move(layers));
  model.compile("sgd", "mse");
  return model;
}

}  // namespace

TEST_CASE("training_stats: each step all-reduces 2(N-1)/N x the gradient and moving-statistic bytes per replica") {
  REQUIRE(devices::list_logical_devices(devices::DeviceType::kCPU).size() >= 4);
  constexpr std::int64_t kRows = 80;
  constexpr std::int64_t kBatch = 16;
  constexpr std::int64_t kSteps = kRows / kBatch;
  const Tensor x = random_tensor(kRows, 6, 1);
  const Tensor y = random_tensor(kRows, 3, 2);
  for (const int n : {2, 4}) {
    for (const bool batch_norm : {false, true}) {
      CAPTURE(n);
      CAPTURE(batch_norm);
      MirroredStrategy strategy(cpu_devices(n));
      Model model = small_model(strategy, batch_norm);
      CHECK(model.training_stats().communication == collective::CommunicationStats{});
      model.fit(x, y, {.batch_size = kBatch, .epochs = 1, .verbose = 0, .shuffle = false});

      // What one replica's step reduces: every trainable weight's gradient, plus (BatchNormalization)
      // the moving mean and variance, the model's only non-trainable weights, riding along.
      const std::int64_t gradients = bytes_of(model.trainable_weights());
      const std::int64_t riders = bytes_of(model.non_trainable_weights());
      CHECK(riders == (batch_norm ? 2 * 8 * 4 : 0));
      const std::int64_t per_replica_step = 2 * (n - 1) * (gradients + riders) / n;

      const auto check_steps = [&](std::int64_t steps) {
        const TrainingStats stats = model.training_stats();
        CHECK(stats.steps == steps);
        CHECK(stats.replicas == n);
        const auto& all_reduce = stats.communication.all_reduce;
        CHECK(all_reduce.bytes_sent == steps * n * per_replica_step);
        CHECK(all_reduce.bytes_received == steps * n * per_replica_step);
        // One all-reduce per bucket per replica per step; nothing but all-reduces.
        CHECK(all_reduce.calls > 0);
        CHECK(all_reduce.calls % (steps * n) == 0);
        CHECK(stats.communication.total() == all_reduce);
        CHECK(stats.cross_worker == collective::CommunicationStats{});
        CHECK(stats.bytes_sent_per_replica_step() == static_cast<double>(per_replica_step));
        CHECK(stats.bytes_sent_per_step() == static_cast<double>(n * per_replica_step));
        CHECK(stats.bytes_received_per_step() == static_cast<double>(n * per_replica_step));
      };
      check_steps(kSteps);
      // A second fit on the same data keeps the trainer: the counts go on from there.
      model.fit(x, y, {.batch_size = kBatch, .epochs = 1, .verbose = 0, .shuffle = false});
      check_steps(2 * kSteps);
      // Evaluation in one process adds the replicas' sums on the host: nothing more is counted.
      model.evaluate(x, y, {.batch_size = kBatch, .verbose = 0});
      check_steps(2 * kSteps);
    }
  }
}

TEST_CASE("training_stats: one replica exchanges nothing, and nothing is counted before the first fit") {
  OneDeviceStrategy strategy("CPU:0");
  Model model;
  {
    auto scope = strategy.scope();
    model = Sequential({Input({6}), Dense(3)});
    model.compile("sgd", "mse");
  }
  CHECK(model.training_stats().steps == 0);
  CHECK(model.training_stats().bytes_sent_per_step() == 0.0);
  model.fit(random_tensor(32, 6, 3), random_tensor(32, 3, 4), {.batch_size = 8, .epochs = 1, .verbose = 0});
  const TrainingStats stats = model.training_stats();
  CHECK(stats.steps == 4);
  CHECK(stats.communication == collective::CommunicationStats{});
  CHECK(stats.bytes_sent_per_step() == 0.0);
}

TEST_CASE("training_stats under ZeRO stages 1 and 2: reduce-scatter and all-gather, 2(N-1)/N x the padded gradient bytes") {
  // Each replica reduce-scatters its gradients packed as N shards (each variable padded to N x
  // ceil(n / N) elements), with the moving statistics appended to every shard's segment, and
  // all-gathers the updated shards: (N-1)/N x N (S + R) + (N-1)/N x N S bytes per replica and step,
  // S = the padded shard bytes of every trainable variable, R = the riders' bytes.
  constexpr std::int64_t kRows = 80;
  constexpr std::int64_t kBatch = 16;
  constexpr std::int64_t kSteps = kRows / kBatch;
  const Tensor x = random_tensor(kRows, 6, 5);
  const Tensor y = random_tensor(kRows, 3, 6);
  for (const int n : {2, 4}) {
    for (const auto stage : {strategy::ZeroStage::k1, strategy::ZeroStage::k2}) {
      for (const bool batch_norm : {false, true}) {
        CAPTURE(n);
        CAPTURE(static_cast<int>(stage));
        CAPTURE(batch_norm);
        MirroredStrategy strategy(strategy::MirroredOptions{.devices = cpu_devices(n), .distribution = {.zero = stage}});
        Model model = small_model(strategy, batch_norm);
        model.fit(x, y, {.batch_size = kBatch, .epochs = 1, .verbose = 0, .shuffle = false});
        std::int64_t shard_bytes = 0;
        for (const auto& v : model.trainable_weights()) {
          shard_bytes += strategy::ShardSpec::even(v->global_shape(), n).shard_elements *
                         static_cast<std::int64_t>(dtype_size(v->dtype()));
        }
        const std::int64_t riders = bytes_of(model.non_trainable_weights());
        const TrainingStats stats = model.training_stats();
        CHECK(stats.steps == kSteps);
        const auto& c = stats.communication;
        CHECK(c.reduce_scatter.bytes_sent == kSteps * n * (n - 1) * (shard_bytes + riders));
        CHECK(c.all_gather.bytes_sent == kSteps * n * (n - 1) * shard_bytes);
        CHECK(c.all_reduce.calls == 0);  // no clipping, no loss scaling: nothing else communicates
        CHECK(c.reduce_scatter.calls == c.all_gather.calls);
        // Without padding or riders this is the all-reduce's 2(N-1)/N x gradient bytes.
        CHECK(stats.bytes_sent_per_replica_step() ==
              static_cast<double>((n - 1) * (2 * shard_bytes + riders)));
      }
    }
  }
}

TEST_CASE("training_stats under ZeRO stage 3: each parameter all-gathered before forward, and again for backward") {
  // Stage 3 keeps each parameter as shards and gathers it whole into the executor just before the
  // steps that read it: once for forward, and again for backward where backward reads it after
  // other layers were gathered. ZeRO's 3(N-1)/N x parameter bytes per step (two gathers and the
  // gradients' reduce-scatter) is the case where backward reads every parameter again. Here, in
  // Dense(8) -> Dense(8) -> Dense(3), backward reads only the kernels of the second and third
  // layers (for their input gradients; the first layer's input needs none, and biases are not
  // read back), and the third layer's stays gathered from its forward to its backward, since no
  // other layer is gathered in between: one gather again, of the second kernel. Each replica
  // sends (N-1) x (S + S_k + S) bytes a step, S = the padded shard bytes of every parameter,
  // S_k = those of that kernel.
  constexpr std::int64_t kRows = 80;
  constexpr std::int64_t kBatch = 16;
  constexpr std::int64_t kSteps = kRows / kBatch;
  const Tensor x = random_tensor(kRows, 6, 7);
  const Tensor y = random_tensor(kRows, 3, 8);
  for (const int n : {2, 4}) {
    CAPTURE(n);
    MirroredStrategy strategy(
        strategy::MirroredOptions{.devices = cpu_devices(n), .distribution = {.zero = strategy::ZeroStage::k3}});
    Model model;
    {
      auto scope = strategy.scope();
      model = Sequential({Input({6}), Dense(8, "relu"), Dense(8, "relu"), Dense(3)});
      model.compile("sgd", "mse");
    }
    model.fit(x, y, {.batch_size = kBatch, .epochs = 1, .verbose = 0, .shuffle = false});
    const auto shard_bytes = [&](const VariablePtr& v) {
      return strategy::ShardSpec::even(v->global_shape(), n).shard_elements *
             static_cast<std::int64_t>(dtype_size(v->dtype()));
    };
    const auto weights = model.trainable_weights();
    REQUIRE(weights.size() == 6);  // kernel and bias of each Dense
    std::int64_t all = 0;
    for (const auto& v : weights) all += shard_bytes(v);
    const std::int64_t again = shard_bytes(weights[2]);
    const TrainingStats stats = model.training_stats();
    CHECK(stats.steps == kSteps);
    const auto& c = stats.communication;
    CHECK(c.reduce_scatter.bytes_sent == kSteps * n * (n - 1) * all);
    CHECK(c.all_gather.bytes_sent == kSteps * n * (n - 1) * (all + again));
    CHECK(c.all_gather.calls == kSteps * n * 7);  // six forward gathers, one for backward
    CHECK(c.all_reduce.calls == 0);
    CHECK(stats.bytes_sent_per_replica_step() == static_cast<double>((n - 1) * (2 * all + again)));
    CHECK(stats.bytes_sent_per_replica_step() <= static_cast<double>(3 * (n - 1) * all));
  }
}

TEST_CASE("TANDEM_PROFILE reports the kernels of training steps, not those of evaluation and prediction") {
  constexpr std::int64_t kRows = 80;
  constexpr std::int64_t kBatch = 16;
  const Tensor x = random_tensor(kRows, 6, 1);
  const Tensor y = random_tensor(kRows, 3, 2);
  std::string report;
  ::setenv("TANDEM_PROFILE", "1", 1);
  auto previous = logging::set_sink([&](logging::Level level, std::string_view message) {
    if (level == logging::Level::kInfo && message.find("TANDEM_PROFILE") != std::string_view::npos) report = message;
  });
  {
    OneDeviceStrategy strategy("CPU:0");
    Model model = small_model(strategy, false);
    // 5 training steps, 5 evaluation batches after the epoch, then 5 more in evaluate and predict.
    model.fit(x, y,
              {.batch_size = kBatch,
               .epochs = 1,
               .verbose = 0,
               .validation_data = data::Dataset::from_tensor_slices({x, y}).batch(kBatch),
               .shuffle = false});
    model.evaluate(x, y, {.batch_size = kBatch, .verbose = 0});
    (void)model.predict(x, {.batch_size = kBatch, .verbose = 0});
  }  // the trainer reports as it goes away
  logging::set_sink(std::move(previous));
  ::unsetenv("TANDEM_PROFILE");
  CAPTURE(report);
  REQUIRE(report.find("5 training steps") != std::string::npos);
  // Each step runs both dense layers' forward once: 10 calls, where all runs together made 40.
  const auto line = report.find("FusedMatMul");
  REQUIRE(line != std::string::npos);
  const std::string calls = report.substr(line, report.find('\n', line) - line);
  CHECK(calls.find(" 10 calls") != std::string::npos);
  CHECK(report.find("not counted above: ") != std::string::npos);
}
