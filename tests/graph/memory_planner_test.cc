#include <doctest/doctest.h>

#include <random>

#include "tandem/graph/memory_planner.h"

using tandem::graph::BufferRequest;
using tandem::graph::plan_memory;

namespace {
// No two buffers that are alive at the same step share a byte.
void check_no_collisions(const std::vector<BufferRequest>& requests, const tandem::graph::MemoryPlan& plan) {
  for (std::size_t i = 0; i < requests.size(); ++i) {
    CHECK(plan.offsets[i] % 64 == 0);
    CHECK(plan.offsets[i] + requests[i].bytes <= plan.arena_bytes);
    for (std::size_t j = i + 1; j < requests.size(); ++j) {
      const bool live_together =
          requests[i].first_step <= requests[j].last_step && requests[j].first_step <= requests[i].last_step;
      const bool share_bytes = plan.offsets[i] < plan.offsets[j] + requests[j].bytes &&
                               plan.offsets[j] < plan.offsets[i] + requests[i].bytes;
      if (live_together && requests[i].bytes > 0 && requests[j].bytes > 0) CHECK_FALSE(share_bytes);
    }
  }
}
}  // namespace

TEST_CASE("buffers with disjoint lifetimes share memory; overlapping ones do not") {
  const std::vector<BufferRequest> chain = {{1000, 0, 1}, {1000, 1, 2}, {1000, 2, 3}, {1000, 3, 4}};
  const auto plan = plan_memory(chain, 64);
  check_no_collisions(chain, plan);
  CHECK(plan.unshared_bytes == 4 * 1024);
  CHECK(plan.arena_bytes == 2 * 1024);  // a chain needs two live buffers at a time
}

TEST_CASE("random lifetimes never collide and beat one buffer per value") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<BufferRequest> requests;
    for (int i = 0; i < 40; ++i) {
      const int first = static_cast<int>(rng() % 30);
      requests.push_back({static_cast<std::int64_t>(rng() % 5000), first, first + static_cast<int>(rng() % 6)});
    }
    const auto plan = plan_memory(requests, 64);
    check_no_collisions(requests, plan);
    CHECK(plan.arena_bytes <= plan.unshared_bytes);
  }
}
