// tandem-run, run as a real process with tandem_run_probe as its workers: the environment each
// worker gets (TF_CONFIG on one node and with --hosts, torchrun's variables without), the rank
// prefixes on both streams, failures (exit code, signal, the message naming the rank), stopping the
// others (SIGTERM, then SIGKILL after --stop_timeout), restarts, signal forwarding, workers'
// children and a SIGKILLed launcher, and command-line mistakes.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <sys/socket.h>

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

const std::string kLauncher = TANDEM_RUN_PATH;
const std::string kProbe = TANDEM_RUN_PROBE_PATH;

struct Result {
  int exit_code = -1;  // 128 + signal when the launcher itself was killed
  std::string out, err;
  double seconds = 0;  // from start to exit
};

// One launcher process with its stdout and stderr captured. The destructor SIGKILLs it if a
// failed check left it running, so no test leaves processes behind.
class Launch {
 public:
  explicit Launch(const std::vector<std::string>& args, const std::vector<std::string>& extra_env = {}) {
    int out[2], err[2];
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(err, O_CLOEXEC) == 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, err[1], STDERR_FILENO);
    std::vector<std::string> argv_strings{kLauncher};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_strings) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
    env_strings.insert(env_strings.end(), extra_env.begin(), extra_env.end());
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    start_ = Clock::now();
    const int rc = ::posix_spawn(&pid_, kLauncher.c_str(), &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    ::close(out[1]);
    ::close(err[1]);
    out_fd_ = out[0];
    err_fd_ = err[0];
    REQUIRE_MESSAGE(rc == 0, "cannot start ", kLauncher);
  }
  ~Launch() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_fd_ >= 0) ::close(out_fd_);
    if (err_fd_ >= 0) ::close(err_fd_);
  }
  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& out() const { return out_; }

  // Reads output until done(stdout) holds; false at the timeout.
  bool wait_for(const std::function<bool(const std::string&)>& done, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (!done(out_)) {
      if (Clock::now() >= deadline || (out_fd_ < 0 && err_fd_ < 0)) return false;
      read_some(50ms);
    }
    return true;
  }

  void send(int sig) { ::kill(pid_, sig); }

  // Reads to the end of both streams and reaps the launcher; SIGKILLs it at the timeout.
  Result finish(std::chrono::milliseconds timeout = 20s) {
    const auto deadline = Clock::now() + timeout;
    while ((out_fd_ >= 0 || err_fd_ >= 0) && Clock::now() < deadline) read_some(100ms);
    Result result;
    int status = 0;
    for (;;) {
      const pid_t got = ::waitpid(pid_, &status, WNOHANG);
      if (got == pid_) break;
      if (Clock::now() >= deadline) {
        FAIL_CHECK("tandem-run did not finish within the test's timeout; stderr so far:\n", err_);
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(10ms);
    }
    result.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    pid_ = -1;
    while (out_fd_ >= 0 || err_fd_ >= 0) read_some(100ms);  // whatever is left after a SIGKILL
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    result.out = out_;
    result.err = err_;
    return result;
  }

 private:
  void read_some(std::chrono::milliseconds timeout) {
    pollfd fds[2] = {{out_fd_, POLLIN, 0}, {err_fd_, POLLIN, 0}};
    if (::poll(fds, 2, static_cast<int>(timeout.count())) <= 0) return;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].revents == 0) continue;
      int& fd = i == 0 ? out_fd_ : err_fd_;
      std::string& text = i == 0 ? out_ : err_;
      char buffer[65536];
      const ssize_t n = ::read(fd, buffer, sizeof buffer);
      if (n > 0) {
        text.append(buffer, static_cast<std::size_t>(n));
      } else {
        ::close(fd);
        fd = -1;
      }
    }
  }

  pid_t pid_ = -1;
  int out_fd_ = -1, err_fd_ = -1;
  std::string out_, err_;
  Clock::time_point start_;
};

Result run_launcher(const std::vector<std::string>& args, const std::vector<std::string>& extra_env = {}) {
  Launch launch(args, extra_env);
  return launch.finish();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Lines "[rank R] text" of one stream, grouped by rank; other lines are returned under -1.
std::map<int, std::vector<std::string>> by_rank(const std::string& text) {
  // Parsed by hand: std::regex recurses per character and overflows the stack on 64 KiB lines.
  std::map<int, std::vector<std::string>> result;
  for (const std::string& line : lines_of(text)) {
    const std::size_t digits = line.starts_with("[rank ") ? 6 : std::string::npos;
    const std::size_t close = digits == std::string::npos ? std::string::npos : line.find("] ", digits);
    const bool numeric =
        close != std::string::npos && close > digits && line.find_first_not_of("0123456789", digits) == close;
    if (numeric) {
      result[std::stoi(line.substr(digits, close - digits))].push_back(line.substr(close + 2));
    } else {
      result[-1].push_back(line);
    }
  }
  return result;
}

// The value printed by `--print-env` for name on rank's stdout ("unset" when it was not set).
std::string env_of(const std::map<int, std::vector<std::string>>& lines, int rank, const std::string& name) {
  const auto it = lines.find(rank);
  if (it == lines.end()) return "<no output from rank " + std::to_string(rank) + ">";
  for (const std::string& line : it->second) {
    if (line.starts_with(name + "=")) return line.substr(name.size() + 1);
    if (line == name + " unset") return "unset";
  }
  return "<not printed>";
}

std::size_t count(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  for (std::size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// The pid that rank printed with `--ready` ("ready pid P").
pid_t ready_pid(const std::string& out, int rank) {
  const auto lines = by_rank(out);
  if (const auto it = lines.find(rank); it != lines.end()) {
    for (const std::string& line : it->second) {
      if (line.starts_with("ready pid ")) return std::stoi(line.substr(10));
    }
  }
  return -1;
}

// Whether pid is gone (or a zombie nobody reaped yet: dead either way), waiting up to timeout.
bool process_gone(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string text;
    if (!stat || !std::getline(stat, text)) return true;
    const std::size_t paren = text.rfind(')');
    if (paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] == 'Z') return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
}

}  // namespace

TEST_CASE("one node: TF_CONFIG names every worker, index = rank; TANDEM_* are set; stale variables are dropped") {
  // RANK and TF_CONFIG inherited from the caller must not leak into a TF_CONFIG-mode worker.
  const Result r = run_launcher({"--nproc_per_node=3", "--master_port", "0", "--", kProbe, "--print-env"},
                                {"RANK=99", "TF_CONFIG=stale"});
  INFO("stderr: ", r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.empty());
  const auto lines = by_rank(r.out);
  CHECK(lines.count(-1) == 0);
  nlohmann::json first_cluster;
  for (int rank = 0; rank < 3; ++rank) {
    CAPTURE(rank);
    const std::string tf_config = env_of(lines, rank, "TF_CONFIG");
    CAPTURE(tf_config);
    const nlohmann::json tf = nlohmann::json::parse(tf_config);
    CHECK(tf.at("task").at("type") == "worker");
    CHECK(tf.at("task").at("index") == rank);
    const auto& workers = tf.at("cluster").at("worker");
    REQUIRE(workers.size() == 3);
    CHECK(tf.at("cluster").size() == 1);  // no "chief" job: worker 0 is the chief
    const std::string chief = workers[0];
    REQUIRE(chief.starts_with("127.0.0.1:"));
    const int port = std::stoi(chief.substr(10));
    CHECK(port > 0);
    for (int k = 0; k < 3; ++k) CHECK(workers[static_cast<std::size_t>(k)] == "127.0.0.1:" + std::to_string(port + k));
    if (rank == 0) first_cluster = tf.at("cluster");
    CHECK(tf.at("cluster") == first_cluster);
    CHECK(env_of(lines, rank, "TANDEM_LOCAL_RANK") == std::to_string(rank));
    CHECK(env_of(lines, rank, "TANDEM_LOCAL_WORLD_SIZE") == "3");
    CHECK(env_of(lines, rank, "TANDEM_RESTART_COUNT") == "0");
    CHECK(env_of(lines, rank, "TANDEM_LAUNCHER") == "tandem-run");
    CHECK(env_of(lines, rank, "RANK") == "unset");
    CHECK(env_of(lines, rank, "MASTER_ADDR") == "unset");
  }
}

// A port nothing listens on now (the kernel's pick for a socket bound to port 0).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  socklen_t size = sizeof address;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) == 0);
  ::close(fd);
  return ntohs(address.sin_port);
}

// Node 1's launcher of a two-node job (args), with node 0's started beside it (the same args with
// --node_rank 0): the launchers meet through node 0's store before any worker starts.
Result run_node_1(std::vector<std::string> args, const std::vector<std::string>& extra_env = {}) {
  std::vector<std::string> node_0 = args;
  const auto node_rank = std::find(node_0.begin(), node_0.end(), "--node_rank");
  REQUIRE(node_rank != node_0.end());
  *(node_rank + 1) = "0";
  Launch first(node_0, extra_env);
  Result r = run_launcher(args, extra_env);
  const Result r0 = first.finish();
  CHECK_MESSAGE(r0.exit_code == 0, "node 0: ", r0.err);
  return r;
}

TEST_CASE("several nodes with --hosts: TF_CONFIG lists every node's workers") {
  const std::string port = std::to_string(free_port());
  const Result r = run_node_1({"--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1", "--master_port", port,
                               "--hosts", "127.0.0.1,127.0.0.2", "--", kProbe, "--print-env"});
  INFO("stderr: ", r.err);
  REQUIRE(r.exit_code == 0);
  const int p = std::stoi(port);
  const auto lines = by_rank(r.out);
  for (int rank : {2, 3}) {
    CAPTURE(rank);
    const nlohmann::json tf = nlohmann::json::parse(env_of(lines, rank, "TF_CONFIG"));
    CHECK(tf.at("task").at("index") == rank);
    const auto at = [&](const char* host, int k) { return fmt::format("{}:{}", host, p + k); };
    CHECK(tf.at("cluster").at("worker") ==
          nlohmann::json::array({at("127.0.0.1", 0), at("127.0.0.1", 1), at("127.0.0.2", 0), at("127.0.0.2", 1)}));
    CHECK(env_of(lines, rank, "TANDEM_LAUNCHER_STORE") == "1");
    CHECK(env_of(lines, rank, "TANDEM_LOCAL_RANK") == std::to_string(rank - 2));
    CHECK(env_of(lines, rank, "RANK") == "unset");
  }
  CHECK(lines.count(0) == 0);
}

TEST_CASE("several nodes without --hosts: torchrun's variables instead of TF_CONFIG") {
  const std::string port = std::to_string(free_port());
  const Result r = run_node_1({"--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1", "--master_addr",
                               "127.0.0.1", "--master_port", port, "--", kProbe, "--print-env"},
                              {"TF_CONFIG=stale"});
  INFO("stderr: ", r.err);
  REQUIRE(r.exit_code == 0);
  const auto lines = by_rank(r.out);
  for (int local = 0; local < 2; ++local) {
    const int rank = 2 + local;
    CAPTURE(rank);
    CHECK(env_of(lines, rank, "TF_CONFIG") == "unset");
    CHECK(env_of(lines, rank, "MASTER_ADDR") == "127.0.0.1");
    CHECK(env_of(lines, rank, "MASTER_PORT") == port);
    CHECK(env_of(lines, rank, "RANK") == std::to_string(rank));
    CHECK(env_of(lines, rank, "WORLD_SIZE") == "4");
    CHECK(env_of(lines, rank, "LOCAL_RANK") == std::to_string(local));
    CHECK(env_of(lines, rank, "LOCAL_WORLD_SIZE") == "2");
    CHECK(env_of(lines, rank, "GROUP_RANK") == "1");
    CHECK(env_of(lines, rank, "TANDEM_LOCAL_RANK") == std::to_string(local));
    CHECK(env_of(lines, rank, "TANDEM_LOCAL_WORLD_SIZE") == "2");
    CHECK(env_of(lines, rank, "TANDEM_RESTART_COUNT") == "0");
  }
}

TEST_CASE("every line of both streams carries its rank; long and partial lines are relayed whole") {
  constexpr int kLines = 40;
  constexpr std::size_t kLongLine = 100000;  // more than the launcher's 64 KiB piece
  const Result r =
      run_launcher({"--nproc_per_node", "2", "--master_port", "0", "--", kProbe, "--lines", std::to_string(kLines),
                    "--long-line", std::to_string(kLongLine), "--partial", "tail"});
  REQUIRE(r.exit_code == 0);
  const auto out = by_rank(r.out);
  const auto err = by_rank(r.err);
  CHECK(out.count(-1) == 0);
  CHECK(err.count(-1) == 0);
  CHECK(r.out.ends_with("\n"));
  for (int rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    REQUIRE(out.count(rank) == 1);
    REQUIRE(err.count(rank) == 1);
    const auto& o = out.at(rank);
    const auto& e = err.at(rank);
    REQUIRE(o.size() >= kLines + 2);
    REQUIRE(e.size() == kLines);
    for (int i = 0; i < kLines; ++i) {
      CHECK(o[static_cast<std::size_t>(i)] == "out " + std::to_string(i));
      CHECK(e[static_cast<std::size_t>(i)] == "err " + std::to_string(i));
    }
    std::size_t xs = 0;
    for (std::size_t i = kLines; i + 1 < o.size(); ++i) {
      CHECK(o[i].size() <= 64 * 1024);
      CHECK(o[i].find_first_not_of('x') == std::string::npos);
      xs += o[i].size();
    }
    CHECK(xs == kLongLine);
    CHECK(o.back() == "tail");
  }
}

TEST_CASE("a worker exiting non-zero: message names the rank and pid, the others are stopped at once") {
  // Rank 0 would sleep 20 s; with the default 30 s stop timeout only SIGTERM ends it early.
  const Result r = run_launcher(
      {"--nproc_per_node", "2", "--master_port", "0", "--", kProbe, "--ready", "--exit", "1:3", "--sleep", "20"});
  INFO("stderr: ", r.err);
  CHECK(r.exit_code == 3);
  const pid_t pid = ready_pid(r.out, 1);
  REQUIRE(pid > 0);
  CHECK(count(r.err, "tandem-run: rank 1 (pid " + std::to_string(pid) + ") exited with code 3\n") == 1);
  CHECK(count(r.err, "tandem-run: failed: rank 1 (pid " + std::to_string(pid) + ") exited with code 3\n") == 1);
  CHECK(r.seconds < 8);
}

TEST_CASE("a SIGKILLed worker: exit 137 and a message naming the rank and the signal") {
  const Result r =
      run_launcher({"--nproc_per_node", "2", "--master_port", "0", "--", kProbe, "--kill-self", "1", "--sleep", "20"});
  INFO("stderr: ", r.err);
  CHECK(r.exit_code == 137);
  CHECK(std::regex_search(r.err, std::regex(R"(tandem-run: rank 1 \(pid \d+\) was killed by signal 9 \(SIGKILL\)\n)")));
  CHECK(r.err.find("tandem-run: failed: rank 1 (pid ") != std::string::npos);
  CHECK(r.seconds < 8);
}

TEST_CASE("a worker that ignores SIGTERM is SIGKILLed after --stop_timeout") {
  // The failing rank waits a second so that rank 0 surely ignores SIGTERM by then.
  const Result r = run_launcher({"--nproc_per_node", "2", "--master_port", "0", "--stop_timeout", "1", "--", kProbe,
                                 "--ignore-sigterm", "--exit-delay", "1000", "--exit", "1:3", "--sleep", "20"});
  INFO("stderr: ", r.err);
  CHECK(r.exit_code == 3);
  CHECK(std::regex_search(r.err,
                          std::regex(R"(tandem-run: rank 0 \(pid \d+\) did not stop within 1 s; sending SIGKILL\n)")));
  CHECK(r.err.find("tandem-run: failed: rank 1 (pid ") != std::string::npos);
  CHECK(r.seconds >= 1.9);  // 1 s before the failure + the 1 s stop timeout
  CHECK(r.seconds < 10);
}

TEST_CASE("--max_restarts 1: a failure on attempt 0 only is restarted once and the job succeeds") {
  const Result r = run_launcher({"--nproc_per_node", "2", "--master_port", "0", "--max_restarts", "1", "--", kProbe,
                                 "--print-env", "--kill-self", "1"});
  INFO("stderr: ", r.err);
  CHECK(r.exit_code == 0);
  CHECK(std::regex_search(r.err, std::regex(R"(tandem-run: rank 1 \(pid \d+\) was killed by signal 9 \(SIGKILL\)\n)")));
  CHECK(count(r.err, "tandem-run: restarting all 2 workers (restart 1 of 1)\n") == 1);
  CHECK(r.err.find("failed") == std::string::npos);
  CHECK(count(r.out, "[rank 1] TANDEM_RESTART_COUNT=0\n") == 1);
  CHECK(count(r.out, "[rank 1] TANDEM_RESTART_COUNT=1\n") == 1);
  CHECK(count(r.out, "[rank 0] TANDEM_RESTART_COUNT=1\n") == 1);
  CHECK(r.out.find("TANDEM_RESTART_COUNT=2") == std::string::npos);
}

TEST_CASE("two nodes restart in step: a worker killed on node 1 restarts node 0's workers too, in the same round") {
  const std::string port = std::to_string(free_port());
  const std::vector<std::string> args{"--nproc_per_node", "1",       "--nnodes",       "2", "--node_rank", "0",
                                      "--master_port",    port,      "--max_restarts", "1", "--",          kProbe,
                                      "--print-env",      "--ready", "--kill-self",    "1", "--sleep",     "2"};
  std::vector<std::string> node_1 = args;
  node_1[5] = "1";
  Launch first(args);
  const Result r1 = run_launcher(node_1);
  const Result r0 = first.finish();
  INFO("node 0 stderr: ", r0.err, "\nnode 1 stderr: ", r1.err);
  CHECK(r0.exit_code == 0);
  CHECK(r1.exit_code == 0);
  CHECK(count(r1.out, "[rank 1] TANDEM_RESTART_COUNT=1\n") == 1);
  CHECK(count(r0.out, "[rank 0] TANDEM_RESTART_COUNT=1\n") == 1);  // node 0 followed node 1's failure
  CHECK(r0.err.find("node 1: rank 1 (pid ") != std::string::npos);
  CHECK(r0.out.find("TANDEM_RESTART_COUNT=2") == std::string::npos);
  CHECK(r0.seconds < 15);  // not 2 s of sleep per worker plus a timeout: node 0 stopped at once
}

TEST_CASE("two nodes started with different --nnodes both fail at once, naming both") {
  const std::string port = std::to_string(free_port());
  Launch first({"--nproc_per_node", "1", "--nnodes", "2", "--node_rank", "0", "--master_port", port, "--", kProbe},
               {"TANDEM_RENDEZVOUS_TIMEOUT=60"});
  const Result r1 =
      run_launcher({"--nproc_per_node", "1", "--nnodes", "3", "--node_rank", "1", "--master_port", port, "--", kProbe},
                   {"TANDEM_RENDEZVOUS_TIMEOUT=60"});
  const Result r0 = first.finish();
  INFO("node 0 stderr: ", r0.err, "\nnode 1 stderr: ", r1.err);
  CHECK(r0.exit_code == 1);
  CHECK(r1.exit_code == 1);
  CHECK(r0.seconds < 10);
  CHECK(r1.seconds < 10);
  CHECK(r1.err.find("was started with world_size 3 (--nnodes 3 --nproc_per_node 1 --max_restarts 0), but node 0 with "
                    "world_size 2 (--nnodes 2 --nproc_per_node 1 --max_restarts 0)") != std::string::npos);
  CHECK(r0.err.find("arrived with world_size 3 (--nnodes 3") != std::string::npos);
}

namespace {

// Two launchers of a job (--nnodes `nnodes` --max_restarts 1 plus `options`) running the probe with
// `probe` arguments (which must include --ready); once node 1's worker runs, node `lost`'s launcher
// is SIGKILLed (its worker dies with it). Returns the other node's result.
Result lose_node(const std::string& nnodes, int lost, const std::vector<std::string>& env,
                 const std::vector<std::string>& options, const std::vector<std::string>& probe) {
  const std::string port = std::to_string(free_port());
  const auto args = [&](int node) {
    std::vector<std::string> a{"--nproc_per_node", "1",  "--nnodes",       nnodes, "--node_rank", std::to_string(node),
                               "--master_port",    port, "--max_restarts", "1"};
    a.insert(a.end(), options.begin(), options.end());
    a.insert(a.end(), {"--", kProbe});
    a.insert(a.end(), probe.begin(), probe.end());
    return a;
  };
  Launch node_0(args(0), env);
  Launch node_1(args(1), env);
  REQUIRE(node_1.wait_for([](const std::string& out) { return out.find("] ready pid ") != std::string::npos; }, 20s));
  Launch& victim = lost == 0 ? node_0 : node_1;
  victim.send(SIGKILL);
  CHECK(victim.finish().exit_code == 137);
  return (lost == 0 ? node_1 : node_0).finish(40s);
}

}  // namespace

TEST_CASE("--nnodes 1:2: node 1 lost for good, node 0 restarts alone at world size 1") {
  const Result r0 = lose_node("1:2", 1, {}, {"--join_timeout", "5"}, {"--print-env", "--ready", "--sleep", "3"});
  INFO("node 0 stderr: ", r0.err, "\nnode 0 stdout: ", r0.out);
  CHECK(r0.exit_code == 0);
  CHECK(r0.err.find("round 0 runs on 2 of 2 nodes (0, 1), this one as node rank 0; world size 2") != std::string::npos);
  CHECK(r0.err.find("the launcher of node 1 exited without a word") != std::string::npos);
  CHECK(
      r0.err.find("round 1 runs on 1 of 2 nodes (0), this one as node rank 0; missing: 1; world size changed 2 -> 1") !=
      std::string::npos);
  CHECK(count(r0.out, "[rank 0] WORLD_SIZE=2\n") == 1);
  CHECK(count(r0.out, "[rank 0] WORLD_SIZE=1\n") == 1);
  CHECK(count(r0.out, "[rank 0] TANDEM_RESTART_COUNT=1\n") == 1);
}

namespace {

// The options of node `node` of a job whose node 0 starts alone (--nnodes 1:2 --join_timeout 0) and
// whose worker fails on round 0 after 4 s (--kill-self): a node 1 started meanwhile waits for round 1.
std::vector<std::string> comeback_job(const std::string& port, int node) {
  return {"--nproc_per_node",
          "1",
          "--nnodes",
          "1:2",
          "--node_rank",
          std::to_string(node),
          "--master_port",
          port,
          "--max_restarts",
          "1",
          "--join_timeout",
          "0",
          "--",
          kProbe,
          "--print-env",
          "--exit-delay",
          "4000",
          "--kill-self",
          "0"};
}

// Waits until node 0 of comeback_job runs its round 0 (alone).
void start_alone(Launch& node_0) {
  REQUIRE(node_0.wait_for([](const std::string& out) { return out.find("WORLD_SIZE=1") != std::string::npos; }, 20s));
}

}  // namespace

TEST_CASE("--nnodes 1:2: a node that comes back joins at the next restart round, as node rank 1") {
  const std::string port = std::to_string(free_port());
  Launch first(comeback_job(port, 0));
  start_alone(first);
  const Result r1 = run_launcher(comeback_job(port, 1));
  const Result r0 = first.finish(40s);
  INFO("node 0 stderr: ", r0.err, "\nnode 1 stderr: ", r1.err);
  CHECK(r1.exit_code == 0);
  CHECK(r0.exit_code == 0);
  CHECK(r1.err.find("node 1 waits to join the job at its next restart round (1)") != std::string::npos);
  CHECK(r0.err.find("world size changed 1 -> 2") != std::string::npos);
  CHECK(count(r1.out, "[rank 1] WORLD_SIZE=2\n") == 1);
  CHECK(count(r1.out, "[rank 1] TANDEM_RESTART_COUNT=1\n") == 1);
}

TEST_CASE("--nnodes 1:2: a node that comes back and dies again before the next round is not waited for") {
  const std::string port = std::to_string(free_port());
  Launch first(comeback_job(port, 0), {"TANDEM_RENDEZVOUS_TIMEOUT=60"});
  start_alone(first);
  {
    Launch second(comeback_job(port, 1), {"TANDEM_RENDEZVOUS_TIMEOUT=60"});
    std::this_thread::sleep_for(1s);  // it waits for round 1
    second.send(SIGKILL);
    second.finish();
  }
  const Result r0 = first.finish(40s);
  INFO("node 0 stderr: ", r0.err);
  CHECK(r0.exit_code == 0);
  CHECK(r0.err.find("round 1 runs on 1 of 2 nodes (0), this one as node rank 0; missing: 1; world size 1") !=
        std::string::npos);
  CHECK(r0.seconds < 30);  // not the 60 s rendezvous timeout
}

TEST_CASE("--nnodes 1:3 --hosts without node 1: nodes 0 and 2 run as node ranks 0 and 1, TF_CONFIG lists their hosts") {
  const std::string port = std::to_string(free_port());
  const std::vector<std::string> args{"--nproc_per_node",
                                      "1",
                                      "--nnodes",
                                      "1:3",
                                      "--node_rank",
                                      "0",
                                      "--master_port",
                                      port,
                                      "--hosts",
                                      "127.0.0.1,127.0.0.2,127.0.0.3",
                                      "--join_timeout",
                                      "3",
                                      "--",
                                      kProbe,
                                      "--print-env"};
  std::vector<std::string> node_2 = args;
  node_2[5] = "2";
  Launch first(args);
  const Result r2 = run_launcher(node_2);
  const Result r0 = first.finish(30s);
  INFO("node 0 stderr: ", r0.err, "\nnode 2 stderr: ", r2.err);
  REQUIRE(r0.exit_code == 0);
  REQUIRE(r2.exit_code == 0);
  CHECK(r2.err.find(
            "round 0 runs on 2 of 3 nodes (0, 2), this one as node rank 1; missing: 1; world size changed 3 -> 2") !=
        std::string::npos);
  const int p = std::stoi(port);
  const nlohmann::json tf = nlohmann::json::parse(env_of(by_rank(r2.out), 1, "TF_CONFIG"));
  CHECK(tf.at("task").at("index") == 1);
  CHECK(tf.at("cluster").at("worker") ==
        nlohmann::json::array({fmt::format("127.0.0.1:{}", p), fmt::format("127.0.0.3:{}", p)}));
}

TEST_CASE("--nnodes 1:2: losing node 0 (the store's host) ends the job on node 1, saying so") {
  const Result r1 = lose_node("1:2", 0, {"TANDEM_RENDEZVOUS_TIMEOUT=5"}, {}, {"--ready", "--sleep", "20"});
  INFO("node 1 stderr: ", r1.err);
  CHECK(r1.exit_code == 1);
  CHECK(r1.seconds < 25);
  CHECK(r1.err.find("an elastic job ends when node 0 is lost") != std::string::npos);
}

TEST_CASE("--nnodes 2:2: a node lost for good fails every survivor at the next round, naming it, within the timeout") {
  const Result r0 = lose_node("2", 1, {"TANDEM_RENDEZVOUS_TIMEOUT=3"}, {}, {"--ready", "--sleep", "20"});
  INFO("node 0 stderr: ", r0.err);
  CHECK(r0.exit_code == 1);
  CHECK(r0.err.find("round 1: ") != std::string::npos);
  CHECK(r0.err.find("node 1") != std::string::npos);
  CHECK(r0.err.find("did not arrive within 3 s") != std::string::npos);
}

TEST_CASE("--nnodes 2:3 with one node: every launcher fails after the timeout, naming the missing nodes") {
  const std::string port = std::to_string(free_port());
  const Result r0 = run_launcher(
      {"--nproc_per_node", "1", "--nnodes", "2:3", "--node_rank", "0", "--master_port", port, "--", kProbe},
      {"TANDEM_RENDEZVOUS_TIMEOUT=2"});
  INFO("node 0 stderr: ", r0.err);
  CHECK(r0.exit_code == 1);
  CHECK(r0.err.find("round 0: 1 node(s) arrived within 2 s, fewer than the 2 that --nnodes 2:3 needs; missing: node 1, "
                    "node 2") != std::string::npos);
}

TEST_CASE("--max_restarts 1: a failure on every attempt ends after two attempts with its exit code") {
  const Result r = run_launcher({"--nproc_per_node", "2", "--master_port", "0", "--max_restarts", "1", "--", kProbe,
                                 "--print-env", "--exit", "1:5"});
  INFO("stderr: ", r.err);
  CHECK(r.exit_code == 5);
  CHECK(count(r.err, "tandem-run: restarting all 2 workers (restart 1 of 1)\n") == 1);
  CHECK(count(r.err, ") exited with code 5\n") == 3);  // two failures + the final "failed:" line
  CHECK(count(r.err, "tandem-run: failed: rank 1 (pid ") == 1);
  CHECK(count(r.out, "[rank 1] TANDEM_RESTART_COUNT=0\n") == 1);
  CHECK(count(r.out, "[rank 1] TANDEM_RESTART_COUNT=1\n") == 1);
  CHECK(r.out.find("TANDEM_RESTART_COUNT=2") == std::string::npos);
}

TEST_CASE("SIGTERM to the launcher reaches every worker; it exits 143") {
  Launch launch(
      {"--nproc_per_node", "2", "--master_port", "0", "--", kProbe, "--report-sigterm", "--ready", "--sleep", "20"});
  const bool ready = launch.wait_for([](const std::string& out) { return count(out, "] ready pid ") == 2; }, 10s);
  REQUIRE_MESSAGE(ready, "workers did not start; stdout: ", launch.out());
  const auto signalled = Clock::now();
  launch.send(SIGTERM);
  const Result r = launch.finish();
  INFO("stderr: ", r.err);
  CHECK(r.exit_code == 143);
  CHECK(count(r.out, "[rank 0] got SIGTERM\n") == 1);
  CHECK(count(r.out, "[rank 1] got SIGTERM\n") == 1);
  CHECK(r.err.find("tandem-run: received SIGTERM") != std::string::npos);
  CHECK(std::chrono::duration<double>(Clock::now() - signalled).count() < 8);
}

TEST_CASE("a stopped worker's own children are stopped too (process group)") {
  Launch launch(
      {"--nproc_per_node", "1", "--master_port", "0", "--", kProbe, "--spawn-child", "--ready", "--sleep", "20"});
  REQUIRE(launch.wait_for([](const std::string& out) { return out.find("] ready pid ") != std::string::npos; }, 10s));
  const std::smatch m = [&] {
    std::smatch match;
    std::regex_search(launch.out(), match, std::regex(R"(\[rank 0\] child pid (\d+))"));
    return match;
  }();
  REQUIRE(m.size() == 2);
  const pid_t child = std::stoi(m[1].str());
  launch.send(SIGTERM);
  const Result r = launch.finish();
  CHECK(r.exit_code == 143);
  CHECK(process_gone(child, 3s));
}

TEST_CASE("workers do not outlive a SIGKILLed launcher") {
  Launch launch({"--nproc_per_node", "2", "--master_port", "0", "--", kProbe, "--ready", "--sleep", "20"});
  REQUIRE(launch.wait_for([](const std::string& out) { return count(out, "] ready pid ") == 2; }, 10s));
  const pid_t worker0 = ready_pid(launch.out(), 0), worker1 = ready_pid(launch.out(), 1);
  REQUIRE(worker0 > 0);
  REQUIRE(worker1 > 0);
  launch.send(SIGKILL);
  const Result r = launch.finish();
  CHECK(r.exit_code == 137);
  CHECK(process_gone(worker0, 3s));
  CHECK(process_gone(worker1, 3s));
}

TEST_CASE("command-line mistakes: exit 2 and one line naming the option") {
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  const std::string p = kProbe;
  const std::vector<Case> cases = {
      {{"--nproc_per_node", "2", "--bogus", "1", "--", p}, "unknown option '--bogus'"},
      {{"--nproc_per_node"}, "--nproc_per_node: 1 required N missing"},
      {{"--nproc_per_node", "--", p}, "--nproc_per_node: 1 required N missing"},
      {{"--nproc_per_node", "abc", "--", p}, "--nproc_per_node: expects an integer from 1 to 256, got 'abc'"},
      {{"--nproc_per_node=0", "--", p}, "--nproc_per_node: expects an integer from 1 to 256, got '0'"},
      {{"--nproc_per_node", "2x", "--", p}, "--nproc_per_node: expects an integer"},
      {{"--master_port", "0", "--", p}, "--nproc_per_node is required"},
      {{"--nproc_per_node", "2", "--nnodes=2", "--node_rank", "2", "--", p}, "--node_rank 2 is out of range"},
      {{"--nproc_per_node", "2", "--nnodes=1:2", "--node_rank", "2", "--", p}, "--node_rank 2 is out of range"},
      {{"--nproc_per_node", "2", "--nnodes", "3:2", "--", p}, "--nnodes: expects N or MIN:MAX with 1 <= MIN <= MAX"},
      {{"--nproc_per_node", "2", "--nnodes", "0:2", "--", p}, "--nnodes: expects N or MIN:MAX"},
      {{"--nproc_per_node", "2", "--nnodes", "1:", "--", p}, "--nnodes: expects N or MIN:MAX"},
      {{"--nproc_per_node", "2", "--nnodes", "1-2", "--", p}, "got '1-2'"},
      {{"--nproc_per_node", "2", "--join_timeout", "x", "--", p}, "--join_timeout: expects seconds"},
      {{"--nproc_per_node", "2", "--master_port", "70000", "--", p}, "--master_port: expects an integer"},
      {{"--nproc_per_node", "2", "--master_port", "65535", "--", p}, "--master_port 65535 is too high"},
      {{"--nproc_per_node", "2", "--nnodes", "2", "--master_port", "0", "--", p}, "--master_port 0"},
      {{"--nproc_per_node", "2", "--max_restarts", "-1", "--", p}, "--max_restarts: expects an integer"},
      {{"--nproc_per_node", "2", "--stop_timeout", "-1", "--", p}, "--stop_timeout: expects seconds"},
      {{"--nproc_per_node", "2", "--stop_timeout", "soon", "--", p}, "--stop_timeout: expects seconds"},
      {{"--nproc_per_node", "2", "--nnodes", "2", "--hosts", "a", "--", p}, "--hosts lists 1 hosts"},
      {{"--nproc_per_node", "2", "--nnodes", "2", "--hosts", "a,a", "--", p}, "--hosts lists 'a' for nodes 0 and 1"},
      {{"--nproc_per_node", "2", "--nnodes", "2", "--hosts", "a,", "--", p}, "--hosts has an empty entry"},
      {{"--nproc_per_node", "2", "--nnodes", "2", "--hosts", "a,b", "--master_addr", "b", "--", p},
       "--master_addr is 'b'"},
      {{"--nproc_per_node", "1", "--nproc_per_node", "2", "--", p}, "option --nproc_per_node is given twice"},
      {{"--nproc_per_node", "2", p}, "unexpected argument"},
      {{"--nproc_per_node", "2"}, "missing '--'"},
      {{"--nproc_per_node", "2", "--"}, "missing the program"},
  };
  for (const Case& c : cases) {
    std::string joined;
    for (const auto& a : c.args) joined += a + " ";
    CAPTURE(joined);
    const Result r = run_launcher(c.args);
    CHECK(r.exit_code == 2);
    CHECK(r.out.empty());
    CHECK(r.err.starts_with("tandem-run: "));
    CHECK(count(r.err, "\n") == 1);
    CHECK_MESSAGE(r.err.find(c.expected) != std::string::npos, "stderr: ", r.err);
  }
}

TEST_CASE("--help prints the usage and exits 0") {
  const Result r = run_launcher({"--help"});
  CHECK(r.exit_code == 0);
  CHECK(r.out.starts_with("Usage: tandem-run --nproc_per_node N"));
  CHECK(r.err.empty());
}

TEST_CASE("a program that cannot run: exit 127 naming it") {
  const Result missing = run_launcher({"--nproc_per_node", "2", "--master_port", "0", "--", "/nonexistent/program"});
  CHECK(missing.exit_code == 127);
  CHECK(missing.err.find("cannot execute '/nonexistent/program': No such file or directory") != std::string::npos);
  const Result not_in_path =
      run_launcher({"--nproc_per_node", "1", "--master_port", "0", "--", "tandem-run-no-such-program"});
  CHECK(not_in_path.exit_code == 127);
  CHECK(not_in_path.err.find("cannot find program 'tandem-run-no-such-program' in PATH") != std::string::npos);
}
