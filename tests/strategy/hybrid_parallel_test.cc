// Hybrid parallelism on hand-built graphs over 4 logical CPU devices: data parallelism (the
// gradients all-reduced over the batch axis), tensor parallelism (Megatron's f and g around a
// column/row Dense pair, strategy/tensor_parallel.h) and pipeline stages (strategy::PipelineRunner)
// composed on 2-D meshes: DP2xTP2, TP2xPP2 and PP2xDP2, each training as one device (every step's
// loss and the final weights within 1e-5 relative) and bitwise the same run to run. A checkpoint of
// a TP2xPP2 run's pieces (keras::CheckpointContents::blocks) reads back whole and evaluates on
// one device to the same loss.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <map>
#include <mutex>
#include <thread>

#include "tandem/collective/in_process.h"
#include "tandem/keras_like/sharded_checkpoint.h"
#include "tandem/strategy/strategy.h"
#include "tandem/graph/autodiff.h"
#include "tandem/graph/executor.h"
#include "tandem/ops/ops.h"
#include "tandem/strategy/pipeline_runner.h"
#include "tandem/strategy/tensor_parallel.h"
#include "tandem/strategy/variable.h"
#include "parallel_mlp.h"

using namespace tandem;
namespace tp = tandem::strategy::tensor_parallel;
using graph::Output;

namespace {

using namespace tandem::testing::parallel_mlp;

const std::vector<std::string> kNames{"pre/kernel", "pre/bias", "fc1/kernel",  "fc1/bias",
                                      "fc2/kernel", "fc2/bias", "head/kernel", "head/bias"};

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<float>> weights;               // whole, in initial_weights() order
  double evaluation = 0;                                 // the loss of batch(-1) after training (no update)
  std::vector<keras::CheckpointContents::Block> blocks;  // data replica 0's pieces, each once
};

using Group = std::vector<std::unique_ptr<collective::Communicator>>;

// Trains on `mesh` with m micro-batches per data replica for `steps` steps.
Run train(const Mesh& mesh, int microbatches, strategy::PipelineSchedule schedule, int steps,
          std::vector<std::vector<float>> w = initial_weights()) {
  const auto dev = [&](int b, int j, int s) -> devices::Device& {
    return devices::get_device(fmt::format("CPU:{}", mesh.device(b, j, s)));
  };
  // Tensor groups per (b, s); pipelines per (b, j); data-parallel groups per (j, s).
  std::map<std::pair<int, int>, Group> tensor_comms, pipe_comms, data_comms;
  std::map<std::pair<int, int>, std::shared_ptr<tp::Group>> tensor_groups;
  for (int b = 0; b < mesh.dp; ++b) {
    for (int s = 0; s < mesh.pp; ++s) {
      if (mesh.tp == 1) continue;
      auto& comms = tensor_comms[{b, s}] = collective::make_in_process_group(mesh.tp);
      std::vector<devices::Device*> devices;
      std::vector<collective::Communicator*> group;
      for (int j = 0; j < mesh.tp; ++j) {
        devices.push_back(&dev(b, j, s));
        group.push_back(comms[static_cast<std::size_t>(j)].get());
      }
      tensor_groups[{b, s}] = tp::Group::create(devices, group);
    }
  }
  for (int j = 0; j < mesh.tp; ++j) {
    for (int s = 0; s < mesh.pp; ++s) data_comms[{j, s}] = collective::make_in_process_group(mesh.dp);
  }
  std::map<std::pair<int, int>, std::unique_ptr<strategy::PipelineRunner>> runners;  // per (b, j)
  for (int b = 0; b < mesh.dp; ++b) {
    for (int j = 0; j < mesh.tp; ++j) {
      auto& comms = pipe_comms[{b, j}] = collective::make_in_process_group(mesh.pp);
      std::vector<strategy::PipelineStage> stages;
      std::vector<collective::Communicator*> group;
      for (int s = 0; s < mesh.pp; ++s) {
        const auto it = tensor_groups.find({b, s});
        stages.push_back(
            make_stage(mesh, s, j, it == tensor_groups.end() ? nullptr : it->second.get(), dev(b, j, s), w));
        group.push_back(comms[static_cast<std::size_t>(s)].get());
      }
      runners[{b, j}] = std::make_unique<strategy::PipelineRunner>(
          std::move(stages),
          strategy::PipelineConfig{.stages = mesh.pp, .microbatches = microbatches, .schedule = schedule}, group);
    }
  }
  Run run;
  const std::int64_t shard = kBatch / mesh.dp, rows = shard / microbatches;
  for (int step = 0; step <= steps; ++step) {
    // The last round evaluates: batch(-1)'s loss, its gradients not applied.
    const bool evaluate = step == steps;
    const auto [x, y] = batch(evaluate ? -1 : step);
    std::map<std::pair<int, int>, strategy::PipelineStepResult> results;
    std::vector<std::thread> threads;
    std::mutex mutex;
    for (auto& [key, runner] : runners) {
      threads.emplace_back([&, key = key, r = runner.get()] {
        std::vector<std::vector<Tensor>> mbs;
        for (int m = 0; m < microbatches; ++m) mbs.push_back(microbatch(x, y, key.first * shard + m * rows, rows));
        auto result = r->step(mbs);
        std::lock_guard lock(mutex);
        results[key] = std::move(result);
      });
    }
    for (auto& t : threads) t.join();
    double loss = 0;
    for (int b = 0; b < mesh.dp; ++b) loss += results[{b, 0}].loss();
    if (evaluate) {
      run.evaluation = loss;
      break;
    }
    run.losses.push_back(loss);
    // Data parallelism: each (tensor rank, stage)'s gradients summed over the data replicas, then
    // the same SGD step on every replica.
    for (int j = 0; j < mesh.tp; ++j) {
      for (int s = 0; s < mesh.pp; ++s) {
        auto& comms = data_comms[{j, s}];
        std::vector<std::thread> reducers;
        for (int b = 0; b < mesh.dp; ++b) {
          reducers.emplace_back([&, b] {
            auto& grads = results[{b, j}].gradients[static_cast<std::size_t>(s)];
            if (mesh.dp > 1) comms[static_cast<std::size_t>(b)]->all_reduce(grads, collective::ReduceOp::kSum);
            sgd(runners[{b, j}]->stages()[static_cast<std::size_t>(s)].values, grads);
          });
        }
        for (auto& t : reducers) t.join();
      }
    }
  }
  // The whole weights from data replica 0: pieces of fc1 and fc2 put back together.
  const auto value = [&](int j, int s, std::size_t k) {
    return runners[{0, j}]->stages()[static_cast<std::size_t>(s)].values[k].to_vector<float>();
  };
  const int last = mesh.pp - 1;
  run.weights.assign(8, {});
  run.weights[0] = value(0, 0, 0);
  run.weights[1] = value(0, 0, 1);
  for (std::int64_t row = 0; row < kIn; ++row) {
    for (int j = 0; j < mesh.tp; ++j) {
      const auto k = value(j, 0, 2);
      const std::int64_t piece = kWide / mesh.tp;
      run.weights[2].insert(run.weights[2].end(), k.begin() + row * piece, k.begin() + (row + 1) * piece);
    }
  }
  for (int j = 0; j < mesh.tp; ++j) {
    const auto b1 = value(j, 0, 3), k2 = value(j, 0, 4);
    run.weights[3].insert(run.weights[3].end(), b1.begin(), b1.end());
    run.weights[4].insert(run.weights[4].end(), k2.begin(), k2.end());
  }
  run.weights[5] = value(0, 0, 5);
  const std::size_t head = mesh.pp == 1 ? 6 : 0;
  run.weights[6] = value(0, last, head);
  run.weights[7] = value(0, last, head + 1);
  // The pieces as a checkpoint holds them: each stage's variables with their offsets; a variable
  // every tensor rank holds whole, from rank 0 only.
  const std::int64_t piece = kWide / mesh.tp;
  for (int s = 0; s < mesh.pp; ++s) {
    for (int j = 0; j < mesh.tp; ++j) {
      const auto& values = runners[{0, j}]->stages()[static_cast<std::size_t>(s)].values;
      for (std::size_t k = 0; k < values.size(); ++k) {
        const std::size_t n = s == 0 ? k : (mesh.pp == 1 ? k : k + 6);
        std::vector<std::int64_t> offsets(static_cast<std::size_t>(values[k].shape().rank()), 0);
        if (n == 2) offsets[1] = j * piece;
        if (n == 3 || n == 4) offsets[0] = j * piece;
        if (n != 2 && n != 3 && n != 4 && j > 0) continue;
        run.blocks.push_back({.name = kNames[n], .offsets = offsets, .piece = values[k]});
      }
    }
  }
  return run;
}

void check_equivalent(const Run& got, const Run& want) {
  REQUIRE(got.losses.size() == want.losses.size());
  for (std::size_t s = 0; s < got.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(std::abs(got.losses[s] - want.losses[s]) <= 1e-5 * std::abs(want.losses[s]));
  }
  for (std::size_t k = 0; k < want.weights.size(); ++k) {
    REQUIRE(got.weights[k].size() == want.weights[k].size());
    for (std::size_t i = 0; i < got.weights[k].size(); ++i) {
      const double a = got.weights[k][i], b = want.weights[k][i];
      if (std::abs(a - b) > 1e-5 * std::max(1e-2, std::abs(b))) {
        FAIL_CHECK("weight " << k << "[" << i << "]: " << a << " vs " << b);
        return;
      }
    }
  }
}

std::string testing_error(const keras::CheckpointContents& contents, const std::string& path) {
  try {
    keras::save_checkpoint_directory(strategy::get_strategy(), path, contents);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("DP2xTP2, TP2xPP2 and PP2xDP2 on 4 devices train as one device, bitwise the same run to run") {
  constexpr int kSteps = 50;
  const Run one = train({}, 1, strategy::PipelineSchedule::k1F1B, kSteps);
  CHECK(one.losses.back() < 0.5 * one.losses.front());  // it trains
  struct Case {
    std::string name;
    Mesh mesh;
    int microbatches;
    strategy::PipelineSchedule schedule;
  };
  for (const Case& c : {Case{"DP2xTP2", {.dp = 2, .tp = 2}, 1, strategy::PipelineSchedule::k1F1B},
                        Case{"TP2xPP2 1F1B", {.tp = 2, .pp = 2}, 4, strategy::PipelineSchedule::k1F1B},
                        Case{"TP2xPP2 GPipe", {.tp = 2, .pp = 2}, 4, strategy::PipelineSchedule::kGPipe},
                        Case{"PP2xDP2", {.dp = 2, .pp = 2}, 4, strategy::PipelineSchedule::k1F1B}}) {
    CAPTURE(c.name);
    REQUIRE(c.mesh.size() == 4);
    const Run got = train(c.mesh, c.microbatches, c.schedule, kSteps);
    check_equivalent(got, one);
    const Run again = train(c.mesh, c.microbatches, c.schedule, kSteps);
    CHECK(again.losses == got.losses);
    CHECK(again.weights == got.weights);
  }
}

TEST_CASE("a checkpoint saved under TP2xPP2 as its pieces loads on one device and evaluates to the same loss") {
  const Run tp_pp = train({.tp = 2, .pp = 2}, 4, strategy::PipelineSchedule::k1F1B, 20);
  keras::CheckpointContents contents;
  for (std::size_t n = 0; n < kNames.size(); ++n) {
    Shape shape;
    if (n % 2 == 0) {
      const std::int64_t rows[] = {kIn, kIn, kWide, kIn}, cols[] = {kIn, kWide, kIn, 1};
      shape = {rows[n / 2], cols[n / 2]};
    } else {
      const std::int64_t sizes[] = {kIn, kWide, kIn, 1};
      shape = {sizes[n / 2]};
    }
    contents.block_tensors.push_back({kNames[n], {kFloat32, shape}});
  }
  contents.blocks = tp_pp.blocks;
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("tandem-hybrid-{}", ::getpid());
  std::filesystem::remove_all(dir);
  keras::save_checkpoint_directory(strategy::get_strategy(), dir.string(), contents);
  // fc1's kernel is split by columns: one chunk per row of each piece (8 x 2), the rest whole or
  // split by rows: one chunk per piece.
  const keras::CheckpointReader reader(dir.string());
  std::vector<std::vector<float>> loaded;
  for (const auto& name : kNames) loaded.push_back(reader.read(name).to_vector<float>());
  CHECK(loaded == tp_pp.weights);
  // One device, the loaded weights, no training: the same loss on a batch it never saw.
  const Run one = train({}, 1, strategy::PipelineSchedule::k1F1B, 0, loaded);
  CHECK(std::abs(one.evaluation - tp_pp.evaluation) <= 1e-6 * std::abs(tp_pp.evaluation));
  // Pieces that do not tile a tensor fail the save, naming it.
  contents.blocks.pop_back();
  const std::string message = testing_error(contents, dir.string() + "-bad");
  CHECK(message.find("head/bias") != std::string::npos);
  std::filesystem::remove_all(dir);
}
