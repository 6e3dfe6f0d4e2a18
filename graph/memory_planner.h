// tandem/graph/memory_planner.h — packs a step's intermediate tensors into one arena.
//
// Every intermediate value of a planned run lives from the step that writes it to the last step
// that reads it. Values whose lifetimes do not overlap may share bytes. plan_memory places them
// greedily, largest first, each at the lowest offset that does not collide with an
// already-placed value alive at the same time (TFLite's "greedy by size"). The executor
// allocates the arena once per plan, so a steady-state step allocates nothing.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace tandem::graph {

struct BufferRequest {
  std::int64_t bytes = 0;
  int first_step = 0;  // the step that writes it
  int last_step = 0;   // the last step that reads it (inclusive)
};

struct MemoryPlan {
  std::vector<std::int64_t> offsets;  // per request, a multiple of the alignment
  std::int64_t arena_bytes = 0;       // the peak: what the arena must hold
  std::int64_t unshared_bytes = 0;    // what one buffer per value would need (aligned)
};

MemoryPlan plan_memory(std::span<const BufferRequest> requests, std::int64_t alignment_bytes);

}  // namespace tandem::graph
