// tandem-run — starts the N worker processes of one multi-worker training program on this node
// (like torchrun), tells each who it is, relays their output line by line, and stops or restarts
// the whole group when one of them fails.
//
//   tandem-run --nproc_per_node 2 -- ./train --epochs 3
//
// Each worker learns its place from TF_CONFIG (TensorFlow's cluster spec; worker 0 is the chief
// and serves the rendezvous store on master_addr:master_port), or, on several nodes without
// --hosts, from torchrun's variables (MASTER_ADDR, RANK, ...). See tools/README.md.
//
// One thread, one poll() loop: the workers' stdout/stderr pipes and a self-pipe that the signal
// handlers (SIGINT, SIGTERM, SIGHUP, SIGCHLD) write to. Every wait in the loop has a deadline or
// ends when the workers end, so the launcher never hangs.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "coordination.h"
#include "tandem/base/env.h"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int kUsageExitCode = 2;        // bad command line, as getopt-style tools do
constexpr int kCannotRunExitCode = 127;  // program not found or not executable, as shells do
// Each worker holds two pipe descriptors in the launcher; 256 workers stay far below the usual
// 1024 descriptor limit, and no node runs more workers than that.
constexpr int kMaxProcsPerNode = 256;
constexpr double kMaxStopTimeoutSeconds = 86400;
constexpr int kDefaultMasterPort = 29500;  // torchrun's default
constexpr auto kDefaultStopTimeout = 30s;
// --nnodes MIN:MAX: how long a round waits for more nodes once MIN have arrived. Short, since a
// node that is gone for good costs every restart this long (torchrun's last_call_timeout).
constexpr auto kDefaultJoinTimeout = 5s;
constexpr int kMaxNodes = 65536;
// A worker that writes a very long line without a newline is relayed in pieces of this size, so
// the launcher's memory stays bounded.
constexpr std::size_t kMaxLineBytes = 64 * 1024;
constexpr std::size_t kReadChunkBytes = 64 * 1024;
// How much of a failed worker's last error line the other nodes are told.
constexpr std::size_t kLastLineBytes = 400;
// After every worker has exited, output still buffered in the pipes is relayed; pipes that a
// worker's own children keep open are read for at most this long.
constexpr auto kDrainTimeout = 2s;
// After SIGKILL the kernel normally reports the exit at once; a process stuck in the kernel
// (uninterruptible I/O) is given up on after this long rather than waited for forever.
constexpr auto kKillWaitTimeout = 10s;
// poll() also wakes up this often, in case a SIGCHLD wake-up was lost (full self-pipe).
constexpr auto kPollInterval = 500ms;
// How many times to look for a run of free ports for --master_port 0.
constexpr int kFreePortAttempts = 50;

// The variables the launcher sets; copies inherited from its own environment are dropped so a
// worker never sees a stale mix (the program's resolver reads TF_CONFIG or torchrun's set).
constexpr std::string_view kManagedVariables[] = {"TF_CONFIG",
                                                  "MASTER_ADDR",
                                                  "MASTER_PORT",
                                                  "RANK",
                                                  "WORLD_SIZE",
                                                  "LOCAL_RANK",
                                                  "LOCAL_WORLD_SIZE",
                                                  "GROUP_RANK",
                                                  "TANDEM_LOCAL_RANK",
                                                  "TANDEM_LOCAL_WORLD_SIZE",
                                                  "TANDEM_RESTART_COUNT",
                                                  "TANDEM_LAUNCHER_STORE",
                                                  "TANDEM_LAUNCHER"};

// The --help text around CLI11's list of options.
constexpr std::string_view kUsageLine = "Usage: tandem-run --nproc_per_node N [options] -- PROGRAM [ARGS...]";
constexpr std::string_view kDescription = R"(Starts N worker processes of PROGRAM on this node for multi-worker training
(MultiWorkerMirroredStrategy) and relays their output, prefixed "[rank R] ".)";
constexpr std::string_view kFooter =
    R"(Options take --opt value or --opt=value; torchrun's dashed spellings (--nproc-per-node) work
too. With --hosts every worker's address is known and TF_CONFIG is set on every node; without
it, several nodes get torchrun's variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK) instead of TF_CONFIG.

--nnodes MIN:MAX (elastic): each restart round runs on the nodes whose launchers arrive, at
least MIN and always node 0, renumbered 0..k-1, with the world size they make; a round waits
--join_timeout seconds for more once MIN are there. A node started again joins at the next
restart.

Every worker also gets TANDEM_LOCAL_RANK, TANDEM_LOCAL_WORLD_SIZE, TANDEM_RESTART_COUNT
(0, then 1, 2, ... after restarts) and TANDEM_LAUNCHER=tandem-run; stdin is /dev/null.

Exit status: 0 when every worker exits 0; else the failed worker's exit code (128 + signal
when it was killed); 128 + signal when tandem-run itself is stopped by SIGINT, SIGTERM or
SIGHUP (forwarded to the workers); 2 for a bad command line; 127 when PROGRAM cannot run.)";

// A command-line mistake: main prints it on one line and exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A fatal problem starting workers (program missing, fork failing): main exits 127 or 1.
class LaunchError : public std::runtime_error {
 public:
  LaunchError(int exit_code, const std::string& message) : std::runtime_error(message), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

struct Options {
  int nproc_per_node = 0;
  int min_nodes = 1;  // --nnodes MIN:MAX; plain --nnodes N is N:N
  int nnodes = 1;     // MAX: the nodes the job is started with, and --node_rank's range
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = kDefaultMasterPort;
  int max_restarts = 0;
  std::chrono::milliseconds stop_timeout = kDefaultStopTimeout;
  std::chrono::milliseconds join_timeout = kDefaultJoinTimeout;
  std::vector<std::string> hosts;    // empty: not given
  std::vector<std::string> program;  // PROGRAM and its arguments
  std::optional<std::string> help;   // set by --help: the text to print, and nothing else to do
};

// ---------------------------------------------------------------------------------------------
// Command line

// CLI11 checks, in tandem-run's words. CLI11 runs them on the text before converting it, and
// puts the option's name in front: "--nproc_per_node: expects an integer from 1 to 256, got 'x'".
CLI::Validator integer_from(int min, int max) {
  return CLI::Validator(
      [min, max](const std::string& text) -> std::string {
        int value = 0;
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, value);
        if (text.empty() || ec != std::errc() || ptr != end || value < min || value > max) {
          return fmt::format("expects an integer from {} to {}, got '{}'", min, max, text);
        }
        return {};
      },
      "");
}

CLI::Validator seconds_up_to(double max) {
  return CLI::Validator(
      [max](const std::string& text) -> std::string {
        char* end = nullptr;
        errno = 0;
        const double seconds = text.empty() ? NAN : std::strtod(text.c_str(), &end);
        if (text.empty() || errno != 0 || end != text.c_str() + text.size() || !std::isfinite(seconds) || seconds < 0 ||
            seconds > max) {
          return fmt::format("expects seconds from 0 to {}, got '{}'", max, text);
        }
        return {};
      },
      "");
}

// "N" or "MIN:MAX" (torchrun's elastic range), 1 <= MIN <= MAX <= kMaxNodes: {MIN, MAX}, or none.
std::optional<std::pair<int, int>> parse_node_range(std::string_view text) {
  const auto number = [](std::string_view part) -> std::optional<int> {
    int value = 0;
    const auto [ptr, ec] = std::from_chars(part.data(), part.data() + part.size(), value);
    if (part.empty() || ec != std::errc() || ptr != part.data() + part.size()) return std::nullopt;
    return value;
  };
  const std::size_t colon = text.find(':');
  const auto min = number(text.substr(0, colon));
  const auto max = colon == std::string_view::npos ? min : number(text.substr(colon + 1));
  if (!min || !max || *min < 1 || *min > *max || *max > kMaxNodes) return std::nullopt;
  return std::pair{*min, *max};
}

std::vector<std::string> split_hosts(std::string_view text) {
  std::vector<std::string> hosts;
  for (std::size_t start = 0;;) {
    const std::size_t comma = text.find(',', start);
    const std::string_view host =
        text.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    if (host.empty()) throw UsageError(fmt::format("--hosts has an empty entry in '{}'", text));
    hosts.emplace_back(host);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return hosts;
}

// --help's layout: our usage line first, then the description, CLI11's list of options, the footer.
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_help(const CLI::App* app, std::string, CLI::AppFormatMode mode) const override {
    return fmt::format("{}\n\n{}{}\n{}", kUsageLine, make_description(app), make_groups(app, mode), make_footer(app));
  }
};

Options parse_command_line(std::span<char* const> args) {
  Options options;
  // Everything after the first "--" is the program and its arguments: CLI11 sees what is before.
  const auto separator =
      std::find_if(args.begin(), args.end(), [](const char* a) { return std::string_view(a) == "--"; });
  const bool saw_separator = separator != args.end();
  if (saw_separator) options.program.assign(separator + 1, args.end());

  CLI::App app(std::string(kDescription), "tandem-run");
  app.formatter(std::make_shared<HelpFormatter>());
  app.get_formatter()->column_width(24);
  app.footer(std::string(kFooter));
  app.set_help_flag("-h,--help", "print this text");
  app.allow_extras();  // reported below, in our words
  // An option given twice is reported below, in our words, rather than as CLI11's "At Most 1".
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  int nproc_per_node = 0;
  double stop_timeout_seconds = 0;
  double join_timeout_seconds = 0;
  std::string hosts;
  std::string nnodes;
  app.add_option("--nproc_per_node", nproc_per_node, "workers on this node (1 to 256)")
      ->type_name("N")
      ->required()
      ->check(integer_from(1, kMaxProcsPerNode));
  app.add_option("--nnodes", nnodes, "nodes in the job (default 1); MIN:MAX: elastic, see below")
      ->type_name("M|MIN:MAX")
      ->check(CLI::Validator(
          [](const std::string& text) -> std::string {
            if (parse_node_range(text)) return {};
            return fmt::format("expects N or MIN:MAX with 1 <= MIN <= MAX <= {}, got '{}'", kMaxNodes, text);
          },
          ""));
  app.add_option("--node_rank", options.node_rank, "this node's index, 0 to M-1 (default 0)")
      ->type_name("R")
      ->check(integer_from(0, 65535));
  auto* master_addr =
      app.add_option("--master_addr", options.master_addr, "the chief's host (default 127.0.0.1, or H0)")
          ->type_name("A")
          ->check(CLI::Validator([](const std::string& text) { return text.empty() ? "is empty" : ""; }, ""));
  app.add_option("--master_port", options.master_port,
                 "the chief's port (default 29500); local worker i listens\non P + i; 0 picks free ports (one node "
                 "only)")
      ->type_name("P")
      ->check(integer_from(0, 65535));
  auto* hosts_option =
      app.add_option("--hosts", hosts, "one host per node, H0 = master_addr (see below)")->type_name("H0,H1,...");
  app.add_option("--max_restarts", options.max_restarts, "restart the group up to K times after a failure\n(default 0)")
      ->type_name("K")
      ->check(integer_from(0, 1000000));
  auto* stop_timeout =
      app.add_option("--stop_timeout", stop_timeout_seconds, "seconds stopping workers get before SIGKILL (default 30)")
          ->type_name("S")
          ->check(seconds_up_to(kMaxStopTimeoutSeconds));
  auto* join_timeout = app.add_option("--join_timeout", join_timeout_seconds,
                                      "--nnodes MIN:MAX: seconds a round waits for more nodes\nonce MIN are there "
                                      "(default 5)")
                           ->type_name("S")
                           ->check(seconds_up_to(kMaxStopTimeoutSeconds));
  // CLI11 takes the arguments last first. torchrun's dashed names (--nproc-per-node) become ours.
  std::vector<std::string> reversed(std::make_reverse_iterator(separator), std::make_reverse_iterator(args.begin()));
  for (std::string& arg : reversed) {
    if (arg.starts_with("--")) std::replace(arg.begin() + 2, std::find(arg.begin(), arg.end(), '='), '-', '_');
  }
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    options.help = app.help();
    return options;
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what());
  }
  for (const CLI::Option* option : app.get_options()) {
    if (option->count() > 1) throw UsageError(fmt::format("option {} is given twice", option->get_name()));
  }
  if (const auto extras = app.remaining(); !extras.empty()) {
    if (extras[0].starts_with("-")) throw UsageError(fmt::format("unknown option '{}'", extras[0]));
    throw UsageError(fmt::format("unexpected argument '{}': options come first, then '--' and the program", extras[0]));
  }
  options.nproc_per_node = nproc_per_node;
  if (stop_timeout->count() > 0) {
    options.stop_timeout =
        std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(stop_timeout_seconds * 1000)));
  }
  if (join_timeout->count() > 0) {
    options.join_timeout =
        std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(join_timeout_seconds * 1000)));
  }
  if (const auto range = parse_node_range(nnodes)) std::tie(options.min_nodes, options.nnodes) = *range;
  if (hosts_option->count() > 0) options.hosts = split_hosts(hosts);

  if (options.node_rank >= options.nnodes) {
    throw UsageError(fmt::format("--node_rank {} is out of range: with --nnodes {} node ranks are 0 to {}",
                                 options.node_rank, options.nnodes, options.nnodes - 1));
  }
  if (options.master_port != 0 && options.master_port + options.nproc_per_node - 1 > 65535) {
    throw UsageError(
        fmt::format("--master_port {} is too high for --nproc_per_node {}: worker ports run to {} (max 65535)",
                    options.master_port, options.nproc_per_node, options.master_port + options.nproc_per_node - 1));
  }
  if (options.master_port == 0 && options.nnodes > 1) {
    throw UsageError(
        fmt::format("--master_port 0 (pick free ports) needs --nnodes 1: the other {} nodes could not "
                    "know the port picked here",
                    options.nnodes - 1));
  }
  if (!options.hosts.empty()) {
    if (static_cast<int>(options.hosts.size()) != options.nnodes) {
      throw UsageError(fmt::format("--hosts lists {} hosts but --nnodes is {}: give one host per node",
                                   options.hosts.size(), options.nnodes));
    }
    for (std::size_t a = 0; a < options.hosts.size(); ++a) {
      for (std::size_t b = a + 1; b < options.hosts.size(); ++b) {
        if (options.hosts[a] == options.hosts[b]) {
          // Ports are master_port + local index on every node, so two nodes on one host collide.
          throw UsageError(fmt::format("--hosts lists '{}' for nodes {} and {}: their workers would use the same ports",
                                       options.hosts[a], a, b));
        }
      }
    }
    if (master_addr->count() == 0) {
      options.master_addr = options.hosts[0];
    } else if (options.hosts[0] != options.master_addr) {
      throw UsageError(
          fmt::format("--hosts starts with '{}' but --master_addr is '{}': node 0 hosts the chief, so "
                      "they must be equal",
                      options.hosts[0], options.master_addr));
    }
  }
  if (!saw_separator) throw UsageError("missing '--' and the program to run (tandem-run [options] -- PROGRAM ...)");
  if (options.program.empty() || options.program[0].empty()) {
    throw UsageError("missing the program to run after '--'");
  }
  return options;
}

// ---------------------------------------------------------------------------------------------
// Small POSIX helpers

std::string errno_text(int error) { return std::strerror(error); }

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

// Writes all of text to fd; gives up quietly when the reader is gone (EPIPE): output that nobody
// reads must not stop the launcher from managing its workers.
void write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {  // our stdout was made non-blocking by someone else: wait for room
        pollfd p{fd, POLLOUT, 0};
        ::poll(&p, 1, 100);
        continue;
      }
      return;
    }
    text.remove_prefix(static_cast<std::size_t>(n));
  }
}

void say(std::string_view message) { write_all(STDERR_FILENO, fmt::format("tandem-run: {}\n", message)); }

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// "host:port", with IPv6 literals in brackets as URLs and gRPC write them.
std::string host_port(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && !host.starts_with('[')) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

bool port_is_free(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

// A port P such that P .. P + count - 1 are free now. The kernel picks P (bind to port 0); the
// rest are checked by binding them, since every local worker listens on P + its local rank.
// Binding the wildcard address conflicts with any address's use of the port, so the check covers
// whichever address the workers bind.
int pick_free_ports(int count) {
  for (int attempt = 0; attempt < kFreePortAttempts; ++attempt) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw LaunchError(1, fmt::format("cannot pick a free port: socket: {}", errno_text(errno)));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = 0;
    socklen_t len = sizeof addr;
    if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      const int error = errno;
      ::close(fd);
      throw LaunchError(1, fmt::format("cannot pick a free port: {}", errno_text(error)));
    }
    ::close(fd);
    const int port = ntohs(addr.sin_port);
    if (port + count - 1 > 65535) continue;
    bool all_free = true;
    for (int k = 0; k < count && all_free; ++k) all_free = port_is_free(port + k);
    if (all_free) return port;
  }
  throw LaunchError(1, fmt::format("cannot find {} consecutive free ports for --master_port 0", count));
}

// PROGRAM as execve needs it: names without a slash are looked up in PATH, as a shell does.
std::string resolve_program(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path_env = std::getenv("PATH");
  const std::string_view path = path_env ? path_env : "/usr/local/bin:/usr/bin:/bin";
  for (std::size_t start = 0;;) {
    const std::size_t colon = path.find(':', start);
    const std::string_view dir =
        path.substr(start, colon == std::string_view::npos ? std::string_view::npos : colon - start);
    // An empty PATH entry means the current directory.
    const std::string candidate = fmt::format("{}/{}", dir.empty() ? std::string_view(".") : dir, name);
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    if (colon == std::string_view::npos) break;
    start = colon + 1;
  }
  throw LaunchError(kCannotRunExitCode, fmt::format("cannot find program '{}' in PATH", name));
}

// ---------------------------------------------------------------------------------------------
// Signals: the handlers only write the signal number into a pipe that the poll loop reads.

int g_signal_pipe_write = -1;
// Set while the launcher meets the others (no worker runs then, and the meeting blocks for up to
// the rendezvous timeout): a stop signal then ends tandem-run at once.
volatile std::sig_atomic_t g_exit_on_signal = 0;

extern "C" void on_signal(int sig) {
  if (g_exit_on_signal != 0 && sig != SIGCHLD) ::_exit(128 + sig);
  const int saved_errno = errno;
  const auto byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t ignored = ::write(g_signal_pipe_write, &byte, 1);
  errno = saved_errno;
}

constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP};

// Returns the read end of the self-pipe.
int install_signal_handlers() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw LaunchError(1, fmt::format("cannot create a pipe: {}", errno_text(errno)));
  }
  g_signal_pipe_write = fds[1];
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  for (const int sig : kForwardedSignals) ::sigaction(sig, &action, nullptr);
  ::sigaction(SIGCHLD, &action, nullptr);
  // A parent may have started us with these blocked; then a stop request would never arrive.
  sigset_t handled;
  sigemptyset(&handled);
  for (const int sig : kForwardedSignals) sigaddset(&handled, sig);
  sigaddset(&handled, SIGCHLD);
  ::sigprocmask(SIG_UNBLOCK, &handled, nullptr);
  // A closed stdout must show up as EPIPE from write, not kill the launcher and orphan workers.
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  ::sigaction(SIGPIPE, &ignore, nullptr);
  return fds[0];
}

// ---------------------------------------------------------------------------------------------
// Workers

// One of a worker's output pipes, relayed line by line with the worker's prefix.
struct OutputPipe {
  int fd = -1;            // read end; -1 once closed
  int target = -1;        // the launcher's STDOUT_FILENO or STDERR_FILENO
  std::string pending;    // bytes after the last newline
  std::string last_line;  // the last line relayed (cut to kLastLineBytes), for failure reports

  void relay(const std::string& prefix, bool at_eof) {
    std::string out;
    std::size_t start = 0;
    for (;;) {
      const std::size_t nl = pending.find('\n', start);
      if (nl != std::string::npos && nl - start <= kMaxLineBytes) {
        out.append(prefix).append(pending, start, nl + 1 - start);
        if (nl > start) last_line.assign(pending, start, std::min(nl - start, kLastLineBytes));
        start = nl + 1;
      } else if (pending.size() - start >= kMaxLineBytes) {
        // Too long for one line: relayed in pieces, each ended with a newline so that every
        // line of the launcher's output starts with a prefix.
        out.append(prefix).append(pending, start, kMaxLineBytes).push_back('\n');
        start += kMaxLineBytes;
      } else {
        break;
      }
    }
    if (at_eof && start < pending.size()) {  // the last line had no newline
      out.append(prefix).append(pending, start, std::string::npos).push_back('\n');
      start = pending.size();
    }
    pending.erase(0, start);
    if (!out.empty()) write_all(target, out);
  }

  // Reads what is there (one chunk, so one chatty worker cannot starve the others).
  void read_some(const std::string& prefix) {
    char buffer[kReadChunkBytes];
    const ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n > 0) {
      pending.append(buffer, static_cast<std::size_t>(n));
      relay(prefix, false);
    } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
      relay(prefix, true);
      close_fd(fd);
    }
  }

  // Relays what is in the pipe now, without waiting for more (a bounded number of chunks).
  void read_available(const std::string& prefix) {
    for (int i = 0; i < 64 && fd >= 0; ++i) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 0) <= 0) return;
      read_some(prefix);
    }
  }

  void close_and_flush(const std::string& prefix) {
    if (fd < 0) return;
    relay(prefix, true);
    close_fd(fd);
  }
};

struct Worker {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;  // also its process group id
  bool running = false;
  int wait_status = 0;
  std::string prefix;
  OutputPipe out, err;
  std::vector<std::string> environment;
};

// "rank 1 (pid 4242) exited with code 3" / "... was killed by signal 9 (SIGKILL)".
std::string describe_exit(const Worker& w) {
  if (WIFSIGNALED(w.wait_status)) {
    const int sig = WTERMSIG(w.wait_status);
    return fmt::format("rank {} (pid {}) was killed by signal {} ({})", w.rank, w.pid, sig, signal_name(sig));
  }
  return fmt::format("rank {} (pid {}) exited with code {}", w.rank, w.pid, WEXITSTATUS(w.wait_status));
}

int exit_code_of(int wait_status) {
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return WEXITSTATUS(wait_status);
}

bool succeeded(int wait_status) { return WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0; }

bool is_managed(std::string_view entry) {
  const std::size_t eq = entry.find('=');
  const std::string_view name = entry.substr(0, eq);
  return std::find(std::begin(kManagedVariables), std::end(kManagedVariables), name) != std::end(kManagedVariables);
}

struct AttemptOutcome {
  enum class Kind { kSucceeded, kWorkerFailed, kSignalled };
  Kind kind = Kind::kSucceeded;
  int exit_code = 0;
  std::string failure;  // describe_exit of the first failed worker
};

class Launcher {
 public:
  Launcher(Options options, int signal_pipe, int wake_fd) : options_(std::move(options)), signal_pipe_(signal_pipe) {
    for (int node = 0; node < options_.nnodes; ++node) membership_.nodes.push_back(node);
    membership_.rank = options_.node_rank;
    program_path_ = resolve_program(options_.program[0]);
    if (options_.master_port == 0) options_.master_port = pick_free_ports(options_.nproc_per_node);
    devnull_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull_ < 0) throw LaunchError(1, fmt::format("cannot open /dev/null: {}", errno_text(errno)));
    try {
      coordinator_ = std::make_unique<tandem::tools::Coordinator>(tandem::tools::CoordinationOptions{
          .master_addr = options_.master_addr,
          .master_port = options_.master_port,
          .node_rank = options_.node_rank,
          .min_nodes = options_.min_nodes,
          .max_nodes = options_.nnodes,
          .join_timeout = options_.join_timeout,
          .processes = options_.nnodes * (options_.nproc_per_node + 1),
          .setup = fmt::format("--nnodes {} --nproc_per_node {} --max_restarts {}", nnodes_text(options_),
                               options_.nproc_per_node, options_.max_restarts),
          .timeout = tandem::env::get_seconds(tandem::env::kRendezvousTimeout),
          .wake_fd = wake_fd});
    } catch (const std::exception& e) {
      throw LaunchError(1, e.what());
    }
  }
  ~Launcher() { close_fd(devnull_); }
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  // Runs the group, restarting it after failures while restarts remain; returns the exit code.
  // Every round starts with all nodes' launchers meeting (coordination.h), so that all nodes
  // restart in step and count the same rounds.
  int run() {
    for (int restart = 0;; ++restart) {
      try {
        g_exit_on_signal = 1;
        const int world_before = world_size();
        membership_ = coordinator_->meet(restart);
        // A node that joins a running job starts at the job's next round.
        restart = membership_.round;
        g_exit_on_signal = 0;
        if (options_.min_nodes < options_.nnodes) say_membership(world_before);
      } catch (const std::exception& e) {
        g_exit_on_signal = 0;
        throw LaunchError(1, e.what());
      }
      if (const int sig = take_pending_terminating_signal()) return 128 + sig;
      AttemptOutcome outcome = run_attempt(restart);
      if (outcome.kind == AttemptOutcome::Kind::kSucceeded) outcome = await_other_nodes();
      switch (outcome.kind) {
        case AttemptOutcome::Kind::kSucceeded: coordinator_->finish(); return 0;
        case AttemptOutcome::Kind::kSignalled:
          coordinator_->report_failure(
              fmt::format("tandem-run was stopped by {}", signal_name(outcome.exit_code - 128)), outcome.exit_code);
          return outcome.exit_code;
        case AttemptOutcome::Kind::kWorkerFailed: break;
      }
      if (restart >= options_.max_restarts) {
        say(fmt::format("failed: {}", outcome.failure));
        return outcome.exit_code;
      }
      // A signal that arrived while stopping the failed group ends the job instead.
      if (const int sig = take_pending_terminating_signal()) {
        say(fmt::format("received {}; not restarting", signal_name(sig)));
        return 128 + sig;
      }
      say(fmt::format("restarting all {} workers (restart {} of {})", options_.nproc_per_node, restart + 1,
                      options_.max_restarts));
    }
  }

 private:
  static std::string nnodes_text(const Options& o) {
    return o.min_nodes == o.nnodes ? std::to_string(o.nnodes) : fmt::format("{}:{}", o.min_nodes, o.nnodes);
  }

  // The current round's world: its nodes' workers.
  int world_size() const { return static_cast<int>(membership_.nodes.size()) * options_.nproc_per_node; }
  // This node's rank in the current round (its node rank as started, unless the job is elastic).
  int node_rank() const { return membership_.rank; }

  // Elastic: which nodes the round runs on, and the world size when it changed.
  void say_membership(int world_before) const {
    std::vector<int> missing;
    for (int node = 0; node < options_.nnodes; ++node) {
      if (std::find(membership_.nodes.begin(), membership_.nodes.end(), node) == membership_.nodes.end()) {
        missing.push_back(node);
      }
    }
    std::string text =
        fmt::format("round {} runs on {} of {} nodes ({}), this one as node rank {}", membership_.round,
                    membership_.nodes.size(), options_.nnodes, fmt::join(membership_.nodes, ", "), node_rank());
    if (!missing.empty()) text += fmt::format("; missing: {}", fmt::join(missing, ", "));
    if (world_before != world_size()) {
      text += fmt::format("; world size changed {} -> {}", world_before, world_size());
    } else {
      text += fmt::format("; world size {}", world_size());
    }
    say(text);
  }

  // The environment of local worker `local_rank`, on attempt `restart`.
  std::vector<std::string> make_environment(int local_rank, int restart) const {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      if (!is_managed(*e)) env.emplace_back(*e);
    }
    const int n = options_.nproc_per_node;
    const int rank = node_rank() * n + local_rank;
    const bool addresses_known = options_.nnodes == 1 || !options_.hosts.empty();
    if (addresses_known) {
      nlohmann::json workers = nlohmann::json::array();
      for (const int node : membership_.nodes) {  // this round's nodes: an elastic job's survivors
        const std::string& host =
            options_.hosts.empty() ? options_.master_addr : options_.hosts[static_cast<std::size_t>(node)];
        for (int k = 0; k < n; ++k) workers.push_back(host_port(host, options_.master_port + k));
      }
      const nlohmann::json tf_config = {{"cluster", {{"worker", workers}}},
                                        {"task", {{"type", "worker"}, {"index", rank}}}};
      env.push_back("TF_CONFIG=" + tf_config.dump());
    } else {
      env.push_back("MASTER_ADDR=" + options_.master_addr);
      env.push_back(fmt::format("MASTER_PORT={}", options_.master_port));
      env.push_back(fmt::format("RANK={}", rank));
      env.push_back(fmt::format("WORLD_SIZE={}", world_size()));
      env.push_back(fmt::format("LOCAL_RANK={}", local_rank));
      env.push_back(fmt::format("LOCAL_WORLD_SIZE={}", n));
      env.push_back(fmt::format("GROUP_RANK={}", node_rank()));
    }
    env.push_back(fmt::format("TANDEM_LOCAL_RANK={}", local_rank));
    env.push_back(fmt::format("TANDEM_LOCAL_WORLD_SIZE={}", n));
    env.push_back(fmt::format("TANDEM_RESTART_COUNT={}", restart));
    env.push_back("TANDEM_LAUNCHER_STORE=1");
    env.push_back("TANDEM_LAUNCHER=tandem-run");
    return env;
  }

  // Starts one worker in its own process group, its stdout/stderr on fresh pipes.
  void spawn(Worker& w) {
    std::vector<char*> argv;
    argv.reserve(options_.program.size() + 1);
    for (auto& a : options_.program) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<char*> envp;
    envp.reserve(w.environment.size() + 1);
    for (auto& e : w.environment) envp.push_back(e.data());
    envp.push_back(nullptr);

    int out[2], err[2], exec_error[2];
    if (::pipe2(out, O_CLOEXEC) != 0) throw LaunchError(1, fmt::format("cannot create a pipe: {}", errno_text(errno)));
    if (::pipe2(err, O_CLOEXEC) != 0) {
      const int e = errno;
      ::close(out[0]), ::close(out[1]);
      throw LaunchError(1, fmt::format("cannot create a pipe: {}", errno_text(e)));
    }
    if (::pipe2(exec_error, O_CLOEXEC) != 0) {
      const int e = errno;
      ::close(out[0]), ::close(out[1]), ::close(err[0]), ::close(err[1]);
      throw LaunchError(1, fmt::format("cannot create a pipe: {}", errno_text(e)));
    }

    // Signals stay blocked across fork so the child cannot run our handlers (which would write
    // into the launcher's self-pipe) before it resets them.
    sigset_t all, saved;
    sigfillset(&all);
    ::sigprocmask(SIG_BLOCK, &all, &saved);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {
      // Child: only async-signal-safe calls until execve.
      ::setpgid(0, 0);                     // its own group: a stop signal reaches the worker's children too
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // die with a SIGKILLed launcher
      if (::getppid() != parent) ::_exit(kCannotRunExitCode);  // the launcher died before prctl
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      for (const int sig : kForwardedSignals) ::sigaction(sig, &dfl, nullptr);
      ::sigaction(SIGCHLD, &dfl, nullptr);
      ::sigaction(SIGPIPE, &dfl, nullptr);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      ::dup2(devnull_, STDIN_FILENO);
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      ::execve(program_path_.c_str(), argv.data(), envp.data());
      const int error = errno;
      [[maybe_unused]] const ssize_t ignored = ::write(exec_error[1], &error, sizeof error);
      ::_exit(kCannotRunExitCode);
    }
    const int fork_error = errno;
    ::sigprocmask(SIG_SETMASK, &saved, nullptr);
    ::close(out[1]);
    ::close(err[1]);
    ::close(exec_error[1]);
    if (pid < 0) {
      ::close(out[0]), ::close(err[0]), ::close(exec_error[0]);
      throw LaunchError(1, fmt::format("cannot start rank {}: fork: {}", w.rank, errno_text(fork_error)));
    }
    ::setpgid(pid, pid);  // also here, so the group exists before we might signal it
    w.pid = pid;
    w.running = true;
    w.out.fd = out[0];
    w.out.target = STDOUT_FILENO;
    w.err.fd = err[0];
    w.err.target = STDERR_FILENO;
    ::fcntl(w.out.fd, F_SETFL, O_NONBLOCK);
    ::fcntl(w.err.fd, F_SETFL, O_NONBLOCK);

    // Ends at execve (close-on-exec) or carries execve's errno: bounded by the child's few calls.
    int exec_errno = 0;
    ssize_t n;
    do {
      n = ::read(exec_error[0], &exec_errno, sizeof exec_errno);
    } while (n < 0 && errno == EINTR);
    ::close(exec_error[0]);
    if (n == static_cast<ssize_t>(sizeof exec_errno)) {
      throw LaunchError(kCannotRunExitCode,
                        fmt::format("cannot execute '{}': {}", program_path_, errno_text(exec_errno)));
    }
  }

  // Sends sig to every worker's process group (the worker and the processes it started).
  void signal_groups(std::vector<Worker>& workers, int sig, bool only_running) {
    for (Worker& w : workers) {
      if (w.pid <= 0 || (only_running && !w.running)) continue;
      if (::kill(-w.pid, sig) != 0 && w.running) ::kill(w.pid, sig);
    }
  }

  // Reaps every exited worker; returns the workers reaped in this call.
  std::vector<Worker*> reap(std::vector<Worker>& workers) {
    std::vector<Worker*> reaped;
    for (;;) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;  // 0: none exited yet; -1/ECHILD: no children left
      for (Worker& w : workers) {
        if (w.pid == pid && w.running) {
          w.running = false;
          w.wait_status = status;
          reaped.push_back(&w);
        }
      }
    }
    return reaped;
  }

  // Returns a forwarded signal that is waiting in the self-pipe, or 0.
  int take_pending_terminating_signal() {
    int found = 0;
    unsigned char buffer[64];
    for (ssize_t n; (n = ::read(signal_pipe_, buffer, sizeof buffer)) > 0;) {
      for (ssize_t i = 0; i < n; ++i) {
        if (buffer[i] != SIGCHLD && buffer[i] != tandem::tools::kWakeByte && found == 0) found = buffer[i];
      }
    }
    return found;
  }

  AttemptOutcome run_attempt(int restart) {
    const int n = options_.nproc_per_node;
    std::vector<Worker> workers(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      Worker& w = workers[static_cast<std::size_t>(i)];
      w.local_rank = i;
      w.rank = node_rank() * n + i;
      w.prefix = fmt::format("[rank {}] ", w.rank);
      w.environment = make_environment(i, restart);
    }

    AttemptOutcome outcome;
    bool stopping = false;  // a failure or a signal: the rest are being stopped
    bool killed = false;    // SIGKILL sent
    int launcher_signal = 0;
    Clock::time_point stop_deadline{}, kill_deadline{};
    std::optional<Clock::time_point> drain_deadline;
    std::optional<std::string> launch_error;
    int launch_error_code = 0;

    const auto begin_stop = [&](int sig) {
      signal_groups(workers, sig, /*only_running=*/false);
      // A stopped (frozen) worker handles the signal only once it runs again.
      if (sig != SIGKILL) signal_groups(workers, SIGCONT, /*only_running=*/true);
      if (!stopping) stop_deadline = Clock::now() + options_.stop_timeout;
      stopping = true;
    };

    for (Worker& w : workers) {
      try {
        spawn(w);
      } catch (const LaunchError& e) {
        // The ones already started are stopped like after a failure; then the error is fatal.
        launch_error = e.what();
        launch_error_code = e.exit_code();
        break;
      }
    }
    if (launch_error) begin_stop(SIGTERM);

    for (;;) {
      const Clock::time_point now = Clock::now();
      const bool any_running = std::any_of(workers.begin(), workers.end(), [](const Worker& w) { return w.running; });
      const bool any_open =
          std::any_of(workers.begin(), workers.end(), [](const Worker& w) { return w.out.fd >= 0 || w.err.fd >= 0; });
      if (!any_running) {
        if (!drain_deadline) drain_deadline = now + kDrainTimeout;
        if (!any_open || now >= *drain_deadline) break;
      }
      if (stopping && !killed && now >= stop_deadline) {
        for (const Worker& w : workers) {
          if (w.running) {
            say(fmt::format("rank {} (pid {}) did not stop within {:g} s; sending SIGKILL", w.rank, w.pid,
                            std::chrono::duration<double>(options_.stop_timeout).count()));
          }
        }
        signal_groups(workers, SIGKILL, /*only_running=*/false);
        killed = true;
        kill_deadline = now + kKillWaitTimeout;
      }
      if (killed && now >= kill_deadline && any_running) {
        for (const Worker& w : workers) {
          if (w.running) {
            say(fmt::format("rank {} (pid {}) did not exit after SIGKILL; giving up on it", w.rank, w.pid));
          }
        }
        break;
      }

      Clock::time_point wake = now + kPollInterval;
      if (!any_running) wake = std::min(wake, *drain_deadline);
      if (stopping && !killed) wake = std::min(wake, stop_deadline);
      if (killed) wake = std::min(wake, kill_deadline);
      const auto timeout_ms = std::chrono::ceil<std::chrono::milliseconds>(wake - now).count();

      std::vector<pollfd> fds;
      std::vector<OutputPipe*> pipes;
      std::vector<const Worker*> owners;
      fds.push_back({signal_pipe_, POLLIN, 0});
      for (Worker& w : workers) {
        for (OutputPipe* p : {&w.out, &w.err}) {
          if (p->fd < 0) continue;
          fds.push_back({p->fd, POLLIN, 0});
          pipes.push_back(p);
          owners.push_back(&w);
        }
      }
      const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<std::int64_t>(timeout_ms, 0)));
      if (ready < 0 && errno != EINTR) {
        say(fmt::format("poll failed: {}; stopping the workers", errno_text(errno)));
        begin_stop(SIGKILL);
        killed = true;
        kill_deadline = Clock::now() + kKillWaitTimeout;
        continue;
      }

      if (ready > 0 && fds[0].revents != 0) {
        unsigned char buffer[64];
        for (ssize_t got; (got = ::read(signal_pipe_, buffer, sizeof buffer)) > 0;) {
          for (ssize_t i = 0; i < got; ++i) {
            const int sig = buffer[i];
            if (sig == SIGCHLD || sig == tandem::tools::kWakeByte) continue;
            if (launcher_signal == 0) {
              launcher_signal = sig;
              say(fmt::format("received {}; forwarding it to the workers", signal_name(sig)));
              begin_stop(sig);
            } else if (!killed) {
              // A second Ctrl-C means "now": do not wait for the stop timeout.
              say(fmt::format("received {} again; killing the workers", signal_name(sig)));
              signal_groups(workers, SIGKILL, /*only_running=*/false);
              killed = true;
              kill_deadline = Clock::now() + kKillWaitTimeout;
            }
          }
        }
      }
      for (std::size_t i = 1; ready > 0 && i < fds.size(); ++i) {
        if (fds[i].revents != 0) pipes[i - 1]->read_some(owners[i - 1]->prefix);
      }

      for (Worker* w : reap(workers)) {
        if (succeeded(w->wait_status) || stopping) continue;  // exits caused by stopping are expected
        outcome.kind = AttemptOutcome::Kind::kWorkerFailed;
        outcome.exit_code = exit_code_of(w->wait_status);
        outcome.failure = describe_exit(*w);
        say(outcome.failure);
        begin_stop(SIGTERM);
        // The other nodes learn why too: their own workers' errors may not name the culprit.
        w->err.read_available(w->prefix);
        coordinator_->report_failure(
            w->err.last_line.empty() ? outcome.failure : fmt::format("{} ({})", outcome.failure, w->err.last_line),
            outcome.exit_code);
      }
      // Another node's worker failed (or the job's store is gone): this node's workers stop too.
      const auto event = coordinator_->event();
      if (!stopping && (event == Coordinator::Event::kFailed || event == Coordinator::Event::kStoreLost)) {
        outcome.kind = AttemptOutcome::Kind::kWorkerFailed;
        outcome.exit_code = event == Coordinator::Event::kFailed ? coordinator_->failure_exit_code() : 1;
        outcome.failure = coordinator_->failure();
        say(fmt::format("{}; stopping the workers of this node", outcome.failure));
        begin_stop(SIGTERM);
      }
    }

    for (Worker& w : workers) {
      w.out.close_and_flush(w.prefix);
      w.err.close_and_flush(w.prefix);
    }
    // A stopped group leaves nothing behind: stragglers among the workers' own children (which
    // may have ignored SIGTERM) would hold the ports the next attempt needs.
    if (stopping && !killed) signal_groups(workers, SIGKILL, /*only_running=*/false);

    if (launch_error) throw LaunchError(launch_error_code, *launch_error);
    if (launcher_signal != 0) {
      outcome.kind = AttemptOutcome::Kind::kSignalled;
      outcome.exit_code = 128 + launcher_signal;
    }
    return outcome;
  }

  // After every worker of this node exited 0: says so, and waits until every node has (success)
  // or the round failed elsewhere (a restart for this node too), or a signal ends the job.
  AttemptOutcome await_other_nodes() {
    coordinator_->report_done();
    AttemptOutcome outcome;
    for (;;) {
      if (const int sig = take_pending_terminating_signal()) {
        say(fmt::format("received {}; stopping", signal_name(sig)));
        return {AttemptOutcome::Kind::kSignalled, 128 + sig, ""};
      }
      switch (coordinator_->event()) {
        case Coordinator::Event::kAllDone: return outcome;
        case Coordinator::Event::kStoreLost:
          // This node's part is done; node 0's launcher has gone, most likely after the others did.
          return outcome;
        case Coordinator::Event::kFailed:
          outcome.kind = AttemptOutcome::Kind::kWorkerFailed;
          outcome.exit_code = coordinator_->failure_exit_code();
          outcome.failure = coordinator_->failure();
          say(outcome.failure);
          return outcome;
        case Coordinator::Event::kNone: break;
      }
      pollfd p{signal_pipe_, POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(kPollInterval.count()));
    }
  }

  using Coordinator = tandem::tools::Coordinator;

  Options options_;
  int signal_pipe_;
  std::string program_path_;
  int devnull_ = -1;
  std::unique_ptr<Coordinator> coordinator_;
  Coordinator::Membership membership_;  // the current round's nodes
};

}  // namespace

// The job's store admits only processes that hold TANDEM_STORE_SECRET. One node: when the user set
// none, a fresh random one, which the workers inherit. Several nodes must share one: the user
// sets it on every node (a launcher cannot hand it to another machine before they have met).
void ensure_store_secret(const Options& options) {
  const char* set = std::getenv("TANDEM_STORE_SECRET");
  if (set != nullptr && *set != '\0') return;
  if (options.nnodes > 1) {
    say("TANDEM_STORE_SECRET is not set: the job's store accepts any process that reaches " +
        host_port(options.master_addr, options.master_port) +
        "; set the same secret on every node (e.g. TANDEM_STORE_SECRET=$(openssl rand -hex 32))");
    return;
  }
  unsigned char bytes[32];
  std::size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = ::getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw LaunchError(1, fmt::format("cannot draw a secret for the job's store: {}", errno_text(errno)));
    got += static_cast<std::size_t>(n);
  }
  std::string hex;
  for (const unsigned char b : bytes) hex += fmt::format("{:02x}", b);
  ::setenv("TANDEM_STORE_SECRET", hex.c_str(), 1);  // before any thread starts; the workers inherit it
}

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse_command_line(std::span<char* const>(argv + 1, static_cast<std::size_t>(std::max(argc - 1, 0))));
  } catch (const UsageError& e) {
    write_all(STDERR_FILENO, fmt::format("tandem-run: {} (see tandem-run --help)\n", e.what()));
    return kUsageExitCode;
  }
  if (options.help) {
    write_all(STDOUT_FILENO, *options.help);
    return 0;
  }
  try {
    ensure_store_secret(options);
    const int signal_pipe = install_signal_handlers();
    Launcher launcher(std::move(options), signal_pipe, g_signal_pipe_write);
    return launcher.run();
  } catch (const LaunchError& e) {
    say(fmt::format("failed: {}", e.what()));
    return e.exit_code();
  } catch (const std::exception& e) {
    say(fmt::format("internal error: {}", e.what()));
    return 1;
  }
}
