// The NCCL group across processes (make_nccl_process_communicator), on real GPUs: two worker
// processes (this binary re-executed with --nccl-worker), one GPU each, meeting through a TCP store
// served by the test. Every collective against host references; a rank that hangs is named in the
// other's DeadlineExceeded; an abort and a killed process reach the other rank promptly, through
// the store. Where fewer than two GPUs are usable, or the build has no NCCL, the program exits 77
// before doing anything, which CTest reports as skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/worker_processes.h"
#include "tandem/collective/nccl.h"
#include "tandem/collective/store.h"
#include "tandem/collective/tcp_store.h"
#include "tandem/devices/device.h"

extern char** environ;

using namespace tandem;
using namespace tandem::collective;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kSkipped = 77;  // CTest's SKIP_RETURN_CODE for this suite
constexpr std::string_view kWorkerFlag = "--nccl-worker";
constexpr int kRanks = 2;

devices::Device& gpu(int i) { return devices::get_device("GPU:" + std::to_string(i)); }

std::vector<float> ramp(std::int64_t n, float scale, float offset) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 1000) * scale + offset;
  return v;
}

// What rank r contributes to the "collectives" scenario.
std::vector<float> input_of(int rank, std::int64_t n) { return ramp(n, rank == 0 ? 0.25f : -0.5f, 1.0f + rank); }

// The "collectives" scenario on one rank: every collective, checked against host references.
// Returns "" or what differed.
std::string run_collectives(Communicator& comm, int rank) {
  if (comm.backend() != "nccl" || comm.rank() != rank || comm.size() != kRanks) {
    return fmt::format("backend {}, rank {}, size {}", comm.backend(), comm.rank(), comm.size());
  }
  const std::int64_t n = (1 << 20) + 3;
  const auto mine = input_of(rank, n);
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < kRanks; ++r) inputs.push_back(input_of(r, n));
  std::vector<float> sum(static_cast<std::size_t>(n)), mean(sum.size()), max(sum.size());
  for (std::size_t i = 0; i < sum.size(); ++i) {
    sum[i] = inputs[0][i] + inputs[1][i];
    mean[i] = sum[i] / 2;
    max[i] = std::max(inputs[0][i], inputs[1][i]);
  }
  std::string problems;
  const auto expect = [&](bool ok, std::string_view what) {
    if (!ok) problems += fmt::format("{}{} differs", problems.empty() ? "" : "; ", what);
  };
  Tensor t = Tensor::from_vector<float>(mine, {n}, gpu(rank));
  comm.all_reduce(t, ReduceOp::kSum);
  expect(t.to_vector<float>() == sum, "all_reduce SUM");
  t = Tensor::from_vector<float>(mine, {n}, gpu(rank));
  comm.all_reduce(t, ReduceOp::kMean);
  expect(t.to_vector<float>() == mean, "all_reduce MEAN");
  // A bucket: the same values split into two tensors, one collective.
  std::vector<Tensor> bucket = {Tensor::from_vector<float>({mine.begin(), mine.begin() + 10}, {10}, gpu(rank)),
                                Tensor::from_vector<float>({mine.begin() + 10, mine.end()}, {n - 10}, gpu(rank))};
  comm.all_reduce(std::span<Tensor>(bucket), ReduceOp::kMax);
  auto got = bucket[0].to_vector<float>();
  const auto rest = bucket[1].to_vector<float>();
  got.insert(got.end(), rest.begin(), rest.end());
  expect(got == max, "all_reduce MAX of a bucket");
  t = Tensor::from_vector<float>(mine, {n}, gpu(rank));
  comm.broadcast(t, 1);
  expect(t.to_vector<float>() == inputs[1], "broadcast from rank 1");
  t = Tensor::from_vector<float>(mine, {n}, gpu(rank));
  comm.broadcast(t, 0);
  expect(t.to_vector<float>() == inputs[0], "broadcast from rank 0");
  Tensor in = Tensor::from_vector<float>({static_cast<float>(rank), static_cast<float>(10 + rank)}, {1, 2}, gpu(rank));
  Tensor out = Tensor::zeros({2, 2}, kFloat32, gpu(rank));
  comm.all_gather(in, out);
  expect(out.to_vector<float>() == std::vector<float>{0, 10, 1, 11}, "all_gather");
  Tensor big = Tensor::from_vector<float>({1, 2, 3, 4}, {4}, gpu(rank));
  Tensor half = Tensor::zeros({2}, kFloat32, gpu(rank));
  comm.reduce_scatter(big, half, ReduceOp::kSum);
  const std::vector<float> part = rank == 0 ? std::vector<float>{2, 4} : std::vector<float>{6, 8};
  expect(half.to_vector<float>() == part, "reduce_scatter");
  for (int i = 0; i < 20; ++i) comm.barrier();
  if (comm.sequence_number() != 27) {
    problems += fmt::format("; sequence number {}, expected 27", comm.sequence_number());
  }
  return problems;
}

// A worker process: connects to the store, makes its communicator on GPU `rank`, runs the
// scenario and writes "<error type>\n<message>\n<milliseconds the failing call took>" to its
// result file.
int worker_main(int argc, char** argv) {
  if (argc != 6) return 2;
  const std::string scenario = argv[2];
  const std::string address = argv[3];
  const int rank = std::atoi(argv[4]);
  const std::string result_path = argv[5];
  std::string type = "none", message;
  long long call_ms = 0;
  try {
    auto store = connect_tcp_store(address, {.connect_timeout = 20s, .rank = rank});
    auto comm = make_nccl_process_communicator(
        {.rank = rank, .size = kRanks, .cuda_device = rank, .store = store, .timeout = 30s});
    Tensor t = Tensor::zeros({1 << 16}, kFloat32, gpu(rank));
    // all_reduce(t); if it throws, call_ms is how long it took to fail.
    const auto timed_all_reduce = [&](CallOptions options) {
      const auto start = Clock::now();
      try {
        comm->all_reduce(t, ReduceOp::kSum, options);
      } catch (...) {
        call_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
        throw;
      }
    };
    if (scenario == "collectives") {
      message = run_collectives(*comm, rank);
      if (!message.empty()) type = "mismatch";
    } else {
      // NCCL connects the peers on the first collective: the failures come after one that works.
      comm->all_reduce(t, ReduceOp::kSum);
      if (scenario == "hang") {
        if (rank == 1) std::this_thread::sleep_for(60s);  // the test kills it
        timed_all_reduce({.timeout = 1s});
      } else if (scenario == "abort") {
        if (rank == 0) {
          std::this_thread::sleep_for(300ms);
          comm->abort("worker 0 stopped");
        } else {
          timed_all_reduce({});
        }
      } else if (scenario == "kill") {
        store->set(fmt::format("ready/{}", rank), {'1'});
        if (rank == 0) std::this_thread::sleep_for(60s);  // the test kills it
        timed_all_reduce({.timeout = 20s});
      }
    }
  } catch (const DeadlineExceeded& e) {
    type = "DeadlineExceeded";
    message = e.what();
  } catch (const Unavailable& e) {
    type = "Unavailable";
    message = e.what();
  } catch (const std::exception& e) {
    type = "other";
    message = e.what();
  }
  std::ofstream(result_path) << type << "\n" << message << "\n" << call_ms << "\n";
  return 0;
}

struct Outcome {
  std::string type;
  std::string message;
  long long call_ms = 0;
};

// Two worker processes of `scenario` (testing::WorkerProcesses; no <size> argument: always two).
class Job {
 public:
  explicit Job(std::string scenario)
      : workers_({.flag = std::string(kWorkerFlag), .scenario = std::move(scenario), .size = kRanks, .pass_size = false}) {}

  Store& store() { return workers_.store(); }
  void kill(int rank) { workers_.kill(rank); }

  // Waits (up to `limit`) for the ranks' processes to exit and reads their outcomes.
  std::vector<Outcome> wait(const std::vector<int>& ranks, std::chrono::seconds limit) {
    const auto deadline = Clock::now() + limit;
    std::vector<Outcome> outcomes;
    for (int r : ranks) {
      workers_.wait_exit(r, deadline, limit);
      std::ifstream in(workers_.result_path(r));
      Outcome o;
      std::getline(in, o.type);
      std::getline(in, o.message);
      in >> o.call_ms;
      outcomes.push_back(o);
    }
    return outcomes;
  }

 private:
  testing::WorkerProcesses workers_;
};

}  // namespace

TEST_CASE("two processes, one GPU each: every collective against host references") {
  Job job("collectives");
  for (const Outcome& o : job.wait({0, 1}, 60s)) {
    CAPTURE(o.message);
    CHECK(o.type == "none");
  }
}

TEST_CASE("two processes: a rank that hangs is named in the other's DeadlineExceeded") {
  Job job("hang");
  const auto outcomes = job.wait({0}, 60s);
  const Outcome& o = outcomes[0];
  CHECK(o.type == "DeadlineExceeded");
  CHECK(o.message == "all_reduce #1: rank 1 of 2 did not arrive within 1000 ms");
  CHECK(o.call_ms < 1000 + 4000);  // the timeout, the report grace and the abort
}

TEST_CASE("two processes: an abort reaches the waiting rank through the store") {
  Job job("abort");
  const auto outcomes = job.wait({0, 1}, 60s);
  CHECK(outcomes[0].type == "none");
  CHECK(outcomes[1].type == "Unavailable");
  CHECK(outcomes[1].message == "all_reduce #1: the group was aborted by rank 0 of 2: worker 0 stopped");
  CHECK(outcomes[1].call_ms < 5000);
}

TEST_CASE("two processes: a killed rank is named by the other, long before its timeout") {
  Job job("kill");
  job.store().wait({"ready/0", "ready/1"}, 60s);
  std::this_thread::sleep_for(200ms);  // rank 1 is waiting in its all_reduce
  job.kill(0);
  const auto outcomes = job.wait({1}, 60s);
  const Outcome& o = outcomes[0];
  CAPTURE(o.message);
  CHECK(o.type == "Unavailable");
  CHECK(o.message.find("lost rank 0 of 2: its process died") != std::string::npos);
  CHECK(o.call_ms < 10000);
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string_view(argv[1]) == kWorkerFlag) return worker_main(argc, argv);
  if (devices::num_gpus() < kRanks) {
    std::printf("skipped: %d usable GPU(s), this suite needs %d (%s)\n", devices::num_gpus(), kRanks,
                devices::gpu_discovery_message().c_str());
    return kSkipped;
  }
  if (!nccl_available()) {
    std::printf("skipped: NCCL is not available (a build without NCCL, or libnccl could not be loaded)\n");
    return kSkipped;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
