#include "tandem/collective/communicator.h"

#include <fmt/format.h>

#include <algorithm>

#include "tandem/collective/detail/common.h"

#include <fmt/ranges.h>
#include "tandem/devices/device.h"

namespace tandem::collective {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "SUM";
    case ReduceOp::kMean: return "MEAN";
    case ReduceOp::kMax: return "MAX";
    case ReduceOp::kMin: return "MIN";
  }
  return "?";
}

void Communicator::all_reduce_on_device(std::span<Tensor> /*tensors*/, ReduceOp /*op*/) {
  throw Unimplemented(
      fmt::format("{} communicator: all-reduces queued on a device stream need NCCL within one "
                  "process",
                  backend()));
}

namespace detail {

std::string_view op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce: return "all_reduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllGather: return "all_gather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kBarrier: return "barrier";
  }
  return "?";
}

std::string call_label(OpKind kind, std::uint64_t sequence_number) {
  return fmt::format("{} #{}", op_kind_name(kind), sequence_number);
}

std::string ranks_of(const std::vector<int>& ranks, int size) {
  return fmt::format("{} {} of {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "), size);
}

std::string rank_label(const std::vector<std::string>& labels, int rank) {
  if (labels.empty()) return fmt::format("rank {}", rank);
  return labels[static_cast<std::size_t>(rank)];
}

std::string rank_names(const std::vector<std::string>& labels, const std::vector<int>& ranks, int size) {
  if (labels.empty()) return ranks_of(ranks, size);
  std::vector<std::string> named;
  for (int r : ranks) named.push_back(rank_label(labels, r));
  return fmt::format("{}", fmt::join(named, ", "));
}

namespace {
thread_local std::optional<Clock::time_point> scope_deadline;
}  // namespace

Clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + std::clamp(timeout, std::chrono::milliseconds(0), kMaxTimeout);
  return scope_deadline ? std::min(deadline, *scope_deadline) : deadline;
}

DeadlineScope::DeadlineScope(Clock::time_point deadline) : saved_(scope_deadline) {
  scope_deadline = saved_ ? std::min(*saved_, deadline) : deadline;
}

DeadlineScope::~DeadlineScope() { scope_deadline = saved_; }

std::string format_duration(std::chrono::milliseconds d) {
  const auto ms = d.count();
  if (ms < 1000) return fmt::format("{} ms", ms);
  if (ms % 1000 == 0) return fmt::format("{} s", ms / 1000);
  return fmt::format("{:.1f} s", static_cast<double>(ms) / 1000.0);
}

std::string quoted_list(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) {
    if (!out.empty()) out += ", ";
    out += fmt::format("\"{}\"", k);
  }
  return out;
}

std::string host_tensor_problem(const Tensor& t, std::string_view what, std::string_view backend) {
  if (!t.defined()) return fmt::format("{} is undefined", what);
  if (!t.device().host_accessible()) {
    return fmt::format("{} is on {}; {} works on host memory (CPU devices)", what, t.device().short_name(), backend);
  }
  return {};
}

std::string in_out_problem(const Tensor& input, const Tensor& output, std::string_view backend) {
  std::string problem = host_tensor_problem(input, "the input", backend);
  if (problem.empty()) problem = host_tensor_problem(output, "the output", backend);
  if (problem.empty() && output.dtype() != input.dtype()) {
    problem = fmt::format("the output has dtype {}, the input {}", output.dtype(), input.dtype());
  }
  return problem;
}

namespace {
// The shape whose first dimension is `first` and whose other dimensions are `rest`'s (all but its
// first); for a scalar `rest`, the vector (first).
Shape with_first_dim(const Shape& rest, std::int64_t first) {
  std::vector<std::int64_t> dims{first};
  if (rest.rank() > 0) dims.insert(dims.end(), rest.dims().begin() + 1, rest.dims().end());
  return Shape(std::span<const std::int64_t>(dims));
}
}  // namespace

std::optional<std::string> check_all_gather_shapes(const Shape& input, const Shape& output, int size) {
  const Shape expected = with_first_dim(input, size * (input.rank() > 0 ? input[0] : 1));
  if (output == expected) return std::nullopt;
  return fmt::format("output has shape {}; gathering {} inputs of shape {} needs {}", output, size, input, expected);
}

std::optional<std::string> check_reduce_scatter_shapes(const Shape& input, const Shape& output, int size) {
  if (input.rank() == 0 || input[0] % size != 0) {
    return fmt::format("input has shape {}; its first dimension must split into {} equal parts", input, size);
  }
  const Shape expected = with_first_dim(input, input[0] / size);
  if (output == expected) return std::nullopt;
  return fmt::format("output has shape {}; part of input {} split {} ways is {}", output, input, size, expected);
}

}  // namespace detail
}  // namespace tandem::collective
