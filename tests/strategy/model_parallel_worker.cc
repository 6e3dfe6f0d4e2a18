// model_parallel_worker — one rank of a 2-process model-parallel job, for
// tests/strategy/model_parallel_processes.sh:
//   --mode tensor    TP=2: this process holds tensor rank R of the MLP's fc1/fc2 pair (one batch)
//   --mode pipeline  PP=2: this process holds stage R, 4 micro-batches under 1F1B
// Under tandem-run each process takes its rank R from the launcher: MultiWorkerMirroredStrategy on
// its CPU:0 gives the job's communicator (shared memory between processes of one machine), which
// carries the all-reduces of Megatron's f and g or the stages' send/recv. With --reference one
// process runs both ranks on 2 threads over an in-process group instead. Each rank writes
// OUT/rank-R.txt: every step's loss (where it has one) and its final weights as hexadecimal floats,
// so that the two runs compare bitwise (hybrid_parallel_test checks the in-process run against
// one device).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <thread>

#include "parallel_mlp.h"
#include "tandem/collective/in_process.h"
#include "tandem/devices/device.h"
#include "tandem/strategy/multi_worker.h"
#include "tandem/strategy/variable.h"

using namespace tandem;
using namespace tandem::testing::parallel_mlp;

namespace {

void run_rank(const std::string& mode, int rank, collective::Communicator& comm, devices::Device& device, int steps,
              const std::string& path) {
  const auto w = initial_weights();
  Mesh mesh;
  int microbatches = 1;
  std::shared_ptr<tp::Group> group;
  auto solo = collective::make_in_process_group(1);
  std::unique_ptr<strategy::PipelineRunner> runner;
  std::vector<strategy::PipelineStage> stages;
  if (mode == "tensor") {
    mesh.tp = 2;
    group = tp::Group::create({&device}, {&comm});
    stages.push_back(make_stage(mesh, 0, rank, group.get(), device, w));
    runner = std::make_unique<strategy::PipelineRunner>(std::move(stages), strategy::PipelineConfig{.stages = 1},
                                                        std::vector{solo[0].get()});
  } else {
    mesh.pp = 2;
    microbatches = 4;
    stages.push_back(make_stage(mesh, rank, 0, nullptr, device, w));
    runner = std::make_unique<strategy::PipelineRunner>(
        std::move(stages), strategy::PipelineConfig{.stages = 2, .microbatches = microbatches}, std::vector{&comm});
  }
  FILE* out = std::fopen(path.c_str(), "w");
  TANDEM_REQUIRE(out != nullptr, Unavailable, "cannot write {}", path);
  const std::int64_t rows = kBatch / microbatches;
  for (int step = 0; step < steps; ++step) {
    const auto [x, y] = batch(step);
    std::vector<std::vector<Tensor>> mbs;
    for (int m = 0; m < microbatches; ++m) mbs.push_back(microbatch(x, y, m * rows, rows));
    const auto result = runner->step(mbs);
    if (result.has_loss) std::fprintf(out, "loss %d %a\n", step, result.loss());
    sgd(runner->stages()[0].values, result.gradients[0]);
  }
  for (const auto& value : runner->stages()[0].values) {
    std::fprintf(out, "weight");
    for (const float v : value.to_vector<float>()) std::fprintf(out, " %a", static_cast<double>(v));
    std::fprintf(out, "\n");
  }
  std::fclose(out);
}

}  // namespace

int main(int argc, char** argv) try {
  std::string mode = "tensor", out;
  int steps = 20;
  bool reference = false;
  CLI::App app("model_parallel_worker: one rank of a 2-process tensor- or pipeline-parallel MLP");
  app.add_option("--mode", mode, "tensor or pipeline")->check(CLI::IsMember({"tensor", "pipeline"}));
  app.add_option("--steps", steps, "training steps")->capture_default_str();
  app.add_option("--out", out, "folder for rank-R.txt")->required();
  app.add_flag("--reference", reference, "both ranks in this process, over an in-process group");
  CLI11_PARSE(app, argc, argv);
  std::filesystem::create_directories(out);
  if (reference) {
    devices::set_logical_device_configuration({.num_cpu_devices = 2});
    auto comms = collective::make_in_process_group(2);
    std::thread other([&] { run_rank(mode, 1, *comms[1], devices::get_device("CPU:1"), steps, out + "/rank-1.txt"); });
    run_rank(mode, 0, *comms[0], devices::get_device("CPU:0"), steps, out + "/rank-0.txt");
    other.join();
    return 0;
  }
  strategy::MultiWorkerOptions options;
  options.local_devices = {"CPU:0"};
  options.communication_options.timeout_seconds = 60;
  strategy::MultiWorkerMirroredStrategy job(options);
  TANDEM_REQUIRE(job.num_workers() == 2, InvalidArgument, "model_parallel_worker: {} workers; run it with 2",
                 job.num_workers());
  run_rank(mode, job.worker_rank(), job.communicator(0), devices::get_device("CPU:0"), steps,
           fmt::format("{}/rank-{}.txt", out, job.worker_rank()));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "model_parallel_worker: %s\n", e.what());
  return 1;
}
