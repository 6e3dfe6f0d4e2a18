// keras::distribution::ModelParallel with a stage axis under fit, on 4 logical CPU devices (CTest
// sets TANDEM_NUM_CPU_DEVICES=4): the MLP of parallel_fit_mlp.h cut into 2 stages (pre, fc1 |
// fc2, head: balanced by parameter bytes) trains as OneDeviceStrategy does (every step's loss, the
// evaluation and the final weights within 1e-5 relative) and bitwise the same run to run, under
// GPipe and 1F1B with 4 micro-batches, with fewer micro-batches than stages, interleaved (2 model
// chunks per stage), with data parallelism over a batch axis (PP2xDP2), and with tensor
// parallelism over a model axis (TP2xPP2), and with ZeRO stages 1 and 2 over the batch axis. Each
// variable lives on its stage's devices only; predict gives one device's outputs; what is not built
// is refused.
#include <doctest/doctest.h>

#include "common/error_message.h"
#include "keras/parallel_fit_mlp.h"
#include "tandem/keras_like/distribution.h"
#include "tandem/keras_like/keras.h"

using namespace tandem;
using namespace tandem::keras;
using namespace tandem::testing::parallel_fit;
namespace kd = tandem::keras::distribution;
using strategy::PipelineSchedule;

namespace {

const Run& one_device() {
  static const Run run = [] {
    OneDeviceStrategy one("CPU:0");
    return train(one);
  }();
  return run;
}

// tensor_split: fc1/fc2 split over the mesh's "model" axis too (pair_layouts).
std::unique_ptr<kd::ModelParallel> pipeline_on(const kd::DeviceMesh& mesh, kd::PipelineOptions options,
                                               bool tensor_split = false) {
  return std::make_unique<kd::ModelParallel>(tensor_split ? pair_layouts(mesh) : kd::LayoutMap(mesh),
                                             kd::ModelParallelOptions{.pipeline = options});
}

}  // namespace

TEST_CASE("pipelines under fit train as one device, bitwise run to run") {
  const Run& want = one_device();
  const kd::DeviceMesh pp2({1, 2}, {"batch", "stage"}, {"CPU:0", "CPU:1"});
  const kd::DeviceMesh pp2dp2({2, 2}, {"batch", "stage"}, kFourCpus);
  const kd::DeviceMesh tp2pp2({1, 2, 2}, {"batch", "model", "stage"}, kFourCpus);
  struct Config {
    std::string name;
    const kd::DeviceMesh* mesh;
    kd::PipelineOptions options;
    bool tensor_split = false;
  };
  const std::vector<Config> configs{
      {"PP=2, GPipe, m=4", &pp2, {.microbatches = 4, .schedule = PipelineSchedule::kGPipe}},
      {"PP=2, 1F1B, m=4", &pp2, {.microbatches = 4, .schedule = PipelineSchedule::k1F1B}},
      {"PP=2, 1F1B, m=1 (fewer micro-batches than stages)", &pp2, {.microbatches = 1}},
      {"PP=2, interleaved 1F1B, 2 chunks per stage, m=4",
       &pp2,
       {.microbatches = 4, .schedule = PipelineSchedule::kInterleaved1F1B, .virtual_stages = 2}},
      {"PP2xDP2, 1F1B, m=4", &pp2dp2, {.microbatches = 4}},
      // The stages cut fc1 | fc2: each is a lone split layer (fc1 gathers, fc2 splits its input).
      {"TP2xPP2 (a 3-D mesh: batch 1 x model 2 x stage 2), 1F1B, m=4", &tp2pp2, {.microbatches = 4}, true},
  };
  for (const auto& config : configs) {
    CAPTURE(config.name);
    const auto run_once = [&] {
      auto mp = pipeline_on(*config.mesh, config.options, config.tensor_split);
      return train(*mp);
    };
    const Run got = run_once();
    CHECK(got.losses.size() == static_cast<std::size_t>(kSteps));
    CHECK(difference(got, want) == "");
    const Run again = run_once();
    CHECK(again.losses == got.losses);
    CHECK(again.weights == got.weights);
    // Each step, each pipeline sends its boundary activation (a micro-batch's rows x 16 float32:
    // fc1's output) forward and its gradient back once per micro-batch and model chunk boundary.
    const std::int64_t pipelines = config.mesh->shape()[0] * (config.tensor_split ? 2 : 1);
    const std::int64_t m = config.options.microbatches, boundaries = 2 * config.options.virtual_stages - 1;
    const std::int64_t rows = kBatch / config.mesh->shape()[0] / m;
    const auto& send = got.stats.pipeline.send;
    if (config.options.virtual_stages == 1) {
      CHECK(send.calls == kSteps * pipelines * 2 * m * boundaries);
      CHECK(send.bytes_sent == kSteps * pipelines * 2 * m * boundaries * rows * 16 * 4);
    } else {
      CHECK(send.calls == kSteps * pipelines * 2 * m * boundaries);  // the chunks' boundaries carry other widths
    }
  }
}

TEST_CASE("a stage's variables live on its devices only; predict gives one device's outputs") {
  auto mp = pipeline_on(kd::DeviceMesh({2, 2}, {"batch", "stage"}, kFourCpus), {.microbatches = 2});
  Model model = [&] {
    auto scope = mp->scope();
    return make_mlp();
  }();
  {
    auto scope = mp->scope();
    model.compile(Adam{}, "mse");
  }
  // Replicas in mesh order: (batch 0, stage 0), (0, 1), (1, 0), (1, 1).
  for (const auto& w : model.weights()) {
    CAPTURE(w->name());
    const bool first = w->name().starts_with("pre/") || w->name().starts_with("fc1/");
    for (int r = 0; r < 4; ++r) {
      const bool here = (r % 2 == 0) == first;
      CHECK(w->value(r).num_elements() == (here ? w->global_shape().num_elements() : 0));
    }
  }
  const auto [x, y] = make_data(2);
  model.fit(x, y, {.batch_size = kBatch, .verbose = 0, .shuffle = false});
  const Tensor got = model.predict(x, {.batch_size = kBatch, .verbose = 0});
  OneDeviceStrategy one("CPU:0");
  Model reference = [&] {
    auto scope = one.scope();
    return make_mlp();
  }();
  reference.set_weights(model.get_weights());
  const Tensor expected = reference.predict(x, {.batch_size = kBatch, .verbose = 0});
  const auto a = got.to_vector<float>(), b = expected.to_vector<float>();
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(std::abs(a[i] - b[i]) <= 1e-6f * std::max(1.0f, std::abs(b[i])));
}

TEST_CASE(
    "ZeRO stages 1 and 2 over pipelines (PP2xDP2) train as one device, each stage's slots sharded along the "
    "batch axis") {
  const Run& want = one_device();
  const kd::DeviceMesh pp2dp2({2, 2}, {"batch", "stage"}, kFourCpus);
  for (const auto stage : {strategy::ZeroStage::k1, strategy::ZeroStage::k2}) {
    CAPTURE(static_cast<int>(stage));
    const auto make = [&] {
      return std::make_unique<kd::ModelParallel>(
          kd::LayoutMap(pp2dp2), kd::ModelParallelOptions{.pipeline = kd::PipelineOptions{.microbatches = 4},
                                                          .distribution = {.zero = stage}});
    };
    auto mp = make();
    const Run got = train(*mp);
    CHECK(difference(got, want) == "");
    auto again = make();
    const Run repeat = train(*again);
    CHECK(repeat.losses == got.losses);
    CHECK(repeat.weights == got.weights);

    // fc1/kernel [8, 16] lives on stage 0's two devices (one per pipeline); its Adam slots are
    // sharded between them, 64 elements each; the other stage's devices hold none of it.
    auto mp2 = make();
    Model model = model_under(*mp2);
    {
      auto scope = mp2->scope();
      model.compile(Adam{.learning_rate = 0.01}, "mse");
    }
    const auto [x, y] = make_data(2);
    model.fit(x, y, {.batch_size = kBatch, .epochs = 1, .verbose = 0, .shuffle = false});
    bool found = false;
    for (const auto& [name, slot] : model.optimizer().slots()) {
      if (name != "fc1/kernel/m") continue;
      found = true;
      REQUIRE(slot->sharding().has_value());
      std::vector<std::int64_t> held;
      for (int r = 0; r < slot->num_replicas(); ++r) held.push_back(slot->value(r).num_elements());
      std::sort(held.begin(), held.end());
      CHECK(held == std::vector<std::int64_t>{0, 0, 64, 64});
      CHECK(slot->read_value().shape() == Shape{kIn, kWide});
    }
    CHECK(found);
  }
}

TEST_CASE("what pipelines under fit do not do yet is refused at compile, the model left whole") {
  {
    auto mp = pipeline_on(kd::DeviceMesh({1, 2}, {"batch", "stage"}, {"CPU:0", "CPU:1"}), {});
    auto scope = mp->scope();
    set_global_seed(3);
    auto x = Input({4});
    auto h = BatchNormalization({.name = "bn"})(Dense(4, {.name = "d"})(x));
    Model model(x, Dense(1, {.name = "out"})(h), "normed");
    CHECK(testing::error_message<Unimplemented>([&] { model.compile("sgd", "mse"); }) ==
          "ModelParallel: BatchNormalization \"bn\" keeps non-trainable state (moving statistics) updated by "
          "training; under a pipeline that is not built yet");
  }
  {
    kd::ModelParallel mp(kd::LayoutMap(kd::DeviceMesh({1, 2}, {"batch", "stage"}, {"CPU:0", "CPU:1"})),
                         {.distribution = {.zero = strategy::ZeroStage::k3}});
    Model model = model_under(mp);
    auto scope = mp.scope();
    CHECK(testing::error_message<Unimplemented>([&] { model.compile("adam", "mse"); }) ==
          "ModelParallel: model \"mlp\" has a pipeline over 'stage', and ZeRO stage 3 is asked; sharding a pipeline "
          "stage's parameters is not built yet: use ZeRO stage 1 or 2 with pipelines");
  }
}

TEST_CASE("a last batch with fewer rows than micro-batches (some micro-batches empty) trains as one device") {
  // 36 rows in batches of 8: the last batch has 4 rows, 2 per data shard under PP2xDP2, so 2 of
  // each pipeline's 4 micro-batches are empty.
  const auto [x, y] = make_data(2);
  const auto xs = x.to_vector<float>(), ys = y.to_vector<float>();
  const Tensor x36 = Tensor::from_vector(std::vector<float>(xs.begin(), xs.begin() + 36 * kIn), {36, kIn});
  const Tensor y36 = Tensor::from_vector(std::vector<float>(ys.begin(), ys.begin() + 36), {36, 1});
  const auto fit = [&](Strategy& strategy) {
    Model model = [&] {
      auto scope = strategy.scope();
      return make_mlp();
    }();
    {
      auto scope = strategy.scope();
      model.compile(Adam{.learning_rate = 0.01}, "mse");
    }
    const auto history = model.fit(x36, y36, {.batch_size = 8, .epochs = 2, .verbose = 0, .shuffle = false});
    return history.history.at("loss");
  };
  OneDeviceStrategy one("CPU:0");
  const auto want = fit(one);
  auto mp = pipeline_on(kd::DeviceMesh({2, 2}, {"batch", "stage"}, kFourCpus), {.microbatches = 4});
  const auto got = fit(*mp);
  REQUIRE(got.size() == want.size());
  for (std::size_t e = 0; e < got.size(); ++e) CHECK(std::abs(got[e] - want[e]) <= 1e-5 * std::abs(want[e]));
}
