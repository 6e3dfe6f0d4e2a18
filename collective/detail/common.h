// tandem/collective/detail/common.h — what the collective backends share: operation names for
// messages, the ranks-list wording of timeouts, and the shape rules of all_gather/reduce_scatter.
// Not part of the public contract.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/collective/communicator.h"

namespace tandem::collective::detail {

enum class OpKind : std::uint8_t { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kBarrier };

// "all_reduce", "broadcast", ...: the method names, as messages print them.
std::string_view op_kind_name(OpKind kind);

// "all_reduce #12": how every message names one call.
std::string call_label(OpKind kind, std::uint64_t sequence_number);

// "rank 3 of 4" or "ranks 1, 3 of 4".
std::string ranks_of(const std::vector<int>& ranks, int size);

// Checks the shapes of all_gather(input, output) in a group of `size`: output's first dimension is
// size x input's, the other dimensions equal (a scalar input gathers into a vector of `size`).
// Returns a description of the problem, or nullopt.
std::optional<std::string> check_all_gather_shapes(const Shape& input, const Shape& output, int size);
// Likewise for reduce_scatter(input, output): input's first dimension is size x output's.
std::optional<std::string> check_reduce_scatter_shapes(const Shape& input, const Shape& output, int size);

}  // namespace tandem::collective::detail
