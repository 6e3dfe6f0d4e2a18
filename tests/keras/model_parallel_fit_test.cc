// keras::distribution::ModelParallel training with tensor parallelism under fit, on 4 logical CPU
// devices (CTest sets TANDEM_NUM_CPU_DEVICES=4): Megatron's column/row Dense pair split over the
// model axis of a 1x2 mesh (TP=2) and of a 2x2 mesh (DP2xTP2), LayoutMap::megatron's choice, and a
// lone column-split (its output gathered) or row-split Dense (its input split) each train as
// OneDeviceStrategy does (every step's loss and the final weights within 1e-5 relative, Adam's
// slots split with their weights) and bitwise the same run to run. Each device holds 1/t of a
// split weight; the tensor-parallel collectives move the bytes of the published formula; a
// checkpoint of a tensor-parallel run loads on one device, and its directory form holds each
// piece once and loads under another mesh; what is not built is refused at
// compile or before the first step, the model left whole.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <random>

#include "common/error_message.h"
#include "common/temp_dir.h"
#include "tandem/keras_like/distribution.h"
#include "tandem/keras_like/keras.h"
#include "tandem/keras_like/sharded_checkpoint.h"
#include "keras/parallel_fit_mlp.h"
#include "tandem/ops/ops.h"

using namespace tandem;
using namespace tandem::keras;
namespace kd = tandem::keras::distribution;

namespace {

using namespace tandem::testing::parallel_fit;

// What the tensor-parallel groups sent per device per step, against plan()'s formula.
void check_planned_bytes(const Run& got) {
  const double sent = static_cast<double>(got.stats.tensor_parallel.total().bytes_sent) /
                      static_cast<double>(got.stats.steps * got.stats.replicas);
  CHECK(got.planned_tensor_parallel_bytes > 0);
  CHECK(sent == got.planned_tensor_parallel_bytes);
}

void check_equivalent(const Run& got, const Run& want) {
  CHECK(got.losses.size() == static_cast<std::size_t>(kSteps));
  CHECK(difference(got, want) == "");
}

const Run& one_device() {
  static const Run run = [] {
    OneDeviceStrategy one("CPU:0");
    return train(one);
  }();
  return run;
}

struct TwoRuns {
  Run first, second;
};

// Trains twice: the first run as one device does, with the planned tensor-parallel bytes, and
// the second bitwise the first.
TwoRuns check_as_one_device_twice(const std::function<Run()>& run_once) {
  TwoRuns runs{run_once(), run_once()};
  check_equivalent(runs.first, one_device());
  check_planned_bytes(runs.first);
  CHECK(runs.second.losses == runs.first.losses);
  CHECK(runs.second.weights == runs.first.weights);
  return runs;
}

}  // namespace

TEST_CASE("tensor parallelism under fit: TP=2 and DP2xTP2 train as one device, bitwise run to run") {
  struct Config {
    std::string name;
    kd::DeviceMesh mesh;
  };
  for (const auto& config : {Config{"TP=2 (mesh 1x2)", kd::DeviceMesh({1, 2}, {"batch", "model"}, {"CPU:0", "CPU:1"})},
                             Config{"DP2xTP2 (mesh 2x2)", kd::DeviceMesh({2, 2}, {"batch", "model"}, kFourCpus)}}) {
    CAPTURE(config.name);
    const auto [got, again] = check_as_one_device_twice([&] {
      kd::ModelParallel mp(pair_layouts(config.mesh));
      return train(mp);
    });
    CHECK(again.evaluation == got.evaluation);

    // Communication per step, from the formula: the pair all-reduces one (local batch x 8)
    // float32 activation forward (g after fc2) and one backward (f before fc1, pre's input
    // gradient); ring all-reduce sends 2(t-1)/t of the buffer per device, t = 2.
    const std::int64_t dp = config.mesh.shape()[0], replicas = dp * 2, rows = kBatch / dp;
    const auto& all_reduce = got.stats.tensor_parallel.all_reduce;
    CHECK(all_reduce.calls == kSteps * replicas * 2);
    CHECK(all_reduce.bytes_sent == kSteps * replicas * 2 * (rows * kIn * 4));  // 2(t-1)/t = 1
    CHECK(got.stats.tensor_parallel.all_gather.calls == 0);
    // The gradients: summed over the batch axis only (no group to sum in with one data shard).
    if (dp == 1) CHECK(got.stats.communication.all_reduce.calls == 0);
    if (dp == 2) CHECK(got.stats.communication.all_reduce.calls > 0);
  }
}

TEST_CASE("a split weight's copies are its pieces: 1/t of the whole on each device, Adam's slots alike") {
  kd::ModelParallel mp(pair_layouts(kd::DeviceMesh({2, 2}, {"batch", "model"}, kFourCpus)));
  Model model = model_under(mp);
  {
    auto scope = mp.scope();
    model.compile(Adam{}, "mse");
  }
  const auto [x, y] = make_data(1);
  model.fit(x, y, {.batch_size = kBatch, .verbose = 0, .shuffle = false});
  for (const auto& w : model.weights()) {
    CAPTURE(w->name());
    const bool split = w->name() == "fc1/kernel" || w->name() == "fc1/bias" || w->name() == "fc2/kernel";
    REQUIRE(w->tensor_split().has_value() == split);
    for (int r = 0; r < 4; ++r) {
      const std::int64_t bytes = static_cast<std::int64_t>(w->value(r).nbytes());
      const std::int64_t whole = w->global_shape().num_elements() * 4;
      CHECK(bytes == (split ? whole / 2 : whole));
    }
  }
  CHECK(model.weights()[2]->value(1).shape() == Shape{kIn, kWide / 2});  // fc1/kernel: 8 of 16 columns
  CHECK(model.weights()[4]->value(3).shape() == Shape{kWide / 2, kIn});  // fc2/kernel: 8 of 16 rows
  // The pieces put together are the weight; the copies of each piece agree across the batch axis.
  const auto weights = model.weights();
  mp.check_replicas_agree(weights);
}

TEST_CASE("the allocator of a replica holds 1/t of each split weight and of its Adam slots") {
  // Input 256 -> fc1 Dense(1024) column-split -> fc2 Dense(256) row-split: two 1 MiB kernels, so
  // that the allocator's rounding does not matter. Measured on CPU:3 (no data lives there): what
  // its allocator has in use after a step, less what it had before the model.
  kd::ModelParallel mp(pair_layouts(kd::DeviceMesh({2, 2}, {"batch", "model"}, kFourCpus)));
  auto& allocator = devices::get_device("CPU:3").allocator();
  const std::int64_t before = allocator.stats().bytes_in_use;
  {
    Model model = [&] {
      auto scope = mp.scope();
      set_global_seed(23);
      auto x = Input({256});
      auto h = Dense(1024, "relu", {.name = "fc1"})(x);
      return Model(x, Dense(256, {.name = "fc2"})(h), "wide");
    }();
    {
      auto scope = mp.scope();
      model.compile(Adam{}, "mse");
    }
    const Tensor x = Tensor::zeros({kBatch, 256}, DType::kF32), y = Tensor::zeros({kBatch, 256}, DType::kF32);
    model.fit(x, y, {.batch_size = kBatch, .verbose = 0});
    // Weights and Adam's two slots (4 + 8 bytes per parameter), split ones halved; the executor's
    // arena (activations, gradients) is released between steps only in part, so it is bounded
    // from above by one step's worth rather than counted.
    const double whole = (256.0 * 1024 + 1024 + 1024.0 * 256 + 256) * 12;
    const double split = (256.0 * 1024 / 2 + 1024.0 / 2 + 1024.0 * 256 / 2 + 256) * 12;
    const double in_use = static_cast<double>(allocator.stats().bytes_in_use - before);
    MESSAGE("CPU:3 in use after a step: " << in_use << " B; split weights + slots " << split << " B, whole "
                                            << whole << " B");
    CHECK(in_use >= split);
    CHECK(in_use < whole);  // replicated, the weights and slots alone would take this much
    const std::int64_t kernel_bytes = model.weights()[0]->value(3).nbytes();
    CHECK(kernel_bytes == 256 * 1024 / 2 * 4);
  }
}

TEST_CASE("LayoutMap::megatron, a lone column-split and a lone row-split Dense train as one device") {
  const Run& want = one_device();
  const kd::DeviceMesh mesh({1, 2}, {"batch", "model"}, {"CPU:0", "CPU:1"});
  {
    INFO("megatron: pre column / fc1 row, fc2 column / head row");
    kd::ModelParallel mp(kd::LayoutMap::megatron(mesh));
    const Run got = train(mp);
    check_equivalent(got, want);
    check_planned_bytes(got);
    // Two pairs, each one all-reduce forward and one backward, but the first pair's backward one:
    // "pre" reads the data, so backward computes no gradient of its input.
    CHECK(got.stats.tensor_parallel.all_reduce.calls == kSteps * 2 * 3);
  }
  {
    INFO("fc1 column-split alone: its output gathered (one all-gather forward, its part of the gradient back)");
    kd::LayoutMap map(mesh);
    map["fc1/kernel"] = {std::nullopt, "model"};
    map["fc1/bias"] = {"model"};
    kd::ModelParallel mp(map);
    const Run got = train(mp);
    check_equivalent(got, want);
    check_planned_bytes(got);
    CHECK(got.stats.tensor_parallel.all_gather.calls == kSteps * 2);
  }
  {
    INFO("fc2 row-split alone: its input split here (its gradient gathered backward)");
    kd::LayoutMap map(mesh);
    map["fc2/kernel"] = {"model", std::nullopt};
    kd::ModelParallel mp(map);
    const Run got = train(mp);
    check_equivalent(got, want);
    check_planned_bytes(got);
    CHECK(got.stats.tensor_parallel.all_gather.calls == kSteps * 2);
    CHECK(got.stats.tensor_parallel.all_reduce.calls == kSteps * 2);
  }
}

TEST_CASE(
    "ZeRO stages 1, 2 and 3 over tensor parallelism (DP2xTP2) train as one device, each piece's slots (and "
    "at stage 3 the piece) sharded along the batch axis") {
  const kd::DeviceMesh mesh({2, 2}, {"batch", "model"}, kFourCpus);
  for (const auto stage : {strategy::ZeroStage::k1, strategy::ZeroStage::k2, strategy::ZeroStage::k3}) {
    CAPTURE(static_cast<int>(stage));
    check_as_one_device_twice([&] {
      kd::ModelParallel mp(pair_layouts(mesh), {.distribution = {.zero = stage}});
      return train(mp);
    });

    // fc1/kernel [8, 16] is split by columns into [8, 8] pieces; each piece's Adam slots are
    // sharded over the 2 replicas along the batch axis: 32 elements per device.
    kd::ModelParallel mp(pair_layouts(mesh), {.distribution = {.zero = stage}});
    Model model = model_under(mp);
    {
      auto scope = mp.scope();
      model.compile(Adam{.learning_rate = 0.01}, "mse");
    }
    const auto [x, y] = make_data(2);
    model.fit(x, y, {.batch_size = kBatch, .epochs = 1, .verbose = 0, .shuffle = false});
    bool found = false;
    for (const auto& [name, slot] : model.optimizer().slots()) {
      if (name != "fc1/kernel/m" && name != "fc1/kernel/momentum") continue;
      found = true;
      REQUIRE(slot->sharding().has_value());
      REQUIRE(slot->tensor_split().has_value());
      CHECK(slot->sharding()->shard_elements == 32);
      CHECK(slot->global_shape() == Shape{kIn, kWide});
      for (int r = 0; r < slot->num_replicas(); ++r) CHECK(slot->value(r).num_elements() == 32);
      // Read whole and written back: the same pieces and shards.
      const Tensor whole = slot->read_value();
      CHECK(whole.shape() == Shape{kIn, kWide});
      const std::vector<Tensor> before{slot->value(0).clone(), slot->value(3).clone()};
      slot->assign(whole);
      CHECK(slot->value(0).to_vector<float>() == before[0].to_vector<float>());
      CHECK(slot->value(3).to_vector<float>() == before[1].to_vector<float>());
    }
    CHECK(found);
    // plan() counts the same: 2 slots of 32 float32 each per device.
    const kd::Plan plan = kd::plan(model);
    const auto row = std::find_if(plan.variables.begin(), plan.variables.end(),
                                  [](const auto& v) { return v.path == "fc1/kernel"; });
    REQUIRE(row != plan.variables.end());
    CHECK(row->slot_bytes == 2 * 32 * 4);
    CHECK(row->gradient_bytes == (stage >= strategy::ZeroStage::k2 ? 32 : 64) * 4);
    CHECK(row->weight_bytes == (stage == strategy::ZeroStage::k3 ? 32 : 64) * 4);
    for (const auto& w : model.weights()) {
      if (w->name() != "fc1/kernel") continue;
      CHECK(w->sharding().has_value() == (stage == strategy::ZeroStage::k3));
      CHECK(w->value(0).num_elements() == (stage == strategy::ZeroStage::k3 ? 32 : 64));
    }

    // A training checkpoint (weights, slots, iterations) loads into a fresh run of the same mesh.
    testing::TempDir dir;
    const std::string path = (dir.path() / "zero-tp").string() + "/";
    save_training_checkpoint(model, path, {.epoch = 1, .step = 0});
    kd::ModelParallel mp2(pair_layouts(mesh), {.distribution = {.zero = stage}});
    Model restored = model_under(mp2);
    {
      auto scope = mp2.scope();
      restored.compile(Adam{.learning_rate = 0.01}, "mse");
    }
    restored.fit(x, y, {.batch_size = kBatch, .epochs = 1, .verbose = 0, .shuffle = false, .steps_per_epoch = 1});
    load_training_checkpoint(restored, path);
    for (const auto& [name, slot] : model.optimizer().slots()) {
      CAPTURE(name);
      const auto other = restored.optimizer().slots();
      const auto it = std::find_if(other.begin(), other.end(), [&](const auto& e) { return e.first == name; });
      REQUIRE(it != other.end());
      CHECK(it->second->read_value().to_vector<float>() == slot->read_value().to_vector<float>());
    }
  }
}

TEST_CASE("a tensor-parallel run's weights save whole and load on one device") {
  testing::TempDir dir;
  const std::string path = (dir.path() / "tp.weights.safetensors").string();
  kd::ModelParallel mp(pair_layouts(kd::DeviceMesh({2, 2}, {"batch", "model"}, kFourCpus)));
  const Run trained = train(mp, path);
  OneDeviceStrategy one("CPU:0");
  Model model = model_under(one);
  {
    auto scope = one.scope();
    model.compile(Adam{}, "mse");
  }
  model.load_weights(path);
  const auto [ex, ey] = make_data(kSteps + 1);
  const double loss = model.evaluate(ex, ey, {.batch_size = kBatch, .verbose = 0}).at("loss");
  CHECK(std::abs(loss - trained.evaluation) <= 1e-6 * std::abs(trained.evaluation));
  std::vector<std::vector<float>> weights;
  for (const auto& w : model.get_weights()) weights.push_back(w.to_vector<float>());
  CHECK(weights == trained.weights);
}

TEST_CASE("a tensor-parallel checkpoint directory holds each piece once, as written, and loads under another mesh") {
  testing::TempDir dir;
  const std::string path = (dir.path() / "tp-weights").string() + "/";
  kd::ModelParallel mp(pair_layouts(kd::DeviceMesh({2, 2}, {"batch", "model"}, kFourCpus)));
  const Run trained = train(mp, path);

  // The index says how each weight was split; each piece is its own chunks (a column split's
  // piece one per row), written once although two replicas (the batch axis) hold it.
  const auto index = keras::parse_checkpoint_index(
      testing::read_file_bytes((dir.path() / "tp-weights" / keras::kCheckpointIndexName).string()), "index.json");
  const auto* fc1 = index.find("fc1/kernel");
  REQUIRE(fc1 != nullptr);
  REQUIRE(fc1->split.has_value());
  CHECK(*fc1->split == keras::CheckpointSplit{.dim = 1, .parts = 2, .axis = "model"});
  CHECK(fc1->chunks.size() == static_cast<std::size_t>(2 * kIn));  // 2 pieces x 8 rows
  const auto* fc2 = index.find("fc2/kernel");
  REQUIRE(fc2 != nullptr);
  CHECK(*fc2->split == keras::CheckpointSplit{.dim = 0, .parts = 2, .axis = "model"});
  CHECK(fc2->chunks.size() == 2);  // a row split: each piece one contiguous run
  const auto* head = index.find("head/kernel");
  REQUIRE(head != nullptr);
  CHECK(!head->split.has_value());
  CHECK(head->chunks.size() == 1);

  // Loaded under a 1x4 mesh (each weight cut in 4, not 2) and on one device: the trained weights.
  for (const bool split : {true, false}) {
    CAPTURE(split);
    kd::ModelParallel four(pair_layouts(kd::DeviceMesh({1, 4}, {"batch", "model"}, kFourCpus)));
    OneDeviceStrategy one("CPU:0");
    Strategy& strategy = split ? static_cast<Strategy&>(four) : one;
    Model model = model_under(strategy);
    {
      auto scope = strategy.scope();
      model.compile(Adam{}, "mse");
    }
    model.load_weights(path);
    if (split) {
      for (const auto& w : model.weights()) {
        if (w->tensor_split()) CHECK(w->tensor_split()->parts == 4);
      }
    }
    std::vector<std::vector<float>> weights;
    for (const auto& w : model.get_weights()) weights.push_back(w.to_vector<float>());
    CHECK(weights == trained.weights);
    const auto [ex, ey] = make_data(kSteps + 1);
    const double loss = model.evaluate(ex, ey, {.batch_size = kBatch, .verbose = 0}).at("loss");
    CHECK(std::abs(loss - trained.evaluation) <= 1e-6 * std::abs(trained.evaluation));
  }
}

TEST_CASE("what tensor parallelism under fit does not do yet is refused before the first step, the model left whole") {
  const kd::DeviceMesh mesh({2, 2}, {"batch", "model"}, kFourCpus);
  {
    kd::ModelParallel mp(pair_layouts(mesh));
    Model model = model_under(mp);
    auto scope = mp.scope();
    model.compile(Adam{.global_clipnorm = 1.0}, "mse");
    const auto [x, y] = make_data(1);
    CHECK(testing::error_message<Unimplemented>([&] { model.fit(x, y, {.batch_size = kBatch, .verbose = 0}); }) ==
          "adam: variable \"fc1/kernel\" is split over 'model' by ModelParallel; global_clipnorm with tensor- or "
          "pipeline-parallel weights is not built yet (each device sees its own part of the gradients only): use "
          "clipvalue, or no clipping and no loss scaling");
  }
  {
    // A layer that declares a split for plan() but does not run it.
    class ScaleImpl final : public LayerImpl {
     public:
      ScaleImpl() : LayerImpl("Scale", "scale") {}
      std::vector<TensorParallelSplit> tensor_parallel_splits() const override {
        return {{.name = "features", .effect = "each device scales its features", .weights = {{"w", 0}}}};
      }
      void build(const std::vector<TensorSpec>& inputs) override {
        w_ = add_weight({.name = "w", .shape = {inputs[0].shape[1]}, .initializer = "ones"});
      }
      std::vector<Output> call(CallContext& ctx, const std::vector<Output>& inputs) override {
        return {inputs[0] * ctx.read(w_)};
      }

     private:
      VariablePtr w_;
    };
    kd::LayoutMap map(kd::DeviceMesh({1, 2}, {"batch", "model"}, {"CPU:0", "CPU:1"}));
    map["scale/w"] = {"model"};
    kd::ModelParallel mp(map);
    auto scope = mp.scope();
    auto x = Input({4});
    auto y = Layer(std::make_shared<ScaleImpl>())(x);
    Model model(x, y, "scaled");
    CHECK(testing::error_message<Unimplemented>([&] { model.compile("sgd", "mse"); }) ==
          "ModelParallel: Scale \"scale\" is features-split over 'model' ('scale/w' along dimension 0): a valid "
          "layout, which plan() shows, but training this layer split is not built yet (tensor-parallel Dense, "
          "Conv2D, MultiHeadAttention and Embedding are); keep its weights whole (no layout for them) to train");
    for (const auto& w : model.weights()) CHECK(!w->tensor_split());
  }
}

namespace {

// Rows of kSteps + 1 batches with features of `shape` (normal), and a target per row from them.
std::pair<Tensor, Tensor> random_rows(const Shape& shape, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::int64_t rows = (kSteps + 1) * kBatch, per_row = shape.num_elements();
  std::vector<float> x(static_cast<std::size_t>(rows * per_row)), y;
  for (auto& v : x) v = normal(rng);
  for (std::int64_t r = 0; r < rows; ++r) {
    float s = 0;
    for (std::int64_t i = 0; i < per_row; ++i) s += std::sin(x[static_cast<std::size_t>(r * per_row + i)] * 0.9f);
    y.push_back(s / static_cast<float>(per_row));
  }
  Shape x_shape{rows};
  for (const auto d : shape.dims()) x_shape.push_back(d);
  return {Tensor::from_vector(x, x_shape), Tensor::from_vector(y, {rows, 1})};
}

}  // namespace

TEST_CASE("Conv2D over output channels, attention over heads, Embedding over the vocabulary or features train as one device") {
  const kd::DeviceMesh tp2({1, 2}, {"batch", "model"}, {"CPU:0", "CPU:1"});
  const kd::DeviceMesh dp2tp2({2, 2}, {"batch", "model"}, kFourCpus);
  const auto check = [&](const std::function<Model()>& make, const std::pair<Tensor, Tensor>& data,
                         const std::function<kd::LayoutMap(const kd::DeviceMesh&)>& layouts, std::int64_t gathers,
                         const OptimizerRef& optimizer = Adam{.learning_rate = 0.01}) {
    OneDeviceStrategy one("CPU:0");
    const Run want = train_model(one, make, data.first, data.second, "", optimizer);
    for (const auto* mesh : {&tp2, &dp2tp2}) {
      CAPTURE(mesh->to_string());
      kd::ModelParallel mp(layouts(*mesh));
      const Run got = train_model(mp, make, data.first, data.second, "", optimizer);
      CHECK(got.losses.size() == static_cast<std::size_t>(kSteps));
      CHECK(difference(got, want) == "");
      const std::int64_t replicas = mesh->shape()[0] * 2;
      CHECK(got.stats.tensor_parallel.all_gather.calls == kSteps * replicas * gathers);
    }
  };
  SUBCASE("Conv2D over output channels: the channels gathered") {
    check(
        [] {
          set_global_seed(13);
          auto x = Input({6, 6, 2});
          auto h = Conv2D(4, {3, 3}, {.activation = "relu", .name = "conv"})(x);
          auto y = Dense(1, {.name = "out"})(Flatten()(h));
          return Model(x, y, "cnn");
        },
        random_rows({6, 6, 2}, 41),
        [](const kd::DeviceMesh& mesh) {
          kd::LayoutMap map(mesh);
          map["conv/kernel"] = {std::nullopt, std::nullopt, std::nullopt, "model"};
          map["conv/bias"] = {"model"};
          return map;
        },
        1);
  }
  SUBCASE("MultiHeadAttention over heads (LayoutMap::megatron): the output projection's sums all-reduced") {
    check(
        [] {
          set_global_seed(17);
          auto x = Input({4, 8});
          auto h = MultiHeadAttention(2, 4, {.name = "mha"})({x, x});
          auto y = Dense(1, {.name = "out"})(Flatten()(h));
          return Model(x, y, "attention");
        },
        random_rows({4, 8}, 43), [](const kd::DeviceMesh& mesh) { return kd::LayoutMap::megatron(mesh); }, 0,
        // SGD: the key projection's bias has a zero gradient in exact arithmetic (a softmax does not
        // see a constant added to every score of a query); its rounding noise, which Adam would
        // scale up to learning-rate-sized steps, stays noise.
        SGD{.learning_rate = 0.05});
  }
  const auto [x, y] = random_rows({4}, 47);
  std::vector<std::int32_t> ids;
  for (const float v : x.to_vector<float>()) ids.push_back(static_cast<std::int32_t>(std::abs(v) * 3) % 10);
  const auto lookup = [] {
    set_global_seed(19);
    auto in = Input({4}, DType::kI32);
    auto h = Embedding(10, 4, {.name = "embedding"})(in);
    auto out = Dense(1, {.name = "out"})(Flatten()(h));
    return Model(in, out, "lookup");
  };
  SUBCASE("Embedding over the vocabulary: each device's rows looked up, the rows summed over the group") {
    check(lookup, {Tensor::from_vector(ids, x.shape()), y},
          [](const kd::DeviceMesh& mesh) {
            kd::LayoutMap map(mesh);
            map["embedding/embeddings"] = {"model", std::nullopt};
            return map;
          },
          0);
  }
  SUBCASE("Embedding over output features: each row's features gathered") {
    check(
        lookup, {Tensor::from_vector(ids, x.shape()), y},
        [](const kd::DeviceMesh& mesh) {
          kd::LayoutMap map(mesh);
          map["embedding/embeddings"] = {std::nullopt, "model"};
          return map;
        },
        1);
  }
}
