// MirroredStrategy: the same training as one device, on 2 and 4 logical CPU devices (CTest runs
// this suite with TANDEM_NUM_CPU_DEVICES=4), and its failure modes.
//
// The "default devices:" cases need a process whose devices do not exist yet, each its own: they
// are skipped unless chosen, and CTest runs each alone (--no-skip --test-case=...).
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>

#include "tandem/base/log.h"
#include "tandem/base/random.h"
#include "tandem/keras_like/keras.h"
#include "common/three_class_data.h"

using namespace tandem;

namespace {

using Data = testing::ThreeClassData;

Data make_data(std::int64_t n = 1000) { return testing::three_class_data(n); }

struct Run {
  std::vector<double> losses;  // the running loss after every batch
  std::vector<Tensor> weights;
  std::int64_t steps = 0;
  double evaluated_loss = 0;  // evaluate() over the same data after training
};

// Trains the same model (same seed) under `strategy` for `epochs` over batches of `batch`.
Run train(Strategy& strategy, const keras::OptimizerRef& optimizer, std::int64_t batch, int epochs, const Data& data) {
  set_global_seed(123);
  keras::Model model;
  {
    auto scope = strategy.scope();
    model = keras::Sequential({keras::Input({8}), keras::Dense(32, "relu"), keras::Dense(16, "tanh"), keras::Dense(3)});
    model.compile(optimizer, keras::SparseCategoricalCrossentropy{.from_logits = true}, {"accuracy"});
  }
  Run run;
  auto recorder = std::make_shared<keras::LambdaCallback>(
      keras::LambdaCallbackOptions{.on_train_batch_end = [&](std::int64_t, keras::Logs& logs) {
        run.losses.push_back(logs.at("loss"));
        ++run.steps;
      }});
  // No shuffle: both runs must see the same batches (1000 = 15 x 64 + 40: a partial last batch).
  auto dataset = data::Dataset::from_tensor_slices({data.x, data.y}).batch(batch);
  model.fit(dataset, {.epochs = epochs, .verbose = 0, .callbacks = {recorder}});
  run.weights = model.get_weights();
  run.evaluated_loss = model.evaluate(dataset, {.verbose = 0}).at("loss");
  return run;
}

double max_relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  double scale = 0;
  for (float v : b) scale = std::max(scale, static_cast<double>(std::abs(v)));
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]) / std::max(1e-3, scale));
  }
  return worst;
}

void check_equivalent(const Run& one, const Run& many, const std::string& what) {
  INFO(what);
  REQUIRE(one.steps == many.steps);
  REQUIRE(one.steps >= 100);
  for (std::size_t s = 0; s < one.losses.size(); ++s) {
    CHECK_MESSAGE(std::abs(one.losses[s] - many.losses[s]) <= 1e-5 * std::max(1.0, std::abs(one.losses[s])), "step ", s,
                  ": one device ", one.losses[s], ", mirrored ", many.losses[s]);
  }
  REQUIRE(one.weights.size() == many.weights.size());
  for (std::size_t w = 0; w < one.weights.size(); ++w) {
    const double err = max_relative_error(many.weights[w].to_vector<float>(), one.weights[w].to_vector<float>());
    CHECK_MESSAGE(err <= 1e-5, "weight ", w, ": relative error ", err);
  }
}

}  // namespace

TEST_CASE("MirroredStrategy on 2 and 4 devices trains exactly like one device (partial last batch included)") {
  REQUIRE(devices::list_logical_devices(devices::DeviceType::kCPU).size() == 4);
  const Data data = make_data();
  for (const auto& [name, optimizer] : std::vector<std::pair<std::string, keras::OptimizerRef>>{
           {"adam", keras::Adam{.learning_rate = 0.01}},
           {"sgd momentum", keras::SGD{.learning_rate = 0.1, .momentum = 0.9}}}) {
    OneDeviceStrategy one("CPU:0");
    const Run reference = train(one, optimizer, 64, 7, data);
    MirroredStrategy two(std::vector<std::string>{"CPU:0", "CPU:1"});
    CHECK(two.num_replicas_in_sync() == 2);
    check_equivalent(reference, train(two, optimizer, 64, 7, data), name + ", 2 replicas");
    MirroredStrategy four;  // every logical CPU device
    CHECK(four.num_replicas_in_sync() == 4);
    check_equivalent(reference, train(four, optimizer, 64, 7, data), name + ", 4 replicas");
  }
}

TEST_CASE("the same holds with gradient accumulation, and micro-steps do not change the weights") {
  const Data data = make_data();
  const keras::OptimizerRef optimizer = keras::Adam{.learning_rate = 0.01, .gradient_accumulation_steps = 3};
  OneDeviceStrategy one("CPU:0");
  const Run reference = train(one, optimizer, 32, 4, data);
  MirroredStrategy two(std::vector<std::string>{"CPU:0", "CPU:1"});
  check_equivalent(reference, train(two, optimizer, 32, 4, data), "adam, accumulation 3, 2 replicas");
  MirroredStrategy four;
  check_equivalent(reference, train(four, optimizer, 32, 4, data), "adam, accumulation 3, 4 replicas");
}

TEST_CASE("a last batch with fewer examples than replicas: some replicas get none, nobody waits") {
  const Data data = make_data(130);  // batches of 64, 64, 2: the last gives replicas 2 and 3 nothing
  OneDeviceStrategy one("CPU:0");
  MirroredStrategy four;
  const keras::OptimizerRef sgd = keras::SGD{.learning_rate = 0.1};
  const auto a = train(one, sgd, 64, 40, data);
  const auto b = train(four, sgd, 64, 40, data);
  check_equivalent(a, b, "sgd, 4 replicas, a batch of 2");
}

TEST_CASE("batches fetched to the devices ahead of their step train exactly like batches fed at the step") {
  // kAlways stages on CPU devices too: the staging thread, its buffers and their reuse run here
  // as they do for GPUs (device_staging_test covers late copies).
  const Data data = make_data(130);  // batches of 64, 64, 2: the last gives replicas 2 and 3 nothing
  const keras::OptimizerRef adam = keras::Adam{.learning_rate = 0.01};
  for (const int replicas : {1, 4}) {
    CAPTURE(replicas);
    std::vector<std::string> names;
    for (int r = 0; r < replicas; ++r) names.push_back(fmt::format("CPU:{}", r));
    MirroredStrategy fed({.devices = names, .distribution = {.fetch_to_device = strategy::FetchToDevice::kNever}});
    MirroredStrategy staged(
        {.devices = names,
         .distribution = {.fetch_to_device = strategy::FetchToDevice::kAlways, .device_prefetch_batches = 1}});
    CHECK_FALSE(fed.fetches_to_device());
    CHECK(staged.fetches_to_device());
    const auto a = train(fed, adam, 64, 40, data);
    const auto b = train(staged, adam, 64, 40, data);
    REQUIRE(a.losses.size() == b.losses.size());
    CHECK(a.losses == b.losses);  // the same arithmetic on the same values: bitwise
    CHECK(a.evaluated_loss == b.evaluated_loss);
    for (std::size_t w = 0; w < a.weights.size(); ++w) {
      CHECK(a.weights[w].to_vector<float>() == b.weights[w].to_vector<float>());
    }
  }
  CHECK_THROWS_AS(MirroredStrategy({.devices = {"CPU:0"}, .distribution = {.device_prefetch_batches = 0}}),
                  InvalidArgument);
  // CPU devices are read by the host: kAuto does not stage for them.
  CHECK_FALSE(MirroredStrategy(std::vector<std::string>{"CPU:0", "CPU:1"}).fetches_to_device());
}

TEST_CASE("BatchNormalization's moving statistics stay equal on every replica") {
  MirroredStrategy two(std::vector<std::string>{"CPU:0", "CPU:1"});
  keras::Model model;
  {
    auto scope = two.scope();
    model = keras::Sequential({keras::Input({8}), keras::Dense(16), keras::BatchNormalization(), keras::Dense(3)});
    model.compile("adam", keras::SparseCategoricalCrossentropy{.from_logits = true});
  }
  const Data data = make_data(300);
  model.fit(data.x, data.y, {.batch_size = 50, .epochs = 2, .verbose = 0});
  for (const auto& w : model.weights()) CHECK_NOTHROW(w->check_copies_equal());
  const auto moving = model.get_layer(model.layers()[1].name())->non_trainable_weights();
  REQUIRE(moving.size() == 2);
  CHECK(moving[0]->read_value().to_vector<float>() != std::vector<float>(16, 0.0f));  // it moved
}

TEST_CASE("strategy.run, all_reduce, reduce and distributed datasets") {
  MirroredStrategy four;
  std::vector<float> seen(4, 0);
  four.run([&](strategy::ReplicaContext& ctx) {
    const int r = ctx.replica_id_in_sync_group();
    CHECK(ctx.num_replicas_in_sync() == 4);
    CHECK(ctx.device().short_name() == fmt::format("CPU:{}", r));
    const auto sum = ctx.all_reduce(strategy::ReduceOp::kSum, Tensor::scalar<float>(static_cast<float>(r + 1)));
    seen[static_cast<std::size_t>(r)] = sum.item<float>();
  });
  CHECK(seen == std::vector<float>(4, 10.0f));
  const auto mean = four.reduce(strategy::ReduceOp::kMean, {Tensor::scalar<float>(1), Tensor::scalar<float>(3),
                                                            Tensor::scalar<float>(5), Tensor::scalar<float>(7)});
  CHECK(mean.item<float>() == 4.0f);
  auto dataset = data::Dataset::from_tensor_slices({make_data(10).x}).batch(10);
  auto it = four.experimental_distribute_dataset(dataset);
  auto shards = it.next();
  REQUIRE(shards);
  CHECK((*shards)[0][0].shape() == Shape{3, 8});
  CHECK((*shards)[3][0].shape() == Shape{2, 8});
}

TEST_CASE("mistakes and failures are reported, never waited on") {
  CHECK_THROWS_WITH_AS(MirroredStrategy(std::vector<std::string>{"CPU:0", "CPU:9"}),
                       doctest::Contains("local devices: CPU:0, CPU:1, CPU:2, CPU:3"), NotFound);
  CHECK_THROWS_AS(MirroredStrategy(std::vector<std::string>{"CPU:1", "CPU:1"}), InvalidArgument);

  // A layer built outside the strategy's scope: its weights have one copy, the strategy two.
  MirroredStrategy two(std::vector<std::string>{"CPU:0", "CPU:1"});
  keras::Dense outside(3);
  auto x = keras::Input({8});
  outside(x);
  {
    auto scope = two.scope();
    CHECK_THROWS_WITH_AS(keras::Model(x, outside(x)), doctest::Contains("has weights from"), FailedPrecondition);
  }
  auto v =
      strategy::default_strategy().create_variable({.name = "lonely", .initial_value = Tensor::zeros({2}, kFloat32)});
  CHECK_THROWS_WITH_AS(two.run([&](strategy::ReplicaContext& ctx) { v->value(ctx.replica_id_in_sync_group()); }),
                       doctest::Contains("create it under the scope of the strategy that runs it"), InvalidArgument);

  // A replica that throws (an out-of-range label in its shard) makes fit fail at once with that
  // error; the other replica, waiting in the all-reduce, is released.
  keras::Model model;
  {
    auto scope = two.scope();
    model = keras::Sequential({keras::Input({8}), keras::Dense(3)});
    model.compile("sgd", keras::SparseCategoricalCrossentropy{.from_logits = true});
  }
  Data data = make_data(8);
  data.y.data<std::int64_t>()[6] = 7;  // in the second replica's half
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(model.fit(data.x, data.y, {.batch_size = 8, .verbose = 0}), doctest::Contains("label 7"),
                       InvalidArgument);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  // The strategy recovers: the next fit works.
  data.y.data<std::int64_t>()[6] = 1;
  CHECK_NOTHROW(model.fit(data.x, data.y, {.batch_size = 8, .verbose = 0}));

  // Copies that differ are detected (they would train apart silently).
  auto w = model.weights().front();
  w->value(1).data<float>()[3] += 1.0f;
  CHECK_THROWS_WITH_AS(w->check_copies_equal(), doctest::Contains("differ at element 3"), FailedPrecondition);
  CHECK_THROWS_AS(model.fit(data.x, data.y, {.batch_size = 8, .verbose = 0}), FailedPrecondition);
}

TEST_CASE("ReductionToOneDevice and reduction after backward train like the default") {
  const Data data = make_data(400);
  const keras::OptimizerRef adam = keras::Adam{.learning_rate = 0.01};
  OneDeviceStrategy one("CPU:0");
  const Run reference = train(one, adam, 32, 9, data);
  MirroredStrategy to_one(strategy::MirroredOptions{
      .devices = {"CPU:0", "CPU:1", "CPU:2"}, .cross_device_ops = std::make_shared<strategy::ReductionToOneDevice>()});
  CHECK(to_one.cross_device_ops().name() == "ReductionToOneDevice");
  check_equivalent(reference, train(to_one, adam, 32, 9, data), "adam, ReductionToOneDevice, 3 replicas");
  // Both sides of the default's choice (Strategy::overlaps_communication), whatever this machine makes it.
  MirroredStrategy after_backward(
      strategy::MirroredOptions{.devices = {"CPU:0", "CPU:1"}, .distribution = {.overlap_communication = false}});
  check_equivalent(reference, train(after_backward, adam, 32, 9, data), "adam, no overlap, 2 replicas");
  MirroredStrategy overlapped(
      strategy::MirroredOptions{.devices = {"CPU:0", "CPU:1"}, .distribution = {.overlap_communication = true}});
  check_equivalent(reference, train(overlapped, adam, 32, 9, data), "adam, overlap, 2 replicas");
  // Small buckets: every weight its own bucket, reduced as soon as backward produced it.
  MirroredStrategy small_buckets(strategy::MirroredOptions{
      .devices = {"CPU:0", "CPU:1"},
      .distribution = {.first_bucket_bytes = 64, .bucket_bytes = 64, .overlap_communication = true}});
  check_equivalent(reference, train(small_buckets, adam, 32, 9, data), "adam, 64-byte buckets, 2 replicas");
}

TEST_CASE("VariableAggregation: replica updates and reads combine as in TF") {
  MirroredStrategy two(std::vector<std::string>{"CPU:0", "CPU:1"});
  const auto make = [&](strategy::VariableSynchronization sync, strategy::VariableAggregation aggregation) {
    auto scope = two.scope();
    return two.create_variable(
        {.name = "v", .initial_value = Tensor::scalar<float>(0), .synchronization = sync, .aggregation = aggregation});
  };
  using strategy::VariableAggregation;
  using strategy::VariableSynchronization;
  const std::vector<Tensor> per_replica{Tensor::scalar<float>(2), Tensor::scalar<float>(6)};

  auto sum = make(VariableSynchronization::kOnWrite, VariableAggregation::kSum);
  CHECK(dynamic_cast<strategy::MirroredVariable*>(sum.get()) != nullptr);
  sum->assign_per_replica(per_replica);
  CHECK(sum->value(0).item<float>() == 8);
  CHECK(sum->value(1).item<float>() == 8);
  auto mean = make(VariableSynchronization::kOnWrite, VariableAggregation::kMean);
  mean->assign_per_replica(per_replica);
  CHECK(mean->read_value().item<float>() == 4);
  auto first = make(VariableSynchronization::kOnWrite, VariableAggregation::kOnlyFirstReplica);
  first->assign_per_replica(per_replica);
  CHECK(first->value(1).item<float>() == 2);
  auto none = make(VariableSynchronization::kOnWrite, VariableAggregation::kNone);
  CHECK_THROWS_WITH_AS(none->assign_per_replica(per_replica), doctest::Contains("aggregation NONE"),
                       FailedPrecondition);

  // On read: each replica keeps its own value; reading combines them.
  auto counter = make(VariableSynchronization::kOnRead, VariableAggregation::kSum);
  CHECK(dynamic_cast<strategy::SyncOnReadVariable*>(counter.get()) != nullptr);
  counter->assign_per_replica(per_replica);
  CHECK(counter->value(0).item<float>() == 2);
  CHECK(counter->read_value().item<float>() == 8);
  counter->assign(Tensor::scalar<float>(6));  // TF: each replica gets 6 / 2, so reading gives 6
  CHECK(counter->value(1).item<float>() == 3);
  CHECK(counter->read_value().item<float>() == 6);
  auto average = make(VariableSynchronization::kOnRead, VariableAggregation::kMean);
  average->assign_per_replica(per_replica);
  CHECK(average->read_value().item<float>() == 4);
  auto only_first = make(VariableSynchronization::kOnRead, VariableAggregation::kOnlyFirstReplica);
  only_first->assign_per_replica(per_replica);
  CHECK(only_first->read_value().item<float>() == 2);
}

// ---------------------------------------------------------------------------------------------
// MirroredStrategy's default devices on a machine without GPUs (each case in a fresh process).

namespace {

// What `MirroredStrategy strategy;` makes on a CPU-only machine: one replica per usable core, up
// to devices::kMaxDefaultCpuDevices.
int per_core_replicas() { return std::min(devices::usable_cpu_cores(), devices::kMaxDefaultCpuDevices); }

bool uses_gpus(const Strategy& strategy) {
  return strategy.replica_devices().front()->type() == devices::DeviceType::kGPU;
}

// Leaves the device layout to the case: the variables may be set where CTest runs.
void unset_device_variables() {
  ::unsetenv("TANDEM_NUM_CPU_DEVICES");
  ::unsetenv("TANDEM_INTRA_OP_THREADS");
}

}  // namespace

TEST_CASE("default devices: one replica per usable core, each with its share of the cores, training like one device" *
          doctest::skip()) {
  unset_device_variables();
  MirroredStrategy strategy;  // as the README writes it, before any tensor
  if (uses_gpus(strategy)) return;
  CHECK(strategy.num_replicas_in_sync() == per_core_replicas());
  for (auto* device : strategy.replica_devices()) {
    CHECK(device->intra_op_threads() == std::max(1, devices::usable_cpu_cores() / per_core_replicas()));
  }
  const Data data = make_data();
  OneDeviceStrategy one("CPU:0");
  const keras::OptimizerRef adam = keras::Adam{.learning_rate = 0.01};
  check_equivalent(train(one, adam, 64, 7, data), train(strategy, adam, 64, 7, data), "adam, the default devices");
}

TEST_CASE("default devices: TANDEM_NUM_CPU_DEVICES wins" * doctest::skip()) {
  unset_device_variables();
  ::setenv("TANDEM_NUM_CPU_DEVICES", "3", 1);
  MirroredStrategy strategy;
  if (uses_gpus(strategy)) return;
  CHECK(strategy.num_replicas_in_sync() == 3);
}

TEST_CASE("default devices: a configuration made in code wins" * doctest::skip()) {
  unset_device_variables();
  devices::set_logical_device_configuration({.num_cpu_devices = 3, .intra_op_threads_per_device = 2});
  MirroredStrategy strategy;
  if (uses_gpus(strategy)) return;
  CHECK(strategy.num_replicas_in_sync() == 3);
  CHECK(strategy.replica_devices().front()->intra_op_threads() == 2);
}

TEST_CASE("default devices: made after the first tensor, it keeps the devices there are and says why" *
          doctest::skip()) {
  unset_device_variables();
  std::string warnings;
  auto previous = logging::set_sink([&](logging::Level level, std::string_view message) {
    if (level == logging::Level::kWarn) warnings += std::string(message) + "\n";
  });
  const Tensor early = Tensor::zeros({2}, kFloat32);  // creates the devices: one CPU device
  MirroredStrategy strategy;
  logging::set_sink(std::move(previous));
  if (uses_gpus(strategy)) return;
  CHECK(strategy.num_replicas_in_sync() == 1);
  if (per_core_replicas() > 1) {
    CHECK(warnings.find("MirroredStrategy") != std::string::npos);
    CHECK(warnings.find("TANDEM_NUM_CPU_DEVICES") != std::string::npos);
  } else {
    CHECK(warnings.empty());
  }
}
