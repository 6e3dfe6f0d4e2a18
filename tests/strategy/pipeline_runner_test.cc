// The pipeline runner (strategy/pipeline_runner.h) on logical CPU devices: an MLP cut into 2 and
// 4 stages trains as the same MLP on one device under GPipe and 1F1B, with as many micro-batches
// as stages, more, and fewer (every step's loss and the final weights within 1e-5 relative);
// bitwise the same run to run; holding at most p micro-batches per stage under 1F1B and m under
// GPipe; sending 2 m transfers of one micro-batch's boundary activation per boundary and step; and
// a stage that fails ends the step at once with an error naming the stage, micro-batch and action;
// the allocator sees GPipe hold m received activations on the last stage and 1F1B one; one runner
// per rank over Gloo and shared memory (as one process per stage) trains bitwise the same; and
// interleaved 1F1B (2 devices x 2 chunks) trains as one device.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <random>
#include <thread>

#include "common/error_message.h"
#include "tandem/collective/gloo.h"
#include "tandem/collective/in_process.h"
#include "tandem/collective/shared_memory.h"
#include "tandem/collective/store.h"
#include "tandem/graph/executor.h"
#include "tandem/ops/ops.h"
#include "tandem/strategy/pipeline_runner.h"
#include "tandem/strategy/variable.h"

using namespace tandem;
using graph::Output;
using strategy::PipelineSchedule;

namespace {

constexpr std::int64_t kIn = 8, kBatch = 32;
constexpr float kLearningRate = 0.05f;

struct Layer {
  std::int64_t in, out;
  const char* activation;  // "tanh", "relu", "" (none)
};
// pre, fc1, fc2, head: 8 -> 8 -> 16 -> 8 -> 1.
const std::vector<Layer> kLayers{{8, 8, "tanh"}, {8, 16, "relu"}, {16, 8, "tanh"}, {8, 1, ""}};

std::vector<std::vector<float>> initial_weights() {
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  std::vector<std::vector<float>> w;
  for (const auto& l : kLayers) {
    for (const auto n : {l.in * l.out, l.out}) {
      std::vector<float> v(static_cast<std::size_t>(n));
      for (auto& e : v) e = u(rng);
      w.push_back(v);
    }
  }
  return w;
}

std::pair<Tensor, Tensor> batch(int step) {
  std::mt19937 rng(static_cast<unsigned>(500 + step));
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(kBatch * kIn)), y(static_cast<std::size_t>(kBatch));
  for (auto& v : x) v = n(rng);
  for (std::int64_t i = 0; i < kBatch; ++i) {
    float s = 0;
    for (std::int64_t f = 0; f < kIn; ++f) s += std::cos(x[static_cast<std::size_t>(i * kIn + f)] * (0.5f + f * 0.2f));
    y[static_cast<std::size_t>(i)] = s / 4;
  }
  return {Tensor::from_vector(x, {kBatch, kIn}), Tensor::from_vector(y, {kBatch, 1})};
}

// Step `step`'s batch as `count` equal micro-batches.
std::vector<std::vector<Tensor>> micro_batches_of(int step, int count) {
  const auto [x, y] = batch(step);
  const std::int64_t rows = kBatch / count;
  std::vector<std::vector<Tensor>> out;
  for (int m = 0; m < count; ++m) {
    out.push_back({strategy::flat_view(x, m * rows * kIn, rows * kIn).reshape({rows, kIn}),
                   strategy::flat_view(y, m * rows, rows).reshape({rows, 1})});
  }
  return out;
}

// Layers [first, last) of the MLP as one stage on `device`; the last layer adds the loss (its
// rows' squared errors times 1 / the global batch).
strategy::PipelineStage make_stage(std::size_t first, std::size_t last, devices::Device& device,
                                   const std::vector<std::vector<float>>& weights) {
  auto g = std::make_shared<graph::Graph>();
  strategy::PipelineStage st;
  st.device = &device;
  Output h;
  if (first == 0) {
    h = g->placeholder(kFloat32, {-1, kIn}, "x");
    st.data.push_back({h, 0});
  } else {
    st.input = h = g->placeholder(kFloat32, {-1, kLayers[first].in}, "input");
  }
  for (std::size_t l = first; l < last; ++l) {
    const auto& layer = kLayers[l];
    st.variables.push_back(g->variable(kFloat32, {layer.in, layer.out}, fmt::format("layer{}/kernel", l)));
    st.values.push_back(Tensor::from_vector(weights[2 * l], {layer.in, layer.out}, device));
    st.variables.push_back(g->variable(kFloat32, {layer.out}, fmt::format("layer{}/bias", l)));
    st.values.push_back(Tensor::from_vector(weights[2 * l + 1], {layer.out}, device));
    h = ops::bias_add(ops::matmul(h, st.variables[st.variables.size() - 2]), st.variables.back());
    if (std::string_view(layer.activation) == "tanh") h = ops::tanh(h);
    if (std::string_view(layer.activation) == "relu") h = ops::relu(h);
  }
  if (last == kLayers.size()) {
    const Output y = g->placeholder(kFloat32, {-1, 1}, "y");
    st.data.push_back({y, 1});
    const Output sum = ops::reduce_sum(ops::square(h - y));
    st.loss = sum * ops::scalar_like(sum, 1.0 / kBatch);
  } else {
    st.output = h;
    st.output_gradient = g->placeholder(kFloat32, {-1, kLayers[last - 1].out}, "output_gradient");
  }
  st.add_gradients();
  st.graph = g;
  return st;
}

void sgd(std::vector<Tensor>& values, const std::vector<Tensor>& gradients) {
  for (std::size_t k = 0; k < values.size(); ++k) {
    float* v = values[k].data<float>();
    const float* d = gradients[k].data<float>();
    for (std::int64_t i = 0; i < values[k].num_elements(); ++i) v[i] -= kLearningRate * d[i];
  }
}

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<float>> weights;
  std::vector<int> peak_stashed;
  collective::CommunicationStats stage0;
};

// The whole MLP as one stage of a 1-stage pipeline with 1 micro-batch: one device's training.
// cuts: the stage boundaries (layer indices), {0, 4} for one device.
Run train(std::vector<std::size_t> cuts, PipelineSchedule schedule, int microbatches, int steps) {
  const int p = static_cast<int>(cuts.size()) - 1;
  const auto weights = initial_weights();
  std::vector<strategy::PipelineStage> stages;
  for (int s = 0; s < p; ++s) {
    stages.push_back(make_stage(cuts[static_cast<std::size_t>(s)], cuts[static_cast<std::size_t>(s) + 1],
                                devices::get_device(fmt::format("CPU:{}", s)), weights));
  }
  auto comms = collective::make_in_process_group(p);
  std::vector<collective::Communicator*> group;
  for (auto& c : comms) group.push_back(c.get());
  strategy::PipelineRunner runner(std::move(stages), {.stages = p, .microbatches = microbatches, .schedule = schedule},
                                  group);
  Run run;
  for (int step = 0; step < steps; ++step) {
    const auto mbs = micro_batches_of(step, microbatches);
    const auto result = runner.step(mbs);
    run.losses.push_back(result.loss());
    for (int s = 0; s < p; ++s)
      sgd(runner.stages()[static_cast<std::size_t>(s)].values, result.gradients[static_cast<std::size_t>(s)]);
    run.peak_stashed = result.peak_stashed;
  }
  for (auto& st : runner.stages()) {
    for (const auto& v : st.values) run.weights.push_back(v.to_vector<float>());
  }
  run.stage0 = comms[0]->stats();
  return run;
}

void check_equivalent(const Run& got, const Run& want) {
  REQUIRE(got.losses.size() <= want.losses.size());
  for (std::size_t s = 0; s < got.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(std::abs(got.losses[s] - want.losses[s]) <= 1e-5 * std::abs(want.losses[s]));
  }
  REQUIRE(got.weights.size() == want.weights.size());
  for (std::size_t k = 0; k < got.weights.size(); ++k) {
    for (std::size_t i = 0; i < got.weights[k].size(); ++i) {
      const double a = got.weights[k][i], b = want.weights[k][i];
      if (std::abs(a - b) > 1e-5 * std::max(1e-2, std::abs(b))) {
        FAIL_CHECK("weight " << k << "[" << i << "]: " << a << " vs " << b);
        return;
      }
    }
  }
}

}  // namespace

TEST_CASE("pipelines of 2 and 4 stages train as one device under GPipe and 1F1B, with m = p, m > p and m < p") {
  constexpr int kSteps = 50;
  const Run one = train({0, 4}, PipelineSchedule::k1F1B, 1, kSteps);
  CHECK(one.losses.back() < 0.5 * one.losses.front());  // it trains
  struct Case {
    std::vector<std::size_t> cuts;
    PipelineSchedule schedule;
    int microbatches;
  };
  for (const Case& c : std::vector<Case>{{{0, 2, 4}, PipelineSchedule::kGPipe, 4},
                                         {{0, 2, 4}, PipelineSchedule::k1F1B, 4},
                                         {{0, 2, 4}, PipelineSchedule::k1F1B, 1},
                                         {{0, 2, 4}, PipelineSchedule::kGPipe, 2},
                                         {{0, 1, 2, 3, 4}, PipelineSchedule::k1F1B, 8},
                                         {{0, 1, 2, 3, 4}, PipelineSchedule::kGPipe, 2}}) {
    const int p = static_cast<int>(c.cuts.size()) - 1;
    CAPTURE(p);
    CAPTURE(c.microbatches);
    CAPTURE(strategy::pipeline_schedule_name(c.schedule));
    const Run got = train(c.cuts, c.schedule, c.microbatches, kSteps);
    check_equivalent(got, one);
    // Micro-batches held between forward and backward: m under GPipe, min(p - s, m) under 1F1B.
    for (int s = 0; s < p; ++s) {
      const int want = c.schedule == PipelineSchedule::kGPipe ? c.microbatches : std::min(p - s, c.microbatches);
      CHECK(got.peak_stashed[static_cast<std::size_t>(s)] == want);
    }
    // Stage 0 sends m activations of (32 / m rows x width) float32 and receives m gradients of
    // them a step: 2 m transfers of one micro-batch's boundary activation.
    const std::int64_t width = kLayers[c.cuts[1] - 1].out;
    const std::int64_t bytes = kBatch * width * 4 * kSteps;
    CHECK(got.stage0.send.calls == c.microbatches * kSteps);
    CHECK(got.stage0.recv.calls == c.microbatches * kSteps);
    CHECK(got.stage0.send.bytes_sent == bytes);
    CHECK(got.stage0.recv.bytes_received == bytes);
    CHECK(got.stage0.all_reduce.calls == 0);
  }
}

TEST_CASE("a pipeline run is bitwise the same run to run") {
  const Run a = train({0, 2, 4}, PipelineSchedule::k1F1B, 4, 20);
  const Run b = train({0, 2, 4}, PipelineSchedule::k1F1B, 4, 20);
  CHECK(a.losses == b.losses);
  CHECK(a.weights == b.weights);
}

TEST_CASE("a stage that fails ends the step on every stage at once, naming the stage, micro-batch and action") {
  const auto weights = initial_weights();
  std::vector<strategy::PipelineStage> stages{make_stage(0, 2, devices::get_device("CPU:0"), weights),
                                              make_stage(2, 4, devices::get_device("CPU:1"), weights)};
  auto comms = collective::make_in_process_group(2);
  strategy::PipelineRunnerOptions options;
  options.transfers.timeout = std::chrono::seconds(60);
  options.before_action = [](int stage, const strategy::PipelineAction& a) {
    if (stage == 1 && a.microbatch == 2 && a.kind == strategy::PipelineAction::Kind::kForward) {
      throw InvalidArgument("injected fault");
    }
  };
  strategy::PipelineRunner runner(std::move(stages), {.stages = 2, .microbatches = 4}, {comms[0].get(), comms[1].get()},
                                  options);
  const auto mbs = micro_batches_of(0, 4);
  const auto start = std::chrono::steady_clock::now();
  CHECK(testing::error_message([&] { runner.step(mbs); }) ==
        "pipeline stage 1, micro-batch 2, forward: injected fault");
  // Stage 0, blocked in a transfer to stage 1, was released by the abort, not by its 60 s timeout.
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  CHECK(testing::error_message([&] { runner.step({mbs[0]}); }) ==
        "PipelineRunner::step: 1 micro-batches given; the schedule has 4");
}

TEST_CASE("PipelineRunner refuses stages that do not chain") {
  const auto weights = initial_weights();
  auto comms = collective::make_in_process_group(2);
  const auto make = [&](std::vector<strategy::PipelineStage> stages) {
    strategy::PipelineRunner runner(std::move(stages), {.stages = 2, .microbatches = 2},
                                    {comms[0].get(), comms[1].get()});
  };
  CHECK(testing::error_message([&] {
          make({make_stage(0, 2, devices::get_device("CPU:0"), weights),
                make_stage(0, 4, devices::get_device("CPU:1"), weights)});
        }) == "PipelineRunner: stage 1 lacks an input placeholder; every stage but the first needs one");
  CHECK(testing::error_message([&] {
          make({make_stage(0, 1, devices::get_device("CPU:0"), weights),
                make_stage(2, 4, devices::get_device("CPU:1"), weights)});
        }) == "PipelineRunner: stage 0's output is float32 (None, 8) but stage 1's input is float32 (None, 16)");
  CHECK(testing::error_message([&] {
          make({make_stage(0, 2, devices::get_device("CPU:0"), weights),
                make_stage(2, 3, devices::get_device("CPU:1"), weights)});
        }) ==
        "PipelineRunner: stage 1 must have a loss and no output (the last stage a loss; the others an output and an "
        "output_gradient placeholder)");
  CHECK(testing::error_message([&] {
          strategy::PipelineRunner runner({make_stage(0, 4, devices::get_device("CPU:0"), weights)},
                                          {.stages = 1, .microbatches = 0}, {comms[0].get()});
        }).find("microbatches") != std::string::npos);
}

namespace {

// n communicators of `backend` ("gloo", "shared-memory") on threads of this process, meeting
// through one in-memory store, as the ranks of n processes meet.
std::vector<std::unique_ptr<collective::Communicator>> make_ranks(const std::string& backend, int n) {
  std::vector<std::unique_ptr<collective::Communicator>> group(static_cast<std::size_t>(n));
  auto store = collective::make_in_memory_store();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      if (backend == "gloo") {
        group[static_cast<std::size_t>(r)] = collective::make_gloo_communicator({.rank = r, .size = n, .store = store});
      } else {
        group[static_cast<std::size_t>(r)] =
            collective::make_shared_memory_communicator({.rank = r, .size = n, .store = store});
      }
    });
  }
  for (auto& t : threads) t.join();
  return group;
}

}  // namespace

TEST_CASE("one runner per stage, as one process per stage, over Gloo and shared memory: the same training") {
  constexpr int kSteps = 20;
  const Run want = train({0, 2, 4}, PipelineSchedule::k1F1B, 4, kSteps);
  for (const std::string backend : {"gloo", "shared-memory"}) {
    CAPTURE(backend);
    auto comms = make_ranks(backend, 2);
    const auto weights = initial_weights();
    // Each rank's runner holds its own stage only, as each process of a 2-process job would.
    std::vector<std::unique_ptr<strategy::PipelineRunner>> runners;
    for (int s = 0; s < 2; ++s) {
      auto stage = make_stage(s == 0 ? 0 : 2, s == 0 ? 2 : 4, devices::get_device(fmt::format("CPU:{}", s)), weights);
      stage.index = s;
      std::vector<strategy::PipelineStage> local;
      local.push_back(std::move(stage));
      runners.push_back(std::make_unique<strategy::PipelineRunner>(
          std::move(local), strategy::PipelineConfig{.stages = 2, .microbatches = 4},
          std::vector{comms[static_cast<std::size_t>(s)].get()}));
    }
    Run got;
    for (int step = 0; step < kSteps; ++step) {
      const auto mbs = micro_batches_of(step, 4);
      std::vector<strategy::PipelineStepResult> results(2);
      std::thread other([&] { results[1] = runners[1]->step(mbs); });
      results[0] = runners[0]->step(mbs);
      other.join();
      CHECK(!results[0].has_loss);
      CHECK(results[1].has_loss);
      got.losses.push_back(results[1].loss());
      for (int s = 0; s < 2; ++s)
        sgd(runners[static_cast<std::size_t>(s)]->stages()[0].values,
            results[static_cast<std::size_t>(s)].gradients[0]);
    }
    for (auto& r : runners) {
      for (const auto& v : r->stages()[0].values) got.weights.push_back(v.to_vector<float>());
    }
    // The same sums in the same order as the in-process pipeline: bitwise its training.
    CHECK(got.losses == want.losses);
    CHECK(got.weights == want.weights);
    CHECK(comms[0]->stats().send.calls == 4 * kSteps);
    CHECK(comms[1]->stats().send.calls == 4 * kSteps);
  }
}

TEST_CASE("the allocator sees m received activations live on the last stage under GPipe, one under 1F1B") {
  // p = 2, m = 8 micro-batches of 4 rows: the boundary is (4 x 16) float32, 256 bytes.
  const auto weights = initial_weights();
  const auto peak_above_start = [&](PipelineSchedule schedule) {
    std::vector<strategy::PipelineStage> stages{make_stage(0, 2, devices::get_device("CPU:0"), weights),
                                                make_stage(2, 4, devices::get_device("CPU:1"), weights)};
    auto comms = collective::make_in_process_group(2);
    strategy::PipelineRunner runner(std::move(stages), {.stages = 2, .microbatches = 8, .schedule = schedule},
                                    {comms[0].get(), comms[1].get()});
    const auto mbs = micro_batches_of(0, 8);
    runner.step(mbs);  // plans and arenas made
    auto& allocator = devices::get_device("CPU:1").allocator();
    std::int64_t worst = 0;
    for (int step = 0; step < 3; ++step) {
      const std::int64_t start = allocator.stats().bytes_in_use;
      allocator.reset_peak_bytes_in_use();
      runner.step(mbs);
      worst = std::max(worst, allocator.stats().peak_bytes_in_use - start);
    }
    return worst;
  };
  const std::int64_t gpipe = peak_above_start(PipelineSchedule::kGPipe);
  const std::int64_t one_f_one_b = peak_above_start(PipelineSchedule::k1F1B);
  MESSAGE("peak bytes above the step's start on stage 1: GPipe " << gpipe << ", 1F1B " << one_f_one_b);
  // GPipe holds all 8 received activations at once, 1F1B one: 7 x 256 bytes apart, give or take
  // the few bytes of small temporaries (a loss scalar) alive at the two peaks.
  CHECK(gpipe >= 8 * 256);
  CHECK(std::abs(gpipe - one_f_one_b - 7 * 256) <= 64);
}

TEST_CASE("interleaved 1F1B: 2 devices holding 2 model chunks each train as one device") {
  constexpr int kSteps = 50;
  const Run one = train({0, 4}, PipelineSchedule::k1F1B, 1, kSteps);
  const auto weights = initial_weights();
  // Virtual stage c x 2 + d holds layer c x 2 + d: device 0 layers 0 and 2, device 1 layers 1 and 3.
  std::vector<strategy::PipelineStage> stages;
  for (int d = 0; d < 2; ++d) {
    for (int c = 0; c < 2; ++c) {
      const auto layer = static_cast<std::size_t>(c * 2 + d);
      auto st = make_stage(layer, layer + 1, devices::get_device(fmt::format("CPU:{}", d)), weights);
      st.index = d;
      st.chunk = c;
      stages.push_back(std::move(st));
    }
  }
  auto comms = collective::make_in_process_group(2);
  strategy::PipelineRunner runner(
      std::move(stages),
      {.stages = 2, .microbatches = 4, .virtual_stages = 2, .schedule = PipelineSchedule::kInterleaved1F1B},
      {comms[0].get(), comms[1].get()});
  Run got;
  for (int step = 0; step < kSteps; ++step) {
    const auto mbs = micro_batches_of(step, 4);
    const auto result = runner.step(mbs);
    CHECK(result.has_loss);
    got.losses.push_back(result.loss());
    for (std::size_t i = 0; i < 4; ++i) sgd(runner.stages()[i].values, result.gradients[i]);
  }
  // Layer order: stages at positions 0 (layer 0), 2 (layer 1), 1 (layer 2), 3 (layer 3).
  for (const std::size_t i : {0, 2, 1, 3}) {
    for (const auto& v : runner.stages()[i].values) got.weights.push_back(v.to_vector<float>());
  }
  check_equivalent(got, one);
  // Four transfers of a micro-batch's boundary a step and micro-batch for device 0: it sends the
  // activations of virtual stages 0 and 2 and the gradient of virtual stage 2's input.
  CHECK(comms[0]->stats().send.calls == 3 * 4 * kSteps);
}

TEST_CASE("PipelineRunner refuses an interleaved pipeline without every chunk of a stage") {
  const auto weights = initial_weights();
  auto comms = collective::make_in_process_group(2);
  std::vector<strategy::PipelineStage> stages;
  stages.push_back(make_stage(0, 1, devices::get_device("CPU:0"), weights));
  stages.back().index = 0;
  stages.push_back(make_stage(1, 2, devices::get_device("CPU:1"), weights));
  stages.back().index = 1;
  CHECK(testing::error_message([&] {
          strategy::PipelineRunner runner(
              std::move(stages),
              {.stages = 2, .microbatches = 2, .virtual_stages = 2, .schedule = PipelineSchedule::kInterleaved1F1B},
              {comms[0].get(), comms[1].get()});
        }) == "PipelineRunner: stage 0 has 1 chunk graphs; interleaving gives each stage 2");
}
