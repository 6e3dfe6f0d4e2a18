// The backends the conformance suite checks: one entry per Communicator factory. A new backend
// gets the whole contract (contract.h) by adding its entry here; CTest then runs it as
// collective_contract_<name>.
#include <fmt/format.h>

#include <thread>

#include "contract.h"
#include "tandem/collective/gloo.h"
#include "tandem/collective/hierarchical.h"
#include "tandem/collective/in_process.h"
#include "tandem/collective/nccl.h"
#include "tandem/collective/shared_memory.h"

namespace tandem::testing::contract {
namespace {

using collective::Store;

// Communicators of process backends wait this long to meet, and this long in calls that keep the
// default timeout: a hang fails the run instead of lasting five minutes.
constexpr auto kProcessTimeout = std::chrono::milliseconds(60s);

const std::vector<DType> kAllReducible = {kFloat32, kFloat64, kInt32, kInt64, DType::kF16, DType::kBF16};

// A hierarchical group over threads: size / 2 workers of two replicas each (one worker of two
// for size 2), every level an in-process group. make_hierarchical_group blocks in a cross-worker
// all-gather, so each worker makes its replicas on a thread of its own.
Group hierarchical_group(int size) {
  constexpr int kReplicas = 2;
  const int workers = size / kReplicas;
  Group cross = collective::make_in_process_group(workers);
  std::vector<Group> per_worker(static_cast<std::size_t>(workers));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(workers));
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      try {
        per_worker[static_cast<std::size_t>(w)] = collective::make_hierarchical_group(
            collective::make_in_process_group(kReplicas), std::move(cross[static_cast<std::size_t>(w)]));
      } catch (...) {
        errors[static_cast<std::size_t>(w)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  Group all;
  for (auto& g : per_worker) {
    for (auto& c : g) all.push_back(std::move(c));
  }
  return all;
}

std::vector<int> first_ranks(int n) {
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(r);
  return ranks;
}

// NCCL needs a GPU per rank, and NCCL itself.
std::string gpus_missing(int size) {
  if (devices::num_gpus() < size) {
    return fmt::format("{} usable GPU(s), {} needed ({})", devices::num_gpus(), size, devices::gpu_discovery_message());
  }
  if (!collective::nccl_available()) return "NCCL is not available (a build without NCCL, or libnccl not loadable)";
  return "";
}

// A Gloo rank all-reducing with `algorithm`.
auto gloo_rank(collective::GlooAllReduceAlgorithm algorithm) {
  return [algorithm](int rank, int n, std::shared_ptr<Store> store) {
    return collective::make_gloo_communicator({.rank = rank,
                                               .size = n,
                                               .store = std::move(store),
                                               .timeout = kProcessTimeout,
                                               .all_reduce_algorithm = algorithm});
  };
}

devices::Device& gpu(int rank) { return devices::get_device(fmt::format("GPU:{}", rank)); }

}  // namespace

const std::vector<Backend>& backends() {
  static const std::vector<Backend> table = {
      {.name = "in_process",
       .traits = {.backend = "in-process",
                  .reduce_dtypes = kAllReducible,
                  .sizes = {1, 2, 3, 4, 8},
                  .failure_size = 4,
                  .rank_order = true,
                  .flat_span = true},
       .make_group = [](int n) { return collective::make_in_process_group(n); }},
      {.name = "shared_memory",
       .traits = {.backend = "shared-memory",
                  .reduce_dtypes = kAllReducible,
                  .sizes = {1, 2, 3},
                  .failure_size = 3,
                  .rank_order = true,
                  .flat_span = true},
       // The smallest slot: calls go through the segment in many pieces.
       .make_rank =
           [](int rank, int n, std::shared_ptr<Store> store) {
             return collective::make_shared_memory_communicator({.rank = rank,
                                                                 .size = n,
                                                                 .store = std::move(store),
                                                                 .timeout = kProcessTimeout,
                                                                 .slot_bytes = collective::kMinSlotBytes});
           }},
      // The default algorithm sums in rank order, as the host backends in shared memory do.
      {.name = "gloo",
       .traits = {.backend = "gloo",
                  .reduce_dtypes = kAllReducible,
                  .sizes = {1, 2, 3, 4},
                  .failure_size = 3,
                  .rank_order = true,
                  .flat_span = true,
                  .mismatch = MismatchReport::kTimeout},
       .make_rank = gloo_rank(collective::GlooAllReduceAlgorithm::kRankOrdered)},
      {.name = "gloo_ring",
       .traits = {.backend = "gloo",
                  .reduce_dtypes = kAllReducible,
                  .sizes = {1, 2, 3},
                  .failure_size = 3,
                  .flat_span = true,
                  .mismatch = MismatchReport::kTimeout},
       .make_rank = gloo_rank(collective::GlooAllReduceAlgorithm::kRing)},
      // Workers do not compare their calls (a disagreement between replicas of one worker is the
      // in-process group's InvalidArgument, between workers a timeout or nothing), a timeout names the missing rank's
      // local number (not its global one), a worker waiting for a local replica learns of another worker's abort
      // only at its next cross-worker step, and point-to-point calls reach only some pairs.
      {.name = "hierarchical",
       .traits = {.backend = "hierarchical",
                  .reduce_dtypes = kAllReducible,
                  .sizes = {2, 4, 6},
                  .failure_size = 4,
                  .mismatch = MismatchReport::kTimeout,
                  .names_missing_rank = false,
                  .abort_reaches_waiting_ranks = false,
                  .point_to_point_any_pair = false},
       .make_group = hierarchical_group},
      {.name = "nccl",
       .traits = {.backend = "nccl",
                  .reduce_dtypes = kAllReducible,
                  .sizes = {1, 2, 4, 8},
                  .failure_size = 2,
                  .mismatch = MismatchReport::kUnchecked},
       .make_group = [](int n) { return collective::make_nccl_group(first_ranks(n)); },
       .unavailable = gpus_missing,
       .device = gpu},
      {.name = "nccl_process",
       .traits = {.backend = "nccl",
                  .reduce_dtypes = kAllReducible,
                  .sizes = {2},
                  .failure_size = 2,
                  .mismatch = MismatchReport::kUnchecked},
       .make_rank =
           [](int rank, int n, std::shared_ptr<Store> store) {
             return collective::make_nccl_process_communicator(
                 {.rank = rank, .size = n, .cuda_device = rank, .store = std::move(store), .timeout = kProcessTimeout});
           },
       .unavailable = gpus_missing,
       .device = gpu},
  };
  return table;
}

}  // namespace tandem::testing::contract
