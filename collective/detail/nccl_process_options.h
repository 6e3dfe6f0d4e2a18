// tandem/collective/detail/nccl_process_options.h — the checks of NcclProcessOptions that need no
// GPU. nccl.cc and nccl_unavailable.cc both run them first, so that a bad option is the same
// InvalidArgument in every build (and a CPU-only build can test them). Not part of the contract.
#pragma once

#include <chrono>

#include "tandem/base/errors.h"
#include "tandem/collective/nccl.h"

namespace tandem::collective::detail {

inline void check_nccl_process_options(const NcclProcessOptions& options) {
  TANDEM_REQUIRE(options.size >= 1, InvalidArgument, "make_nccl_process_communicator: size must be at least 1, got {}",
                 options.size);
  TANDEM_REQUIRE(options.rank >= 0 && options.rank < options.size, InvalidArgument,
                 "make_nccl_process_communicator: rank {} is not in [0, {})", options.rank, options.size);
  TANDEM_REQUIRE(options.store != nullptr, InvalidArgument,
                 "make_nccl_process_communicator: rank {} has no store (NcclProcessOptions::store); the ranks meet "
                 "through one, which carries NCCL's unique id",
                 options.rank);
  TANDEM_REQUIRE(options.timeout > std::chrono::milliseconds(0), InvalidArgument,
                 "make_nccl_process_communicator: the timeout must be positive, got {} ms", options.timeout.count());
  TANDEM_REQUIRE(options.rank_labels.empty() || static_cast<int>(options.rank_labels.size()) == options.size,
                 InvalidArgument,
                 "make_nccl_process_communicator: {} rank labels for a group of {}; give one per rank or none",
                 options.rank_labels.size(), options.size);
  TANDEM_REQUIRE(options.cuda_device >= 0, InvalidArgument,
                 "make_nccl_process_communicator: rank {} has CUDA device {}; ordinals start at 0", options.rank,
                 options.cuda_device);
}

}  // namespace tandem::collective::detail
