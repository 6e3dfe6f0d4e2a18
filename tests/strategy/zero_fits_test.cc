// A model that fits only sharded: 4 logical CPU devices of 26 MiB each (LogicalDeviceConfiguration
// ::memory_limit_bytes, which makes the allocator refuse what a device of that size could not
// hold) and a 4.2M-parameter model under Adam. Replicated it needs 16 bytes a parameter on every
// device (67 MB); ZeRO stages 1 and 2 still hold the whole weights (10 and 7.2 bytes a parameter:
// 42 and 30 MB); stage 3 holds about 4.5 (19 MB), and trains. Reduce-scatter buckets of 1 MiB
// (reduce_bucket_bytes, DeepSpeed's reduce_bucket_size: each layer's gradients), so that the
// whole gradients held at once are a layer's or two. Its own process: the device layout is fixed before any device
// exists.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <string>

#include "tandem/keras_like/keras.h"

using namespace tandem;
using strategy::MirroredOptions;
using strategy::ZeroStage;

namespace {

constexpr std::int64_t kLimit = std::int64_t{26} << 20;
constexpr std::int64_t kWidth = 512, kLayers = 16, kRows = 64;

keras::Model make_model() {
  std::vector<keras::SequentialItem> layers{keras::Input({kWidth})};
  for (std::int64_t l = 0; l < kLayers; ++l) layers.emplace_back(keras::Dense(kWidth, "relu"));
  layers.emplace_back(keras::Dense(4));
  return keras::Sequential(std::move(layers));
}

}  // namespace

TEST_CASE("a model that does not fit replicated on 4 devices of 26 MiB trains under ZeRO stage 3") {
  devices::set_logical_device_configuration({.num_cpu_devices = 4, .memory_limit_bytes = kLimit});
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> xs(static_cast<std::size_t>(kRows * kWidth));
  for (auto& v : xs) v = normal(rng);
  std::vector<std::int64_t> ys(static_cast<std::size_t>(kRows));
  for (std::size_t i = 0; i < ys.size(); ++i) ys[i] = static_cast<std::int64_t>(i % 4);
  const Tensor x = Tensor::from_vector(xs, {kRows, kWidth}), y = Tensor::from_vector(ys, {kRows});
  const std::vector<std::string> devices{"CPU:0", "CPU:1", "CPU:2", "CPU:3"};
  const auto attempt = [&](ZeroStage stage) {
    MirroredStrategy four(MirroredOptions{
        .devices = devices, .distribution = {.zero = stage, .reduce_bucket_bytes = std::int64_t{1} << 20}});
    keras::Model model;
    {
      auto scope = four.scope();
      model = make_model();
      model.compile(keras::Adam{.learning_rate = 1e-3}, keras::SparseCategoricalCrossentropy{.from_logits = true});
    }
    REQUIRE(model.count_params() > 4'000'000);
    return model.fit(x, y, {.batch_size = 16, .epochs = 2, .verbose = 0}).history.at("loss");
  };
  for (const auto stage : {ZeroStage::k0, ZeroStage::k1, ZeroStage::k2}) {
    CAPTURE(static_cast<int>(stage));
    try {
      attempt(stage);
      FAIL("the model fitted on devices of 26 MiB");
    } catch (const ResourceExhausted& e) {
      const std::string message = e.what();
      CHECK(message.find("memory limit of 27262976 bytes") != std::string::npos);
      CHECK(message.find("CPU:") != std::string::npos);
    }
  }
  for (const auto& name : devices) devices::get_device(name).allocator().reset_peak_bytes_in_use();
  const auto losses = attempt(ZeroStage::k3);
  REQUIRE(losses.size() == 2);
  CHECK(std::isfinite(losses[1]));
  for (const auto& name : devices) {
    const auto peak = devices::get_device(name).allocator().stats().peak_bytes_in_use;
    MESSAGE(name, ": stage 3's peak ", peak, " bytes of the ", kLimit, " allowed");
    CHECK(peak <= kLimit);
  }
}
