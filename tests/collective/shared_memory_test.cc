// The shared-memory communicator.
//
// Real processes (this binary re-executed with --shm-worker, meeting through a TCP store served by
// the test): every collective, reduction and dtype against a sequential rank-order reference for
// 2, 3 and 4 processes, with a 4 KiB slot so that calls go through the segment in many pieces,
// bitwise the same on every rank; a rank killed with SIGKILL (a peer or the segment's creator), a
// rank that hangs, mismatched collectives, abort. After each, /dev/shm holds no segment of theirs.
//
// Threads of this process (ranks may share a process; an in-memory store): bad options, a group of
// one, bad arguments, a rank that never comes to the meeting, a rank whose slot size differs, a
// destroyed peer.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/worker_processes.h"
#include "on_ranks.h"
#include "tandem/collective/communicator.h"
#include "tandem/collective/shared_memory.h"
#include "tandem/collective/store.h"
#include "tandem/collective/tcp_store.h"

extern char** environ;

using namespace tandem;
using namespace tandem::collective;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

using testing::error_as;
using testing::Group;
using testing::on_ranks;
using testing::require_no_errors;

constexpr std::string_view kWorkerFlag = "--shm-worker";
constexpr std::int64_t kSmallSlot = 4096;

// The segments in /dev/shm made by process `pid` (their names start "tandem-<pid>-").
std::vector<std::string> segments_of(pid_t pid) {
  std::vector<std::string> found;
  const std::string prefix = fmt::format("tandem-{}-", pid);
  std::error_code ignored;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ignored)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with(prefix)) found.push_back(name);
  }
  return found;
}

// n ranks on threads of this process, meeting through one in-memory store.
Group make_group(int n, SharedMemoryOptions base = {}, std::shared_ptr<Store> store = make_in_memory_store()) {
  Group group(static_cast<std::size_t>(n));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        SharedMemoryOptions options = base;
        options.rank = r;
        options.size = n;
        options.store = store;
        group[static_cast<std::size_t>(r)] = make_shared_memory_communicator(options);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  require_no_errors(errors);
  return group;
}

// --- the battery a worker process runs -----------------------------------------------------------

// Rank `rank`'s data for call `call`: floats with fractions (so that the order of a sum shows in
// its bits), integers small enough never to overflow.
template <class T>
std::vector<T> values(std::int64_t n, int rank, int call) {
  std::mt19937 rng(static_cast<unsigned>(7919 * call + rank));
  std::vector<T> v(static_cast<std::size_t>(n));
  if constexpr (std::is_floating_point_v<T>) {
    std::uniform_real_distribution<T> u(-10, 10);
    for (auto& x : v) x = u(rng);
  } else {
    std::uniform_int_distribution<int> u(-1000, 1000);
    for (auto& x : v) x = static_cast<T>(u(rng));
  }
  return v;
}

// The reduction of every rank's values, element by element in rank order.
template <class T>
std::vector<T> reference(int n, std::int64_t count, ReduceOp op, int call) {
  std::vector<T> out = values<T>(count, 0, call);
  for (int q = 1; q < n; ++q) {
    const auto v = values<T>(count, q, call);
    for (std::size_t i = 0; i < out.size(); ++i) {
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kMean: out[i] = static_cast<T>(out[i] + v[i]); break;
        case ReduceOp::kMax: out[i] = std::max(out[i], v[i]); break;
        case ReduceOp::kMin: out[i] = std::min(out[i], v[i]); break;
      }
    }
  }
  if (op == ReduceOp::kMean) {
    for (auto& x : out) x = static_cast<T>(x / static_cast<T>(n));
  }
  return out;
}

// FNV-1a over every result a rank received: equal on every rank iff the results are bitwise equal.
struct Digest {
  std::uint64_t h = 1469598103934665603ull;
  template <class T>
  void add(const std::vector<T>& v) {
    const auto* p = reinterpret_cast<const unsigned char*>(v.data());
    for (std::size_t i = 0; i < v.size() * sizeof(T); ++i) {
      h ^= p[i];
      h *= 1099511628211ull;
    }
  }
};

template <class T>
void expect_equal(const std::vector<T>& got, const std::vector<T>& expected, const std::string& what) {
  if (got.size() != expected.size()) {
    throw std::runtime_error(fmt::format("{}: {} elements, expected {}", what, got.size(), expected.size()));
  }
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &expected[i], sizeof(T)) != 0) {
      throw std::runtime_error(fmt::format("{}: element {} is {}, expected {}", what, i, got[i], expected[i]));
    }
  }
}

template <class T>
void all_reduce_battery(Communicator& c, int& call, Digest& digest) {
  const int n = c.size();
  // Sizes that are multiples of nothing, below, at and well above one 4 KiB slot.
  for (std::int64_t count : {0, 1, 13, 1000, 1031, 4099, 10007}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin}) {
      ++call;
      Tensor t = Tensor::from_vector<T>(values<T>(count, c.rank(), call), {count});
      c.all_reduce(t, op);
      const auto got = t.to_vector<T>();
      expect_equal(got, reference<T>(n, count, op, call),
                   fmt::format("all_reduce {} {} x {}", reduce_op_name(op), graph::dtype_of<T>, count));
      digest.add(got);
    }
  }
  // A span of tensors is one logical buffer; ranks may split it differently.
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean}) {
    ++call;
    const std::vector<std::int64_t> sizes =
        c.rank() % 2 == 0 ? std::vector<std::int64_t>{3, 1500, 0, 777, 2048} : std::vector<std::int64_t>{2000, 2328};
    const auto v = values<T>(4328, c.rank(), call);
    std::vector<Tensor> bucket;
    std::int64_t at = 0;
    for (std::int64_t s : sizes) {
      bucket.push_back(Tensor::from_vector<T>(std::vector<T>(v.begin() + at, v.begin() + at + s), {s}));
      at += s;
    }
    c.all_reduce(std::span<Tensor>(bucket), op);
    std::vector<T> got;
    for (const Tensor& t : bucket) {
      const auto part = t.to_vector<T>();
      got.insert(got.end(), part.begin(), part.end());
    }
    expect_equal(got, reference<T>(n, 4328, op, call), fmt::format("all_reduce of a span, {}", reduce_op_name(op)));
    digest.add(got);
  }
}

// Every collective; returns the digest of the results. Throws on any wrong result.
std::uint64_t battery(Communicator& c) {
  const int n = c.size();
  int call = 0;
  Digest digest;
  all_reduce_battery<float>(c, call, digest);
  all_reduce_battery<double>(c, call, digest);
  all_reduce_battery<std::int32_t>(c, call, digest);
  all_reduce_battery<std::int64_t>(c, call, digest);

  for (int root = 0; root < n; ++root) {
    ++call;
    Tensor f = Tensor::from_vector<float>(values<float>(5000, c.rank(), call), {50, 100});
    c.broadcast(f, root);
    expect_equal(f.to_vector<float>(), values<float>(5000, root, call), fmt::format("broadcast from {}", root));
    Tensor b = Tensor::from_vector<std::uint8_t>(std::vector<std::uint8_t>(9001, static_cast<std::uint8_t>(c.rank())),
                                                 {9001});
    c.broadcast(b, root);
    expect_equal(b.to_vector<std::uint8_t>(), std::vector<std::uint8_t>(9001, static_cast<std::uint8_t>(root)),
                 fmt::format("uint8 broadcast from {}", root));
  }

  ++call;
  Tensor in = Tensor::from_vector<float>(values<float>(3000, c.rank(), call), {1500, 2});
  Tensor out = Tensor::zeros({1500 * n, 2}, kFloat32);
  c.all_gather(in, out);
  std::vector<float> gathered;
  for (int q = 0; q < n; ++q) {
    const auto v = values<float>(3000, q, call);
    gathered.insert(gathered.end(), v.begin(), v.end());
  }
  expect_equal(out.to_vector<float>(), gathered, "all_gather");
  digest.add(out.to_vector<float>());
  Tensor scalar = Tensor::scalar<std::int64_t>(10 * c.rank());
  Tensor all = Tensor::zeros({n}, kInt64);
  c.all_gather(scalar, all);
  std::vector<std::int64_t> scalars;
  for (int q = 0; q < n; ++q) scalars.push_back(10 * q);
  expect_equal(all.to_vector<std::int64_t>(), scalars, "all_gather of scalars");

  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin}) {
    ++call;
    Tensor input = Tensor::from_vector<float>(values<float>(1100 * n, c.rank(), call), {1100 * n});
    Tensor part = Tensor::zeros({1100}, kFloat32);
    c.reduce_scatter(input, part, op);
    const auto full = reference<float>(n, 1100 * n, op, call);
    expect_equal(part.to_vector<float>(), std::vector<float>(full.begin() + 1100 * c.rank(), full.begin() + 1100 * (c.rank() + 1)),
                 fmt::format("reduce_scatter {}", reduce_op_name(op)));
    expect_equal(input.to_vector<float>(), values<float>(1100 * n, c.rank(), call), "reduce_scatter's input");
    ++call;
    Tensor ints = Tensor::from_vector<std::int64_t>(values<std::int64_t>(6 * n, c.rank(), call), {3 * n, 2});
    Tensor ints_part = Tensor::zeros({3, 2}, kInt64);
    c.reduce_scatter(ints, ints_part, op);
    const auto ints_full = reference<std::int64_t>(n, 6 * n, op, call);
    expect_equal(ints_part.to_vector<std::int64_t>(),
                 std::vector<std::int64_t>(ints_full.begin() + 6 * c.rank(), ints_full.begin() + 6 * (c.rank() + 1)),
                 fmt::format("int64 reduce_scatter {}", reduce_op_name(op)));
  }

  for (int i = 0; i < 3; ++i) c.barrier();

  // A rank with bad arguments: every rank throws InvalidArgument naming it, and the group goes on.
  Tensor t = c.rank() == n - 1 ? Tensor::zeros({5}, DType::kU8) : Tensor::zeros({5}, kFloat32);
  try {
    c.all_reduce(t, ReduceOp::kSum);
    throw std::runtime_error("an all_reduce of uint8 on one rank did not throw");
  } catch (const InvalidArgument& e) {
    const std::string expected =
        fmt::format("rank {}: uint8 tensors cannot be reduced; the shared-memory communicator reduces float32, float64, "
                    "float16, bfloat16, int32 and int64",
                    n - 1);
    if (std::string_view(e.what()).find(expected) == std::string_view::npos) {
      throw std::runtime_error(fmt::format("unexpected message: {}", e.what()));
    }
  }
  Tensor ones = Tensor::filled<float>({3}, 1.0f);
  c.all_reduce(ones, ReduceOp::kSum);
  expect_equal(ones.to_vector<float>(), std::vector<float>(3, static_cast<float>(n)), "all_reduce after an error");
  const std::uint64_t expected_calls = 4 * (7 * 4 + 2) + 2 * static_cast<std::uint64_t>(n) + 2 + 8 + 3 + 2;
  if (c.sequence_number() != expected_calls) {
    throw std::runtime_error(fmt::format("sequence_number {} after the battery, expected {}", c.sequence_number(),
                                         expected_calls));
  }
  return digest.h;
}

// --- worker processes ----------------------------------------------------------------------------

// One line of a worker's result file: "<type>\t<milliseconds>\t<message>".
struct Outcome {
  std::string type;
  long long call_ms = 0;
  std::string message;
};

// Runs `fn`, returning what it threw (type "none" when nothing) and how long it took.
template <class Fn>
Outcome outcome_of(Fn&& fn) {
  Outcome o{"none", 0, ""};
  const auto start = Clock::now();
  try {
    fn();
  } catch (const DeadlineExceeded& e) {
    o = {"DeadlineExceeded", 0, e.what()};
  } catch (const Unavailable& e) {
    o = {"Unavailable", 0, e.what()};
  } catch (const InvalidArgument& e) {
    o = {"InvalidArgument", 0, e.what()};
  } catch (const std::exception& e) {
    o = {"other", 0, e.what()};
  }
  o.call_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  return o;
}

// A worker process: connects to the store, makes its communicator, runs the scenario and writes
// one outcome line per step to its result file.
int worker_main(int argc, char** argv) {
  if (argc != 7) return 2;
  const std::string scenario = argv[2];
  const std::string address = argv[3];
  const int rank = std::atoi(argv[4]);
  const int size = std::atoi(argv[5]);
  std::ofstream result(argv[6]);
  const auto write = [&](const Outcome& o) { result << o.type << "\t" << o.call_ms << "\t" << o.message << "\n" << std::flush; };
  std::vector<std::string> labels;
  for (int r = 0; r < size; ++r) labels.push_back(fmt::format("worker {}", r));
  std::shared_ptr<Store> store;
  std::unique_ptr<Communicator> comm;
  const Outcome setup = outcome_of([&] {
    store = connect_tcp_store(address, {.connect_timeout = 20s, .rank = rank});
    SharedMemoryOptions options{.rank = rank, .size = size, .store = store, .timeout = 10s};
    if (scenario == "battery") options.slot_bytes = kSmallSlot;
    if (scenario == "hang") options.timeout = 1s;
    if (scenario != "battery" && scenario != "hang") options.rank_labels = labels;
    comm = make_shared_memory_communicator(options);
  });
  if (!comm) {
    write(setup);
    return 0;
  }
  Tensor t = Tensor::zeros({1 << 18}, kFloat32);
  if (scenario == "battery") {
    std::uint64_t digest = 0;
    Outcome o = outcome_of([&] { digest = battery(*comm); });
    if (o.type == "none") o.message = fmt::format("{:016x}", digest);
    write(o);
  } else if (scenario == "kill") {
    // Reduce until something fails; the test kills a rank once every rank has done a few.
    write(outcome_of([&] {
      for (int i = 0;; ++i) {
        if (i == 3) store->set(fmt::format("ready/{}", rank), {'1'});
        comm->all_reduce(t, ReduceOp::kSum);
      }
    }));
  } else if (scenario == "hang") {
    comm->all_reduce(t, ReduceOp::kSum);
    if (rank == 2) std::this_thread::sleep_for(60s);  // the test kills it
    write(outcome_of([&] { comm->all_reduce(t, ReduceOp::kSum); }));
  } else if (scenario == "mismatch") {
    write(outcome_of([&] {
      std::vector<Tensor> bucket = {Tensor::zeros({1000}, kFloat32), Tensor::zeros({rank == 0 ? 90 : 100}, kFloat32),
                                    Tensor::zeros({200}, kFloat32)};
      comm->all_reduce(std::span<Tensor>(bucket), ReduceOp::kSum);
    }));
    write(outcome_of([&] {
      Tensor small = Tensor::zeros({4}, kFloat32);
      Tensor gathered = Tensor::zeros({8}, kFloat32);
      if (rank == 0) {
        comm->broadcast(small, 0);
      } else {
        comm->all_gather(small, gathered);
      }
    }));
    // Both threw the same: the group goes on.
    write(outcome_of([&] {
      Tensor x = Tensor::filled<float>({5}, static_cast<float>(rank + 1));
      comm->all_reduce(x, ReduceOp::kSum);
      if (x.to_vector<float>() != std::vector<float>(5, 3.0f)) throw std::runtime_error("wrong sum after a mismatch");
    }));
  } else if (scenario == "abort") {
    comm->all_reduce(t, ReduceOp::kSum);
    if (rank == 1) {
      std::thread aborter([&] {
        std::this_thread::sleep_for(300ms);
        comm->abort("disk full");
      });
      write(outcome_of([&] { comm->all_reduce(t, ReduceOp::kSum); }));
      aborter.join();
    } else if (rank == 0) {
      write(outcome_of([&] { comm->all_reduce(t, ReduceOp::kSum); }));
    } else {
      std::this_thread::sleep_for(1500ms);  // never joins that all_reduce
      write(outcome_of([&] { comm->barrier(); }));
    }
  }
  return 0;
}

// `size` worker processes of `scenario` (testing::WorkerProcesses): each connects to the store,
// makes its communicator, runs the scenario and writes one outcome line per step to its file.
class Job {
 public:
  Job(std::string scenario, int size)
      : workers_({.flag = std::string(kWorkerFlag), .scenario = std::move(scenario), .size = size}) {}

  // However the workers ended, none left its segment behind: every worker still running is
  // killed and reaped first (a killed process's segment must be gone too).
  ~Job() {
    for (int r = 0; r < static_cast<int>(workers_.spawned().size()); ++r) {
      if (std::find(done_.begin(), done_.end(), r) == done_.end()) workers_.kill(r);
    }
    for (pid_t pid : workers_.spawned()) CHECK(segments_of(pid).empty());
  }

  Store& store() { return workers_.store(); }
  void kill(int rank) {
    workers_.kill(rank);
    done_.push_back(rank);
  }

  // Waits (up to `limit`) for the ranks' processes to exit and reads their outcomes, one list per rank.
  std::vector<std::vector<Outcome>> wait(const std::vector<int>& ranks, std::chrono::seconds limit) {
    const auto deadline = Clock::now() + limit;
    std::vector<std::vector<Outcome>> outcomes;
    for (int r : ranks) {
      workers_.wait_exit(r, deadline, limit);
      done_.push_back(r);
      std::ifstream in(workers_.result_path(r));
      std::vector<Outcome> lines;
      for (std::string line; std::getline(in, line);) {
        const auto tab1 = line.find('\t');
        const auto tab2 = line.find('\t', tab1 + 1);
        if (tab1 == std::string::npos || tab2 == std::string::npos) continue;
        lines.push_back({line.substr(0, tab1), std::atoll(line.substr(tab1 + 1, tab2 - tab1 - 1).c_str()),
                         line.substr(tab2 + 1)});
      }
      outcomes.push_back(lines);
    }
    return outcomes;
  }

 private:
  testing::WorkerProcesses workers_;
  std::vector<int> done_;  // ranks killed or waited for
};

std::vector<int> all_ranks(int n) {
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(r);
  return ranks;
}

void wait_for_ready(Store& store, int size) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(fmt::format("ready/{}", r));
  store.wait(keys, 30s);
}

}  // namespace

TEST_CASE("processes: every collective, reduction and dtype, in pieces, bitwise equal on 2, 3 and 4 ranks") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    Job job("battery", n);
    const auto outcomes = job.wait(all_ranks(n), 60s);
    std::string digest;
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const auto& lines = outcomes[static_cast<std::size_t>(r)];
      REQUIRE(lines.size() == 1);
      CAPTURE(lines[0].message);
      CHECK(lines[0].type == "none");
      if (r == 0) digest = lines[0].message;
      CHECK(lines[0].message == digest);  // bitwise the same results on every rank
    }
  }
}

TEST_CASE("processes: a killed rank is named by the others within a second") {
  for (int victim : {2, 0}) {  // a peer, and the rank that made the segment
    CAPTURE(victim);
    Job job("kill", 3);
    wait_for_ready(job.store(), 3);
    job.kill(victim);
    std::vector<int> survivors;
    for (int r = 0; r < 3; ++r) {
      if (r != victim) survivors.push_back(r);
    }
    for (const auto& lines : job.wait(survivors, 20s)) {
      REQUIRE(lines.size() == 1);
      const Outcome& o = lines[0];
      CAPTURE(o.message);
      CHECK(o.type == "Unavailable");
      CHECK(o.message.find(fmt::format("lost worker {}: its process died", victim)) != std::string::npos);
      CHECK(o.call_ms < 1000);
    }
  }
}

TEST_CASE("processes: a rank that hangs is named in the others' DeadlineExceeded at the timeout") {
  Job job("hang", 3);
  const auto outcomes = job.wait({0, 1}, 20s);
  for (std::size_t i = 0; i < outcomes.size(); ++i) {
    REQUIRE(outcomes[i].size() == 1);
    const Outcome& o = outcomes[i][0];
    CAPTURE(o.message);
    CHECK(o.type == "DeadlineExceeded");
    CHECK(o.message == fmt::format("shared-memory all_reduce #1 (float32, 262144 elements) on rank {}: timed out after "
                                   "1 s waiting for rank 2 of 3, which never reached it",
                                   i));
    CHECK(o.call_ms >= 900);
    CHECK(o.call_ms < 3000);
  }
}

TEST_CASE("processes: mismatched collectives throw InvalidArgument with both sides on every rank") {
  Job job("mismatch", 2);
  const auto outcomes = job.wait({0, 1}, 20s);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const auto& lines = outcomes[static_cast<std::size_t>(r)];
    REQUIRE(lines.size() == 3);
    CHECK(lines[0].type == "InvalidArgument");
    CHECK(lines[0].message ==
          fmt::format("shared-memory all_reduce #0 (float32, {} elements) on worker {}: collective mismatch: worker 0 "
                      "issued all_reduce SUM float32 x 1290 but worker 1 issued all_reduce SUM float32 x 1300",
                      r == 0 ? 1290 : 1300, r));
    CHECK(lines[1].type == "InvalidArgument");
    CHECK(lines[1].message.ends_with(
        "collective mismatch: worker 0 issued broadcast #1 float32 x 4 from root 0 but worker 1 issued all_gather #1 "
        "float32 x 4"));
    CAPTURE(lines[2].message);
    CHECK(lines[2].type == "none");
  }
}

TEST_CASE("processes: abort ends the peers' pending call promptly, and every later call") {
  Job job("abort", 3);
  const auto outcomes = job.wait({0, 1, 2}, 20s);
  for (const auto& lines : outcomes) REQUIRE(lines.size() == 1);
  const Outcome& aborter = outcomes[1][0];
  CHECK(aborter.type == "Unavailable");
  CHECK(aborter.message ==
        "shared-memory all_reduce #1 (float32, 262144 elements) on worker 1: the group was aborted: disk full");
  CHECK(aborter.call_ms < 1000);
  const Outcome& peer = outcomes[0][0];
  CHECK(peer.type == "Unavailable");
  CHECK(peer.message ==
        "shared-memory all_reduce #1 (float32, 262144 elements) on worker 0: worker 1 aborted the group: disk full");
  CHECK(peer.call_ms < 1000);
  const Outcome& late = outcomes[2][0];
  CHECK(late.type == "Unavailable");
  CHECK(late.message == "shared-memory barrier #1 on worker 2: worker 1 aborted the group: disk full");
  CHECK(late.call_ms < 100);
}

// --- threads of this process -------------------------------------------------------------------

TEST_CASE("bad options") {
  auto store = make_in_memory_store();
  CHECK_THROWS_WITH_AS(make_shared_memory_communicator({.rank = 2, .size = 2, .store = store}),
                       "make_shared_memory_communicator: rank 2 is not in [0, 2)", InvalidArgument);
  CHECK_THROWS_WITH_AS(make_shared_memory_communicator({.rank = 0, .size = 2}), doctest::Contains("rank 0 has no store"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(make_shared_memory_communicator({.rank = 0, .size = 2, .store = store, .rank_labels = {"chief"}}),
                       doctest::Contains("1 rank labels for a group of 2"), InvalidArgument);
  CHECK_THROWS_WITH_AS(make_shared_memory_communicator({.rank = 0, .size = 2, .store = store, .slot_bytes = 1000}),
                       "make_shared_memory_communicator: slot_bytes must be at least 4096 (kMinSlotBytes), got 1000",
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(make_shared_memory_communicator({.rank = 0, .size = 2, .store = store, .timeout = 0ms}),
                       doctest::Contains("the timeout must be positive"), InvalidArgument);
}

TEST_CASE("a group of one: every collective is local") {
  auto c = make_shared_memory_communicator({});
  CHECK(c->backend() == "shared-memory");
  Tensor t = Tensor::from_vector<float>({1, 2, 3}, {3});
  c->all_reduce(t, ReduceOp::kMean);
  CHECK(t.to_vector<float>() == std::vector<float>{1, 2, 3});
  c->broadcast(t, 0);
  Tensor gathered = Tensor::zeros({3}, kFloat32);
  c->all_gather(t, gathered);
  CHECK(gathered.to_vector<float>() == std::vector<float>{1, 2, 3});
  Tensor part = Tensor::zeros({3}, kFloat32);
  c->reduce_scatter(t, part, ReduceOp::kMean);
  CHECK(part.to_vector<float>() == std::vector<float>{1, 2, 3});
  c->barrier();
  CHECK(c->sequence_number() == 5);
  CHECK_THROWS_WITH_AS(c->broadcast(t, 1), doctest::Contains("root 1 is not a rank of this group of 1"), InvalidArgument);
  c->abort("stop");
  CHECK_THROWS_WITH_AS(c->barrier(), "shared-memory barrier #6 on rank 0: the group was aborted: stop", Unavailable);
}

TEST_CASE("threads: bad arguments on one rank throw on every rank, and the group goes on") {
  Group group = make_group(2, {.timeout = 20s, .rank_labels = {"chief", "worker 1"}, .slot_bytes = kSmallSlot});
  CHECK(segments_of(::getpid()).empty());  // removed from /dev/shm as soon as both mapped it
  auto errors = on_ranks(group, [&](Communicator& c) {
    std::vector<Tensor> bucket = {Tensor::zeros({4}, kFloat32), Tensor::zeros({4}, c.rank() == 1 ? kInt32 : kFloat32)};
    c.all_reduce(std::span<Tensor>(bucket), ReduceOp::kSum);
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(error_as<InvalidArgument>(errors[static_cast<std::size_t>(r)]) ==
          fmt::format("shared-memory all_reduce #0 (float32, 8 elements) on {}: worker 1: tensor 1 of 2 has dtype int32, "
                      "tensor 0 has float32; one all_reduce reduces one dtype",
                      r == 0 ? "chief" : "worker 1"));
  }
  errors = on_ranks(group, [&](Communicator& c) {
    Tensor in = Tensor::zeros({3}, kFloat32);
    Tensor out = Tensor::zeros({c.rank() == 0 ? 5 : 6}, kFloat32);
    c.all_gather(in, out);
  });
  CHECK(error_as<InvalidArgument>(errors[1]) ==
        "shared-memory all_gather #1 (float32, 3 elements) on worker 1: chief: output has shape (5,); gathering 2 "
        "inputs of shape (3,) needs (6,)");
  errors = on_ranks(group, [&](Communicator& c) {
    Tensor t = Tensor::zeros({3}, kFloat32);
    c.broadcast(t, c.rank() == 0 ? 0 : 1);
  });
  CHECK(error_as<InvalidArgument>(errors[0]).ends_with(
      "collective mismatch: chief issued broadcast float32 x 3 from root 0 but worker 1 issued broadcast float32 x 3 "
      "from root 1"));
  require_no_errors(on_ranks(group, [&](Communicator& c) {
    Tensor t = Tensor::filled<std::int32_t>({10000}, c.rank() + 1);
    c.all_reduce(t, ReduceOp::kMax);
    CHECK(t.to_vector<std::int32_t>() == std::vector<std::int32_t>(10000, 2));
  }));
}

TEST_CASE("threads: a rank that never comes to the meeting is named, and no segment is left") {
  auto store = make_in_memory_store();
  CHECK_THROWS_WITH_AS(make_shared_memory_communicator({.rank = 0, .size = 3, .store = store, .timeout = 300ms}),
                       "make_shared_memory_communicator on rank 0 of 3: ranks 1, 2 of 3 did not map the shared-memory "
                       "segment within 300 ms",
                       DeadlineExceeded);
  CHECK(segments_of(::getpid()).empty());
  CHECK_THROWS_WITH_AS(
      make_shared_memory_communicator({.rank = 1, .size = 2, .store = make_in_memory_store(), .timeout = 200ms}),
      "make_shared_memory_communicator on rank 1 of 2: rank 0 did not publish the shared-memory segment in the store "
      "in-memory within 200 ms",
      DeadlineExceeded);
}

TEST_CASE("threads: ranks whose slot sizes differ cannot meet") {
  auto store = make_in_memory_store();
  std::exception_ptr errors[2];
  std::thread other([&] {
    try {
      make_shared_memory_communicator({.rank = 1, .size = 2, .store = store, .timeout = 10s, .slot_bytes = 8192});
    } catch (...) {
      errors[1] = std::current_exception();
    }
  });
  try {
    make_shared_memory_communicator({.rank = 0, .size = 2, .store = store, .timeout = 10s, .slot_bytes = 4096});
  } catch (...) {
    errors[0] = std::current_exception();
  }
  other.join();
  CHECK(error_as<InvalidArgument>(errors[1]) ==
        "make_shared_memory_communicator on rank 1 of 2: rank 0 made the segment for 2 ranks with slot_bytes 4096, this "
        "rank has size 2 and slot_bytes 8192; every rank needs the same");
  CHECK(error_as<InvalidArgument>(errors[0]).starts_with(
      "make_shared_memory_communicator on rank 0 of 2: rank 1 could not join: make_shared_memory_communicator on rank 1"));
  CHECK(segments_of(::getpid()).empty());
}

TEST_CASE("threads: a peer that destroyed its communicator fails the next call at once") {
  Group group = make_group(2, {.timeout = 20s, .slot_bytes = kSmallSlot});
  require_no_errors(on_ranks(group, [&](Communicator& c) { c.barrier(); }));
  group[1].reset();
  const auto start = Clock::now();
  CHECK_THROWS_WITH_AS(group[0]->barrier(),
                       "shared-memory barrier #1 on rank 0: rank 1 left the group (its communicator was destroyed)",
                       Unavailable);
  CHECK(Clock::now() - start < 1s);
}

TEST_CASE("threads: a call with its own timeout names the missing rank; the group then fails") {
  Group group = make_group(3, {.timeout = 20s, .slot_bytes = kSmallSlot});
  auto errors = on_ranks(group, [&](Communicator& c) {
    if (c.rank() == 1) return;
    Tensor t = Tensor::zeros({10}, kFloat64);
    c.all_reduce(t, ReduceOp::kSum, {.timeout = 200ms});
  });
  for (int r : {0, 2}) {
    CHECK(error_as<DeadlineExceeded>(errors[static_cast<std::size_t>(r)]) ==
          fmt::format("shared-memory all_reduce #0 (float64, 10 elements) on rank {}: timed out after 200 ms waiting for "
                      "rank 1 of 3, which never reached it",
                      r));
  }
  CHECK_THROWS_WITH_AS(group[1]->barrier(),
                       "shared-memory barrier #0 on rank 1: the group failed at all_reduce #0: timed out after 200 ms "
                       "waiting for rank 1 of 3, which never reached it",
                       Unavailable);
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string_view(argv[1]) == kWorkerFlag) return worker_main(argc, argv);
  return doctest::Context(argc, argv).run();
}
