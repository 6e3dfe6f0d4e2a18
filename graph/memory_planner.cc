#include "tandem/graph/memory_planner.h"

#include <algorithm>
#include <numeric>

#include "tandem/base/errors.h"

namespace tandem::graph {

MemoryPlan plan_memory(std::span<const BufferRequest> requests, std::int64_t alignment_bytes) {
  TANDEM_ASSERT(alignment_bytes > 0, "alignment must be positive");
  const auto aligned = [&](std::int64_t b) { return (b + alignment_bytes - 1) / alignment_bytes * alignment_bytes; };
  MemoryPlan plan;
  plan.offsets.assign(requests.size(), 0);

  std::vector<std::size_t> by_size(requests.size());
  std::iota(by_size.begin(), by_size.end(), std::size_t{0});
  std::stable_sort(by_size.begin(), by_size.end(), [&](std::size_t a, std::size_t b) {
    if (requests[a].bytes != requests[b].bytes) return requests[a].bytes > requests[b].bytes;
    return requests[a].first_step < requests[b].first_step;
  });

  std::vector<std::size_t> placed;
  std::vector<std::pair<std::int64_t, std::int64_t>> busy;  // [offset, end) of live neighbours
  for (const std::size_t r : by_size) {
    const auto& req = requests[r];
    TANDEM_ASSERT(req.first_step <= req.last_step, "request {} ends (step {}) before it starts (step {})", r,
                  req.last_step, req.first_step);
    const std::int64_t size = aligned(req.bytes);
    plan.unshared_bytes += size;
    busy.clear();
    for (const std::size_t p : placed) {
      const auto& other = requests[p];
      const bool overlaps_in_time = other.first_step <= req.last_step && req.first_step <= other.last_step;
      if (overlaps_in_time) busy.emplace_back(plan.offsets[p], plan.offsets[p] + aligned(other.bytes));
    }
    std::sort(busy.begin(), busy.end());
    // Best fit: the smallest gap between live neighbours that holds this value.
    std::int64_t best_offset = -1;
    std::int64_t best_gap = 0;
    std::int64_t cursor = 0;
    for (const auto& [begin, end] : busy) {
      const std::int64_t gap = begin - cursor;
      if (gap >= size && (best_offset < 0 || gap < best_gap)) {
        best_offset = cursor;
        best_gap = gap;
      }
      cursor = std::max(cursor, end);
    }
    if (best_offset < 0) best_offset = cursor;
    plan.offsets[r] = best_offset;
    plan.arena_bytes = std::max(plan.arena_bytes, best_offset + size);
    placed.push_back(r);
  }
  return plan;
}

}  // namespace tandem::graph
