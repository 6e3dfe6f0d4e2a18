// LossScaleOptimizer: dynamic loss scaling's skip / halve / grow behaviour on injected inf and NaN
// gradients, equality with the plain inner optimizer on finite runs (power-of-two scaling is
// exact), MirroredStrategy on 2 logical CPU devices (CTest sets TANDEM_NUM_CPU_DEVICES=2), and
// the scale and counter in training checkpoints.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <random>

#include <unistd.h>

#include "tandem/base/random.h"
#include "tandem/keras_like/keras.h"

using namespace tandem;
using namespace tandem::keras;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

VariablePtr make_variable(const std::vector<float>& values, const std::string& name) {
  strategy::VariableOptions options;
  options.name = name;
  options.initial_value = Tensor::from_vector<float>(values, {static_cast<std::int64_t>(values.size())});
  return strategy::default_strategy().create_variable(std::move(options));
}

Tensor vec(const std::vector<float>& v) { return Tensor::from_vector<float>(v, {static_cast<std::int64_t>(v.size())}); }

std::vector<float> times(const std::vector<float>& v, double factor) {
  std::vector<float> out;
  for (float x : v) out.push_back(static_cast<float>(x * factor));
  return out;
}

std::vector<std::vector<float>> slot_values(const Optimizer& opt, bool with_loss_scale_state) {
  std::vector<std::vector<float>> out;
  for (const auto& [name, slot] : opt.slots()) {
    if (name.starts_with("loss_scale_optimizer/")) {
      CHECK(with_loss_scale_state);
      continue;
    }
    out.push_back(slot->read_value().to_vector<float>());
  }
  return out;
}

// 64 examples of a noisy linear target in 4 features.
struct Data {
  std::vector<float> x, y;
  std::int64_t n = 64;
  Tensor x_tensor() const { return Tensor::from_vector<float>(x, {n, 4}); }
  Tensor y_tensor() const { return Tensor::from_vector<float>(y, {n, 1}); }
  // Without the examples [begin, end).
  Data without(std::int64_t begin, std::int64_t end) const {
    Data d;
    d.n = n - (end - begin);
    for (std::int64_t i = 0; i < n; ++i) {
      if (i >= begin && i < end) continue;
      d.x.insert(d.x.end(), x.begin() + i * 4, x.begin() + i * 4 + 4);
      d.y.push_back(y[static_cast<std::size_t>(i)]);
    }
    return d;
  }
};

Data make_data() {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Data d;
  for (std::int64_t i = 0; i < d.n; ++i) {
    float target = 0.1f * normal(rng);
    for (int f = 0; f < 4; ++f) {
      const float v = normal(rng);
      d.x.push_back(v);
      target += (f % 2 == 0 ? 0.7f : -0.4f) * v;
    }
    d.y.push_back(target);
  }
  return d;
}

Model make_model(Strategy& strategy, const OptimizerRef& optimizer) {
  set_global_seed(77);
  auto scope = strategy.scope();
  auto x = Input({4});
  auto h = Dense(8, "tanh", {.name = "ls_hidden"})(x);
  auto y = Dense(1, {.name = "ls_out"})(h);
  Model model(x, y);
  model.compile(optimizer, "mse");
  return model;
}

// Batches of 8, no shuffle: batch k is examples [8k, 8k + 8).
Model train(Strategy& strategy, const OptimizerRef& optimizer, const Data& data, int epochs = 1) {
  Model model = make_model(strategy, optimizer);
  model.fit(data.x_tensor(), data.y_tensor(), {.batch_size = 8, .epochs = epochs, .verbose = 0, .shuffle = false});
  return model;
}

void check_weights_close(const Model& got, const Model& want, double tolerance) {
  const auto a = got.get_weights();
  const auto b = want.get_weights();
  REQUIRE(a.size() == b.size());
  for (std::size_t w = 0; w < a.size(); ++w) {
    const auto va = a[w].to_vector<float>();
    const auto vb = b[w].to_vector<float>();
    REQUIRE(va.size() == vb.size());
    for (std::size_t i = 0; i < va.size(); ++i) {
      CHECK_MESSAGE(std::abs(va[i] - vb[i]) <= tolerance * std::max(1.0f, std::abs(vb[i])), "weight ", w, "[", i,
                    "]: ", va[i], " vs ", vb[i]);
    }
  }
}

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() /
           fmt::format("tandem_loss_scale_test_{}_{}", static_cast<long long>(::getpid()), std::random_device{}());
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

}  // namespace

TEST_CASE("LossScaleOptimizer: defaults, names and bad settings") {
  const OptimizerRef ref(LossScaleOptimizer{});
  REQUIRE(ref.loss_scale_optimizer().has_value());
  CHECK(ref.loss_scale_optimizer()->initial_scale == 32768.0);
  CHECK(ref.loss_scale_optimizer()->dynamic_growth_steps == 2000);
  CHECK(std::holds_alternative<Adam>(ref.spec()));
  CHECK_FALSE(OptimizerRef("adam").loss_scale_optimizer().has_value());

  Optimizer opt(LossScaleOptimizer{.inner_optimizer = SGD{.learning_rate = 0.5}});
  CHECK(opt.name() == "loss_scale_optimizer(sgd)");
  CHECK(opt.learning_rate() == 0.5);
  CHECK(opt.loss_scale() == 32768.0);  // before build: the initial scale
  CHECK(opt.loss_scale_step_counter() == 0);
  CHECK(Optimizer(Adam{}).loss_scale() == 1.0);

  for (double bad : {0.0, -2.0, std::nan(""), std::numeric_limits<double>::infinity(), 1e40}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(Optimizer(LossScaleOptimizer{.initial_scale = bad}), doctest::Contains("initial_scale"),
                         InvalidArgument);
  }
  CHECK_THROWS_WITH_AS(Optimizer(LossScaleOptimizer{.dynamic_growth_steps = 0}),
                       doctest::Contains("dynamic_growth_steps must be at least 1; got 0"), InvalidArgument);
  CHECK_THROWS_WITH_AS(Optimizer(LossScaleOptimizer{.inner_optimizer = Adam{.gradient_accumulation_steps = 2}}),
                       doctest::Contains("gradient_accumulation_steps"), Unimplemented);
}

TEST_CASE("LossScaleOptimizer::apply skips and halves on inf/NaN, grows after dynamic_growth_steps finite steps") {
  const std::vector<float> w0{1.0f, -2.0f, 0.5f};
  auto plain_w = make_variable(w0, "plain_w");
  auto scaled_w = make_variable(w0, "scaled_w");
  Optimizer plain(Adam{.learning_rate = 0.1});
  Optimizer scaled(
      LossScaleOptimizer{.inner_optimizer = Adam{.learning_rate = 0.1}, .initial_scale = 8, .dynamic_growth_steps = 3});
  plain.build({plain_w});
  scaled.build({scaled_w});
  REQUIRE(scaled.slots().size() == plain.slots().size() + 2);
  CHECK(scaled.slots()[0].first == "loss_scale_optimizer/dynamic_scale");
  CHECK(scaled.slots()[1].first == "loss_scale_optimizer/step_counter");
  CHECK(scaled.loss_scale() == 8.0);

  const std::vector<std::vector<float>> grads{
      {0.1f, -0.2f, 0.3f}, {0.05f, 0.4f, -0.1f}, {-0.3f, 0.1f, 0.2f}, {0.2f, 0.2f, -0.7f}, {0.01f, -0.02f, 0.03f}};
  // A finite step with the scaled gradient changes exactly what the plain one does.
  const auto finite_step = [&](const std::vector<float>& g) {
    CHECK(plain.apply(0, {vec(g)}));
    plain.finish_step();
    CHECK(scaled.apply(0, {vec(times(g, scaled.loss_scale()))}));
    scaled.finish_step();
    CHECK(scaled_w->read_value().to_vector<float>() == plain_w->read_value().to_vector<float>());
    CHECK(slot_values(scaled, true) == slot_values(plain, false));
  };
  const auto skipped_step = [&](const std::vector<float>& g) {
    const auto weights = scaled_w->read_value().to_vector<float>();
    const auto slots = slot_values(scaled, true);
    const double scale = scaled.loss_scale();
    CHECK_FALSE(scaled.apply(0, {vec(g)}));
    CHECK(scaled_w->read_value().to_vector<float>() == weights);
    CHECK(slot_values(scaled, true) == slots);
    CHECK(scaled.loss_scale() == scale / 2);
    CHECK(scaled.loss_scale_step_counter() == 0);
  };

  finite_step(grads[0]);
  finite_step(grads[1]);
  CHECK(scaled.loss_scale_step_counter() == 2);
  CHECK(scaled.loss_scale() == 8.0);
  skipped_step({0.1f, kInf, 0.2f});           // 8 -> 4, count restarts
  skipped_step({std::nanf(""), 0.0f, 0.0f});  // 4 -> 2
  skipped_step({0.0f, 0.0f, -kInf});          // 2 -> 1
  CHECK(scaled.loss_scale() == 1.0);
  finite_step(grads[2]);
  finite_step(grads[3]);
  CHECK(scaled.loss_scale() == 1.0);
  CHECK(scaled.loss_scale_step_counter() == 2);
  finite_step(grads[4]);  // the third finite step in a row: the scale doubles after applying
  CHECK(scaled.loss_scale() == 2.0);
  CHECK(scaled.loss_scale_step_counter() == 0);
  for (const auto& g : grads) finite_step(g);
  CHECK(scaled.loss_scale() == 4.0);
  CHECK(scaled.loss_scale_step_counter() == 2);
  CHECK(scaled.iterations() == plain.iterations());  // the caller does not count skipped steps

  // The gradients still have to fit the variables.
  CHECK_THROWS_AS(scaled.apply(0, {}), InvalidArgument);
}

TEST_CASE("fit with LossScaleOptimizer equals the inner optimizer on finite data, and grows the scale") {
  const Data data = make_data();
  auto& one = strategy::default_strategy();
  for (const OptimizerSpec& inner :
       {OptimizerSpec(Adam{.learning_rate = 0.01}), OptimizerSpec(SGD{.learning_rate = 0.05, .momentum = 0.9})}) {
    const Model plain = train(one, inner, data, 2);
    const Model scaled = train(
        one, LossScaleOptimizer{.inner_optimizer = inner, .initial_scale = 1024, .dynamic_growth_steps = 3}, data, 2);
    // Scaling by a power of two is exact, so the runs agree to the bit.
    check_weights_close(scaled, plain, 0.0);
    CHECK(scaled.optimizer().iterations() == 16);
    // 16 finite steps: doubled after steps 3, 6, 9, 12 and 15; one step counted since.
    CHECK(scaled.optimizer().loss_scale() == 1024.0 * 32);
    CHECK(scaled.optimizer().loss_scale_step_counter() == 1);
  }
}

TEST_CASE("fit with LossScaleOptimizer skips a batch whose gradients are inf or NaN, and halves the scale") {
  const Data data = make_data();
  auto& one = strategy::default_strategy();
  const LossScaleOptimizer optimizer{
      .inner_optimizer = Adam{.learning_rate = 0.01}, .initial_scale = 4096, .dynamic_growth_steps = 100};
  // Training without batch 2 at all is what the skipped step must amount to (Adam's step count
  // included: iterations do not count a skipped step).
  const Model reference = train(one, Adam{.learning_rate = 0.01}, data.without(16, 24));
  for (const float poison : {kInf, std::nanf("")}) {
    CAPTURE(poison);
    Data poisoned = data;
    poisoned.y[20] = poison;  // one target in batch 2
    const Model scaled = train(one, optimizer, poisoned);
    check_weights_close(scaled, reference, 0.0);
    CHECK(scaled.optimizer().iterations() == 7);
    CHECK(scaled.optimizer().loss_scale() == 2048.0);
    CHECK(scaled.optimizer().loss_scale_step_counter() == 5);  // batches 3..7
  }
}

TEST_CASE("LossScaleOptimizer under MirroredStrategy on 2 devices: every replica skips, halves and grows alike") {
  const Data data = make_data();
  auto& one = strategy::default_strategy();
  MirroredStrategy two(std::vector<std::string>{"CPU:0", "CPU:1"});
  const LossScaleOptimizer optimizer{
      .inner_optimizer = Adam{.learning_rate = 0.01}, .initial_scale = 4096, .dynamic_growth_steps = 2};
  // The inf target is in the last example of batch 2: in replica 1's shard only, so replica 0
  // sees it through the all-reduce.
  Data poisoned = data;
  poisoned.y[23] = kInf;
  const Model single = train(one, optimizer, poisoned);
  const Model mirrored = train(two, optimizer, poisoned);
  CHECK(mirrored.optimizer().iterations() == 7);
  // Batches 0, 1: doubled to 8192; batch 2 skipped: 4096; batches 3..7: doubled twice, one counted.
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(mirrored.optimizer().loss_scale(r) == 4096.0 * 4);
    CHECK(mirrored.optimizer().loss_scale_step_counter(r) == 1);
  }
  CHECK(single.optimizer().loss_scale() == 4096.0 * 4);
  // Only the summation order of the gradients differs from one device.
  check_weights_close(mirrored, single, 1e-5);
  for (const auto& w : mirrored.weights()) w->check_copies_equal();

  // On finite data the mirrored run equals the plain inner optimizer under the same strategy.
  const Model plain = train(two, Adam{.learning_rate = 0.01}, data);
  const Model scaled = train(two, optimizer, data);
  check_weights_close(scaled, plain, 0.0);
}

TEST_CASE("LossScaleOptimizer's scale and counter are saved in and restored from training checkpoints") {
  TempDir dir;
  const auto path = (dir.path / "ckpt.safetensors").string();
  const Data data = make_data();
  auto& one = strategy::default_strategy();
  const LossScaleOptimizer optimizer{
      .inner_optimizer = Adam{.learning_rate = 0.01}, .initial_scale = 256, .dynamic_growth_steps = 3};
  Model model = train(one, optimizer, data);  // 8 finite steps: 1024, counter 2
  REQUIRE(model.optimizer().loss_scale() == 1024.0);
  REQUIRE(model.optimizer().loss_scale_step_counter() == 2);
  save_training_checkpoint(model, path, {.epoch = 1, .step = 0});

  const auto content = read_safetensors(path);
  std::map<std::string, Tensor> by_name(content.tensors.begin(), content.tensors.end());
  REQUIRE(by_name.count("optimizer/loss_scale_optimizer/dynamic_scale") == 1);
  REQUIRE(by_name.count("optimizer/loss_scale_optimizer/step_counter") == 1);
  CHECK(by_name.at("optimizer/loss_scale_optimizer/dynamic_scale").item<float>() == 1024.0f);
  CHECK(by_name.at("optimizer/loss_scale_optimizer/step_counter").item<std::int64_t>() == 2);
  CHECK(content.metadata.at("optimizer") == "loss_scale_optimizer(adam)");

  // Train on with a poisoned batch (the scale halves), then restore: the checkpoint's state returns.
  Data poisoned = data;
  poisoned.y[3] = kInf;
  model.fit(poisoned.x_tensor(), poisoned.y_tensor(), {.batch_size = 8, .epochs = 1, .verbose = 0, .shuffle = false});
  CHECK(model.optimizer().loss_scale() == 2048.0);  // halved to 512, then doubled after 3 and 6 finite steps
  CHECK(model.optimizer().loss_scale_step_counter() == 1);
  CHECK(model.optimizer().iterations() == 15);
  load_training_checkpoint(model, path);
  CHECK(model.optimizer().loss_scale() == 1024.0);
  CHECK(model.optimizer().loss_scale_step_counter() == 2);
  CHECK(model.optimizer().iterations() == 8);

  // A fresh model with the same layer names resumes from it before its first step.
  Model fresh = make_model(one, optimizer);
  load_training_checkpoint(fresh, path);
  CHECK(fresh.optimizer().loss_scale() == 1024.0);
  CHECK(fresh.optimizer().loss_scale_step_counter() == 2);

  // Loss scaling wraps the optimizer: the plain inner optimizer's model (a float32 model resuming
  // a mixed_float16 run) takes the weights, slots and iterations and leaves the scale behind...
  Model adam = make_model(one, Adam{.learning_rate = 0.01});
  load_training_checkpoint(adam, path);
  CHECK(adam.optimizer().iterations() == 8);
  CHECK_FALSE(adam.optimizer().loss_scale_optimizer().has_value());
  // ...and a loss-scaled model resuming a plain checkpoint starts from its initial scale.
  const std::string plain_path = path + ".plain";
  save_training_checkpoint(adam, plain_path, {.epoch = 1, .step = 0});
  Model scaled = make_model(one, optimizer);
  load_training_checkpoint(scaled, plain_path);
  CHECK(scaled.optimizer().iterations() == 8);
  CHECK(scaled.optimizer().loss_scale() == optimizer.initial_scale);
  std::filesystem::remove(plain_path);
  // Another inner optimizer is still refused, naming both.
  Model sgd = make_model(one, SGD{});
  CHECK_THROWS_WITH_AS(load_training_checkpoint(sgd, path), doctest::Contains("loss_scale_optimizer(adam)"),
                       InvalidArgument);
}

namespace {

struct ResumableRun {
  Model model;
  int steps = 0;
  std::string restored_from;
  double scale_at_start = 0;  // after BackupAndRestore's on_train_begin
  std::int64_t counter_at_start = -1;
};

// Two epochs with a poisoned target in batch 1 (skipped, scale halved), backed up every 2
// batches, stopped by an exception after `stop_after` steps when given.
ResumableRun run_with_backup(const std::string& dir, std::optional<int> stop_after) {
  Data data = make_data();
  data.y[10] = kInf;
  ResumableRun run{.model = make_model(strategy::default_strategy(),
                                       LossScaleOptimizer{.inner_optimizer = Adam{.learning_rate = 0.01},
                                                          .initial_scale = 512,
                                                          .dynamic_growth_steps = 3})};
  auto backup = std::make_shared<BackupAndRestore>(dir, BackupAndRestoreOptions{.save_freq = 2});
  FitOptions fit{.batch_size = 8, .epochs = 2, .verbose = 0, .shuffle = false};
  fit.callbacks.push_back(backup);
  fit.callbacks.push_back(std::make_shared<LambdaCallback>(
      LambdaCallbackOptions{.on_train_batch_end =
                                [&](std::int64_t, Logs&) {
                                  ++run.steps;
                                  if (stop_after && run.steps == *stop_after) throw Unavailable("simulated crash");
                                },
                            .on_train_begin =
                                [&](Logs&) {
                                  run.scale_at_start = run.model.optimizer().loss_scale();
                                  run.counter_at_start = run.model.optimizer().loss_scale_step_counter();
                                }}));
  try {
    run.model.fit(data.x_tensor(), data.y_tensor(), fit);
  } catch (const Unavailable&) {
    CHECK(stop_after.has_value());
  }
  run.restored_from = backup->restored_from();
  return run;
}

}  // namespace

TEST_CASE("BackupAndRestore resumes LossScaleOptimizer's scale and counter") {
  TempDir reference_dir, dir;
  const auto reference = run_with_backup((reference_dir.path / "a").string(), std::nullopt);
  CHECK(reference.scale_at_start == 512.0);
  CHECK(reference.counter_at_start == 0);
  // Per epoch: batch 0 counted, batch 1 skipped (halved), batches 2..7 double it twice:
  // 512 -> 256 -> 1024 in epoch 1, -> 512 -> 2048 in epoch 2; 14 steps applied.
  CHECK(reference.model.optimizer().iterations() == 14);
  CHECK(reference.model.optimizer().loss_scale() == 2048.0);
  CHECK(reference.model.optimizer().loss_scale_step_counter() == 0);
  // Crash after 5 steps; the backup after step 4 holds scale 256, counter 2.
  (void)run_with_backup((dir.path / "b").string(), 5);
  const auto resumed = run_with_backup((dir.path / "b").string(), std::nullopt);
  CHECK_FALSE(resumed.restored_from.empty());
  CHECK(resumed.scale_at_start == 256.0);
  CHECK(resumed.counter_at_start == 2);
  CHECK(resumed.steps == 12);
  CHECK(resumed.model.optimizer().iterations() == 14);
  CHECK(resumed.model.optimizer().loss_scale() == 2048.0);
  CHECK(resumed.model.optimizer().loss_scale_step_counter() == 0);
  check_weights_close(resumed.model, reference.model, 0.0);
}
