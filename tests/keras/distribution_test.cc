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

Model make_mlp(bool with_norm);  // below

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

TEST_CASE("ModelParallel trains replicated layouts as data parallelism and splits the variables of valid layouts") {
  const kd::DeviceMesh mesh({2, 1}, {"batch", "model"}, kTwoCpus);
  {
    kd::LayoutMap map(mesh);
    map["d1/kernel"] = {std::nullopt, "model"};  // 'model' has one device: replicated
    map["d9/.*"] = {std::nullopt};               // matches nothing: the plan says so, compile warns
    kd::ModelParallel mp(map, {.batch_dim_name = "batch", .strict = false});
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
    // Valid tensor-parallel layouts pass every check, and compile splits the weights
    // (model_parallel_fit_test trains them).
    kd::LayoutMap map(kd::DeviceMesh({1, 2}, {"batch", "model"}, kTwoCpus));
    map["fc1/kernel"] = {std::nullopt, "model"};
    map["fc1/bias"] = {"model"};
    map["fc2/kernel"] = {"model", std::nullopt};
    kd::ModelParallel mp(map);
    auto scope = mp.scope();
    Model model = make_mlp(false);
    model.compile("sgd", "mse");
    CHECK(model.compiled());
    CHECK(model.weights()[0]->tensor_split()->dim == 1);
    CHECK(model.weights()[0]->value(1).shape() == Shape{8, 8});
  }
  {
    kd::LayoutMap map(kd::DeviceMesh({1, 2}, {"batch", "model"}, kTwoCpus));
    kd::ModelParallel mp(map);
    Model model = make_model(&mp);
    auto scope = mp.scope();
    CHECK(contains(testing::error_message<InvalidArgument>([&] { model.compile("sgd", "mse"); }),
                   "has 2 devices along axis 'model', but no layout splits a variable of model \"tiny\" over it, so "
                   "each of those devices would compute the same rows"));
    CHECK(contains(
        testing::error_message<InvalidArgument>([&] { kd::ModelParallel other(map, {.batch_dim_name = "data"}); }),
        "'data' is not an axis of"));
  }
}

namespace {

// Input 8 -> Dense(16, relu) "fc1" -> Dropout -> Dense(8) "fc2" [-> LayerNormalization "ln"] -> Dense(3) "out".
Model make_mlp(bool with_norm = false) {
  set_global_seed(5);
  auto x = Input({8});
  auto h = Dense(16, "relu", {.name = "fc1"})(x);
  h = Dropout(0.1, {.name = "dropout"})(h);
  h = Dense(8, {.name = "fc2"})(h);
  if (with_norm) h = LayerNormalization({.name = "ln"})(h);
  auto y = Dense(3, {.name = "out"})(h);
  return Model(x, y, "mlp");
}

std::string layouts_text(const std::vector<kd::VariableLayout>& layouts) {
  std::string out;
  for (const auto& v : layouts) {
    out += fmt::format("{}:{}:{}:{} ", v.path, v.split.empty() ? "whole" : v.split, v.split_dim, v.axis);
  }
  return out;
}

}  // namespace

TEST_CASE(
    "LayoutMap::megatron pairs Dense layers column then row, splits attention by heads, and says what stays whole") {
  const kd::DeviceMesh mesh({1, 2}, {"batch", "model"}, kTwoCpus);
  {
    const Model model = make_mlp();
    std::vector<std::string> notes;
    const kd::LayoutMap resolved = kd::LayoutMap::megatron(mesh).resolve(model, &notes);
    CHECK(resolved.get("fc1/kernel")->to_string() == "[None, 'model']");
    CHECK(resolved.get("fc1/bias")->to_string() == "['model']");
    CHECK(resolved.get("fc2/kernel")->to_string() == "['model', None]");
    CHECK(resolved.get("fc2/bias")->to_string() == "[None]");
    CHECK(!resolved.get("out/kernel"));
    CHECK(notes ==
          std::vector<std::string>{"Dense \"out\" kept whole: its 3 output features do not divide by 2 ('model')"});
    CHECK(layouts_text(kd::check_layouts(model, resolved, "batch")) ==
          "fc1/kernel:column:1:model fc1/bias:column:0:model fc2/kernel:row:0:model fc2/bias:whole:-1: "
          "out/kernel:whole:-1: out/bias:whole:-1: ");
    // A key the user gives wins over the automatic choice (and breaks the pair it was in).
    kd::LayoutMap map = kd::LayoutMap::megatron(mesh);
    map["fc1/kernel"] = {std::nullopt, std::nullopt};
    const kd::LayoutMap mine = map.resolve(model);
    CHECK(mine.get("fc1/kernel")->to_string() == "[None, None]");
    CHECK(!mine.get("fc1/bias"));
    CHECK(mine.get("fc2/kernel")->to_string() == "[None, 'model']");  // fc2 now pairs with out
    CHECK(mine.get("out/kernel")->to_string() == "['model', None]");
    CHECK(mine.get("out/bias")->to_string() == "[None]");
  }
  {
    set_global_seed(5);
    auto x = Input({4, 8});
    auto a = MultiHeadAttention(2, 4, {.name = "mha"})({x, x});
    auto h = Dense(16, "gelu", {.name = "up"})(a);
    auto y = Dense(8, {.name = "down"})(h);
    const Model model(x, y, "block");
    const kd::LayoutMap resolved = kd::LayoutMap::megatron(mesh).resolve(model);
    CHECK(resolved.get("mha/query/kernel")->to_string() == "[None, 'model', None]");
    CHECK(resolved.get("mha/query/bias")->to_string() == "['model', None]");
    CHECK(resolved.get("mha/attention_output/kernel")->to_string() == "['model', None, None]");
    CHECK(resolved.get("mha/attention_output/bias")->to_string() == "[None]");
    CHECK(resolved.get("up/kernel")->to_string() == "[None, 'model']");
    CHECK(resolved.get("down/kernel")->to_string() == "['model', None]");
    const auto layouts = kd::check_layouts(model, resolved, "batch");
    CHECK(std::count_if(layouts.begin(), layouts.end(), [](const auto& v) { return v.split == "heads"; }) == 7);
  }
  CHECK(contains(testing::error_message<InvalidArgument>([&] { kd::LayoutMap::megatron(mesh, "tensor"); }),
                 "'tensor' is not an axis of"));
}

TEST_CASE(
    "ModelParallel's layout checks: a corpus of bad layouts, each refused naming the variable, shape, axis and size") {
  const kd::DeviceMesh mesh({1, 2}, {"batch", "model"}, kTwoCpus);
  const Model model = make_mlp(/*with_norm=*/true);
  const auto error = [&](const std::function<void(kd::LayoutMap&)>& fill, const kd::DeviceMesh& m, bool strict = true) {
    kd::LayoutMap map(m);
    fill(map);
    return testing::error_message<InvalidArgument>([&] { kd::check_layouts(model, map, "batch", strict); });
  };
  // A key that matches no variable (a typo): strict refuses, naming the key and the variables.
  const auto typo = [](kd::LayoutMap& map) { map[".*kernal"] = {std::nullopt, "model"}; };
  CHECK(error(typo, mesh) ==
        "ModelParallel: layout_map key '.*kernal' matches no variable of model \"mlp\" (a key is an exact path or a "
        "regular expression matched against the whole path); its variables are fc1/kernel, fc1/bias, fc2/kernel, "
        "fc2/bias, ln/gamma, ln/beta, out/kernel, out/bias (ModelParallelOptions::strict = false makes this a "
        "warning)");
  {
    kd::LayoutMap map(mesh);
    typo(map);
    CHECK(kd::check_layouts(model, map, "batch", /*strict=*/false).size() == 8);
  }
  // Two keys that match one path.
  CHECK(contains(error(
                     [](kd::LayoutMap& map) {
                       map["fc1/.*"] = {std::nullopt, "model"};
                       map[".*/kernel"] = {std::nullopt, "model"};
                     },
                     mesh),
                 "LayoutMap: path 'fc1/kernel' matches the keys 'fc1/.*' and '.*/kernel'"));
  // A dimension the axis does not divide.
  CHECK(error(
            [](kd::LayoutMap& map) {
              map["out/kernel"] = {std::nullopt, "model"};
              map["out/bias"] = {"model"};
            },
            mesh) ==
        "ModelParallel: variable 'out/kernel' of shape (8, 3) cannot be split over mesh axis 'model' (2 devices) along "
        "dimension 1: 3 is not a multiple of 2 (layout_map['out/kernel'] = [None, 'model'])");
  // Half a split (the bias of a column-parallel Dense left whole), and swapped axes (a row-split
  // kernel with a column-split bias): neither is a split Dense supports.
  const std::string dense_splits =
      "which is none of the tensor-parallel splits Dense supports: column (kernel along dimension 1, bias along "
      "dimension 0); row (kernel along dimension 0, bias whole)";
  CHECK(error(
            [](kd::LayoutMap& map) {
              map["fc1/kernel"] = {std::nullopt, "model"};
            },
            mesh) ==
        "ModelParallel: Dense \"fc1\" is laid out as kernel along dimension 1, bias whole over mesh axis 'model' (2 "
        "devices), " +
            dense_splits);
  CHECK(error(
            [](kd::LayoutMap& map) {
              map["fc1/kernel"] = {"model", std::nullopt};
              map["fc1/bias"] = {"model"};
            },
            mesh) ==
        "ModelParallel: Dense \"fc1\" is laid out as kernel along dimension 0, bias along dimension 0 over mesh axis "
        "'model' (2 devices), " +
            dense_splits);
  // A layer with no tensor-parallel split.
  CHECK(error([](kd::LayoutMap& map) { map["ln/gamma"] = {"model"}; }, mesh) ==
        "ModelParallel: LayerNormalization \"ln\" has no tensor-parallel split, but layout_map['ln/gamma'] splits its "
        "variable 'ln/gamma' of shape (8,) over mesh axis 'model' (2 devices) along dimension 0: its weights must stay "
        "whole (a layout of None, or no key)");
  // A weight on the batch axis.
  const kd::DeviceMesh batch_mesh({2, 1}, {"batch", "model"}, kTwoCpus);
  CHECK(contains(error(
                     [](kd::LayoutMap& map) {
                       map["fc1/kernel"] = {"batch", std::nullopt};
                     },
                     batch_mesh),
                 "ModelParallel: variable 'fc1/kernel' of shape (8, 16) is split over the batch axis 'batch' (2 "
                 "devices) by layout_map['fc1/kernel'] = ['batch', None]: the batch axis splits the data"));
  // One variable split along two dimensions, and one layer over two axes.
  const kd::DeviceMesh cube({1, 2, 2}, {"batch", "m1", "m2"}, {"CPU:0", "CPU:1", "CPU:2", "CPU:3"});
  CHECK(contains(error(
                     [](kd::LayoutMap& map) {
                       map["fc1/kernel"] = {"m1", "m2"};
                     },
                     cube),
                 "variable 'fc1/kernel' of shape (8, 16) is split along dimensions 0 and 1 by layout_map['fc1/kernel'] "
                 "= ['m1', 'm2']; tensor parallelism splits a variable along one dimension"));
  CHECK(contains(error(
                     [](kd::LayoutMap& map) {
                       map["fc1/kernel"] = {std::nullopt, "m1"};
                       map["fc1/bias"] = {"m2"};
                     },
                     cube),
                 "Dense \"fc1\" splits 'fc1/kernel' over mesh axis 'm1' but 'fc1/bias' over 'm2'; a layer's weights "
                 "are split over one axis"));
  // A layout of the wrong rank.
  CHECK(contains(
      error([](kd::LayoutMap& map) { map["fc1/kernel"] = {"model"}; }, mesh),
      "variable 'fc1/kernel' of shape (8, 16) has rank 2 but layout_map['fc1/kernel'] = ['model'] has 1 axes"));
}

TEST_CASE(
    "plan() of a tensor-parallel layout: 1/t of each split variable per device, Megatron's two all-reduces per pair") {
  const kd::DeviceMesh mesh({1, 2}, {"batch", "model"}, kTwoCpus);
  set_global_seed(5);
  auto x = Input({8});
  auto h = Dense(8, "relu", {.name = "pre"})(x);
  h = Dense(16, "relu", {.name = "fc1"})(h);
  const Model model(x, Dense(8, {.name = "fc2"})(h), "pair");
  kd::LayoutMap map(mesh);
  map["fc1/kernel"] = {std::nullopt, "model"};
  map["fc1/bias"] = {"model"};
  map["fc2/kernel"] = {"model", std::nullopt};
  const kd::Plan p =
      kd::plan(model, {.replicas = 1, .optimizer = OptimizerRef("sgd"), .layout_map = &map, .batch_rows = 32});
  // fc1/kernel (8, 16): 64 of 128 elements per device; fc2/bias stays whole.
  CHECK(p.variables[2].weight_bytes == 64 * 4);
  CHECK(p.variables[2].layout == "column [None, 'model'] (64 of 128 elements each)");
  CHECK(p.variables[3].weight_bytes == 8 * 4);
  CHECK(p.variables[4].layout == "row ['model', None] (64 of 128 elements each)");
  CHECK(p.variables[5].layout == "replicated");
  // A column -> row pair over t = 2: an all-reduce of the 8-wide input's gradient (backward) and
  // of the 8-wide output (forward), 2 (t - 1) / t x 8 x 4 bytes = 32 bytes per row each.
  std::vector<std::string> per_row;
  for (const auto& c : p.collectives) {
    if (c.per_row) per_row.push_back(fmt::format("{} {} {}", c.op, c.what, c.bytes_per_device));
  }
  CHECK(per_row ==
        std::vector<std::string>{"all_reduce fc1 input gradient (backward) 32", "all_reduce fc2 output (forward) 32"});
  CHECK(p.communication_bytes_per_row == 64);
  CHECK(p.local_rows == 32);
  CHECK(contains(p.to_string(), "total                                                    64  x 32 rows = 2048 (2.00 KiB)"));
  CHECK(contains(p.to_string(), "Tensor-parallel collectives and pipeline transfers per row of the local batch"));
  // The first layer's input is data: backward computes no gradient for it, so nothing to reduce.
  const Model mlp = make_mlp();
  const kd::LayoutMap megatron = kd::LayoutMap::megatron(mesh);
  const kd::Plan q = kd::plan(mlp, {.replicas = 1, .layout_map = &megatron});
  CHECK(q.communication_bytes_per_row == 32);
  CHECK(contains(q.to_string(),
                 "LayoutMap::megatron: Dense \"out\" kept whole: its 3 output features do not divide by 2"));
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

TEST_CASE("cut_into_stages: balanced by parameter bytes or at named layers; a boundary carries exactly one tensor") {
  const Model mlp = make_mlp(/*with_norm=*/true);  // fc1 (8x16+16), dropout, fc2 (16x8+8), ln (16), out (8x3+3)
  const auto names = [](const std::vector<kd::PlannedStage>& stages) {
    std::string out;
    for (const auto& s : stages)
      out += fmt::format("[{}..{} {} {}B] ", s.first_layer, s.last_layer, s.layer_calls, s.parameter_bytes);
    return out;
  };
  // 576 + 0 + 544 + 64 + 108 = 1292 bytes: stage 1 starts once 646 are behind it (after fc2).
  CHECK(names(kd::cut_into_stages(mlp, 2)) == "[fc1..fc2 3 1120B] [ln..out 2 172B] ");
  CHECK(names(kd::cut_into_stages(mlp, 2, {"fc2"})) == "[fc1..dropout 2 576B] [fc2..out 3 716B] ");
  CHECK(names(kd::cut_into_stages(mlp, 5)) ==
        "[fc1..fc1 1 576B] [dropout..dropout 1 0B] [fc2..fc2 1 544B] [ln..ln 1 64B] [out..out 1 108B] ");
  CHECK(kd::cut_into_stages(mlp, 2, {"fc2"})[0].boundary->shape.to_string() == "(None, 16)");
  CHECK(testing::error_message([&] { kd::cut_into_stages(mlp, 2, {"fc9"}); }) ==
        "pipeline: cut 'fc9' is not a layer of model \"mlp\"");
  CHECK(testing::error_message([&] {
          kd::cut_into_stages(mlp, 3, {"ln", "fc2"});
        }) ==
        "pipeline: cut 'fc2' (layer call 2) does not come after the previous stage's start (layer call 3, 'ln'); list "
        "the cuts in model order");
  CHECK(testing::error_message([&] { kd::cut_into_stages(mlp, 3, {"ln"}); }) ==
        "pipeline: 1 cut given for 3 stages of model \"mlp\"; give the 2 layers that start stages 1 to 2");
  CHECK(testing::error_message([&] { kd::cut_into_stages(mlp, 6); }) ==
        "pipeline: 6 stages for model \"mlp\", which has 5 layer calls; give 1 to 5 stages");
  // A residual connection: x + Dense(x) cannot be cut between the Dense and the Add.
  set_global_seed(5);
  auto x = Input({8}, DType::kF32, "features");
  auto h = Dense(8, {.name = "inner"})(x);
  auto y = Dense(4, {.name = "after"})(Add({.name = "residual"})({x, h}));
  const Model residual(x, y, "residual_model");
  CHECK(
      testing::error_message([&] { kd::cut_into_stages(residual, 2, {"residual"}); }) ==
      "pipeline: the boundary before layer 'residual' of model \"residual_model\" is crossed by 2 tensors (features:0, "
      "inner:0); a stage boundary must carry exactly one (move the cut past the connection that skips it)");
  CHECK(names(kd::cut_into_stages(residual, 2)) == "[inner..residual 2 288B] [after..after 1 144B] ");
}

TEST_CASE("ModelParallel with a stage axis: the pipeline checked at construction and compile, its plan shown") {
  const kd::DeviceMesh mesh({1, 2}, {"batch", "stage"}, kTwoCpus);
  CHECK(contains(
      testing::error_message([&] {
        kd::ModelParallel mp(
            kd::LayoutMap(mesh),
            {.pipeline = kd::PipelineOptions{
                 .microbatches = 3, .schedule = strategy::PipelineSchedule::kInterleaved1F1B, .virtual_stages = 2}});
      }),
      "interleaved 1F1B needs microbatches (3) to be a multiple of stages (2)"));
  CHECK(testing::error_message([&] {
          kd::ModelParallel mp(kd::LayoutMap(mesh), {.pipeline = kd::PipelineOptions{.stage_axis = "pipe"}});
        }) ==
        "ModelParallel: the pipeline's stage axis 'pipe' is not an axis of DeviceMesh(shape=[1, 2], axis_names=[batch, "
        "stage])");
  CHECK(testing::error_message(
            [&] { kd::ModelParallel mp(kd::LayoutMap(mesh), {.pipeline = kd::PipelineOptions{.stages = 4}}); }) ==
        "ModelParallel: PipelineOptions::stages is 4 but the stage axis 'stage' of DeviceMesh(shape=[1, 2], "
        "axis_names=[batch, stage]) has 2 devices");
  {
    kd::ModelParallel mp(kd::LayoutMap(mesh),
                         {.pipeline = kd::PipelineOptions{
                              .microbatches = 4, .schedule = strategy::PipelineSchedule::kGPipe, .cuts = {"fc2"}}});
    REQUIRE(mp.pipeline());
    CHECK(mp.pipeline()->stages == 2);
    auto scope = mp.scope();
    Model model = make_mlp(false);
    const kd::Plan p = mp.plan(model);
    REQUIRE(p.pipeline);
    CHECK(p.pipeline->predicted_bubble == doctest::Approx(1.0 / 5));
    CHECK(contains(p.to_string(), "bubble: 0.200 (predicted (p-1)/(m+p-1) = 1/5 = 0.200)"));
    CHECK(contains(p.to_string(),
                   "stage 0: fc1 to dropout (2 layer calls), 576 parameter bytes, sends float32 (None, 16)"));
    // 2 m transfers of a micro-batch's (rows / m x 16) float32 boundary a step: 64 bytes per row each way.
    CHECK(p.communication_bytes_per_row == 128);
    // Compile places each stage's variables on its device (pipeline_fit_test trains them).
    model.compile("sgd", "mse");
    CHECK(model.weights()[0]->value(0).num_elements() == 8 * 16);  // fc1/kernel on stage 0
    CHECK(model.weights()[0]->value(1).num_elements() == 0);
  }
  {
    // A "stage" axis of several devices is a pipeline by default (1F1B, as many micro-batches as stages).
    kd::ModelParallel mp(kd::LayoutMap{mesh});
    REQUIRE(mp.pipeline());
    CHECK(mp.pipeline()->microbatches == 2);
    CHECK(mp.pipeline()->schedule == strategy::PipelineSchedule::k1F1B);
    kd::LayoutMap map(mesh);
    map["fc1/kernel"] = {std::nullopt, "stage"};
    CHECK(testing::error_message([&] { kd::ModelParallel bad(map); }) ==
          "ModelParallel: layout_map['fc1/kernel'] = [None, 'stage'] splits variables over 'stage', the pipeline's "
          "stage axis: the stages split the layers, not their weights");
  }
}
