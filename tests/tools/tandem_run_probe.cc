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
#include <string>
#include <string_view>
#include <utility>
#include <thread>

#include <CLI/CLI.hpp>
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

}  // namespace

int main(int argc, char** argv) {
  bool ignore_sigterm = false, on_sigterm_report = false, spawn_child = false, print_env = false, ready = false;
  int lines = 0, long_line = 0, exit_delay_ms = 0, kill_rank = -1;
  std::pair<int, int> exit_spec{-1, 0};
  double sleep_s = 0;
  std::string partial;
  CLI::App app("tandem_run_probe: the worker program tandem_run_test launches");
  app.add_flag("--ignore-sigterm", ignore_sigterm, "ignore SIGTERM");
  app.add_flag("--report-sigterm", on_sigterm_report, "answer SIGTERM with \"got SIGTERM\" and exit 143");
  app.add_flag("--spawn-child", spawn_child, "fork a child that sleeps 30 s; print \"child pid P\"");
  app.add_flag("--print-env", print_env, "print TF_CONFIG, torchrun's and TANDEM_* variables");
  app.add_option("--lines", lines, "print \"out i\" to stdout and \"err i\" to stderr, i = 0..N-1");
  app.add_option("--long-line", long_line, "print BYTES 'x' then one newline");
  app.add_flag("--ready", ready, "print \"ready pid P\"");
  app.add_option("--exit-delay", exit_delay_ms, "wait MS before --exit and --kill-self (on that rank only)");
  app.add_option("--exit", exit_spec, "exit with code X when rank == R (every attempt)")
      ->type_name("R:X")
      ->delimiter(':');
  app.add_option("--kill-self", kill_rank, "SIGKILL itself when rank == R and TANDEM_RESTART_COUNT == 0");
  app.add_option("--sleep", sleep_s, "sleep S seconds");
  app.add_option("--partial", partial, "print TEXT without a newline");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 64;
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
                             "TANDEM_RESTART_COUNT", "TANDEM_LAUNCHER_STORE", "TANDEM_LAUNCHER"}) {
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
  if (!partial.empty()) put(STDOUT_FILENO, partial);
  return 0;
}
