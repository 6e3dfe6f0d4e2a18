// Worker processes of the running test program, for the multi-process collective tests (the
// conformance suite's process backends, gloo_test): each worker is this executable started again as
//
//   /proc/self/exe <flag> <scenario> <store address> <rank> [<size>] <result file>
//
// against a TCP store served by the test process. The test's worker_main reads those arguments,
// runs the scenario and writes its result file; the test reads the files after wait_exit().
// Destroying the object SIGKILLs and reaps whatever still runs and removes the scratch folder.
#pragma once

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tandem/collective/store.h"
#include "tandem/collective/tcp_store.h"

extern char** environ;

namespace tandem::testing {

class WorkerProcesses {
 public:
  struct Options {
    std::string flag;       // the worker mode's flag ("--gloo-worker")
    std::string scenario;   // what the workers do
    int size = 2;           // processes
    bool pass_size = true;  // put <size> in the arguments
  };

  explicit WorkerProcesses(Options options) : options_(std::move(options)) {
    std::string pattern = (std::filesystem::temp_directory_path() / "tandem_workers_XXXXXX").string();
    REQUIRE(mkdtemp(pattern.data()) != nullptr);
    dir_ = pattern;
    server_ = collective::TcpStoreServer::start("127.0.0.1", 0);
    store_ = collective::connect_tcp_store(server_->address());
    for (int r = 0; r < options_.size; ++r) spawn(r);
    spawned_ = pids_;
  }

  ~WorkerProcesses() {
    for (pid_t pid : pids_) {
      if (pid > 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  WorkerProcesses(const WorkerProcesses&) = delete;
  WorkerProcesses& operator=(const WorkerProcesses&) = delete;

  collective::Store& store() { return *store_; }
  // Takes the store server down (the chief's process would take it with it when it dies).
  void stop_server() {
    store_.reset();
    server_.reset();
  }
  void kill(int rank) {
    pid_t& pid = pids_[static_cast<std::size_t>(rank)];
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    pid = -1;
  }
  // Waits until rank's process has exited; FAILs naming the rank past `deadline`.
  void wait_exit(int rank, std::chrono::steady_clock::time_point deadline, std::chrono::seconds limit) {
    pid_t& pid = pids_[static_cast<std::size_t>(rank)];
    int status = 0;
    while (pid > 0 && ::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        FAIL("rank " << rank << " did not finish within " << limit.count() << " s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid = -1;
  }
  std::string result_path(int rank) const { return fmt::format("{}/rank{}.txt", dir_, rank); }
  // Every process started, exited or not.
  const std::vector<pid_t>& spawned() const { return spawned_; }

 private:
  void spawn(int rank) {
    std::vector<std::string> args = {"/proc/self/exe", options_.flag, options_.scenario, server_->address(),
                                     std::to_string(rank)};
    if (options_.pass_size) args.push_back(std::to_string(options_.size));
    args.push_back(result_path(rank));
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = 0;
    const int rc = ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), environ);
    REQUIRE_MESSAGE(rc == 0, "posix_spawn failed: " << std::strerror(rc));
    pids_.push_back(pid);
  }

  Options options_;
  std::string dir_;
  std::unique_ptr<collective::TcpStoreServer> server_;
  std::shared_ptr<collective::Store> store_;
  std::vector<pid_t> pids_;
  std::vector<pid_t> spawned_;
};

}  // namespace tandem::testing
