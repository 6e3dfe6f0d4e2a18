// What the hierarchical group has beyond the Communicator contract (contract/ checks every
// collective and failure on a group of in-process levels): its rank numbering over a process
// backend (worker-major: worker w's replica i is rank w * L + i) and the checks of its levels.
// Workers are threads of this process; the cross-worker level is Gloo over an in-memory store.
#include <doctest/doctest.h>

#include <exception>
#include <thread>
#include <vector>

#include "on_ranks.h"
#include "tandem/collective/gloo.h"
#include "tandem/collective/hierarchical.h"
#include "tandem/collective/in_process.h"

using namespace tandem;
using namespace tandem::collective;
using namespace std::chrono_literals;

namespace {

using testing::error_as;
using testing::Group;
using testing::on_ranks;
using testing::require_no_errors;

// One hierarchical group per worker (a thread each), replicas_per_worker[w] local replicas each,
// joined over Gloo. Returns each worker's replicas, or what each worker's creation threw.
std::vector<Group> make_workers(const std::vector<int>& replicas_per_worker, std::vector<std::exception_ptr>& errors) {
  const int workers = static_cast<int>(replicas_per_worker.size());
  auto store = make_in_memory_store();
  std::vector<Group> per_worker(static_cast<std::size_t>(workers));
  errors.assign(static_cast<std::size_t>(workers), nullptr);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      try {
        auto cross = make_gloo_communicator({.rank = w, .size = workers, .store = store, .timeout = 20s});
        per_worker[static_cast<std::size_t>(w)] = make_hierarchical_group(
            make_in_process_group(replicas_per_worker[static_cast<std::size_t>(w)]), std::move(cross));
      } catch (...) {
        errors[static_cast<std::size_t>(w)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return per_worker;
}

}  // namespace

TEST_CASE("hierarchical group over Gloo: ranks are worker-major, and a collective spans both levels") {
  std::vector<std::exception_ptr> errors;
  std::vector<Group> workers = make_workers({2, 2}, errors);
  require_no_errors(errors);
  Group all;
  for (auto& g : workers) {
    for (auto& c : g) all.push_back(std::move(c));
  }
  for (int r = 0; r < 4; ++r) {
    CHECK(all[static_cast<std::size_t>(r)]->rank() == r);
    CHECK(all[static_cast<std::size_t>(r)]->size() == 4);
    CHECK(all[static_cast<std::size_t>(r)]->backend() == "hierarchical");
  }
  std::vector<std::vector<float>> gathered(4);
  require_no_errors(on_ranks(all, [&](Communicator& c) {
    Tensor in = Tensor::scalar<float>(static_cast<float>(10 * c.rank()));
    Tensor out = Tensor::zeros({4}, kFloat32);
    c.all_gather(in, out);
    gathered[static_cast<std::size_t>(c.rank())] = out.to_vector<float>();
  }));
  for (const auto& g : gathered) CHECK(g == std::vector<float>{0, 10, 20, 30});
}

TEST_CASE("hierarchical group: workers with different replica counts are named, on every worker") {
  std::vector<std::exception_ptr> errors;
  make_workers({2, 3}, errors);
  for (int w = 0; w < 2; ++w) {
    CHECK(error_as<InvalidArgument>(errors[static_cast<std::size_t>(w)]) ==
          "make_hierarchical_group: worker 0 has 2 local replicas but worker 1 has 3; every worker needs the same "
          "number");
  }
}

TEST_CASE("hierarchical group: its levels are checked") {
  CHECK_THROWS_WITH_AS(make_hierarchical_group({}, std::move(make_in_process_group(1)[0])),
                       doctest::Contains("no local communicators"), InvalidArgument);
  CHECK_THROWS_WITH_AS(make_hierarchical_group(make_in_process_group(2), nullptr),
                       doctest::Contains("the cross-worker communicator is null"), InvalidArgument);
  // local[i] must be rank i of one group.
  Group local = make_in_process_group(2);
  std::swap(local[0], local[1]);
  CHECK_THROWS_WITH_AS(make_hierarchical_group(std::move(local), std::move(make_in_process_group(1)[0])),
                       "make_hierarchical_group: local communicator 0 has rank 1 of 2; local[i] must be rank i of 2",
                       InvalidArgument);
}

TEST_CASE("hierarchical group: its stats count the group's level, cross_worker_stats the worker's own traffic") {
  std::vector<std::exception_ptr> errors;
  std::vector<Group> workers = make_workers({2, 2}, errors);
  require_no_errors(errors);
  // What the group's making did across workers (it all-gathers the replica counts) is the cross
  // level's: read it before, compare the difference.
  std::vector<CommunicationStats> before;
  for (auto& g : workers) before.push_back(cross_worker_stats(*g[0]));
  Group all;
  for (auto& g : workers) {
    for (auto& c : g) all.push_back(std::move(c));
  }
  constexpr std::int64_t kBytes = 4 * 1000;  // float32 x 1000
  require_no_errors(on_ranks(all, [&](Communicator& c) {
    Tensor t = Tensor::zeros({1000}, kFloat32);
    c.all_reduce(t, ReduceOp::kSum);
  }));
  for (auto& c : all) {
    // N = 4 replicas: 2 x 3 / 4 of the buffer.
    CHECK(c->stats().all_reduce == OpStats{.calls = 1, .bytes_sent = kBytes * 6 / 4, .bytes_received = kBytes * 6 / 4});
    CHECK(c->stats().total().calls == 1);
  }
  for (int w = 0; w < 2; ++w) {
    // Replica 0 of each worker all-reduced once across N = 2 workers: 2 x 1 / 2 of the buffer.
    // Every replica of the worker reads the same cross-worker communicator.
    CommunicationStats cross = cross_worker_stats(*all[static_cast<std::size_t>(2 * w + 1)]);
    cross -= before[static_cast<std::size_t>(w)];
    CHECK(cross.all_reduce == OpStats{.calls = 1, .bytes_sent = kBytes, .bytes_received = kBytes});
    CHECK(cross.total().calls == 1);
  }
  auto plain = make_in_process_group(1);
  CHECK_THROWS_WITH_AS(cross_worker_stats(*plain[0]),
                       "cross_worker_stats: rank 0's communicator is in-process, not a hierarchical group's",
                       InvalidArgument);
}
