// bench_fit: one epoch of Fashion-MNIST training (Adam, batch 128) for the three models of
// bench/peers/torch_fmnist.py and tf_fmnist.py, beside those scripts run in the same invocation.
//
//   build/bench/bench_fit [--models mlp,wide,cnn] [--epochs 1] [--threads N] [--repeat R] [--no-peer]
//                         [--python VENV/bin/python] [--install-peers]
//   build/bench/bench_fit --strategy mirrored [--replicas 2] [--models mlp,wide] [--repeat R]
//   build/bench/bench_fit --strategy multiworker [--models mlp,wide] [--repeat R]
//   build/bench/bench_fit --strategy mirrored --zero 0,1,2 [--replicas 2] [--models mlp,wide] [--repeat R]
//   build/bench/bench_fit --device gpu [--models mlp,wide,cnn] [--data DIR] [--gpu-peer-command CMD] [--no-peer]
//   build/bench/bench_fit --seeds 5 [--seed 0] [--models wide] [--strategy one|mirrored|multiworker]
//
// The one-device table ends with each model's training loop in GFLOP/s (samples/s x the step's
// product FLOPs per sample), for tandem and the fastest peer, as a share of the sgemm ceiling
// (bench/sgemm_ceiling.h, bench_ops' ceiling) measured before each tandem run of the invocation.
//
// --seeds N times nothing: it trains from each of N seeds (--seed, --seed + 1, ...) on every side
// of --strategy's table and prints the test accuracies, their means and standard deviations. A
// seed sets every side's initial weights and data order; --seed alone does so for the timed runs.
//
// --device gpu trains on GPU:0 (OneDeviceStrategy) in float32 and under mixed_bfloat16, beside
// scripts/torch_fmnist_gpu.py (PyTorch eager on the same GPU, float32 and bf16 autocast) run in
// the same invocation, and prints the ratios, with and without CUDA graphs.
//
// --strategy multiworker starts this program again as two worker processes of one intra-op
// thread each on 127.0.0.1 (TF_CONFIG set as tandem-run sets it), training under
// MultiWorkerMirroredStrategy (global batch 128 = 64 per worker), beside the same DDP peer and
// bench/peers/tf_mwms2.sh (Keras 3 under MultiWorkerMirroredStrategy, two worker processes of one
// intra-op thread on 127.0.0.1): the same shape of job on every side. tandem runs twice: as it
// chooses (AUTO: shared memory between workers of one machine) and with Gloo's ring over TCP
// (kRing), the DDP peer's transport.
//
// --strategy mirrored trains under MirroredStrategy on --replicas logical CPU devices of one
// intra-op thread each, beside bench/peers/torch_ddp2.sh (PyTorch DDP over Gloo, two processes of
// one thread, global batch 128) and tf_fmnist.py --strategy mirrored (Keras 3's MirroredStrategy
// over --replicas logical CPU devices of one process, which share TensorFlow's thread pools). It
// trains with the all-reduce overlapped with backward and with it after backward (tandem's column
// is the one MirroredStrategy() chooses, Strategy::overlaps_communication), and times the
// all-reduce of the model's gradient buckets alone, to show how much of the all-reduce the overlap
// hides. Each run reports (Model::training_times) how long replica 0 waited for the gradient
// all-reduce after its backward pass: all of the all-reduce without overlap, the unhidden rest with
// it; hidden = 1 - wait with overlap / wait without.
//
// --strategy mirrored --zero 0,1,2 trains the same MirroredStrategy at each ZeRO stage listed
// (DistributionOptions::zero) and prints, per stage, samples/s and its ratio to stage 0
// (unsharded data parallelism), the CPU time per step and replica 0's time after its backward,
// the bytes per replica device of weights, gradients and optimizer slots (what the stage
// shards), and the device's peak allocator bytes; beside it the DDP peer with PyTorch's
// ZeroRedundancyOptimizer (its ZeRO stage 1), run with --python.
//
// The machines we measure on are shared VMs whose speed drifts by tens of percent over minutes;
// --repeat R interleaves R runs of tandem and of each peer variant and reports the medians.
//
// Both sides time the training loop only (data already decoded in memory), over the same
// 468 full batches of 128 per epoch (the peer drops the last partial batch; so do we here), and
// report test accuracy after training. The peers come from a virtual environment with PyTorch 2.15
// and TensorFlow 2.21 (--python; --install-peers makes it), never from the project's dependencies:
// PyTorch eager with tandem's thread count, and Keras 3 on TensorFlow with oneDNN on, as it comes
// and in its fastest configuration found here (XLA, steps_per_execution 32). Each peer runs 20
// untimed warm-up steps first. The DDP peers use the same PyTorch. The mirrored and multiworker
// tables end, like the one-device table, with tandem's samples/s over the fastest peer's.
#include <tandem/keras_like/keras.h>

#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "machine_info.h"
#include "sgemm_ceiling.h"
#include "tandem/ops/cpu/gemm.h"
#include "tandem/ops/cuda/cudnn.h"

namespace {

using namespace tandem;
using Clock = std::chrono::steady_clock;

constexpr std::int64_t kBatch = 128;
// The OpenBLAS kernel set for the fair peer run: what tandem's loader picks on AVX-512 machines.
constexpr const char* kPeerCoreType = "Cooperlake";

// $TANDEM_PEERS_VENV/bin/python, else ~/peers-venv/bin/python (bench/README.md's install).
std::string peers_python_default() {
  if (const char* venv = std::getenv("TANDEM_PEERS_VENV")) return std::string(venv) + "/bin/python";
  const char* home = std::getenv("HOME");
  return std::string(home ? home : "/root") + "/peers-venv/bin/python";
}

struct Options {
  std::vector<std::string> models{"mlp", "wide", "cnn"};
  int epochs = 1;
  int threads = 0;  // 0: all usable cores
  int repeat = 1;   // runs of each side, interleaved; the table shows medians
  bool peer = true;
  bool install_peers = false;
  std::string peer_script = TANDEM_BENCH_PEER_DIR "/torch_fmnist.py";
  std::string tf_script = TANDEM_BENCH_PEER_DIR "/tf_fmnist.py";
  std::string strategy = "one";  // or "mirrored", "multiworker"
  int replicas = 2;              // logical CPU devices under --strategy mirrored
  std::string worker_model;      // set in the worker processes of --strategy multiworker
  bool worker_ring = false;      // those workers use Gloo (RING) instead of the default (shared memory here)
  bool worker_overlap = false;   // those workers set overlap_communication = true (not the default's choice)
  std::vector<int> zero;         // ZeRO stages to compare under --strategy mirrored
  int seed = 0;                  // every run's seed: tandem's global seed and the peers' --seed
  int seeds = 0;                 // > 0: test accuracy over the seeds seed .. seed + seeds - 1, no timing
  bool lockstep = false;         // tandem and Keras 3 step by step from the same weights and batches
  // The peers' Python: a virtual environment with torch 2.15 and tensorflow-cpu 2.21 (found, or
  // made with --install-peers); never a project dependency.
  std::string python = peers_python_default();
  std::string device = "cpu";    // or "gpu"
  std::string data_dir = data::kDebianFashionMnistDir;
  // How to start the GPU peer (a command prefix: gpu_check.sh adds the environment PyTorch needs).
  std::string gpu_peer_command = "python3 " TANDEM_BENCH_PEER_DIR "/../../scripts/torch_fmnist_gpu.py";
};

// The command line, declared on app: parsing it fills o.
void add_options(CLI::App& app, Options& o) {
  app.add_option("--models", o.models,
                 "models to train: mlp, wide, cnn (default: all; mlp,wide under "
                 "--strategy mirrored or multiworker)")
      ->delimiter(',')
      ->check(CLI::IsMember({"mlp", "wide", "cnn"}));
  app.add_option("--strategy", o.strategy,
                 "one (OneDeviceStrategy), mirrored (MirroredStrategy on --replicas "
                 "logical CPU devices) or multiworker (two worker processes)")
      ->capture_default_str()
      ->check(CLI::IsMember({"one", "mirrored", "multiworker"}));
  app.add_option("--replicas", o.replicas, "logical CPU devices under --strategy mirrored")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--epochs", o.epochs, "epochs of each run")->capture_default_str()->check(CLI::Range(1, 1000));
  app.add_option("--threads", o.threads, "intra-op threads (0: every usable core)")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  app.add_option("--repeat", o.repeat, "runs of each side, interleaved; the table shows medians")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_flag("--peer,!--no-peer", o.peer, "run the PyTorch peer beside tandem (--no-peer: tandem only)");
  app.add_option("--seed", o.seed, "the seed of every run (tandem's global seed, the peers' --seed)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 30));
  app.add_option("--seeds", o.seeds,
                 "instead of timing: test accuracy after training with N seeds (--seed, --seed + 1, ...), per\n"
                 "seed, their mean and standard deviation, for tandem and the peers of --strategy")
      ->check(CLI::Range(1, 1000));
  app.add_flag("--lockstep", o.lockstep,
               "instead of timing: one epoch in tandem and in Keras 3 (tf_fmnist.py --lockstep) from the same\n"
               "initial weights (Keras's, then tandem's) and batches, compared step by step");
  app.add_option("--zero", o.zero,
                 "under --strategy mirrored: ZeRO stages to compare (e.g. 0,1,2), in a table of their own")
      ->delimiter(',')
      ->check(CLI::Range(0, 3));
  app.add_option("--python", o.python,
                 "the peers' Python: a virtual environment with torch 2.15 and tensorflow-cpu 2.21\n(default: "
                 "$TANDEM_PEERS_VENV/bin/python, else ~/peers-venv/bin/python)")
      ->capture_default_str();
  app.add_flag("--install-peers", o.install_peers,
               "create the --python virtual environment and pip install torch==2.15.0\ntensorflow-cpu==2.21.0 "
               "into it first (about 7 GB), then run");
  app.add_option("--device", o.device, "cpu, or gpu (GPU:0, float32 and mixed_bfloat16, beside PyTorch eager)")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "gpu"}));
  app.add_option("--data", o.data_dir, "Fashion-MNIST's folder")->capture_default_str();
  app.add_option("--gpu-peer-command", o.gpu_peer_command, "how to start the GPU peer (a command prefix)")
      ->capture_default_str();
  app.add_option("--peer-script", o.peer_script, "the CPU peer's script")->capture_default_str();
  // Internal: how --strategy multiworker starts its worker processes.
  app.add_option("--multiworker-worker", o.worker_model)->group("");
  app.add_flag("--multiworker-ring", o.worker_ring)->group("");  // those workers use kRing, not shared memory
  app.add_flag("--multiworker-overlap", o.worker_overlap)->group("");  // ... and overlap_communication = true
}

keras::Model build(const std::string& kind) {
  using namespace keras;
  if (kind == "mlp") return Sequential({Input({28, 28}), Flatten(), Dense(128, "relu"), Dense(10)});
  if (kind == "wide") {
    return Sequential({Input({28, 28}), Flatten(), Dense(1024, "relu"), Dense(1024, "relu"), Dense(10)});
  }
  TANDEM_REQUIRE(kind == "cnn", InvalidArgument, "unknown model \"{}\" (mlp, wide, cnn)", kind);
  return Sequential({Input({28, 28}), Reshape({28, 28, 1}), Conv2D(32, {3, 3}, "relu"), MaxPooling2D(),
                     Conv2D(64, {3, 3}, "relu"), MaxPooling2D(), Flatten(), Dense(128, "relu"), Dense(10)});
}

// FLOPs of one training step per sample of build(kind)'s model (a multiply-add counts 2): each
// Dense and Conv2D layer's forward product, its kernel gradient and, except for the first layer
// (the data needs no gradient), its input gradient. Bias, activations, pooling, the loss and Adam
// are left out: these are the products an sgemm ceiling bounds.
double training_flops_per_sample(const std::string& kind) {
  std::vector<double> forward;  // each layer's forward FLOPs per sample, input side first
  if (kind == "mlp") {
    forward = {2.0 * 784 * 128, 2.0 * 128 * 10};
  } else if (kind == "wide") {
    forward = {2.0 * 784 * 1024, 2.0 * 1024 * 1024, 2.0 * 1024 * 10};
  } else {  // cnn: 3x3 valid convolutions 28x28x1 -> 26x26x32 and 13x13x32 -> 11x11x64, then 1600 -> 128 -> 10
    forward = {2.0 * 26 * 26 * 9 * 32, 2.0 * 11 * 11 * 9 * 32 * 64, 2.0 * 1600 * 128, 2.0 * 128 * 10};
  }
  double flops = 0;
  for (std::size_t i = 0; i < forward.size(); ++i) flops += (i == 0 ? 2 : 3) * forward[i];
  return flops;
}

struct Result {
  double samples_per_s = 0;
  double test_accuracy = 0;
  keras::TrainingTimes times;  // tandem only
  double cpu_seconds = 0;      // tandem only: the process's CPU time during fit (every thread)
};

// The process's CPU time so far: on a shared machine it drifts less than wall time.
double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// One training run of o.epochs from o.seed; under `strategy` (its scope) when given, else the
// default strategy. `trained`: where to leave the model after the run (its weights and slots), when given.
Result run_tandem(const std::string& kind, const data::ImageClassificationData& data, const Options& o,
                  Strategy* strategy = nullptr, const char* policy = "float32", bool cuda_graphs = true,
                  keras::Model* trained = nullptr) {
  const int epochs = o.epochs;
  set_global_seed(static_cast<std::uint64_t>(o.seed));
  keras::mixed_precision::PolicyScope policy_scope(policy);
  const auto make = [&] {
    auto model = build(kind);
    model.compile(keras::Adam{.epsilon = 1e-7}, keras::SparseCategoricalCrossentropy{.from_logits = true}, {"accuracy"},
                  {.cuda_graphs = cuda_graphs});
    return model;
  };
  keras::Model model;
  if (strategy != nullptr) {
    auto scope = strategy->scope();
    model = make();
  } else {
    model = make();
  }
  auto train = data.train.shuffle(60000).batch(kBatch, /*drop_remainder=*/true);
  const auto start = Clock::now();
  const double cpu_start = process_cpu_seconds();
  model.fit(train, {.epochs = epochs, .verbose = 0});
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const double cpu_seconds = process_cpu_seconds() - cpu_start;
  const auto times = model.training_times();
  const double samples = static_cast<double>(epochs) * static_cast<double>(60000 / kBatch * kBatch);
  const auto test = model.evaluate(data.test.batch(1000), {.verbose = 0});
  if (trained != nullptr) *trained = model;
  return {samples / seconds, test.at("accuracy"), times, cpu_seconds};
}

// Runs a peer's command line and reads its "samples_per_s=" and "test_acc=" fields.
std::optional<Result> run_peer_command(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  std::string output;
  char buffer[4096];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) output += buffer;
  const int status = pclose(pipe);
  const auto field = [&](const std::string& name) -> std::optional<double> {
    const auto at = output.find(name + "=");
    if (at == std::string::npos) return std::nullopt;
    return std::stod(output.substr(at + name.size() + 1));
  };
  const auto sps = field("samples_per_s");
  const auto acc = field("test_acc");
  if (status != 0 || !sps || !acc) {
    std::fprintf(stderr, "peer did not run (%s):\n%s\n", command.c_str(), output.c_str());
    return std::nullopt;
  }
  return Result{*sps, *acc, {}};
}

// Untimed steps each peer runs before its timed epoch (tracing, first-touch allocations), as
// tandem's fit needs none: its first step is as fast as the rest.
constexpr int kPeerWarmupSteps = 20;

// bench/peers/torch_fmnist.py (PyTorch eager) with `python`, in one process of `threads` threads,
// and `extra` flags: "--compile" for torch.compile (its warm-up steps compile; the script exits 3,
// saying why, when torch.compile cannot run here).
std::optional<Result> run_torch_peer(const Options& o, const std::string& python, const std::string& kind, int threads,
                                     const std::string& extra = "") {
  return run_peer_command(
      fmt::format("{} {} --model {} --epochs {} --batch {} --threads {} --warmup-steps {} --seed {} {} 2>&1", python,
                  o.peer_script, kind, o.epochs, kBatch, threads, kPeerWarmupSteps, o.seed, extra));
}

// The environment every TensorFlow peer runs in: oneDNN's kernels on (off by default on AMD CPUs),
// TensorFlow's start-up notices off.
constexpr const char* kTfEnvironment = "TF_ENABLE_ONEDNN_OPTS=1 TF_CPP_MIN_LOG_LEVEL=2";

// bench/peers/tf_fmnist.py (Keras 3 on TensorFlow) with oneDNN on, and `extra` flags: one device,
// or --strategy mirrored.
std::optional<Result> run_tf_peer(const Options& o, const std::string& kind, const std::string& extra) {
  return run_peer_command(fmt::format("{} {} {} --model {} --epochs {} --batch {} --warmup-steps {} --seed {} {} 2>&1",
                                      kTfEnvironment, o.python, o.tf_script, kind, o.epochs, kBatch, kPeerWarmupSteps,
                                      o.seed, extra));
}

// bench/peers/tf_mwms2.sh: Keras 3 under MultiWorkerMirroredStrategy, two worker processes of one
// intra-op thread on 127.0.0.1 (ports `port` and `port` + 1), global batch kBatch.
std::optional<Result> run_tf_multiworker_peer(const Options& o, const std::string& kind, int port) {
  return run_peer_command(fmt::format(
      "{} PYTHON={} bash {}/tf_mwms2.sh {} {} --epochs {} --batch {} --warmup-steps {} --seed {} 2>&1", kTfEnvironment,
      o.python, TANDEM_BENCH_PEER_DIR, kind, port, o.epochs, kBatch, kPeerWarmupSteps, o.seed));
}

// --install-peers: the virtual environment of --python, made and filled with pip.
void install_peers(const Options& o) {
  const std::string venv = o.python.substr(0, o.python.rfind("/bin/python"));
  const std::string command =
      fmt::format("python3 -m venv {0} && {0}/bin/pip install -q torch==2.15.0 tensorflow-cpu==2.21.0", venv);
  std::printf("installing the peers: %s\n", command.c_str());
  TANDEM_REQUIRE(std::system(command.c_str()) == 0, Unavailable, "--install-peers: \"{}\" failed", command);
}

// The version of `module` (torch, tensorflow) in `python`, or "missing".
std::string peer_version(const std::string& python, const std::string& module) {
  FILE* pipe = popen(fmt::format("{0} -c 'import {1}; print({1}.__version__)' 2>/dev/null", python, module).c_str(), "r");
  if (pipe == nullptr) return "missing";
  char buffer[256] = {};
  const bool read = std::fgets(buffer, sizeof buffer, pipe) != nullptr;
  const int status = pclose(pipe);
  if (!read || status != 0) return "missing";
  std::string version(buffer);
  while (!version.empty() && (version.back() == '\n' || version.back() == '\r')) version.pop_back();
  return version;
}

// Milliseconds per step of the gradient all-reduce alone: the model's gradients handed to the
// strategy's GradientReducer as a backward pass hands them (last layer first, through the
// executor's observer interface), so that it buckets, overlaps and reduces exactly as in fit; no
// kernels run, on every replica of `strategy`.
double allreduce_ms_per_step(Strategy& mirrored, const std::string& kind, int steps) {
  Graph graph;
  std::vector<strategy::GradientSource> sources;
  {
    auto scope = mirrored.scope();
    for (const auto& w : build(kind).trainable_weights()) sources.push_back({w, {}});
  }
  // Backward computes the last layer's gradients first: their nodes come first.
  for (std::size_t k = sources.size(); k-- > 0;) {
    sources[k].gradient = graph.placeholder(sources[k].variable->dtype(), sources[k].variable->shape(), "gradient");
  }
  std::vector<std::vector<Tensor>> grads(mirrored.replica_devices().size());  // per replica, per gradient
  for (std::size_t r = 0; r < grads.size(); ++r) {
    for (const auto& source : sources) {
      const auto& w = source.variable;
      grads[r].push_back(Tensor::zeros(w->shape(), w->dtype(), *mirrored.replica_devices()[r]));
    }
  }
  std::vector<int> nodes;
  for (const auto& source : sources) nodes.push_back(source.gradient.node);
  const auto reducer = mirrored.make_gradient_reducer(std::move(sources));
  const auto step = [&] {
    mirrored.run([&](strategy::ReplicaContext& ctx) {
      const int r = ctx.replica_id_in_sync_group();
      reducer->begin_step(r, strategy::StepKind::kReduce);
      for (std::size_t k = nodes.size(); k-- > 0;) {
        Tensor* value = &grads[static_cast<std::size_t>(r)][k];
        reducer->observer(r)->node_done(nodes[k], {&value, 1});
      }
      reducer->finish_step(r);
    });
  };
  step();  // warm-up
  const auto start = Clock::now();
  for (int i = 0; i < steps; ++i) step();
  return 1e3 * std::chrono::duration<double>(Clock::now() - start).count() / steps;
}

// PyTorch DDP over Gloo, two processes of one thread (bench/peers/torch_ddp2.sh).
std::optional<Result> run_ddp_peer(const Options& o, const std::string& kind, const std::string& env) {
  return run_peer_command(fmt::format("{} PYTHON={} bash {}/torch_ddp2.sh {} 29511 --warmup-steps {} --seed {} 2>&1",
                                      env, o.python, TANDEM_BENCH_PEER_DIR, kind, kPeerWarmupSteps, o.seed));
}

// tandem's two workers of --strategy multiworker (this program again, one intra-op thread each,
// TF_CONFIG set as tandem-run sets it, on ports `port` and `port` + 1); the chief's report.
// `ring`: Gloo's ring over TCP instead of the default (shared memory between workers of one machine);
// `overlap`: overlap_communication = true instead of the default's choice.
std::optional<Result> run_tandem_workers(const Options& o, const std::string& kind, bool ring, int port,
                                         bool overlap = false) {
  const auto worker = [&](int rank) {
    return fmt::format(
        "TANDEM_INTRA_OP_THREADS=1 TF_CONFIG='{{\"cluster\":{{\"worker\":[\"127.0.0.1:{}\",\"127.0.0.1:{}\"]}},"
        "\"task\":{{\"type\":\"worker\",\"index\":{}}}}}' /proc/{}/exe --multiworker-worker {} --epochs {} --seed {}{}{}",
        port, port + 1, rank, getpid(), kind, o.epochs, o.seed, ring ? " --multiworker-ring" : "",
        overlap ? " --multiworker-overlap" : "");
  };
  return run_peer_command(fmt::format("{} >/dev/null 2>&1 & {} 2>&1; wait", worker(1), worker(0)));
}

std::optional<Result> median(std::vector<Result> runs) {
  if (runs.empty()) return std::nullopt;
  std::sort(runs.begin(), runs.end(),
            [](const Result& a, const Result& b) { return a.samples_per_s < b.samples_per_s; });
  return runs[runs.size() / 2];
}

// The first ports of the two-worker jobs on 127.0.0.1 (each job takes the next two).
constexpr int kTandemWorkersPort = 29620;
constexpr int kTfWorkersPort = 23456;

// The fastest of `peers`' median samples/s, 0 when none ran: what "vs best" divides by.
double best_peer(std::initializer_list<std::optional<Result>> peers) {
  double best = 0;
  for (const auto& p : peers) {
    if (p) best = std::max(best, p->samples_per_s);
  }
  return best;
}

// A "vs best" cell: `samples_per_s` over the fastest peer's, or "-" when no peer ran.
std::string vs_best_cell(double samples_per_s, double best) {
  return best > 0 ? fmt::format("{:>8.2f}x", samples_per_s / best) : fmt::format("{:>9}", "-");
}

// One model's row of print_ceiling_table: samples/s of tandem's training loop, of its steps alone
// (Model::training_times), and of the fastest peer's loop.
struct CeilingRow {
  std::string kind;
  double loop = 0, steps = 0, peer = 0;
};

// The training loops' GFLOP/s (samples/s x training_flops_per_sample) as a share of the sgemm
// ceiling measured in the same invocation: the whole loop's time counts (data, element-wise ops,
// Adam, the first step's graph building), so the share is a lower bound on the products' own;
// "steps" counts only the steps' own time (Model::training_times().step_seconds).
void print_ceiling_table(const bench::SgemmCeiling& ceiling, int threads, const std::vector<CeilingRow>& rows) {
  std::printf(
      "\nThe training loop against this run's sgemm ceiling, %.1f GFLOP/s (%s, %lld^3, %d thread(s);\n"
      "the best of one measurement before each tandem run). GFLOP/s = samples/s x the step's product\n"
      "FLOPs per sample: the forward, kernel-gradient and (past the first layer) input-gradient products\n"
      "of each Dense and Conv2D layer.\n",
      ceiling.gflops, ceiling.which.c_str(), static_cast<long long>(bench::kCeilingSquare), threads);
  std::printf("%-6s | %12s | %11s %7s | %11s %7s | %11s %7s\n", "model", "MFLOP/sample", "loop GFLOP", "ceiling",
              "steps GFLOP", "ceiling", "peer GFLOP", "ceiling");
  std::printf("%s\n", std::string(84, '-').c_str());
  const auto cells = [&](double samples_per_s, double flops) {
    if (samples_per_s <= 0) return fmt::format("{:>11} {:>7}", "-", "-");
    const double gf = samples_per_s * flops / 1e9;
    return fmt::format("{:>11.1f} {:>7.2f}", gf, gf / ceiling.gflops);
  };
  for (const auto& row : rows) {
    const double flops = training_flops_per_sample(row.kind);
    std::printf("%-6s | %12.2f | %s | %s | %s\n", row.kind.c_str(), flops / 1e6, cells(row.loop, flops).c_str(),
                cells(row.steps, flops).c_str(), cells(row.peer, flops).c_str());
  }
  std::printf(
      "loop = tandem's whole training loop (a lower bound: the input pipeline and the first step's graph\n"
      "building count), steps = its steps alone (Model::training_times), peer = the fastest peer column's\n"
      "loop; GFLOP = GFLOP/s, ceiling = that over the sgemm ceiling.\n");
}

}  // namespace

int run_seeds(const Options& o);
int run_lockstep(const Options& o);
int run_mirrored(const Options& o);
int run_zero(const Options& o);
int run_multiworker(const Options& o);
int run_multiworker_worker(const Options& o);
int run_gpu(const Options& o);

int main(int argc, char** argv) try {
  Options o;
  CLI::App app("bench_fit: training-loop throughput of tandem's fit beside PyTorch on the same models");
  add_options(app, o);
  CLI11_PARSE(app, argc, argv);
  // The DDP peer covers mlp and wide (a CNN under DDP is not among its configurations).
  if ((o.strategy == "mirrored" || o.strategy == "multiworker") && app.count("--models") == 0)
    o.models = {"mlp", "wide"};
  if (!o.worker_model.empty()) return run_multiworker_worker(o);
  if (o.seeds > 0) return run_seeds(o);
  if (o.lockstep) return run_lockstep(o);
  if (o.strategy == "mirrored" && !o.zero.empty()) return run_zero(o);
  if (o.strategy == "mirrored") return run_mirrored(o);
  if (o.strategy == "multiworker") return run_multiworker(o);
  if (o.device == "gpu") return run_gpu(o);
  if (o.threads > 0)
    devices::set_logical_device_configuration({.num_cpu_devices = 1, .intra_op_threads_per_device = o.threads});
  const int threads = devices::default_cpu_device().intra_op_threads();
  if (o.install_peers) install_peers(o);
  const std::string torch_version = o.peer ? peer_version(o.python, "torch") : "skipped";
  const std::string tf_version = o.peer ? peer_version(o.python, "tensorflow") : "skipped";
  std::printf("bench_fit: Fashion-MNIST, Adam, batch %lld, %d epoch(s), training loop only, median of %d run(s)\n",
              static_cast<long long>(kBatch), o.epochs, o.repeat);
  std::printf("CPU:           %s, %d intra-op thread(s)\n", bench::cpu_model().c_str(), threads);
  std::printf("tandem GEMM:   %s\n", ops::cpu::gemm_backend_description().c_str());
  std::printf("CPU kernels:   %s\n", bench::cpu_kernels_text().c_str());
  std::printf("peers:         %s: torch %s, tensorflow %s (%d untimed warm-up steps each)\n\n", o.python.c_str(),
              torch_version.c_str(), tf_version.c_str(), kPeerWarmupSteps);
  const auto data = data::fashion_mnist();

  std::printf("%-6s | %11s %7s | %11s %7s | %11s %7s | %11s %7s | %11s %7s | %9s\n", "model", "tandem /s", "acc",
              "torch /s", "acc", "torch-c /s", "acc", "tf /s", "acc", "tf-xla /s", "acc", "vs best");
  std::printf("%s\n", std::string(120, '-').c_str());
  bench::SgemmCeilingProbe probe;
  bench::SgemmCeiling ceiling;  // the best over the run
  std::vector<CeilingRow> ceiling_rows;
  for (const auto& kind : o.models) {
    // Interleaved runs, so that a slow phase of the machine hits every column alike.
    std::vector<Result> ours_runs, torch_runs, compiled_runs, tf_runs, xla_runs;
    for (int r = 0; r < o.repeat; ++r) {
      if (const auto c = probe.measure(devices::default_cpu_device()); c.gflops > ceiling.gflops) ceiling = c;
      ours_runs.push_back(run_tandem(kind, data, o));
      if (!o.peer) continue;
      if (torch_version != "missing") {
        if (auto p = run_torch_peer(o, o.python, kind, threads)) torch_runs.push_back(*p);
        if (auto p = run_torch_peer(o, o.python, kind, threads, "--compile")) compiled_runs.push_back(*p);
      }
      if (tf_version != "missing") {
        if (auto p = run_tf_peer(o, kind, "")) tf_runs.push_back(*p);
        if (auto p = run_tf_peer(o, kind, "--jit-compile --steps-per-execution 32")) xla_runs.push_back(*p);
      }
    }
    const Result ours = *median(ours_runs);
    const std::optional<Result> torch = median(torch_runs), compiled = median(compiled_runs), tf = median(tf_runs),
                                xla = median(xla_runs);
    const auto cell = [](const std::optional<Result>& r) {
      if (!r) return fmt::format("{:>11} {:>7}", "-", "-");
      return fmt::format("{:>11.0f} {:>7.4f}", r->samples_per_s, r->test_accuracy);
    };
    std::printf("%-6s | %11.0f %7.4f | %s | %s | %s | %s | %s\n", kind.c_str(), ours.samples_per_s, ours.test_accuracy,
                cell(torch).c_str(), cell(compiled).c_str(), cell(tf).c_str(), cell(xla).c_str(),
                vs_best_cell(ours.samples_per_s, best_peer({torch, compiled, tf, xla})).c_str());
    std::fflush(stdout);
    const double step_samples_per_s =
        ours.times.step_seconds > 0 ? static_cast<double>(ours.times.steps * kBatch) / ours.times.step_seconds : 0;
    ceiling_rows.push_back({kind, ours.samples_per_s, step_samples_per_s, best_peer({torch, compiled, tf, xla})});
  }
  std::printf(
      "\ntorch = PyTorch eager (bench/peers/torch_fmnist.py, --threads as tandem's); torch-c = the same under\n"
      "torch.compile (--compile: inductor, compiled in the untimed warm-up steps); tf = Keras 3 on TensorFlow\n"
      "with oneDNN on (TF_ENABLE_ONEDNN_OPTS=1; bench/peers/tf_fmnist.py); tf-xla = the same with\n"
      "jit_compile=True and steps_per_execution=32; vs best = tandem samples/s over the fastest peer column;\n"
      "- = that peer did not run (its output, with the reason, is on stderr).\n");
  print_ceiling_table(ceiling, threads, ceiling_rows);
  return 0;
} catch (const tandem::Error& e) {
  std::fprintf(stderr, "bench_fit: %s\n", e.what());
  return 1;
}

// --device gpu: tandem on GPU:0 in float32 and mixed_bfloat16 beside PyTorch eager on that GPU.
int run_gpu(const Options& o) {
  TANDEM_REQUIRE(devices::num_gpus() > 0, FailedPrecondition, "--device gpu: no GPU ({})",
                 devices::gpu_discovery_message());
  const auto data = data::fashion_mnist(o.data_dir);
  std::printf(
      "bench_fit --device gpu: Fashion-MNIST, Adam, batch %lld, %d epoch(s), training loop only, median of %d "
      "run(s)\n",
      static_cast<long long>(kBatch), o.epochs, o.repeat);
  std::printf("GPU:  %s\ncuDNN: %s\npeer: %s\n\n", devices::gpu_discovery_message().c_str(),
              ops::cuda::cudnn_status().c_str(), o.peer ? o.gpu_peer_command.c_str() : "(skipped)");
  std::printf("%-6s %-15s | %12s %8s | %12s | %12s %8s | %7s %7s\n", "model", "precision", "graphs /s", "acc",
              "no graphs /s", "torch /s", "acc", "ratio", "ratio-");
  std::printf("%s\n", std::string(100, '-').c_str());
  OneDeviceStrategy gpu("GPU:0");
  for (const auto& kind : o.models) {
    for (const auto& [policy, peer_precision] :
         {std::pair{"float32", "float32"}, std::pair{"mixed_bfloat16", "bf16"}}) {
      std::vector<Result> graph_runs, eager_runs, peer_runs;
      for (int r = 0; r < o.repeat; ++r) {
        graph_runs.push_back(run_tandem(kind, data, o, &gpu, policy, /*cuda_graphs=*/true));
        eager_runs.push_back(run_tandem(kind, data, o, &gpu, policy, /*cuda_graphs=*/false));
        if (!o.peer) continue;
        if (auto p =
                run_peer_command(fmt::format("{} --model {} --precision {} --epochs {} --batch {} --data {} 2>&1",
                                             o.gpu_peer_command, kind, peer_precision, o.epochs, kBatch, o.data_dir))) {
          peer_runs.push_back(*p);
        }
      }
      const Result graphs = *median(graph_runs), eager = *median(eager_runs);
      const auto peer = median(peer_runs);
      const std::string peer_cell =
          peer ? fmt::format("{:>12.0f} {:>8.4f} | {:>6.2f}x {:>6.2f}x", peer->samples_per_s, peer->test_accuracy,
                             graphs.samples_per_s / peer->samples_per_s, eager.samples_per_s / peer->samples_per_s)
               : fmt::format("{:>12} {:>8} | {:>7} {:>7}", "-", "-", "-", "-");
      std::printf("%-6s %-15s | %12.0f %8.4f | %12.0f | %s\n", kind.c_str(), policy, graphs.samples_per_s,
                  graphs.test_accuracy, eager.samples_per_s, peer_cell.c_str());
      std::fflush(stdout);
    }
  }
  std::printf(
      "\nratio = tandem with CUDA graphs over PyTorch eager on the same GPU (torch: float32, or bf16 autocast);\n"
      "ratio- = tandem without CUDA graphs (CompileOptions{.cuda_graphs = false}) over the same.\n");
  return 0;
}

// --seeds N: test accuracy after o.epochs from each of N seeds, for tandem and the peers of
// --strategy (the runs of the speed tables, untimed here): one device beside PyTorch eager and
// Keras 3; MirroredStrategy beside DDP and Keras 3's MirroredStrategy; two workers beside DDP and
// Keras 3's MultiWorkerMirroredStrategy. A seed sets everything random on each side: initial
// weights and the order of the training data.
int run_seeds(const Options& o) {
  if (o.strategy == "mirrored") {
    devices::set_logical_device_configuration({.num_cpu_devices = o.replicas, .intra_op_threads_per_device = 1});
  } else if (o.threads > 0) {
    devices::set_logical_device_configuration({.num_cpu_devices = 1, .intra_op_threads_per_device = o.threads});
  }
  const int threads = devices::default_cpu_device().intra_op_threads();
  const auto data = data::fashion_mnist();
  std::optional<MirroredStrategy> mirrored;  // under --strategy mirrored
  int port = kTandemWorkersPort, tf_port = kTfWorkersPort;
  using Run = std::function<std::optional<Result>(const Options&, const std::string&)>;
  std::vector<std::pair<std::string, Run>> columns;
  if (o.strategy == "one") {
    columns = {{"tandem", [&](const Options& s, const std::string& kind) { return run_tandem(kind, data, s); }},
               {"torch",
                [&](const Options& s, const std::string& kind) { return run_torch_peer(s, s.python, kind, threads); }},
               {"tf", [&](const Options& s, const std::string& kind) { return run_tf_peer(s, kind, ""); }}};
  } else if (o.strategy == "mirrored") {
    mirrored.emplace();
    columns = {
        {"tandem", [&](const Options& s, const std::string& kind) { return run_tandem(kind, data, s, &*mirrored); }},
        {"DDP", [&](const Options& s, const std::string& kind) { return run_ddp_peer(s, kind, ""); }},
        {"tf", [&](const Options& s, const std::string& kind) {
           return run_tf_peer(s, kind, fmt::format("--strategy mirrored --cpu-devices {}", s.replicas));
         }}};
  } else {
    columns = {
        {"tandem", [&](const Options& s,
                       const std::string& kind) { return run_tandem_workers(s, kind, /*ring=*/false, port += 2); }},
        {"DDP", [&](const Options& s, const std::string& kind) { return run_ddp_peer(s, kind, ""); }},
        {"tf",
         [&](const Options& s, const std::string& kind) { return run_tf_multiworker_peer(s, kind, tf_port += 2); }}};
  }
  if (!o.peer) columns.resize(1);

  std::printf(
      "bench_fit --seeds %d: test accuracy after %d epoch(s) of Fashion-MNIST, Adam, global batch %lld, "
      "seeds %d..%d, --strategy %s\n\n",
      o.seeds, o.epochs, static_cast<long long>(kBatch), o.seed, o.seed + o.seeds - 1, o.strategy.c_str());
  std::printf("%-5s | %5s", "model", "seed");
  for (const auto& [name, run] : columns) std::printf(" | %8s", name.c_str());
  std::printf("\n%s\n", std::string(14 + 11 * columns.size(), '-').c_str());
  for (const auto& kind : o.models) {
    std::vector<std::vector<double>> accuracies(columns.size());
    for (int k = 0; k < o.seeds; ++k) {
      Options seeded = o;
      seeded.seed = o.seed + k;
      std::printf("%-5s | %5d", kind.c_str(), seeded.seed);
      for (std::size_t c = 0; c < columns.size(); ++c) {
        const std::optional<Result> r = columns[c].second(seeded, kind);
        if (r) accuracies[c].push_back(r->test_accuracy);
        std::printf(" | %8s", r ? fmt::format("{:.4f}", r->test_accuracy).c_str() : "-");
        std::fflush(stdout);
      }
      std::printf("\n");
    }
    // Mean, sample standard deviation, and each peer's mean minus tandem's.
    const auto mean = [](const std::vector<double>& v) {
      double sum = 0;
      for (const double x : v) sum += x;
      return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
    };
    const auto sd = [&](const std::vector<double>& v) {
      if (v.size() < 2) return 0.0;
      const double m = mean(v);
      double sum = 0;
      for (const double x : v) sum += (x - m) * (x - m);
      return std::sqrt(sum / static_cast<double>(v.size() - 1));
    };
    const auto row = [&](const char* label, const auto& value) {
      std::printf("%-5s | %5s", kind.c_str(), label);
      for (std::size_t c = 0; c < columns.size(); ++c) std::printf(" | %8s", value(c).c_str());
      std::printf("\n");
    };
    const auto or_dash = [&](std::size_t c, double x, const char* format) {
      return accuracies[c].empty() ? std::string("-") : fmt::format(fmt::runtime(format), x);
    };
    row("mean", [&](std::size_t c) { return or_dash(c, mean(accuracies[c]), "{:.4f}"); });
    row("sd", [&](std::size_t c) { return or_dash(c, sd(accuracies[c]), "{:.4f}"); });
    row("gap", [&](std::size_t c) {
      return c == 0 || accuracies[0].empty() ? std::string("-")
                                             : or_dash(c, mean(accuracies[c]) - mean(accuracies[0]), "{:+.4f}");
    });
    std::fflush(stdout);
  }
  std::printf("\nsd = sample standard deviation over the seeds; gap = the peer's mean minus tandem's.\n");
  return 0;
}

namespace {

// One value per line (tf_fmnist.py --lockstep's losses).
std::vector<double> read_values(const std::string& path) {
  std::ifstream in(path);
  TANDEM_REQUIRE(in.good(), NotFound, "bench_fit --lockstep: cannot read \"{}\"", path);
  std::vector<double> values;
  for (double v = 0; in >> v;) values.push_back(v);
  return values;
}

// The training rows in `order` (int64, as tf_fmnist.py --lockstep writes it), batched in that
// order without shuffling: the full batches only.
data::Dataset rows_in_order(const data::ImageClassificationData& data, const std::string& order_path) {
  const std::int64_t n = data.x_train.shape()[0], rows = n / kBatch * kBatch, pixels = 28 * 28;
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::ifstream in(order_path, std::ios::binary);
  in.read(reinterpret_cast<char*>(order.data()), static_cast<std::streamsize>(order.size() * sizeof(std::int64_t)));
  TANDEM_REQUIRE(in.good(), NotFound, "bench_fit --lockstep: cannot read {} row numbers from \"{}\"", n, order_path);
  std::vector<float> x(static_cast<std::size_t>(rows * pixels));
  std::vector<std::int64_t> y(static_cast<std::size_t>(rows));
  const float* images = data.x_train.data<float>();
  const std::int64_t* labels = data.y_train.data<std::int64_t>();
  for (std::int64_t i = 0; i < rows; ++i) {
    const std::int64_t row = order[static_cast<std::size_t>(i)];
    std::copy(images + row * pixels, images + (row + 1) * pixels, x.begin() + i * pixels);
    y[static_cast<std::size_t>(i)] = labels[row];
  }
  return data::Dataset::from_tensor_slices(
             {Tensor::from_vector<float>(x, {rows, 28, 28}), Tensor::from_vector<std::int64_t>(y, {rows})})
      .batch(kBatch, /*drop_remainder=*/true);
}

struct StepRun {
  std::vector<double> losses;  // each step's loss, on the batch before its update
  double test_accuracy = 0;
};

// tandem's model of `kind` from o.seed's weights (written to `save_init`), or from `init` when
// given, trained one epoch on `train`. fit's logs hold the epoch's running mean of the loss; the
// step's own loss is the difference of two running sums.
StepRun run_tandem_steps(const std::string& kind, const data::ImageClassificationData& data, const Options& o,
                         const data::Dataset& train, const std::string& init, const std::string& save_init) {
  set_global_seed(static_cast<std::uint64_t>(o.seed));
  auto model = build(kind);
  model.compile(keras::Adam{.epsilon = 1e-7}, keras::SparseCategoricalCrossentropy{.from_logits = true}, {"accuracy"});
  if (!save_init.empty()) model.save_weights(save_init);
  if (!init.empty()) model.load_weights(init);
  std::vector<double> means;
  auto record = std::make_shared<keras::LambdaCallback>(keras::LambdaCallbackOptions{
      .on_train_batch_end = [&](std::int64_t, keras::Logs& logs) { means.push_back(logs.at("loss")); }});
  model.fit(train, {.epochs = 1, .verbose = 0, .callbacks = {record}});
  StepRun run;
  for (std::size_t k = 0; k < means.size(); ++k) {
    const auto before = static_cast<double>(k);
    run.losses.push_back(k == 0 ? means[0] : (before + 1) * means[k] - before * means[k - 1]);
  }
  run.test_accuracy = model.evaluate(data.test.batch(1000), {.verbose = 0}).at("accuracy");
  return run;
}

// Keras 3 (tf_fmnist.py --lockstep) in `dir`: from its own weights (init empty) or from `init`;
// `extra`: more flags.
StepRun run_keras_steps(const Options& o, const std::string& kind, const std::string& dir, const std::string& init,
                        const std::string& losses, const std::string& extra = "") {
  const auto r = run_peer_command(fmt::format(
      "{} {} {} --model {} --batch {} --seed {} --lockstep {} --losses {}{}{} 2>&1", kTfEnvironment, o.python,
      o.tf_script, kind, kBatch, o.seed, dir, losses, init.empty() ? "" : " --init-from " + init, extra));
  TANDEM_REQUIRE(r.has_value(), Unavailable, "bench_fit --lockstep: tf_fmnist.py --lockstep did not run");
  return {read_values(dir + "/" + losses), r->test_accuracy};
}

// "max |d| steps 1-10, mean |d| 1-50, mean |d| 51-end" of `run`'s losses against `reference`'s.
std::string loss_differences(const StepRun& run, const StepRun& reference) {
  TANDEM_REQUIRE(run.losses.size() == reference.losses.size(), Internal,
                 "bench_fit --lockstep: {} steps against the reference's {}", run.losses.size(),
                 reference.losses.size());
  const auto d = [&](std::size_t k) { return std::abs(run.losses[k] - reference.losses[k]); };
  double first = 0, early = 0, late = 0;
  for (std::size_t k = 0; k < run.losses.size(); ++k) {
    if (k < 10) first = std::max(first, d(k));
    (k < 50 ? early : late) += d(k);
  }
  return fmt::format("{:>12.2e} {:>12.2e} {:>12.2e}", first, early / 50.0,
                     late / static_cast<double>(run.losses.size() - 50));
}

}  // namespace

// --lockstep: tandem and Keras 3 train one epoch on the same batches from the same initial
// weights, Keras's and then tandem's, and each step's loss is compared with the reference: Keras
// with Adam's step size computed in float64, as tandem computes it (Keras as it comes rounds it to
// float32, 6e-6 of every step: its row shows what that alone does). Programs that compute the same
// thing agree to float32 rounding until a ReLU input within rounding of zero takes the other side;
// from there training, chaotic, drifts apart at the same rate whatever the cause, and the test
// accuracies differ by chance alone.
int run_lockstep(const Options& o) {
  if (o.threads > 0)
    devices::set_logical_device_configuration({.num_cpu_devices = 1, .intra_op_threads_per_device = o.threads});
  const auto data = data::fashion_mnist();
  char dir_template[] = "/tmp/bench_fit_lockstep.XXXXXX";
  TANDEM_REQUIRE(mkdtemp(dir_template) != nullptr, Unavailable, "bench_fit --lockstep: mkdtemp failed");
  const std::string dir = dir_template;
  std::printf(
      "bench_fit --lockstep: one epoch of Fashion-MNIST, Adam, batch %lld, in the order seed %d draws (numpy), from "
      "the\n"
      "same initial weights on both sides; files in %s\n\n",
      static_cast<long long>(kBatch), o.seed, dir.c_str());
  std::printf("%-5s | %-12s %-18s | %8s | %12s %12s %12s\n", "model", "start", "trained by", "test acc", "max|d| 1-10",
              "mean|d| 1-50", "mean|d| 51-");
  std::printf("%s\n", std::string(94, '-').c_str());
  for (const auto& kind : o.models) {
    const auto row = [&](const char* start, const char* by, const StepRun& run, const StepRun* reference) {
      std::printf("%-5s | %-12s %-18s | %8.4f | %s\n", kind.c_str(), start, by, run.test_accuracy,
                  reference ? loss_differences(run, *reference).c_str() : "   (reference)");
      std::fflush(stdout);
    };
    // The reference: Keras computing what tandem computes (Adam's step size in float64).
    const std::string f64_step = " --adam-step-float64";
    const StepRun keras_f64 = run_keras_steps(o, kind, dir, "", kind + "_keras_f64.txt", f64_step);
    row("Keras's", "Keras, f64 step", keras_f64, nullptr);
    row("Keras's", "Keras", run_keras_steps(o, kind, dir, dir + "/keras_init.safetensors", kind + "_keras.txt"),
        &keras_f64);
    const data::Dataset train = rows_in_order(data, dir + "/order.i64");
    const std::string tandem_init = dir + "/" + kind + "_tandem_init.safetensors";
    row("Keras's", "tandem", run_tandem_steps(kind, data, o, train, dir + "/keras_init.safetensors", tandem_init),
        &keras_f64);
    const StepRun keras_from_tandem = run_keras_steps(o, kind, dir, tandem_init, kind + "_keras_t.txt", f64_step);
    row("tandem's", "Keras, f64 step", keras_from_tandem, nullptr);
    row("tandem's", "tandem", run_tandem_steps(kind, data, o, train, "", ""), &keras_from_tandem);
  }
  std::printf(
      "\nd = a step's loss (on its batch, before its update) minus the same step's in the reference row above it\n"
      "(Keras from the same start with f64 step): the largest over steps 1-10, the mean over 1-50 and over the\n"
      "rest. f64 step = Adam's step size lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) computed in float64, as tandem\n"
      "computes it; Keras as it comes computes it in float32.\n");
  return 0;
}

// --strategy mirrored: tandem's MirroredStrategy (with and without overlap) beside PyTorch DDP and
// Keras 3's MirroredStrategy.
int run_mirrored(const Options& o) {
  devices::set_logical_device_configuration({.num_cpu_devices = o.replicas, .intra_op_threads_per_device = 1});
  std::printf(
      "bench_fit --strategy mirrored: Fashion-MNIST, Adam, global batch %lld, %d epoch(s), training loop only, "
      "median of %d run(s)\n",
      static_cast<long long>(kBatch), o.epochs, o.repeat);
  std::printf("CPU:           %s; tandem: MirroredStrategy over %d logical CPU devices of 1 thread\n",
              bench::cpu_model().c_str(), o.replicas);
  std::printf("peers:         %s\n\n",
              o.peer ? fmt::format("{}/torch_ddp2.sh (DDP, Gloo, 2 processes x 1 thread); tf_fmnist.py --strategy "
                                   "mirrored --cpu-devices {} (Keras 3, {}); {} untimed warm-up steps each",
                                   TANDEM_BENCH_PEER_DIR, o.replicas, kTfEnvironment, kPeerWarmupSteps)
                           .c_str()
                     : "(skipped)");
  const auto data = data::fashion_mnist();
  MirroredStrategy overlapped(strategy::MirroredOptions{.distribution = {.overlap_communication = true}});
  MirroredStrategy after_backward(strategy::MirroredOptions{.distribution = {.overlap_communication = false}});
  // What MirroredStrategy() chooses here (overlap_communication unset): its runs are the column
  // of that choice.
  const bool default_overlaps = MirroredStrategy().overlaps_communication();
  std::printf("default:       overlap_communication unset: %s here\n\n",
              default_overlaps ? "overlapped" : "reduced after backward (the replicas' threads take every core)");
  const std::string core = std::getenv("OPENBLAS_CORETYPE") ? std::getenv("OPENBLAS_CORETYPE") : kPeerCoreType;
  const std::string tf_mirrored = fmt::format("--strategy mirrored --cpu-devices {}", o.replicas);

  std::printf("%-5s | %10s %7s | %10s | %7s %8s %8s %9s %9s %7s | %10s %7s %7s | %10s %7s %7s | %10s %7s %7s | %9s\n",
              "model", "tandem /s", "acc", "ovl /s", "a-r ms", "ovl ms", "ovl wt", "no-ovl ms", "no-ovl wt", "hidden",
              "DDP /s", "acc", "ratio", "DDP** /s", "acc", "ratio", "tf /s", "acc", "ratio", "vs best");
  std::printf("%s\n", std::string(190, '-').c_str());
  for (const auto& kind : o.models) {
    // Interleaved runs, so that a slow phase of the machine hits every column alike.
    std::vector<Result> overlap_runs, plain_runs, peer_runs, tuned_runs, tf_runs;
    std::vector<double> allreduce_runs;
    for (int r = 0; r < o.repeat; ++r) {
      overlap_runs.push_back(run_tandem(kind, data, o, &overlapped));
      plain_runs.push_back(run_tandem(kind, data, o, &after_backward));
      allreduce_runs.push_back(allreduce_ms_per_step(overlapped, kind, 200));
      if (!o.peer) continue;
      if (auto p = run_ddp_peer(o, kind, "env -u OPENBLAS_CORETYPE -u OPENBLAS_NUM_THREADS")) peer_runs.push_back(*p);
      if (auto p = run_ddp_peer(o, kind, fmt::format("env OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE={}", core))) {
        tuned_runs.push_back(*p);
      }
      if (auto p = run_tf_peer(o, kind, tf_mirrored)) tf_runs.push_back(*p);
    }
    std::sort(allreduce_runs.begin(), allreduce_runs.end());
    const double allreduce_ms = allreduce_runs[allreduce_runs.size() / 2];
    const Result overlap = *median(overlap_runs), plain = *median(plain_runs);
    const Result& ours = default_overlaps ? overlap : plain;
    const std::optional<Result> ddp = median(peer_runs), tuned = median(tuned_runs), tf = median(tf_runs);
    const auto ms = [](const Result& r) { return 1e3 * static_cast<double>(kBatch) / r.samples_per_s; };
    const auto wait_ms = [](const Result& r) {
      return 1e3 * r.times.reduce_wait_seconds / static_cast<double>(std::max<std::int64_t>(1, r.times.steps));
    };
    const double hidden = wait_ms(plain) > 0 ? 1.0 - wait_ms(overlap) / wait_ms(plain) : 0.0;
    const auto cell = [&](const std::optional<Result>& r) {
      if (!r) return fmt::format("{:>10} {:>7} {:>7}", "-", "-", "-");
      return fmt::format("{:>10.0f} {:>7.4f} {:>6.2f}x", r->samples_per_s, r->test_accuracy,
                         ours.samples_per_s / r->samples_per_s);
    };
    std::printf("%-5s | %10.0f %7.4f | %10.0f | %7.3f %8.3f %8.3f %9.3f %9.3f %6.0f%% | %s | %s | %s | %s\n",
                kind.c_str(), ours.samples_per_s, ours.test_accuracy, overlap.samples_per_s, allreduce_ms, ms(overlap),
                wait_ms(overlap), ms(plain), wait_ms(plain), 100.0 * hidden, cell(ddp).c_str(), cell(tuned).c_str(),
                cell(tf).c_str(), vs_best_cell(ours.samples_per_s, best_peer({ddp, tuned, tf})).c_str());
    std::fflush(stdout);
  }
  std::printf(
      "\ntandem = MirroredStrategy() as it comes (the runs of its overlap choice above); ovl = with\n"
      "overlap_communication = true (buckets all-reduced on a communication thread while backward goes on),\n"
      "no-ovl = false (all buckets reduced after backward). a-r ms = the gradient buckets' all-reduce alone, per\n"
      "step; then step time and wait (replica 0's time between the end of its backward pass and the last reduced\n"
      "bucket) with overlap, then without; hidden = 1 - ovl wait / no-ovl wait, the share of the all-reduce\n"
      "overlapping hides. DDP = torch_ddp2.sh with\n"
      "--python's PyTorch; DDP** = with OPENBLAS_CORETYPE=%s and OPENBLAS_NUM_THREADS=1. tf = Keras 3 on\n"
      "TensorFlow, tf.distribute.MirroredStrategy over %d logical CPU devices (TensorFlow's own thread pools, one\n"
      "for the process), oneDNN on. ratio = tandem /s over the peer's; vs best = tandem /s over the fastest peer.\n",
      core.c_str(), o.replicas);
  return 0;
}

// Bytes that replica `r` holds of the model's weights and of its optimizer's slots (sharded ones
// count their shard).
std::pair<std::int64_t, std::int64_t> state_bytes(const keras::Model& model, int r) {
  std::int64_t weights = 0, slots = 0;
  for (const auto& w : model.weights()) weights += static_cast<std::int64_t>(w->value(r).nbytes());
  for (const auto& [name, slot] : model.optimizer().slots()) slots += static_cast<std::int64_t>(slot->value(r).nbytes());
  return {weights, slots};
}

int run_zero(const Options& o) {
  devices::set_logical_device_configuration({.num_cpu_devices = o.replicas, .intra_op_threads_per_device = 1});
  std::printf(
      "bench_fit --strategy mirrored --zero: Fashion-MNIST, Adam, global batch %lld, %d epoch(s), training loop "
      "only, median of %d run(s)\n",
      static_cast<long long>(kBatch), o.epochs, o.repeat);
  std::printf("CPU:           %s; tandem: MirroredStrategy over %d logical CPU devices of 1 thread\n",
              bench::cpu_model().c_str(), o.replicas);
  std::printf("peer:          %s\n\n",
              o.peer ? "torch_ddp2.sh --zero 1 (DDP + ZeroRedundancyOptimizer(Adam), Gloo, 2 processes x 1 thread)"
                     : "(skipped)");
  const auto data = data::fashion_mnist();
  std::printf("%-5s %5s | %10s %7s %7s | %7s %7s | %10s %10s %10s | %10s %7s %7s\n", "model", "zero", "tandem /s",
              "acc", "vs k0", "cpu ms", "post ms", "weights", "slots", "peak", "ZeRO-1 /s", "acc", "ratio");
  std::printf("%s\n", std::string(126, '-').c_str());
  const auto mib = [](std::int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); };
  for (const auto& kind : o.models) {
    std::optional<double> stage0;
    std::vector<Result> peer_runs;
    for (int r = 0; r < o.repeat && o.peer; ++r) {
      if (auto p = run_peer_command(fmt::format("PYTHON={} bash {}/torch_ddp2.sh {} 29512 --zero 1 2>&1", o.python,
                                                TANDEM_BENCH_PEER_DIR, kind))) {
        peer_runs.push_back(*p);
      }
    }
    const std::optional<Result> peer = median(peer_runs);
    for (const int stage : o.zero) {
      MirroredStrategy strategy(
          strategy::MirroredOptions{.distribution = {.zero = static_cast<strategy::ZeroStage>(stage)}});
      std::vector<Result> runs;
      std::int64_t weights = 0, slots = 0, peak = 0;
      for (int r = 0; r < o.repeat; ++r) {
        auto& device = *strategy.replica_devices().back();
        device.allocator().reset_peak_bytes_in_use();
        keras::Model model;
        runs.push_back(run_tandem(kind, data, o, &strategy, "float32", true, &model));
        peak = device.allocator().stats().peak_bytes_in_use;
        std::tie(weights, slots) = state_bytes(model, static_cast<int>(strategy.replica_devices().size()) - 1);
      }
      const Result ours = *median(runs);
      if (!stage0) stage0 = ours.samples_per_s;
      // Per step, medians over the runs: the process's CPU time, and replica 0's time after its
      // backward (the gradient collectives it waited for, the optimizer, the ZeRO all-gather).
      std::vector<double> cpu, post;
      for (const Result& run : runs) {
        const auto steps = static_cast<double>(std::max<std::int64_t>(1, run.times.steps));
        cpu.push_back(1e3 * run.cpu_seconds / steps);
        post.push_back(1e3 * (run.times.reduce_wait_seconds + run.times.apply_seconds) / steps);
      }
      const auto middle = [](std::vector<double>& v) {
        std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
        return v[v.size() / 2];
      };
      const std::string peer_cell =
          peer && stage == 1 ? fmt::format("{:>10.0f} {:>7.4f} {:>6.2f}x", peer->samples_per_s, peer->test_accuracy,
                                           ours.samples_per_s / peer->samples_per_s)
                             : fmt::format("{:>10} {:>7} {:>7}", "-", "-", "-");
      std::printf("%-5s %5d | %10.0f %7.4f %6.2fx | %7.3f %7.3f | %7.2f MiB %6.2f MiB %6.2f MiB | %s\n", kind.c_str(),
                  stage, ours.samples_per_s, ours.test_accuracy, ours.samples_per_s / *stage0, middle(cpu),
                  middle(post), mib(weights), mib(slots), mib(peak), peer_cell.c_str());
      std::fflush(stdout);
    }
  }
  std::printf(
      "\nvs k0 = samples/s over the first stage listed (0: unsharded data parallelism). cpu ms = the process's\n"
      "CPU time per step (all threads; steadier than samples/s on a shared machine); post ms = replica 0's\n"
      "wall time per step after its backward: gradient collectives not hidden, optimizer, ZeRO's all-gather.\n"
      "weights, slots = bytes the last replica's device holds of the model's weights and of Adam's slots (a\n"
      "sharded slot counts its shard); peak = that device's peak allocator bytes during the run (activations and gradients included).\n"
      "ZeRO-1 = the PyTorch peer at its ZeRO stage 1, beside tandem's stage 1; ratio = tandem /s over it.\n");
  return 0;
}

// One worker of --strategy multiworker (TF_CONFIG comes from the parent): trains, and the chief
// prints the fields run_peer_command reads.
int run_multiworker_worker(const Options& o) {
  strategy::MultiWorkerOptions options;
  if (o.worker_ring) options.communication_options.implementation = strategy::CommunicationImplementation::kRing;
  if (o.worker_overlap) options.distribution.overlap_communication = true;
  MultiWorkerMirroredStrategy strategy(options);
  const auto data = data::fashion_mnist();
  const Result r = run_tandem(o.worker_model, data, o, &strategy);
  if (strategy.worker_rank() == 0) {
    std::printf("samples_per_s=%.1f test_acc=%.4f wait_ms=%.3f\n", r.samples_per_s, r.test_accuracy,
                1e3 * r.times.reduce_wait_seconds / static_cast<double>(std::max<std::int64_t>(1, r.times.steps)));
  }
  return 0;
}

// --strategy multiworker: two worker processes of one thread, beside PyTorch DDP and Keras 3's
// MultiWorkerMirroredStrategy (the same).
int run_multiworker(const Options& o) {
  std::printf(
      "bench_fit --strategy multiworker: Fashion-MNIST, Adam, global batch %lld, %d epoch(s), training loop "
      "only, median of %d run(s)\n",
      static_cast<long long>(kBatch), o.epochs, o.repeat);
  std::printf("CPU:           %s; tandem: MultiWorkerMirroredStrategy, 2 processes x 1 thread, Gloo on 127.0.0.1\n",
              bench::cpu_model().c_str());
  std::printf("peers:         %s\n\n",
              o.peer ? fmt::format("{0}/torch_ddp2.sh (DDP, Gloo, 2 processes x 1 thread); {0}/tf_mwms2.sh (Keras 3 "
                                   "MultiWorkerMirroredStrategy, 2 processes x 1 thread, {1}); {2} untimed warm-up "
                                   "steps each",
                                   TANDEM_BENCH_PEER_DIR, kTfEnvironment, kPeerWarmupSteps)
                           .c_str()
                     : "(skipped)");
  const std::string core = std::getenv("OPENBLAS_CORETYPE") ? std::getenv("OPENBLAS_CORETYPE") : kPeerCoreType;
  std::printf("%-5s | %10s %7s | %10s | %10s %7s | %10s %7s %7s %7s | %10s %7s %7s %7s | %10s %7s %7s %7s | %9s %9s\n",
              "model", "tandem /s", "acc", "ovl /s", "ring /s", "acc", "DDP /s", "acc", "ratio", "ring", "DDP** /s",
              "acc", "ratio", "ring", "tf /s", "acc", "ratio", "ring", "vs best", "ring vs");
  std::printf("%s\n", std::string(191, '-').c_str());
  int port = kTandemWorkersPort, tf_port = kTfWorkersPort;
  for (const auto& kind : o.models) {
    // Interleaved runs, so that a slow phase of the machine hits every column alike.
    std::vector<Result> ours_runs, overlap_runs, ring_runs, peer_runs, tuned_runs, tf_runs;
    for (int r = 0; r < o.repeat; ++r) {
      if (auto ours = run_tandem_workers(o, kind, /*ring=*/false, port += 2)) ours_runs.push_back(*ours);
      if (auto ovl = run_tandem_workers(o, kind, /*ring=*/false, port += 2, /*overlap=*/true)) overlap_runs.push_back(*ovl);
      if (auto ring = run_tandem_workers(o, kind, /*ring=*/true, port += 2)) ring_runs.push_back(*ring);
      if (!o.peer) continue;
      if (auto p = run_ddp_peer(o, kind, "env -u OPENBLAS_CORETYPE -u OPENBLAS_NUM_THREADS")) peer_runs.push_back(*p);
      if (auto p = run_ddp_peer(o, kind, fmt::format("env OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE={}", core))) {
        tuned_runs.push_back(*p);
      }
      if (auto p = run_tf_multiworker_peer(o, kind, tf_port += 2)) tf_runs.push_back(*p);
    }
    const std::optional<Result> ours = median(ours_runs), overlap = median(overlap_runs), ring = median(ring_runs);
    TANDEM_REQUIRE(ours.has_value() && overlap.has_value() && ring.has_value(), Internal,
                   "bench_fit: the tandem workers of model {} did not report", kind);
    const std::optional<Result> ddp = median(peer_runs), tuned = median(tuned_runs), tf = median(tf_runs);
    const auto cell = [&](const std::optional<Result>& p) {
      if (!p) return fmt::format("{:>10} {:>7} {:>7} {:>7}", "-", "-", "-", "-");
      return fmt::format("{:>10.0f} {:>7.4f} {:>6.2f}x {:>6.2f}x", p->samples_per_s, p->test_accuracy,
                         ours->samples_per_s / p->samples_per_s, ring->samples_per_s / p->samples_per_s);
    };
    const double best = best_peer({ddp, tuned, tf});
    std::printf("%-5s | %10.0f %7.4f | %10.0f | %10.0f %7.4f | %s | %s | %s | %s %s\n", kind.c_str(),
                ours->samples_per_s, ours->test_accuracy, overlap->samples_per_s, ring->samples_per_s,
                ring->test_accuracy, cell(ddp).c_str(), cell(tuned).c_str(),
                cell(tf).c_str(), vs_best_cell(ours->samples_per_s, best).c_str(),
                vs_best_cell(ring->samples_per_s, best).c_str());
    std::fflush(stdout);
  }
  std::printf(
      "\ntandem = the default (AUTO: both workers on this machine, so gradients meet in shared memory; the\n"
      "all-reduce overlaps backward only where a core is free for it, Strategy::overlaps_communication);\n"
      "ovl = the same with overlap_communication = true; ring = CommunicationImplementation::kRing (Gloo over\n"
      "TCP, as the peers), overlap as the default. DDP = torch_ddp2.sh with\n"
      "--python's PyTorch; DDP** = with OPENBLAS_CORETYPE=%s and OPENBLAS_NUM_THREADS=1. tf = Keras 3 on\n"
      "TensorFlow, tf.distribute.MultiWorkerMirroredStrategy (tf_mwms2.sh: 2 workers of 1 intra-op thread on\n"
      "127.0.0.1, collectives over gRPC), oneDNN on. ratio = tandem /s over the peer's; ring = ring /s over the\n"
      "peer's; vs best, ring vs = tandem /s and ring /s over the fastest peer.\n",
      core.c_str());
  return 0;
}
