// What the shared-memory communicator has beyond the Communicator contract (contract/ checks
// every collective and failure on it, in worker processes): its options, the segment's name
// leaving /dev/shm once every rank has mapped it (so nothing is left behind however the processes
// end), its meeting, and a peer that destroyed its communicator. Ranks are threads of this process
// (they may share one), meeting through an in-memory store.
#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "on_ranks.h"
#include "tandem/collective/shared_memory.h"
#include "tandem/collective/store.h"

using namespace tandem;
using namespace tandem::collective;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

using testing::error_as;
using testing::Group;
using testing::on_ranks;
using testing::require_no_errors;

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

}  // namespace

TEST_CASE("bad options") {
  auto store = make_in_memory_store();
  CHECK_THROWS_WITH_AS(make_shared_memory_communicator({.rank = 2, .size = 2, .store = store}),
                       "make_shared_memory_communicator: rank 2 is not in [0, 2)", InvalidArgument);
  CHECK_THROWS_WITH_AS(make_shared_memory_communicator({.rank = 0, .size = 2}),
                       doctest::Contains("rank 0 has no store"), InvalidArgument);
  CHECK_THROWS_WITH_AS(
      make_shared_memory_communicator({.rank = 0, .size = 2, .store = store, .rank_labels = {"chief"}}),
      doctest::Contains("1 rank labels for a group of 2"), InvalidArgument);
  CHECK_THROWS_WITH_AS(make_shared_memory_communicator({.rank = 0, .size = 2, .store = store, .slot_bytes = 1000}),
                       "make_shared_memory_communicator: slot_bytes must be at least 4096 (kMinSlotBytes), got 1000",
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(make_shared_memory_communicator({.rank = 0, .size = 2, .store = store, .timeout = 0ms}),
                       doctest::Contains("the timeout must be positive"), InvalidArgument);
}

TEST_CASE("threads: the segment's name leaves /dev/shm as soon as every rank has mapped it") {
  Group group = make_group(2, {.timeout = 20s, .slot_bytes = kSmallSlot});
  CHECK(segments_of(::getpid()).empty());
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
  CHECK(
      error_as<InvalidArgument>(errors[1]) ==
      "make_shared_memory_communicator on rank 1 of 2: rank 0 made the segment for 2 ranks with slot_bytes 4096, this "
      "rank has size 2 and slot_bytes 8192; every rank needs the same");
  CHECK(
      error_as<InvalidArgument>(errors[0]).starts_with("make_shared_memory_communicator on rank 0 of 2: rank 1 could "
                                                       "not join: make_shared_memory_communicator on rank 1"));
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
