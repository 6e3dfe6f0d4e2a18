// tandem_run_probe — the worker program that tandem_run_test launches. What it does is chosen by
// its arguments, always in this order (so a test knows, e.g., that the environment is printed
// before the probe fails):
//
//   --ignore-sigterm | --report-sigterm   SIGTERM ignored / answered with "got SIGTERM", exit 143
//   --spawn-child        fork a child that sleeps 30 s; print "child pid P"
//   --print-env          print NAME=value (or "NAME unset") for TF_CONFIG, torchrun's and TANDEM_*
//   --lines N            print "out i" to stdout and "err i" to stderr, i = 0..N-1
//   --long-line BYTES    print BYTES 'x' then one newline
//   --ready              print "ready pid P"
//   --exit-delay MS      wait MS before the two checks below (on the failing rank only)
//   --exit R:X           exit with code X when rank == R (every attempt)
//   --kill-self R        SIGKILL itself when rank == R and TANDEM_RESTART_COUNT == 0
//   --sleep S            sleep S seconds
//   --partial TEXT       print TEXT without a newline
//
// then exit 0. The rank is RANK when set, else TF_CONFIG's task index.
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>

#include <nlohmann/json.hpp>

namespace {

void put(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n <= 0) return;
    text.remove_prefix(static_cast<std::size_t>(n));
  }
}

void line(std::string_view text) { put(STDOUT_FILENO, std::string(text) + "\n"); }

extern "C" void report_sigterm(int) {
  static const char kMessage[] = "got SIGTERM\n";
  [[maybe_unused]] const ssize_t ignored = ::write(STDOUT_FILENO, kMessage, sizeof kMessage - 1);
  ::_exit(143);
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

int my_rank() {
  if (std::getenv("RANK")) return env_int("RANK", -1);
  if (const char* tf = std::getenv("TF_CONFIG")) return nlohmann::json::parse(tf).at("task").at("index").get<int>();
  return -1;
}

// "R:X" -> {R, X}
std::pair<int, int> rank_and_value(const char* text) {
  const char* colon = std::strchr(text, ':');
  if (!colon) {
    std::fprintf(stderr, "tandem_run_probe: expected R:X, got '%s'\n", text);
    std::exit(64);
  }
  return {std::atoi(text), std::atoi(colon + 1)};
}

}  // namespace

int main(int argc, char** argv) {
  bool ignore_sigterm = false, on_sigterm_report = false, spawn_child = false, print_env = false, ready = false;
  int lines = 0, long_line = 0, exit_delay_ms = 0, kill_rank = -1;
  std::pair<int, int> exit_spec{-1, 0};
  double sleep_s = 0;
  const char* partial = nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "tandem_run_probe: %s needs a value\n", argv[i]);
        std::exit(64);
      }
      return argv[++i];
    };
    if (a == "--ignore-sigterm") ignore_sigterm = true;
    else if (a == "--report-sigterm") on_sigterm_report = true;
    else if (a == "--spawn-child") spawn_child = true;
    else if (a == "--print-env") print_env = true;
    else if (a == "--lines") lines = std::atoi(next());
    else if (a == "--long-line") long_line = std::atoi(next());
    else if (a == "--ready") ready = true;
    else if (a == "--exit-delay") exit_delay_ms = std::atoi(next());
    else if (a == "--exit") exit_spec = rank_and_value(next());
    else if (a == "--kill-self") kill_rank = std::atoi(next());
    else if (a == "--sleep") sleep_s = std::atof(next());
    else if (a == "--partial") partial = next();
    else {
      std::fprintf(stderr, "tandem_run_probe: unknown argument '%s'\n", argv[i]);
      return 64;
    }
  }

  if (ignore_sigterm) ::signal(SIGTERM, SIG_IGN);
  if (on_sigterm_report) ::signal(SIGTERM, report_sigterm);
  if (spawn_child) {
    const pid_t child = ::fork();
    if (child == 0) {
      ::signal(SIGTERM, SIG_DFL);
      ::sleep(30);
      ::_exit(0);
    }
    line("child pid " + std::to_string(child));
  }
  const int rank = my_rank();
  if (print_env) {
    for (const char* name : {"TF_CONFIG", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                             "LOCAL_WORLD_SIZE", "GROUP_RANK", "TANDEM_LOCAL_RANK", "TANDEM_LOCAL_WORLD_SIZE",
                             "TANDEM_RESTART_COUNT", "TANDEM_LAUNCHER"}) {
      const char* v = std::getenv(name);
      line(v ? std::string(name) + "=" + v : std::string(name) + " unset");
    }
  }
  for (int i = 0; i < lines; ++i) {
    line("out " + std::to_string(i));
    put(STDERR_FILENO, "err " + std::to_string(i) + "\n");
  }
  if (long_line > 0) line(std::string(static_cast<std::size_t>(long_line), 'x'));
  if (ready) line("ready pid " + std::to_string(::getpid()));
  if (rank == exit_spec.first || rank == kill_rank) {
    std::this_thread::sleep_for(std::chrono::milliseconds(exit_delay_ms));
  }
  if (rank == exit_spec.first) return exit_spec.second;
  if (rank == kill_rank && env_int("TANDEM_RESTART_COUNT", -1) == 0) ::raise(SIGKILL);
  if (sleep_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(sleep_s));
  if (partial) put(STDOUT_FILENO, partial);
  return 0;
}
