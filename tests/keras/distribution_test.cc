// keras::distribution: DeviceMesh, TensorLayout and LayoutMap checks (every message), LayoutMap's
// lookup (exact key first, then full regular-expression matches), DataParallel training bitwise as
// MirroredStrategy on the same 2 logical CPU devices (CTest sets TANDEM_NUM_CPU_DEVICES=2),
// set_distribution, ModelParallel's refusals, and plan()'s bytes against hand-computed figures.
#include <doctest/doctest.h>

#include <random>
#include <sstream>

#include "common/error_message.h"
#include "tandem/keras_like/distribution.h"
#include "tandem/keras_like/keras.h"

using namespace tandem;
using namespace tandem::keras;
namespace kd = tandem::keras::distribution;

namespace {

const std::vector<std::string> kTwoCpus{"CPU:0", "CPU:1"};

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Input 4 -> Dense(3) "d1" -> Dense(2) "d2": 12 + 3 + 6 + 2 = 23 float32 parameters.
// Under `strategy`'s scope; null: under no scope (the global distribution, else the default).
Model make_model(Strategy* strategy) {
  const auto build = [] {
    set_global_seed(11);
    auto x = Input({4});
    auto h = Dense(3, "tanh", {.name = "d1"})(x);
    auto y = Dense(2, {.name = "d2"})(h);
    return Model(x, y, "tiny");
  };
  if (strategy == nullptr) return build();
  auto scope = strategy->scope();
  return build();
}

std::pair<Tensor, Tensor> make_data() {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x, y;
  for (int i = 0; i < 36; ++i) {  // 36 rows in batches of 8: a partial last batch
    float a = 0, b = 0;
    for (int f = 0; f < 4; ++f) {
      const float v = normal(rng);
      x.push_back(v);
      a += 0.5f * v;
      b -= 0.25f * v * static_cast<float>(f);
    }
    y.push_back(a);
    y.push_back(b);
  }
  return {Tensor::from_vector<float>(x, {36, 4}), Tensor::from_vector<float>(y, {36, 2})};
}

struct Trained {
  std::vector<double> losses;
  std::vector<std::vector<float>> weights;
};

Trained train(Strategy& strategy) {
  Model model = make_model(&strategy);
  {
    auto scope = strategy.scope();
    model.compile(SGD{.learning_rate = 0.05, .momentum = 0.9}, "mse");
  }
  const auto [x, y] = make_data();
  const auto history = model.fit(x, y, {.batch_size = 8, .epochs = 3, .verbose = 0, .shuffle = false});
  Trained t;
  t.losses = history.history.at("loss");
  for (const auto& w : model.get_weights()) t.weights.push_back(w.to_vector<float>());
  return t;
}

}  // namespace

TEST_CASE("DeviceMesh refuses empty, mismatched, repeated and miscounted meshes, naming what is wrong") {
  CHECK(contains(testing::error_message<InvalidArgument>([] { kd::DeviceMesh({}, {}, kTwoCpus); }),
                 "shape and axis_names cannot be empty"));
  CHECK(contains(testing::error_message<InvalidArgument>([] { kd::DeviceMesh({2}, {"batch", "model"}, kTwoCpus); }),
                 "shape [2] has 1 axes but axis_names [batch, model] has 2 names"));
  CHECK(contains(testing::error_message<InvalidArgument>([] { kd::DeviceMesh({1, 2}, {"batch", "batch"}, kTwoCpus); }),
                 "axis name 'batch' appears twice in [batch, batch]"));
  CHECK(contains(testing::error_message<InvalidArgument>([] { kd::DeviceMesh({4}, {"batch"}, kTwoCpus); }),
                 "shape [4] holds 4 devices but 2 were given (CPU:0, CPU:1)"));
  CHECK(contains(testing::error_message<InvalidArgument>([] { kd::DeviceMesh({0, 2}, {"batch", "model"}, kTwoCpus); }),
                 "axis 'batch' has size 0"));
  CHECK(contains(testing::error_message<InvalidArgument>([] { kd::DeviceMesh({2}, {"batch"}, {"CPU:0", "CPU:0"}); }),
                 "device \"CPU:0\" appears twice"));

  const kd::DeviceMesh mesh({1, 2}, {"batch", "model"}, kTwoCpus);
  CHECK(mesh.axis_size("model") == 2);
  CHECK(mesh.to_string() == "DeviceMesh(shape=[1, 2], axis_names=[batch, model])");
  CHECK(contains(testing::error_message<InvalidArgument>([&] { mesh.axis_size("data"); }),
                 "'data' is not an axis of DeviceMesh(shape=[1, 2], axis_names=[batch, model]); its axes are 'batch', "
                 "'model'"));
  // The default devices are MirroredStrategy's: the 2 logical CPU devices here.
  CHECK(kd::list_devices() == kTwoCpus);
  CHECK(kd::DeviceMesh({2}, {"batch"}).devices() == kTwoCpus);
}

TEST_CASE("TensorLayout: an axis used twice, or unknown to the mesh it is bound to, is an error naming it") {
  CHECK(contains(testing::error_message<InvalidArgument>([] { kd::TensorLayout({"model", "model"}); }),
                 "TensorLayout ['model', 'model']: mesh axis 'model' splits dimensions 0 and 1"));
  const kd::DeviceMesh mesh({1, 2}, {"batch", "model"}, kTwoCpus);
  CHECK(contains(testing::error_message<InvalidArgument>([&] { kd::TensorLayout({std::nullopt, "tensor"}, mesh); }),
                 "TensorLayout [None, 'tensor']: 'tensor' is not an axis of DeviceMesh(shape=[1, 2], "
                 "axis_names=[batch, model]); its axes are 'batch', 'model'"));
  const kd::TensorLayout layout({std::nullopt, "model"}, mesh);
  CHECK(layout.num_shards() == 2);
  CHECK(layout.to_string() == "[None, 'model']");
  CHECK(kd::TensorLayout({std::nullopt, std::nullopt}, mesh).num_shards() == 1);
}

TEST_CASE("LayoutMap: exact key first, then keys as regular expressions matched against the whole path") {
  kd::LayoutMap map(kd::DeviceMesh({1, 2}, {"batch", "model"}, kTwoCpus));
  map["d1/kernel"] = kd::TensorLayout({"model", std::nullopt});
  map[".*kernel"] = {std::nullopt, "model"};
  map["d.*/bias"] = {"model"};

  // The exact key wins although ".*kernel" matches too.
  CHECK(map.get("d1/kernel")->to_string() == "['model', None]");
  CHECK(*map.matching_key("d1/kernel") == "d1/kernel");
  CHECK(map.get("d2/kernel")->to_string() == "[None, 'model']");
  CHECK(*map.matching_key("d2/bias") == "d.*/bias");
  // Matched in full: "kernel" alone is not a match for ".*kernel/m"'s path, nor "d1/bias/m" for "d.*/bias".
  CHECK_FALSE(map.get("d2/kernel/m").has_value());
  CHECK_FALSE(map.get("d1/bias/m").has_value());
  CHECK_FALSE(map.get("embedding/embeddings").has_value());
  CHECK(map.keys() == std::vector<std::string>{"d1/kernel", ".*kernel", "d.*/bias"});

  // A path two expressions match is an error naming both keys and the path.
  map["d2/.*"] = {std::nullopt, std::nullopt};
  CHECK(testing::error_message<InvalidArgument>([&] { map.get("d2/kernel"); }) ==
        "LayoutMap: path 'd2/kernel' matches the keys '.*kernel' and 'd2/.*'; make each variable path match one key at "
        "most");
  CHECK(contains(testing::error_message<InvalidArgument>([&] { map["d1/kernel"] = {std::nullopt, std::nullopt}; }),
                 "LayoutMap: key 'd1/kernel' is already there (layout ['model', None])"));
  CHECK(contains(testing::error_message<InvalidArgument>([&] { map["dense(/kernel"] = {std::nullopt}; }),
                 "LayoutMap: key 'dense(/kernel' is not a regular expression"));
  CHECK(contains(testing::error_message<InvalidArgument>([&] { map["x"] = {"data"}; }), "'data' is not an axis of"));
}

TEST_CASE("DataParallel trains bitwise as MirroredStrategy on the same 2 devices, and is the global distribution") {
  MirroredStrategy mirrored(kTwoCpus);
  const Trained want = train(mirrored);

  kd::DataParallel dp(kd::DeviceMesh({2}, {"batch"}, kTwoCpus));
  CHECK(dp.num_replicas_in_sync() == 2);
  CHECK(dp.num_workers() == 1);
  CHECK(contains(dp.name(), "DataParallel#"));
  CHECK(dp.batch_dim_name() == "batch");
  CHECK(dp.cross_device_ops().name() == mirrored.cross_device_ops().name());
  const Trained got = train(dp);
  CHECK(got.losses == want.losses);
  CHECK(got.weights == want.weights);

  // No mesh: a 1-D mesh of list_devices() named "batch", as Keras makes it.
  kd::DataParallel all;
  CHECK(all.device_mesh().devices() == kTwoCpus);
  CHECK(all.device_mesh().axis_names() == std::vector<std::string>{"batch"});

  // From a device list, with the stage passed into DistributionOptions.
  kd::DataParallel listed(kTwoCpus, {.zero = kd::ZeroStage::k1});
  CHECK(listed.device_mesh().axis_names() == std::vector<std::string>{"batch"});
  CHECK(listed.distribution_options().zero == kd::ZeroStage::k1);
  CHECK(contains(testing::error_message<InvalidArgument>([] {
                   kd::DataParallel(kTwoCpus, {.zero = kd::ZeroStage::k1,
                                               .distribution = {.zero = kd::ZeroStage::k2}});
                 }),
                 "DataParallelOptions::zero is stage 1 but its distribution.zero is stage 2"));
  CHECK(contains(testing::error_message<InvalidArgument>(
                     [] { kd::DataParallel(kd::DeviceMesh({1, 2}, {"batch", "model"}, kTwoCpus)); }),
                 "has 2 devices along axis 'model'; DataParallel splits the batch over the first axis ('batch')"));

  // set_distribution: code with no scope makes its model under it; the scope of another wins.
  REQUIRE(kd::distribution() == nullptr);
  kd::set_distribution(dp);
  CHECK(kd::distribution() == &dp);
  CHECK(&strategy::get_strategy() == &dp);
  Model global = make_model(nullptr);
  CHECK(&global.distribute_strategy() == &dp);
  {
    auto scope = mirrored.scope();
    CHECK(&strategy::get_strategy() == &mirrored);
  }
  kd::set_distribution(nullptr);
  CHECK(&strategy::get_strategy() == &strategy::default_strategy());
  {
    kd::DataParallel temporary(kTwoCpus);
    kd::set_distribution(temporary);
  }
  CHECK(kd::distribution() == nullptr);  // destroying the global distribution unsets it
}

TEST_CASE("a mesh across workers names each device with its worker's rank, worker-major, as many per worker") {
  const auto resolver = std::make_shared<strategy::TFConfigClusterResolver>(strategy::TFConfigClusterResolver::from_json(
      R"({"cluster": {"worker": ["localhost:1", "localhost:2"]}, "task": {"type": "worker", "index": 1}})"));
  const kd::WorkerOptions workers{.cluster_resolver = resolver};
  CHECK(contains(testing::error_message<InvalidArgument>([&] { kd::DataParallel(kTwoCpus, {.workers = workers}); }),
                 "mesh device \"CPU:0\" names no task, but this job has 2 workers: name each device with its worker's "
                 "rank, as \"/job:worker/replica:0/task:1/device:CPU:0\""));
  // The error of a DataParallel on these devices, as rank 1 of the 2 workers.
  const auto error = [&](std::vector<std::string> devices) {
    return testing::error_message<InvalidArgument>([&] { kd::DataParallel(devices, {.workers = workers}); });
  };
  const auto global = [](int task, int cpu) { return fmt::format("/job:worker/replica:0/task:{}/device:CPU:{}", task, cpu); };
  CHECK(contains(error({global(1, 0), global(0, 0)}),
                 "comes after a device of task 1: list the devices worker by worker (worker-major)"));
  CHECK(contains(error({global(0, 0), global(0, 1), global(1, 0)}), "the mesh holds 2 devices of task 0 but 1 of task 1"));
  CHECK(contains(error({global(0, 0), global(2, 0)}), "is on task 2, but this job has 2 workers (tasks 0 to 1)"));
}

TEST_CASE("ModelParallel trains replicated layouts as data parallelism and refuses to split variables") {
  const kd::DeviceMesh mesh({2, 1}, {"batch", "model"}, kTwoCpus);
  {
    kd::LayoutMap map(mesh);
    map["d1/kernel"] = {std::nullopt, "model"};  // 'model' has one device: replicated
    map["d9/.*"] = {std::nullopt};               // matches nothing: the plan says so
    kd::ModelParallel mp(map, {.batch_dim_name = "batch"});
    CHECK(mp.num_replicas_in_sync() == 2);
    CHECK(mp.get_variable_layout("d1/kernel", 2).to_string() == "[None, 'model']");
    CHECK(mp.get_variable_layout("d2/kernel", 2).to_string() == "[None, None]");
    Model model = make_model(&mp);
    const kd::Plan p = mp.plan(model);
    CHECK(p.unmatched_layout_keys == std::vector<std::string>{"d9/.*"});
    CHECK(p.variables[0].layout_key == "d1/kernel");
    CHECK(contains(p.to_string(), "LayoutMap keys that match no variable of the model: 'd9/.*'"));
    // Data parallelism over 'batch': MirroredStrategy's training on the same devices.
    MirroredStrategy mirrored(kTwoCpus);
    const Trained want = train(mirrored);
    const Trained got = train(mp);
    CHECK(got.losses == want.losses);
    CHECK(got.weights == want.weights);
  }
  {
    kd::LayoutMap map(mesh);
    map["d1/kernel"] = {std::nullopt};  // rank 1 for a rank-2 kernel
    kd::ModelParallel mp(map);
    CHECK(contains(testing::error_message<InvalidArgument>([&] { make_model(&mp); }),
                   "variable 'd1/kernel' of shape (4, 3) has rank 2 but layout_map['d1/kernel'] = [None] has 1 axes"));
  }
  {
    kd::LayoutMap map(mesh);
    map[".*kernel"] = {"batch", std::nullopt};
    CHECK(testing::error_message<Unimplemented>([&] { kd::ModelParallel mp(map); }) ==
          "ModelParallel: layout_map['.*kernel'] = ['batch', None] splits variables over the batch axis 'batch' (2 "
          "devices): that is ZeRO stage 3; use DataParallel(mesh, {.zero = ZeroStage::k3})");
  }
  {
    kd::LayoutMap map(kd::DeviceMesh({1, 2}, {"batch", "model"}, kTwoCpus));
    map[".*kernel"] = {std::nullopt, "model"};
    CHECK(contains(testing::error_message<Unimplemented>([&] { kd::ModelParallel mp(map); }),
                   "layout_map['.*kernel'] = [None, 'model'] splits variables over mesh axis 'model' (2 devices): "
                   "tensor parallelism is not implemented yet"));
  }
  {
    kd::LayoutMap map(kd::DeviceMesh({1, 2}, {"batch", "model"}, kTwoCpus));
    CHECK(contains(testing::error_message<Unimplemented>([&] { kd::ModelParallel mp(map); }),
                   "has 2 devices along axis 'model', which is not the batch axis 'batch': tensor parallelism is not "
                   "implemented yet"));
    CHECK(contains(testing::error_message<InvalidArgument>([&] { kd::ModelParallel mp(map, {.batch_dim_name = "data"}); }),
                   "'data' is not an axis of"));
  }
}

TEST_CASE("plan: bytes per device and per step for ZeRO stages 0-3 on 2 and 4 replicas, as computed by hand") {
  // 23 float32 parameters in 4 variables (12, 3, 6, 2); Adam keeps 2 slots of each.
  // N = 2: shards of 6, 2 (+1 padding), 3, 1 elements = 12 (24 padded); the largest layer, d1, 15
  // parameters (60 bytes). N = 4: 3, 1 (+1), 2 (+2), 1 (+2) = 7 (28 padded).
  const Model model = make_model(nullptr);
  struct Case {
    int replicas;
    kd::ZeroStage zero;
    std::int64_t weights, gradients, slots, gathered;
    std::vector<double> collective_bytes;
  };
  const std::vector<Case> cases{
      {2, kd::ZeroStage::k0, 92, 92, 184, 0, {92}},          // all-reduce 2 (1/2) 92
      {2, kd::ZeroStage::k1, 92, 92, 96, 0, {48, 48}},       // (1/2) 96 each way
      {2, kd::ZeroStage::k2, 92, 48, 96, 0, {48, 48}},       // gradient shards (hand-offs)
      {2, kd::ZeroStage::k3, 48, 48, 96, 60, {48, 48, 48}},  // 3 (N-1)/N of the parameters
      {4, kd::ZeroStage::k0, 92, 92, 184, 0, {138}},         // 2 (3/4) 92
      {4, kd::ZeroStage::k1, 92, 92, 56, 0, {84, 84}},       // (3/4) 112
      {4, kd::ZeroStage::k2, 92, 28, 56, 0, {84, 84}},      {4, kd::ZeroStage::k3, 28, 28, 56, 60, {84, 84, 84}},
  };
  for (const auto& c : cases) {
    CAPTURE(c.replicas);
    CAPTURE(static_cast<int>(c.zero));
    const kd::Plan p = kd::plan(model, {.replicas = c.replicas, .zero = c.zero, .optimizer = OptimizerRef(Adam{})});
    CHECK(p.slots_per_variable == 2);
    CHECK(p.memory.weights == c.weights);
    CHECK(p.memory.gradients == c.gradients);
    CHECK(p.memory.slots == c.slots);
    CHECK(p.memory.gathered == c.gathered);
    REQUIRE(p.collectives.size() == c.collective_bytes.size());
    double total = 0;
    for (std::size_t i = 0; i < p.collectives.size(); ++i) {
      CHECK(p.collectives[i].bytes_per_device == c.collective_bytes[i]);
      total += c.collective_bytes[i];
    }
    CHECK(p.communication_bytes_per_device == total);
    CHECK(p.memory_by_stage[static_cast<std::size_t>(c.zero)].total() == p.memory.total());
  }
  const kd::Plan k1 = kd::plan(model, {.replicas = 4, .zero = kd::ZeroStage::k1, .optimizer = OptimizerRef(Adam{})});
  CHECK(k1.variables[1].path == "d1/bias");
  CHECK(k1.variables[1].shard_elements == 1);
  CHECK(k1.variables[1].padding == 1);
  CHECK(k1.variables[1].layout == "slots 1/4: 1 element (+1 padding)");
  CHECK(k1.memory_by_stage[0].total() == 368);  // 16 bytes per parameter, replicated

  // Slots per rule; none before compile; one replica communicates nothing.
  const auto slots = [&](OptimizerRef o) { return kd::plan(model, {.optimizer = o}).slots_per_variable; };
  CHECK(slots(SGD{}) == 0);
  CHECK(slots(SGD{.momentum = 0.9}) == 1);
  CHECK(slots(RMSprop{}) == 1);
  CHECK(slots(RMSprop{.momentum = 0.9, .centered = true}) == 3);
  CHECK(slots(AdamW{.amsgrad = true}) == 3);
  CHECK(slots(Adam{.gradient_accumulation_steps = 4}) == 3);
  // The accumulator stays whole at stages 1 and 2: 92 bytes beside Adam's 56 sharded on 4.
  const kd::Plan accumulating = kd::plan(
      model, {.replicas = 4, .zero = kd::ZeroStage::k1, .optimizer = OptimizerRef(Adam{.gradient_accumulation_steps = 4})});
  CHECK(accumulating.memory.slots == 56 + 92);
  const kd::Plan bare = kd::plan(model);
  CHECK(bare.slots_per_variable == 0);
  CHECK(bare.replicas == 1);
  CHECK(bare.collectives.empty());
  CHECK(contains(bare.optimizer, "not compiled"));

  std::ostringstream text;
  kd::print_plan(model, text, {.replicas = 2, .zero = kd::ZeroStage::k3, .optimizer = OptimizerRef(Adam{})});
  CHECK(contains(text.str(), "2 replicas in sync, ZeRO stage 3, optimizer adam (2 slots per variable)"));
  CHECK(contains(text.str(), "d1/kernel"));
  CHECK(contains(text.str(), "all_gather      weights before forward   48"));

  // A Sequential without an Input has no variables to plan yet.
  const Model deferred = Sequential({Dense(2)});
  CHECK(contains(testing::error_message<FailedPrecondition>([&] { kd::plan(deferred); }), "is not built"));
}
