#include "tandem/collective/communicator.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "tandem/base/errors.h"
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

void Communicator::do_all_reduce_on_device(std::span<Tensor> /*tensors*/, ReduceOp /*op*/) {
  throw Unimplemented(
      fmt::format("{} communicator: all-reduces queued on a device stream need NCCL within one "
                  "process",
                  backend()));
}

// --- the collectives: the backend's, then counted ------------------------------------------------

namespace {

std::int64_t bytes_of(std::span<const Tensor> tensors) {
  std::int64_t bytes = 0;
  for (const Tensor& t : tensors) bytes += static_cast<std::int64_t>(t.nbytes());
  return bytes;
}

std::int64_t bytes_of(const Tensor& tensor) { return static_cast<std::int64_t>(tensor.nbytes()); }

}  // namespace

void Communicator::all_reduce(std::span<Tensor> tensors, ReduceOp op, const CallOptions& options) {
  do_all_reduce(tensors, op, options);
  const std::int64_t bytes = bytes_of(tensors);
  count(kAllReduceOp, bytes, bytes);
}

void Communicator::all_reduce_on_device(std::span<Tensor> tensors, ReduceOp op) {
  do_all_reduce_on_device(tensors, op);
  const std::int64_t bytes = bytes_of(tensors);
  count(kAllReduceOp, bytes, bytes);
}

void Communicator::broadcast(Tensor& tensor, int root, const CallOptions& options) {
  do_broadcast(tensor, root, options);
  const bool is_root = root == rank();
  count(kBroadcastOp, is_root ? bytes_of(tensor) : 0, is_root ? 0 : bytes_of(tensor));
}

void Communicator::all_gather(const Tensor& input, Tensor& output, const CallOptions& options) {
  do_all_gather(input, output, options);
  count(kAllGatherOp, bytes_of(output), bytes_of(output));
}

void Communicator::reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op, const CallOptions& options) {
  do_reduce_scatter(input, output, op, options);
  count(kReduceScatterOp, bytes_of(input), bytes_of(input));
}

namespace {

// Elements [offset, offset + count) of `tensor` flattened: a 1-D view of its buffer.
Tensor flat(const Tensor& tensor, std::int64_t offset, std::int64_t count) {
  return Tensor(Shape{count}, tensor.dtype(), tensor.buffer(),
                tensor.byte_offset() + static_cast<std::size_t>(offset) * graph::dtype_size(tensor.dtype()));
}

// Rank r's range of a tensor split into ranges of `shard` elements (reduce_scatter_ranges).
std::pair<std::int64_t, std::int64_t> range_of(const Tensor& tensor, std::int64_t shard, int rank) {
  const std::int64_t n = tensor.num_elements();
  return {std::min(n, rank * shard), std::min(n, (rank + 1) * shard)};
}

// Copies rank's range of src into dst at `at`, zero-padded to `shard` elements.
void pack_range(Tensor& dst, std::int64_t at, const Tensor& src, std::int64_t shard, int rank) {
  const auto [begin, end] = range_of(src, shard, rank);
  if (end > begin) flat(dst, at, end - begin).copy_from(flat(src, begin, end - begin));
  if (end - begin < shard) {
    Tensor pad = flat(dst, at + (end - begin), shard - (end - begin));
    pad.device().fill_zero(pad.raw_data(), pad.nbytes());
  }
}

// The inverse: the first elements of src at `at` into rank's range of dst.
void unpack_range(Tensor& dst, const Tensor& src, std::int64_t at, std::int64_t shard, int rank) {
  const auto [begin, end] = range_of(dst, shard, rank);
  if (end > begin) flat(dst, begin, end - begin).copy_from(flat(src, at, end - begin));
}

// One part of the packed buffer the range collectives stand for, in bytes.
std::int64_t part_bytes(std::span<const Tensor> tensors, std::span<const std::int64_t> shard_elements,
                        std::span<const Tensor> riders) {
  std::int64_t bytes = bytes_of(riders);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    bytes += shard_elements[i] * static_cast<std::int64_t>(graph::dtype_size(tensors[i].dtype()));
  }
  return bytes;
}

void check_ranges(std::string_view op, std::span<const Tensor> tensors, std::span<const std::int64_t> shard_elements,
                  int size) {
  TANDEM_REQUIRE(!tensors.empty() && shard_elements.size() == tensors.size(), InvalidArgument,
                 "{}: {} shard sizes for {} tensors; expected one per tensor, and at least one tensor", op,
                 shard_elements.size(), tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    TANDEM_REQUIRE(shard_elements[i] >= 0 && shard_elements[i] * size >= tensors[i].num_elements(), InvalidArgument,
                   "{}: tensor {} of {} has {} elements; {} ranges of {} elements do not cover it", op, i,
                   tensors.size(), tensors[i].num_elements(), size, shard_elements[i]);
  }
}

}  // namespace

void Communicator::reduce_scatter_ranges(std::span<Tensor> tensors, std::span<const std::int64_t> shard_elements,
                                         std::span<Tensor> riders, ReduceOp op, const CallOptions& options) {
  check_ranges("reduce_scatter_ranges", tensors, shard_elements, size());
  do_reduce_scatter_ranges(tensors, shard_elements, riders, op, options);
  const std::int64_t bytes = part_bytes(tensors, shard_elements, riders) * size();
  count(kReduceScatterOp, bytes, bytes);
}

void Communicator::all_gather_ranges(std::span<Tensor> tensors, std::span<const std::int64_t> shard_elements,
                                     const CallOptions& options) {
  check_ranges("all_gather_ranges", tensors, shard_elements, size());
  do_all_gather_ranges(tensors, shard_elements, options);
  const std::int64_t bytes = part_bytes(tensors, shard_elements, {}) * size();
  count(kAllGatherOp, bytes, bytes);
}

// Part q of the packed buffer: rank q's range of each tensor, then the riders. One tensor that
// splits evenly, with no riders, is that buffer already.
void Communicator::do_reduce_scatter_ranges(std::span<Tensor> tensors, std::span<const std::int64_t> shard_elements,
                                            std::span<Tensor> riders, ReduceOp op, const CallOptions& options) {
  const int n = size();
  const Tensor& first = tensors.front();
  std::int64_t part = 0;
  for (const std::int64_t shard : shard_elements) part += shard;
  for (const Tensor& rider : riders) part += rider.num_elements();
  const bool direct = tensors.size() == 1 && riders.empty() && part * n == first.num_elements();
  Tensor recv = Tensor::empty({part}, first.dtype(), first.device());
  {
    Tensor send = direct ? flat(first, 0, first.num_elements()) : Tensor::empty({n * part}, first.dtype(), first.device());
    for (int q = 0; q < n && !direct; ++q) {
      std::int64_t at = q * part;
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        pack_range(send, at, tensors[i], shard_elements[i], q);
        at += shard_elements[i];
      }
      for (const Tensor& rider : riders) {
        flat(send, at, rider.num_elements()).copy_from(flat(rider, 0, rider.num_elements()));
        at += rider.num_elements();
      }
    }
    do_reduce_scatter(send, recv, op, options);
  }
  std::int64_t at = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    unpack_range(tensors[i], recv, at, shard_elements[i], rank());
    at += shard_elements[i];
  }
  for (Tensor& rider : riders) {
    flat(rider, 0, rider.num_elements()).copy_from(flat(recv, at, rider.num_elements()));
    at += rider.num_elements();
  }
}

// This rank's ranges packed, all-gathered, and the other ranks' ranges copied out. One tensor
// that splits evenly receives the gather itself.
void Communicator::do_all_gather_ranges(std::span<Tensor> tensors, std::span<const std::int64_t> shard_elements,
                                        const CallOptions& options) {
  const int n = size();
  const Tensor& first = tensors.front();
  std::int64_t part = 0;
  for (const std::int64_t shard : shard_elements) part += shard;
  Tensor send = Tensor::empty({part}, first.dtype(), first.device());
  std::int64_t at = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    pack_range(send, at, tensors[i], shard_elements[i], rank());
    at += shard_elements[i];
  }
  const bool direct = tensors.size() == 1 && part * n == first.num_elements();
  Tensor gathered = direct ? flat(first, 0, first.num_elements()) : Tensor::empty({n * part}, first.dtype(), first.device());
  do_all_gather(send, gathered, options);
  for (int q = 0; q < n && !direct; ++q) {
    if (q == rank()) continue;  // this rank's own ranges are in place
    at = q * part;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      unpack_range(tensors[i], gathered, at, shard_elements[i], q);
      at += shard_elements[i];
    }
  }
}

void Communicator::barrier(const CallOptions& options) {
  do_barrier(options);
  count(kBarrierOp, 0, 0);
}

// --- point-to-point --------------------------------------------------------------------------------

void Communicator::check_peer(std::string_view op, std::string_view role, int peer, bool allow_none) const {
  if (allow_none && peer < 0) return;
  TANDEM_REQUIRE(peer != rank(), InvalidArgument,
                 "{} on rank {} of {}: the {} is this rank itself; a rank cannot {} itself", op, rank(), size(), role,
                 role == "receiver" ? "send to" : "receive from");
  TANDEM_REQUIRE(peer >= 0 && peer < size(), InvalidArgument,
                 "{} on rank {} of {}: the {} {} is not a rank of this group{}", op, rank(), size(), role, peer,
                 allow_none ? " (-1: none)" : "");
}

void Communicator::send(const Tensor& tensor, int peer, const CallOptions& options) {
  check_peer("send", "receiver", peer, false);
  Tensor none;
  do_send_recv(tensor, peer, none, -1, options);
  count(kSendOp, bytes_of(tensor), 0);
}

void Communicator::recv(Tensor& tensor, int peer, const CallOptions& options) {
  check_peer("recv", "sender", peer, false);
  do_send_recv(Tensor(), -1, tensor, peer, options);
  count(kRecvOp, 0, bytes_of(tensor));
}

void Communicator::send_recv(const Tensor& send_tensor, int send_peer, Tensor& recv_tensor, int recv_peer,
                             const CallOptions& options) {
  check_peer("send_recv", "receiver", send_peer, true);
  check_peer("send_recv", "sender", recv_peer, true);
  if (send_peer < 0 && recv_peer < 0) return;  // a pipeline of one stage
  Tensor none;
  do_send_recv(send_peer < 0 ? none : send_tensor, send_peer, recv_peer < 0 ? none : recv_tensor, recv_peer, options);
  if (send_peer >= 0) count(kSendOp, bytes_of(send_tensor), 0);
  if (recv_peer >= 0) count(kRecvOp, 0, bytes_of(recv_tensor));
}

void Communicator::do_send_recv(const Tensor& /*send_tensor*/, int send_peer, Tensor& /*recv_tensor*/, int recv_peer,
                                const CallOptions& /*options*/) {
  throw Unimplemented(fmt::format("{} communicator: {} is not implemented by this backend", backend(),
                                  detail::point_to_point_name(send_peer, recv_peer)));
}

// --- stats -----------------------------------------------------------------------------------------

void Communicator::count(Op op, std::int64_t sent_buffer_bytes, std::int64_t received_buffer_bytes) {
  Counter& c = counters_[op];
  // Only this rank's thread writes (one call at a time): relaxed adds; readers see each counter
  // exact.
  c.calls.fetch_add(1, std::memory_order_relaxed);
  c.sent_buffer_bytes.fetch_add(sent_buffer_bytes, std::memory_order_relaxed);
  c.received_buffer_bytes.fetch_add(received_buffer_bytes, std::memory_order_relaxed);
}

namespace {

// floor(buffer_bytes x numerator / n), exactly and without overflowing the product.
std::int64_t scaled(std::int64_t buffer_bytes, std::int64_t numerator, std::int64_t n) {
  return buffer_bytes / n * numerator + buffer_bytes % n * numerator / n;
}

}  // namespace

OpStats Communicator::read(Op op) const {
  const Counter& c = counters_[op];
  const std::int64_t n = size();
  // The ring's bytes per rank, as a fraction numerator / n of the buffer (CommunicationStats).
  std::int64_t numerator = 0;
  if (n > 1) {
    switch (op) {
      case kAllReduceOp: numerator = 2 * (n - 1); break;
      case kReduceScatterOp:
      case kAllGatherOp: numerator = n - 1; break;
      case kBroadcastOp: numerator = n; break;
      case kSendOp:
      case kRecvOp: numerator = n; break;  // the bytes themselves
      case kBarrierOp:
      case kNumOps: break;
    }
  }
  return {.calls = c.calls.load(std::memory_order_relaxed),
          .bytes_sent = scaled(c.sent_buffer_bytes.load(std::memory_order_relaxed), numerator, n),
          .bytes_received = scaled(c.received_buffer_bytes.load(std::memory_order_relaxed), numerator, n)};
}

CommunicationStats Communicator::stats() const {
  return {.all_reduce = read(kAllReduceOp),
          .reduce_scatter = read(kReduceScatterOp),
          .all_gather = read(kAllGatherOp),
          .broadcast = read(kBroadcastOp),
          .barrier = read(kBarrierOp),
          .send = read(kSendOp),
          .recv = read(kRecvOp)};
}

void Communicator::reset_stats() {
  for (Counter& c : counters_) {
    c.calls.store(0, std::memory_order_relaxed);
    c.sent_buffer_bytes.store(0, std::memory_order_relaxed);
    c.received_buffer_bytes.store(0, std::memory_order_relaxed);
  }
}

OpStats& OpStats::operator+=(const OpStats& other) {
  calls += other.calls;
  bytes_sent += other.bytes_sent;
  bytes_received += other.bytes_received;
  return *this;
}

OpStats& OpStats::operator-=(const OpStats& other) {
  calls -= other.calls;
  bytes_sent -= other.bytes_sent;
  bytes_received -= other.bytes_received;
  return *this;
}

namespace {

// Every op of a CommunicationStats with its name, in the struct's order.
template <class Stats, class Fn>
void for_each_op(Stats& stats, Fn&& fn) {
  fn("all_reduce", stats.all_reduce);
  fn("reduce_scatter", stats.reduce_scatter);
  fn("all_gather", stats.all_gather);
  fn("broadcast", stats.broadcast);
  fn("barrier", stats.barrier);
  fn("send", stats.send);
  fn("recv", stats.recv);
}

}  // namespace

OpStats CommunicationStats::total() const {
  OpStats sum;
  for_each_op(*this, [&](std::string_view, const OpStats& op) { sum += op; });
  return sum;
}

namespace {

// fn(a's op, b's op) for every op.
template <class Fn>
void zip_ops(CommunicationStats& a, const CommunicationStats& b, Fn&& fn) {
  fn(a.all_reduce, b.all_reduce);
  fn(a.reduce_scatter, b.reduce_scatter);
  fn(a.all_gather, b.all_gather);
  fn(a.broadcast, b.broadcast);
  fn(a.barrier, b.barrier);
  fn(a.send, b.send);
  fn(a.recv, b.recv);
}

}  // namespace

CommunicationStats& CommunicationStats::operator+=(const CommunicationStats& other) {
  zip_ops(*this, other, [](OpStats& mine, const OpStats& theirs) { mine += theirs; });
  return *this;
}

CommunicationStats& CommunicationStats::operator-=(const CommunicationStats& other) {
  zip_ops(*this, other, [](OpStats& mine, const OpStats& theirs) { mine -= theirs; });
  return *this;
}

std::string CommunicationStats::to_string() const {
  std::string out;
  for_each_op(*this, [&](std::string_view name, const OpStats& op) {
    if (op.calls == 0) return;
    if (!out.empty()) out += '\n';
    out += fmt::format("{}: {} calls, {} B sent, {} B received", name, op.calls, op.bytes_sent, op.bytes_received);
  });
  return out.empty() ? std::string("no collectives") : out;
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

std::string_view point_to_point_name(int send_peer, int recv_peer) {
  if (send_peer < 0) return "recv";
  if (recv_peer < 0) return "send";
  return "send_recv";
}

std::string point_to_point_label(std::string_view op, bool receiving, std::uint64_t number, std::string_view peer,
                                 std::string_view self) {
  const std::string half =
      fmt::format("{} #{} {} {}", receiving ? "recv" : "send", number, receiving ? "from" : "to", peer);
  if (op == "send_recv") return fmt::format("send_recv (its {}) on {}", half, self);
  return fmt::format("{} on {}", half, self);
}

std::string point_to_point_mismatch(int sender, DType sent_dtype, std::int64_t sent_elements, int receiver,
                                    DType expected_dtype, std::int64_t expected_elements) {
  return fmt::format(
      "rank {} sent {} {} elements, rank {} receives {} {} elements; the dtypes and element counts "
      "must match",
      sender, sent_elements, sent_dtype, receiver, expected_elements, expected_dtype);
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
