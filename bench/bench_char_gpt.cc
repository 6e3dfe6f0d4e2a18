// bench_char_gpt — the character-level GPT of samples/char_gpt.cc beside its PyTorch peer
// (bench/peers/torch_char_gpt.py, eager and torch.compile), run in the same invocation: training
// tokens/s and the validation loss (nats/char) every --eval-every steps, for each.
//
//   build/bench/bench_char_gpt [--steps 2000] [--eval-every 250] [--repeat 1] [--python PY]
//       [--no-compile] [--no-peer] [--strategy mirrored|one] [--same-init] [-- extra char_gpt flags]
//
// Both programs train the same model on the same data split with the same initialisers,
// optimizer and schedule (the peer's header states them; char_gpt matches it), time the training
// steps only (after 10 warm-up steps) and report peak resident memory. Both validate on the same
// windows: the peer's 20 batches drawn with its fixed seed (torch.randint under manual_seed(1234)),
// which this program asks the peer's Python for and hands to char_gpt as --eval-starts.
// --repeat R interleaves R runs of each and reports median tokens/s (the machines we measure on
// drift by tens of percent over minutes); the loss curves come from the first round (tandem's are
// the same every run).
// --same-init adds a second tandem run that starts from the peer's own initial weights (the peer's
// --save-init, loaded by char_gpt's --init-from): the two programs then differ only in the batches
// and dropout masks they draw, not in the initial draw, whose luck moves the final loss by
// several hundredths.
// The machine's ceiling, measured in the same run: sgemm through tandem's gemm() on every thread.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "machine_info.h"
#include "tandem/devices/device.h"
#include "tandem/ops/cpu/gemm.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  int steps = 2000;
  int eval_every = 250;
  int repeat = 1;
  bool peer = true;
  bool compile = true;
  bool same_init = false;  // also run char_gpt from the peer's initial weights
  std::string python;
  std::string strategy = "mirrored";  // char_gpt's default: one replica per core
  std::vector<std::string> extra;     // passed to char_gpt after its own flags
};

// What one run printed: "step S train_loss L val_loss V tokens/s T" lines (both programs print
// this format) and the final "tokens/s T peak_rss_mb M".
struct Run {
  std::map<int, double> val_loss;
  double tokens_per_s = 0;
  double peak_rss_mb = 0;
  double wall_s = 0;
};

std::optional<Run> run_command(const std::string& command) {
  const auto start = Clock::now();
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return std::nullopt;
  std::string output;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, pipe) != nullptr) output += buf;
  const int status = pclose(pipe);
  Run run;
  run.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    int step = 0;
    double train = 0, val = 0, tps = 0, rss = 0;
    if (std::sscanf(line.c_str(), "step %d train_loss %lf val_loss %lf tokens/s %lf", &step, &train, &val, &tps) == 4) {
      run.val_loss[step] = val;
    } else if (std::sscanf(line.c_str(), "tokens/s %lf peak_rss_mb %lf", &tps, &rss) == 2) {
      run.tokens_per_s = tps;
      run.peak_rss_mb = rss;
    }
  }
  if (status != 0 || run.tokens_per_s <= 0) {
    std::fprintf(stderr, "did not run (%s), exit status %d:\n%s\n", command.c_str(), status, output.c_str());
    return std::nullopt;
  }
  return run;
}

// The peers' interpreter: --python, else $TANDEM_PEER_PYTHON, else the virtual environment
// bench/peers/README.md installs, else python3.
std::string default_python() {
  if (const char* env = std::getenv("TANDEM_PEER_PYTHON"); env != nullptr && *env != '\0') return env;
  if (const char* home = std::getenv("HOME"); home != nullptr) {
    const std::string venv = std::string(home) + "/peers-venv/bin/python";
    if (access(venv.c_str(), X_OK) == 0) return venv;
  }
  return "python3";
}

// sgemm 1024^3 through tandem's gemm() on every thread of CPU:0: the best of 5 calls.
double sgemm_ceiling_gflops() {
  constexpr std::int64_t n = 1024;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n, 0.0f);
  auto& device = tandem::devices::get_device("CPU:0");
  const tandem::ops::cpu::GemmShape shape{.m = n, .n = n, .k = n, .lda = n, .ldb = n, .ldc = n};
  double best = 0;
  for (int i = 0; i < 6; ++i) {
    const auto start = Clock::now();
    tandem::ops::cpu::gemm<float>(device, shape, 1.0f, a.data(), b.data(), 0.0f, c.data());
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    if (i > 0) best = std::max(best, 2.0 * n * n * n / s / 1e9);  // the first call warms up
  }
  return best;
}

// Multiply-adds of one training step of the default model, counted as the usual 6 * (matrix
// parameters) * tokens plus the attention products (QK^T and PV, forward and two backward, causal
// rows counted whole), so that GFLOP/s compares with the sgemm ceiling.
double flops_per_step(double vocab) {
  const double width = 128, context = 128, batch = 32, layers = 4, tokens = batch * context;
  const double matrix_params = layers * 12 * width * width + width * vocab;
  const double attention = layers * batch * 3 * 2 * (2 * context * context * width);
  return 6 * matrix_params * tokens + attention;
}

// Writes the start offsets of the peer's validation windows (its evaluate(): 20 batches of 32 from
// torch.randint under manual_seed(1234), over the last 10% of the text) to `path`, one batch per
// line, using the peer's own Python and PyTorch so that the numbers are the ones it draws.
bool write_peer_eval_starts(const std::string& python, const std::string& path) {
  const std::string script = fmt::format(
      "import gzip, torch\n"
      "raw = gzip.open('{0}', 'rb').read()\n"
      "n = len(raw.decode('utf-8', errors='replace'))\n"
      "val = n - int(0.9 * n)\n"
      "g = torch.Generator().manual_seed(1234)\n"
      "with open('{1}', 'w') as f:\n"
      "    for _ in range(20):\n"
      "        f.write(' '.join(str(i) for i in torch.randint(val - 128 - 1, (32,), generator=g).tolist()) + '\\n')\n",
      "/usr/share/doc/jargon-text/jargon.txt.gz", path);
  FILE* pipe = popen((python + " - 2>&1").c_str(), "w");
  if (pipe == nullptr) return false;
  std::fputs(script.c_str(), pipe);
  return pclose(pipe) == 0;
}

// Writes the peer's initial weights (its --save-init: char_gpt's names and layouts) to `path`.
bool write_peer_init(const std::string& python, const std::string& path) {
  const std::string cmd = fmt::format("{} {}/torch_char_gpt.py --steps 0 --save-init {} >/dev/null 2>&1", python,
                                      TANDEM_BENCH_PEER_DIR, path);
  return std::system(cmd.c_str()) == 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) try {
  Options o;
  o.python = default_python();
  CLI::App app("bench_char_gpt: samples/char_gpt beside the PyTorch peer (eager and torch.compile)");
  app.add_option("--steps", o.steps, "training steps of each run")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--eval-every", o.eval_every, "steps between validation losses")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--repeat", o.repeat, "interleaved runs of each program (median tokens/s)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--python", o.python, "the peers' Python (with torch 2.15)")->capture_default_str();
  app.add_flag("--peer,!--no-peer", o.peer, "run the PyTorch peer");
  app.add_flag("--compile,!--no-compile", o.compile, "also run the peer under torch.compile");
  app.add_option("--strategy", o.strategy, "char_gpt's --strategy")
      ->capture_default_str()
      ->check(CLI::IsMember({"one", "mirrored"}));
  app.add_flag("--same-init", o.same_init, "also run char_gpt from the peer's initial weights");
  app.add_option("extra", o.extra, "more char_gpt flags (after --)");
  CLI11_PARSE(app, argc, argv);

  const int threads = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  fmt::print("bench_char_gpt, {}\n", bench::now_text());
  fmt::print("machine: {}, {} cores, {}\n", bench::cpu_model(), threads, bench::memory_total());
  fmt::print("CPU kernels: {}\n", bench::cpu_kernels_text());
  fmt::print("sgemm 1024^3 through tandem's gemm() on {} threads: {:.1f} GFLOP/s (the ceiling)\n",
             tandem::devices::get_device("CPU:0").intra_op_threads(), sgemm_ceiling_gflops());

  std::string extra;
  for (const auto& e : o.extra) extra += " " + e;
  char starts_path[] = "/tmp/bench_char_gpt_starts.XXXXXX";
  const int fd = mkstemp(starts_path);
  if (fd >= 0) close(fd);
  if (o.peer && fd >= 0 && write_peer_eval_starts(o.python, starts_path)) {
    extra += fmt::format(" --eval-starts {}", starts_path);
  } else if (o.peer) {
    std::fprintf(stderr, "could not draw the peer's validation windows; char_gpt validates on its own\n");
  }
  const std::string tandem_cmd = fmt::format("{} --steps {} --eval-every {} --strategy {} --verbose 0{} 2>&1",
                                             TANDEM_CHAR_GPT_PATH, o.steps, o.eval_every, o.strategy, extra);
  const std::string peer_cmd = fmt::format("{} {}/torch_char_gpt.py --steps {} --eval-every {} --threads {}", o.python,
                                           TANDEM_BENCH_PEER_DIR, o.steps, o.eval_every, threads);
  struct Column {
    std::string name, command;
    std::vector<Run> runs;
  };
  std::vector<Column> columns{{"tandem (" + o.strategy + ")", tandem_cmd, {}}};
  char init_path[] = "/tmp/bench_char_gpt_init.XXXXXX";
  const int init_fd = o.same_init ? mkstemp(init_path) : -1;
  if (init_fd >= 0) close(init_fd);
  if (init_fd >= 0 && write_peer_init(o.python, init_path)) {
    const std::string same =
        fmt::format("{} --steps {} --eval-every {} --strategy {} --verbose 0{} --init-from {} 2>&1",
                    TANDEM_CHAR_GPT_PATH, o.steps, o.eval_every, o.strategy, extra, init_path);
    columns.push_back({"tandem, peer's init", same, {}});
  } else if (o.same_init) {
    std::fprintf(stderr, "could not write the peer's initial weights; no --same-init run\n");
  }
  if (o.peer) columns.push_back({"torch eager", peer_cmd + " 2>&1", {}});
  if (o.peer && o.compile) columns.push_back({"torch.compile", peer_cmd + " --compile 2>&1", {}});
  for (const auto& c : columns) fmt::print("  {}: {}\n", c.name, c.command);
  for (int r = 0; r < o.repeat; ++r) {
    for (auto& c : columns) {
      if (auto run = run_command(c.command)) c.runs.push_back(*run);
    }
  }

  fmt::print("\nvalidation loss, nats/char, on the peer's 20 validation batches (first round)\n{:>6}", "step");
  for (const auto& c : columns) fmt::print(" {:>22}", c.name);
  fmt::print("\n");
  for (int step = o.eval_every; step <= o.steps + o.eval_every - 1; step += o.eval_every) {
    const int s = std::min(step, o.steps);
    fmt::print("{:>6}", s);
    for (const auto& c : columns) {
      const auto it = c.runs.empty() ? std::map<int, double>::const_iterator{} : c.runs[0].val_loss.find(s);
      if (c.runs.empty() || it == c.runs[0].val_loss.end()) {
        fmt::print(" {:>22}", "-");
      } else {
        fmt::print(" {:>22.4f}", it->second);
      }
    }
    fmt::print("\n");
  }

  const double flops = flops_per_step(155);
  fmt::print("\ntraining throughput, median of {} round(s)\n", o.repeat);
  fmt::print("{:<22} {:>10} {:>9} {:>10} {:>10} {:>12}\n", "program", "tokens/s", "GFLOP/s", "vs tandem", "wall s",
             "peak RSS MB");
  double ours = 0;
  for (const auto& c : columns) {
    std::vector<double> tps, wall, rss;
    for (const auto& r : c.runs) {
      tps.push_back(r.tokens_per_s);
      wall.push_back(r.wall_s);
      rss.push_back(r.peak_rss_mb);
    }
    if (tps.empty()) {
      fmt::print("{:<22} {:>10}\n", c.name, "(did not run)");
      continue;
    }
    const double t = median(tps);
    if (ours == 0) ours = t;
    fmt::print("{:<22} {:>10.0f} {:>9.1f} {:>8.2f}x {:>10.0f} {:>12.0f}\n", c.name, t, t / (32.0 * 128) * flops / 1e9,
               ours / t, median(wall), median(rss));
  }
  fmt::print(
      "(GFLOP/s counts {:.2f} GFLOP per step of 4096 tokens; \"vs tandem\" is tandem's tokens/s over the row's)\n",
      flops / 1e9);
  if (fd >= 0) unlink(starts_path);
  if (init_fd >= 0) unlink(init_path);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_char_gpt: %s\n", e.what());
  return 1;
}
