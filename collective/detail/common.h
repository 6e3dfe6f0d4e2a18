// tandem/collective/detail/common.h — what the collective backends share: operation names for
// messages, the ranks-list wording of timeouts, deadlines and how messages print durations and
// keys, the host-memory checks of the CPU backends, and the shape rules of
// all_gather/reduce_scatter. Not part of the public contract.
#pragma once

#include <chrono>
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

// "send", "recv" or "send_recv": which point-to-point call Communicator::do_send_recv stands for
// (a negative peer: that half is left out).
std::string_view point_to_point_name(int send_peer, int recv_peer);
// How messages name one half of a point-to-point call: "recv #3 from rank 0 on rank 1", or within a
// send_recv "send_recv (its recv #3 from rank 0) on rank 1". `number` is the pair's message number;
// `peer` and `self` are how the backend names the two ranks.
std::string point_to_point_label(std::string_view op, bool receiving, std::uint64_t number, std::string_view peer,
                                 std::string_view self);
// The receiver's InvalidArgument when a message does not fit its tensor: "rank 0 sent 8 float32
// elements, rank 1 receives 8 int64 elements; ...".
std::string point_to_point_mismatch(int sender, DType sent_dtype, std::int64_t sent_elements, int receiver,
                                    DType expected_dtype, std::int64_t expected_elements);

// "all_reduce #12": how every message names one call.
std::string call_label(OpKind kind, std::uint64_t sequence_number);

// "rank 3 of 4" or "ranks 1, 3 of 4".
std::string ranks_of(const std::vector<int>& ranks, int size);
// How a group with these rank labels (empty: none) names rank r ("worker 1 (10.0.0.2:2222)", or
// "rank 1"), and a list of ranks (the labels joined, or ranks_of).
std::string rank_label(const std::vector<std::string>& labels, int rank);
std::string rank_names(const std::vector<std::string>& labels, const std::vector<int>& ranks, int size);

// The clock every collective deadline is measured on.
using Clock = std::chrono::steady_clock;

// Timeouts beyond a year are a year: the clock arithmetic must not overflow.
constexpr std::chrono::milliseconds kMaxTimeout = std::chrono::hours(24 * 365);

// now + timeout, with the timeout clamped to [0, kMaxTimeout], and no later than the innermost
// DeadlineScope of this thread.
Clock::time_point deadline_after(std::chrono::milliseconds timeout);

// While it lives, every deadline this thread takes from deadline_after ends by `deadline`: the
// store calls of a failed collective's diagnosis (the TCP store's client measures every request
// with deadline_after) end by the call's own deadline, even when the store's server is frozen or
// cut off by a partition. Scopes nest; the earliest deadline wins.
class DeadlineScope {
 public:
  explicit DeadlineScope(Clock::time_point deadline);
  ~DeadlineScope();
  DeadlineScope(const DeadlineScope&) = delete;
  DeadlineScope& operator=(const DeadlineScope&) = delete;

 private:
  std::optional<Clock::time_point> saved_;
};

// "250 ms", "5 s", "2.5 s": how messages print a timeout.
std::string format_duration(std::chrono::milliseconds d);

// `"a", "b"`: how messages list store keys.
std::string quoted_list(const std::vector<std::string>& keys);

// Why tensor `what` cannot be used by `backend` ("the gloo communicator"), or "" if it can.
std::string host_tensor_problem(const Tensor& t, std::string_view what, std::string_view backend);

// all_gather's and reduce_scatter's input and output: both in host memory, of one dtype; "" if so.
std::string in_out_problem(const Tensor& input, const Tensor& output, std::string_view backend);

// Checks the shapes of all_gather(input, output) in a group of `size`: output's first dimension is
// size x input's, the other dimensions equal (a scalar input gathers into a vector of `size`).
// Returns a description of the problem, or nullopt.
std::optional<std::string> check_all_gather_shapes(const Shape& input, const Shape& output, int size);
// Likewise for reduce_scatter(input, output): input's first dimension is size x output's.
std::optional<std::string> check_reduce_scatter_shapes(const Shape& input, const Shape& output, int size);

}  // namespace tandem::collective::detail
