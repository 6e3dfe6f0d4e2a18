// bench_fit: one epoch of Fashion-MNIST training (Adam, batch 128) for the three models of
// bench/peers/torch_fmnist.py, beside that script run in the same invocation.
//
//   build/bench/bench_fit [--models mlp,wide,cnn] [--epochs 1] [--threads N] [--repeat R] [--no-peer]
//
// The machines we measure on are shared VMs whose speed drifts by tens of percent over minutes;
// --repeat R interleaves R runs of tandem and of each peer variant and reports the medians.
//
// Both sides time the training loop only (data already decoded in memory), over the same
// 468 full batches of 128 per epoch (the peer drops the last partial batch; so do we here), and
// report test accuracy after training. The peer runs three times: as Debian installs it; with
// OPENBLAS_CORETYPE set to the kernel set tandem's loader picks (Debian's OpenBLAS otherwise falls
// back to SSE3 kernels on recent Xeons); and with that plus OPENBLAS_NUM_THREADS=1.
#include <tandem/keras_like/keras.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "tandem/ops/cpu/gemm.h"

namespace {

using namespace tandem;
using Clock = std::chrono::steady_clock;

constexpr std::int64_t kBatch = 128;
// The OpenBLAS kernel set for the fair peer run: what tandem's loader picks on AVX-512 machines.
constexpr const char* kPeerCoreType = "Cooperlake";

struct Options {
  std::vector<std::string> models{"mlp", "wide", "cnn"};
  int epochs = 1;
  int threads = 0;  // 0: all usable cores
  int repeat = 1;   // runs of each side, interleaved; the table shows medians
  bool peer = true;
  std::string peer_script = TANDEM_BENCH_PEER_DIR "/torch_fmnist.py";
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&]() -> std::string {
      TANDEM_REQUIRE(i + 1 < argc, InvalidArgument, "{} needs a value", arg);
      return argv[++i];
    };
    if (arg == "--models") {
      o.models.clear();
      std::stringstream list(value());
      for (std::string m; std::getline(list, m, ',');) o.models.push_back(m);
    } else if (arg == "--epochs") {
      o.epochs = std::stoi(value());
    } else if (arg == "--threads") {
      o.threads = std::stoi(value());
    } else if (arg == "--repeat") {
      o.repeat = std::max(1, std::stoi(value()));
    } else if (arg == "--no-peer") {
      o.peer = false;
    } else if (arg == "--peer-script") {
      o.peer_script = value();
    } else {
      throw InvalidArgument(fmt::format("unknown argument \"{}\"; see the comment at the top of bench_fit.cc", arg));
    }
  }
  return o;
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

struct Result {
  double samples_per_s = 0;
  double test_accuracy = 0;
};

Result run_tandem(const std::string& kind, const data::ImageClassificationData& data, int epochs) {
  set_global_seed(0);
  auto model = build(kind);
  model.compile(keras::Adam{.epsilon = 1e-7}, keras::SparseCategoricalCrossentropy{.from_logits = true}, {"accuracy"});
  auto train = data.train.shuffle(60000).batch(kBatch, /*drop_remainder=*/true);
  const auto start = Clock::now();
  model.fit(train, {.epochs = epochs, .verbose = 0});
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const double samples = static_cast<double>(epochs) * static_cast<double>(60000 / kBatch * kBatch);
  const auto test = model.evaluate(data.test.batch(1000), {.verbose = 0});
  return {samples / seconds, test.at("accuracy")};
}

std::optional<Result> run_peer(const Options& o, const std::string& kind, int threads, const std::string& env) {
  const std::string command = fmt::format("{} /usr/bin/python3 {} --model {} --epochs {} --batch {} --threads {} 2>&1", env,
                                          o.peer_script, kind, o.epochs, kBatch, threads);
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
  return Result{*sps, *acc};
}

std::optional<Result> median(std::vector<Result> runs) {
  if (runs.empty()) return std::nullopt;
  std::sort(runs.begin(), runs.end(), [](const Result& a, const Result& b) { return a.samples_per_s < b.samples_per_s; });
  return runs[runs.size() / 2];
}

std::string cpu_model() {
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown CPU";
}

}  // namespace

int main(int argc, char** argv) try {
  const Options o = parse(argc, argv);
  if (o.threads > 0) devices::set_logical_device_configuration({.num_cpu_devices = 1, .intra_op_threads_per_device = o.threads});
  const int threads = devices::default_cpu_device().intra_op_threads();
  const std::string coretype = std::getenv("OPENBLAS_CORETYPE") ? std::getenv("OPENBLAS_CORETYPE") : "";
  std::printf("bench_fit: Fashion-MNIST, Adam, batch %lld, %d epoch(s), training loop only, median of %d run(s)\n",
              static_cast<long long>(kBatch), o.epochs, o.repeat);
  std::printf("CPU:           %s, %d intra-op thread(s)\n", cpu_model().c_str(), threads);
  std::printf("tandem GEMM:   %s\n", ops::cpu::gemm_backend_description().c_str());
  std::printf("peer:          %s %s\n\n", o.peer ? "/usr/bin/python3" : "(skipped)", o.peer ? o.peer_script.c_str() : "");
  const auto data = data::fashion_mnist();

  std::printf("%-6s | %12s %8s | %12s %8s %7s | %12s %8s %7s | %12s %8s %7s\n", "model", "tandem /s", "acc", "torch /s",
              "acc", "ratio", "torch* /s", "acc", "ratio", "torch** /s", "acc", "ratio");
  std::printf("%s\n", std::string(130, '-').c_str());
  for (const auto& kind : o.models) {
    // Interleaved runs, so that a slow phase of the machine hits every column alike.
    std::vector<Result> ours_runs, peer_runs, fixed_runs, tuned_runs;
    const std::string core = coretype.empty() ? kPeerCoreType : coretype;
    for (int r = 0; r < o.repeat; ++r) {
      ours_runs.push_back(run_tandem(kind, data, o.epochs));
      if (!o.peer) continue;
      // As installed: nothing of ours in its environment.
      if (auto p = run_peer(o, kind, threads, "env -u OPENBLAS_CORETYPE -u OPENBLAS_NUM_THREADS")) peer_runs.push_back(*p);
      // The same peer with OpenBLAS's AVX-512 kernels (what tandem's loader selects) ...
      if (auto p = run_peer(o, kind, threads, fmt::format("env -u OPENBLAS_NUM_THREADS OPENBLAS_CORETYPE={}", core))) {
        fixed_runs.push_back(*p);
      }
      // ... and also without OpenBLAS's own thread pool competing with PyTorch's: its best here.
      if (auto p = run_peer(o, kind, threads, fmt::format("env OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE={}", core))) {
        tuned_runs.push_back(*p);
      }
    }
    const Result ours = *median(ours_runs);
    const std::optional<Result> peer = median(peer_runs), fixed = median(fixed_runs), tuned = median(tuned_runs);
    const auto cell = [&](const std::optional<Result>& r) {
      if (!r) return fmt::format("{:>12} {:>8} {:>7}", "-", "-", "-");
      return fmt::format("{:>12.0f} {:>8.4f} {:>6.2f}x", r->samples_per_s, r->test_accuracy, ours.samples_per_s / r->samples_per_s);
    };
    std::printf("%-6s | %12.0f %8.4f | %s | %s | %s\n", kind.c_str(), ours.samples_per_s, ours.test_accuracy,
                cell(peer).c_str(), cell(fixed).c_str(), cell(tuned).c_str());
    std::fflush(stdout);
  }
  std::printf("\nratio = tandem samples/s over the peer's. torch = PyTorch as Debian installs it (its OpenBLAS detects\n"
              "this CPU as Prescott and uses SSE3 kernels); torch* = with OPENBLAS_CORETYPE set (AVX-512 kernels, as\n"
              "tandem uses); torch** = also with OPENBLAS_NUM_THREADS=1, so OpenBLAS's pool does not compete with\n"
              "PyTorch's (the fastest PyTorch found on this machine).\n");
  return 0;
} catch (const tandem::Error& e) {
  std::fprintf(stderr, "bench_fit: %s\n", e.what());
  return 1;
}
