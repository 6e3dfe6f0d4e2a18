// The in-process group: the ranks are threads of one process, their tensors host memory, and every
// rank reads and writes the other ranks' buffers directly. Nothing is copied through a staging
// buffer.
//
// A collective is two barrier phases around the work:
//   1. entry: the rank publishes what it is doing in its slot (operation, sequence number, dtype,
//      element count, the pointers of its buffer) and waits for every rank. This is the only wait
//      with a timeout: a rank that does not arrive is named in the DeadlineExceeded.
//   2. every rank compares every slot with rank 0's and reaches the same verdict; on any
//      disagreement they all throw InvalidArgument naming both sides.
//   3. the work, split into `size` chunks: rank r does chunk r for every rank.
//   4. exit: nobody returns (after which its caller may touch or free the buffer) while another
//      rank may still read or write it. Once all ranks have entered, the work ahead of each is a
//      bounded amount of memory traffic, so the exit waits without a timeout.
//
// all_reduce in step 3: rank r reads chunk r of every rank's buffer, reduces it, and writes the
// result into chunk r of every rank's buffer: the reduce-scatter and the all-gather fused into one
// pass. Each byte of every buffer is read once and written once, the least memory traffic an
// all-reduce in shared memory can have, with one barrier fewer than a reduce-scatter followed by
// an all-gather (which, at 2 ranks, also moves 25% more bytes; see bench/README.md). Each element
// is reduced in rank order (((x0 op x1) op x2) ...) by exactly one thread, so every rank receives
// bitwise the same result, run after run.
//
// Slots are double-buffered by phase parity: a rank may publish for the next collective while a
// slower rank still reads this one's slots (it cannot get two phases ahead).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>

#include <fmt/ranges.h>

#include "tandem/base/spin.h"
#include "tandem/collective/in_process.h"
#include "tandem/collective/detail/common.h"
#include "tandem/collective/detail/reduce_kernels.h"
#include "tandem/devices/device.h"

namespace tandem::collective {
namespace {

using detail::Clock;
using detail::deadline_after;
using detail::dispatch_reduction;
using detail::divide;
using detail::OpKind;
using detail::part_of;
using detail::reduce_blocks;
using detail::reducible;

// How tensor-check messages name this backend: "... works on host memory (CPU devices)".
constexpr std::string_view kBackendName = "the in-process group";

// Chunk boundaries fall on multiples of 64 bytes (one cache line, one AVX-512 vector), so that two
// ranks never write into the same cache line and the vector loops start aligned where the buffer
// is (tensor buffers are 64-byte aligned).
constexpr std::size_t kChunkAlignBytes = 64;
// A rank that arrives early polls this long before it sleeps: collectives of one training step
// come in bursts, and a thread woken from a condition variable on a VM takes tens of microseconds.
// When the group has more ranks than cores, polling only delays the ranks it waits for.
constexpr auto kSpin = std::chrono::microseconds(100);

// --- reduction kernels (the element-wise ones are in detail/reduce_kernels.h) -----------------

// Two ranks, in place: one pass that reads both buffers and writes both.
template <class T, class Op, bool kMean>
void reduce_pair_in_place(T* __restrict a, T* __restrict b, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    T x = Op::apply(a[i], b[i]);
    if constexpr (kMean) x = x / T{2};
    a[i] = x;
    b[i] = x;
  }
}

// --- the group's shared state ----------------------------------------------------------------

struct Segment {
  std::byte* data = nullptr;
  std::int64_t elements = 0;
};

// What one rank says it is doing in one collective. Written by its rank before it enters; read by
// every rank between the entry and the exit.
struct alignas(64) Slot {
  OpKind kind = OpKind::kBarrier;
  std::uint64_t seq = 0;
  DType dtype = kFloat32;
  std::int64_t elements = 0;  // the buffer (all_reduce, broadcast) or the input (all_gather, reduce_scatter)
  ReduceOp reduce = ReduceOp::kSum;
  int root = 0;
  std::string error;              // this rank's own arguments are wrong: every rank throws it
  std::vector<Segment> segments;  // the buffer's memory, zero-element tensors left out
  std::byte* output = nullptr;    // all_gather, reduce_scatter
  // The range collectives: one segment per tensor (empty ones included), split into ranges of
  // shards[i] elements.
  std::vector<std::int64_t> shards;
};

// Why the group cannot be used any more.
struct Failure {
  bool timeout = false;     // a rank timed out in an entry (else: abort)
  std::uint64_t phase = 0;  // timeout: the phase it timed out in
  std::string call;         // timeout: the call that timed out, "all_reduce #7"
  std::string message;      // timeout: "rank 3 of 4 did not arrive within 200 ms"; abort: the reason
};

// The barrier and the slots. Arrivals are lock-free: one atomic word holds whether the group has
// failed, the phase (the number of completed phases) and the count of ranks that arrived in it.
// Completing a phase, a timed-out rank withdrawing from it, and failing the group are each one
// atomic operation on that word, so a phase that has failed can never complete afterwards, and
// a rank that has given up on a phase is never waited for nor worked on by its peers. The mutex
// is for the slow paths only: sleeping, and the failure's message.
class Group {
 public:
  explicit Group(int size)
      : size_(size),
        spin_(spin_budget(kSpin, size, devices::usable_cpu_cores())),
        arrived_at_(std::make_unique<std::atomic<std::uint64_t>[]>(static_cast<std::size_t>(size))) {
    for (auto& slots : slots_) slots.resize(static_cast<std::size_t>(size));
  }

  int size() const { return size_; }
  // The phase the calling rank is in: no phase completes without every rank, so between two of
  // this rank's arrivals the value is fixed.
  std::uint64_t phase() const { return phase_of(state_.load(std::memory_order_acquire)); }
  Slot& slot(std::uint64_t phase, int rank) { return slots_[phase & 1][static_cast<std::size_t>(rank)]; }

  // Entry of a collective: arrives at `phase` and waits until every rank has. Throws Unavailable
  // when the group has failed (aborted, or an earlier timeout), before or during the wait, and
  // DeadlineExceeded when `deadline` passes first, naming the ranks that did not arrive; the group
  // then fails, so that a late rank cannot start a collective its peers have left. Called by each
  // rank's thread; blocks.
  void enter(int rank, std::uint64_t phase, Clock::time_point deadline, std::chrono::milliseconds timeout, OpKind kind,
             std::uint64_t seq) {
    const auto call = [&] { return detail::call_label(kind, seq); };
    switch (arrive(rank, phase, /*cancellable=*/true)) {
      case Arrival::kCompleted: return;
      case Arrival::kWaiting: break;
      case Arrival::kGroupFailed: {
        std::lock_guard lock(mutex_);
        throw unusable(call());
      }
    }
    const auto done = [&] {
      const std::uint64_t state = state_.load(std::memory_order_acquire);
      return phase_of(state) != phase || (state & kFailedBit) != 0;
    };
    if (!poll_for(spin_, done) && !sleep_until(deadline, done)) {
      // The deadline passed. Withdraw, unless the phase completed meanwhile: then it goes ahead.
      if (withdraw(phase)) {
        std::lock_guard lock(mutex_);
        // Ranks that time out together report the first one's list.
        if ((state_.load(std::memory_order_relaxed) & kFailedBit) != 0) {
          if (failure_.timeout && failure_.phase == phase) {
            throw DeadlineExceeded(fmt::format("{}: {}", call(), failure_.message));
          }
          throw unusable(call());
        }
        std::vector<int> missing;
        for (int q = 0; q < size_; ++q) {
          if (q != rank && arrived_at_[static_cast<std::size_t>(q)].load(std::memory_order_relaxed) != phase + 1) {
            missing.push_back(q);
          }
        }
        Failure failure{.timeout = true,
                        .phase = phase,
                        .call = call(),
                        .message = fmt::format("{} did not arrive within {} ms", detail::ranks_of(missing, size_),
                                               timeout.count())};
        const std::string text = fmt::format("{}: {}", call(), failure.message);
        fail_locked(std::move(failure));
        throw DeadlineExceeded(text);
      }
    }
    // The phase completed (then the collective goes ahead, whatever happened since: every rank
    // sees the same), or the group failed while we waited.
    if (this->phase() != phase) return;
    std::lock_guard lock(mutex_);
    if (failure_.timeout && failure_.phase == phase) {
      throw DeadlineExceeded(fmt::format("{}: {}", call(), failure_.message));
    }
    throw unusable(call());
  }

  // Exit of a collective: arrives at `phase` and waits for every rank, ignoring aborts and
  // deadlines: every rank has entered and its remaining work is bounded, and returning early
  // would hand a buffer back to its caller while a peer still writes into it. Blocks.
  void exit(int rank, std::uint64_t phase) {
    if (arrive(rank, phase, /*cancellable=*/false) == Arrival::kCompleted) return;
    const auto done = [&] { return this->phase() != phase; };
    if (!poll_for(spin_, done)) sleep_until(Clock::time_point::max(), done);
  }

  // Fails the group with `reason` (the first failure's reason stays). Any thread; does not block
  // beyond the group's lock.
  void abort(const std::string& reason) {
    std::lock_guard lock(mutex_);
    if ((state_.load(std::memory_order_relaxed) & kFailedBit) == 0) fail_locked(Failure{.message = reason});
  }

  // --- point-to-point ---------------------------------------------------------------------------
  // One mailbox per ordered pair (sender, receiver): the messages sent and not yet received, in
  // order, each a copy of the sender's bytes. So a send never waits for its recv, and the sender
  // may reuse its tensor as soon as send returns. A recv waits (on p2p_cv_) for the mailbox's
  // first message. Point-to-point calls take no part in the phases: a timeout fails nothing (the
  // message, if it comes later, waits for the next recv), and only an abort (or a collective's
  // failure) makes them throw Unavailable.
  struct Message {
    DType dtype = kFloat32;
    std::int64_t elements = 0;
    std::vector<std::byte> bytes;
  };

  bool failed() const { return (state_.load(std::memory_order_acquire) & kFailedBit) != 0; }

  // Unavailable for `call` once the group has failed.
  Unavailable unusable_now(const std::string& call) {
    std::lock_guard lock(mutex_);
    return unusable(call);
  }

  void post(int sender, int receiver, Message message) {
    std::lock_guard lock(p2p_mutex_);
    mailbox(sender, receiver).push_back(std::move(message));
    p2p_cv_.notify_all();
  }

  enum class Taken { kMessage, kTimedOut, kFailed };

  // Waits until the pair's first message is there (moved into `out`), the deadline passes, or the
  // group fails.
  Taken take(int sender, int receiver, Clock::time_point deadline, Message& out) {
    std::unique_lock lock(p2p_mutex_);
    auto& box = mailbox(sender, receiver);
    const bool ready = p2p_cv_.wait_until(lock, deadline, [&] { return !box.empty() || failed(); });
    if (failed()) return Taken::kFailed;  // an abort ends pending calls even when a message is there
    if (!ready) return Taken::kTimedOut;
    out = std::move(box.front());
    box.pop_front();
    return Taken::kMessage;
  }

 private:
  // state_: bit 63 = the group failed; bits 24-62 = the phase; bits 0-23 = ranks arrived in it.
  static constexpr int kCountBits = 24;
  static constexpr std::uint64_t kCountMask = (std::uint64_t{1} << kCountBits) - 1;
  static constexpr std::uint64_t kFailedBit = std::uint64_t{1} << 63;
  static std::uint64_t phase_of(std::uint64_t state) { return (state & ~kFailedBit) >> kCountBits; }

  enum class Arrival { kWaiting, kCompleted, kGroupFailed };

  // Counts this rank in, unless (when cancellable) the group has failed. On completing the
  // phase, wakes the sleepers. The exits of a collective are not cancellable: they complete even
  // in a failed group, because every rank is bound to reach them.
  Arrival arrive(int rank, std::uint64_t phase, bool cancellable) {
    arrived_at_[static_cast<std::size_t>(rank)].store(phase + 1, std::memory_order_relaxed);
    std::uint64_t old = state_.load(std::memory_order_relaxed);
    std::uint64_t next = 0;
    do {
      if (cancellable && (old & kFailedBit) != 0) return Arrival::kGroupFailed;
      const bool last = (old & kCountMask) + 1 == static_cast<std::uint64_t>(size_);
      next = last ? ((phase + 1) << kCountBits) | (old & kFailedBit) : old + 1;
    } while (!state_.compare_exchange_weak(old, next, std::memory_order_seq_cst, std::memory_order_relaxed));
    if ((next & kCountMask) != 0) return Arrival::kWaiting;
    // A sleeper counts itself in under the mutex before it checks the phase (both seq_cst): either
    // it sees the new phase, or we see it and notify under the mutex, after it has begun to wait.
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard lock(mutex_);
      cv_.notify_all();
    }
    return Arrival::kCompleted;
  }

  // Takes the calling rank back out of `phase`, unless the phase has completed; returns whether
  // it did. Its arrived_at_ stays: the ranks that never arrived are the ones to name.
  bool withdraw(std::uint64_t phase) {
    std::uint64_t old = state_.load(std::memory_order_relaxed);
    do {
      if (phase_of(old) != phase) return false;
    } while (!state_.compare_exchange_weak(old, old - 1, std::memory_order_seq_cst, std::memory_order_relaxed));
    return true;
  }

  // Sleeps until done() or the deadline; returns done().
  template <class Done>
  bool sleep_until(Clock::time_point deadline, Done done) {
    std::unique_lock lock(mutex_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    const bool result = cv_.wait_until(lock, deadline, done);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return result;
  }

  void fail_locked(Failure failure) {
    failure_ = std::move(failure);
    state_.fetch_or(kFailedBit, std::memory_order_seq_cst);
    cv_.notify_all();
    // Receivers check the failed bit under p2p_mutex_: notifying under it cannot be missed.
    std::lock_guard lock(p2p_mutex_);
    p2p_cv_.notify_all();
  }

  std::deque<Message>& mailbox(int sender, int receiver) {
    return mailboxes_[static_cast<std::size_t>(sender) * static_cast<std::size_t>(size_) +
                      static_cast<std::size_t>(receiver)];
  }

  // Caller holds mutex_ and the group has failed.
  Unavailable unusable(const std::string& call) const {
    if (failure_.timeout) {
      return Unavailable(fmt::format("{}: the group failed at {}: {}", call, failure_.call, failure_.message));
    }
    return Unavailable(fmt::format("{}: the group was aborted: {}", call, failure_.message));
  }

  const int size_;
  const std::chrono::microseconds spin_;
  std::array<std::vector<Slot>, 2> slots_;

  alignas(64) std::atomic<std::uint64_t> state_{0};           // failed bit | phase | ranks arrived in it
  std::atomic<int> sleepers_{0};                              // ranks in sleep_until
  std::unique_ptr<std::atomic<std::uint64_t>[]> arrived_at_;  // per rank: 1 + the last phase it arrived at
  std::mutex mutex_;
  std::condition_variable cv_;
  Failure failure_;  // guarded by mutex_; set before the failed bit

  // Point-to-point (post, take). Never locked while mutex_ is wanted: fail_locked takes it under
  // mutex_, nothing takes mutex_ under it.
  std::mutex p2p_mutex_;
  std::condition_variable p2p_cv_;
  std::vector<std::deque<Message>> mailboxes_ =
      std::vector<std::deque<Message>>(static_cast<std::size_t>(size_) * static_cast<std::size_t>(size_));
};

// --- one rank's communicator -----------------------------------------------------------------

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<Group> group, int rank)
      : group_(std::move(group)),
        rank_(rank),
        sent_to_(static_cast<std::size_t>(group_->size())),
        received_from_(static_cast<std::size_t>(group_->size())),
        inputs_(static_cast<std::size_t>(group_->size())),
        outputs_(static_cast<std::size_t>(group_->size())),
        cursors_(static_cast<std::size_t>(group_->size())) {}

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::uint64_t sequence_number() const override { return seq_.load(std::memory_order_relaxed); }
  std::string_view backend() const override { return "in-process"; }

 protected:
  void do_all_reduce(std::span<Tensor> tensors, ReduceOp op, const CallOptions& options) override {
    Call call = begin(OpKind::kAllReduce, options);
    Slot& slot = *call.slot;
    slot.reduce = op;
    slot.dtype = tensors.empty() ? kFloat32 : tensors[0].dtype();
    for (std::size_t i = 0; i < tensors.size() && slot.error.empty(); ++i) {
      slot.error = tensor_problem(tensors, i, slot.dtype);
      if (slot.error.empty()) add_segment(slot, tensors[i]);
    }
    if (slot.error.empty() && !reducible(slot.dtype)) slot.error = not_reducible(slot.dtype);
    enter(call);
    run_then_exit(call, [&] {
      const int n = size();
      if (n == 1 || slot.elements == 0) return;
      const std::int64_t esize = static_cast<std::int64_t>(dtype_size(slot.dtype));
      const auto [begin, end] = part_of(slot.elements, n, rank_, static_cast<std::int64_t>(kChunkAlignBytes) / esize);
      dispatch_reduction(slot.dtype, op, "in-process collective", [&]<class T, class Op, bool kMean>() {
        for_each_run(call.phase, begin, end, esize, [&](std::int64_t count) {
          if (n == 2) {
            reduce_pair_in_place<T, Op, kMean>(static_cast<T*>(inputs_[0]), static_cast<T*>(inputs_[1]), count);
          } else {
            reduce_blocks<T, Op, kMean>(inputs_.data(), n, inputs_.data(), n, count);
          }
        });
      });
    });
  }

  void do_broadcast(Tensor& tensor, int root, const CallOptions& options) override {
    Call call = begin(OpKind::kBroadcast, options);
    Slot& slot = *call.slot;
    slot.root = root;
    slot.dtype = tensor.dtype();
    slot.error = detail::host_tensor_problem(tensor, "the tensor", kBackendName);
    if (slot.error.empty() && (root < 0 || root >= size())) {
      slot.error = fmt::format("root {} is not a rank of this group of {}", root, size());
    }
    if (slot.error.empty()) add_segment(slot, tensor);
    enter(call);
    run_then_exit(call, [&] {
      if (size() == 1 || slot.elements == 0) return;
      // Rank r copies chunk r of the root's buffer into every other rank's: the root's
      // bandwidth is shared by all ranks instead of each rank pulling the whole buffer alone.
      const std::int64_t bytes = slot.elements * static_cast<std::int64_t>(dtype_size(slot.dtype));
      const auto [begin, end] = part_of(bytes, size(), rank_, static_cast<std::int64_t>(kChunkAlignBytes));
      if (begin == end) return;
      const std::byte* source = group_->slot(call.phase, root).segments[0].data + begin;
      for (int q = 0; q < size(); ++q) {
        if (q == root) continue;
        std::memcpy(group_->slot(call.phase, q).segments[0].data + begin, source,
                    static_cast<std::size_t>(end - begin));
      }
    });
  }

  void do_all_gather(const Tensor& input, Tensor& output, const CallOptions& options) override {
    Call call = begin(OpKind::kAllGather, options);
    Slot& slot = *call.slot;
    slot.dtype = input.dtype();
    slot.error = detail::in_out_problem(input, output, kBackendName);
    if (slot.error.empty()) {
      slot.error = detail::check_all_gather_shapes(input.shape(), output.shape(), size()).value_or("");
    }
    if (slot.error.empty()) {
      add_segment(slot, input);
      slot.output = static_cast<std::byte*>(output.raw_data());
    }
    enter(call);
    run_then_exit(call, [&] {
      // Each rank pulls every input into its own output: all ranks copy at once, and the
      // gathered tensor lands in the cache of the core that uses it next.
      const std::size_t bytes = static_cast<std::size_t>(slot.elements) * dtype_size(slot.dtype);
      if (bytes == 0) return;
      for (int q = 0; q < size(); ++q) {
        std::byte* destination = slot.output + static_cast<std::size_t>(q) * bytes;
        const std::byte* source = group_->slot(call.phase, q).segments[0].data;
        if (destination != source) std::memcpy(destination, source, bytes);
      }
    });
  }

  void do_reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op, const CallOptions& options) override {
    Call call = begin(OpKind::kReduceScatter, options);
    Slot& slot = *call.slot;
    slot.reduce = op;
    slot.dtype = input.dtype();
    slot.error = detail::in_out_problem(input, output, kBackendName);
    if (slot.error.empty()) {
      slot.error = detail::check_reduce_scatter_shapes(input.shape(), output.shape(), size()).value_or("");
    }
    if (slot.error.empty() && !reducible(slot.dtype)) slot.error = not_reducible(slot.dtype);
    if (slot.error.empty()) {
      add_segment(slot, input);
      slot.output = static_cast<std::byte*>(output.raw_data());
    }
    enter(call);
    run_then_exit(call, [&] {
      const int n = size();
      const std::int64_t part = slot.elements / n;
      if (part == 0) return;
      const std::size_t part_bytes = static_cast<std::size_t>(part) * dtype_size(slot.dtype);
      for (int q = 0; q < n; ++q) {
        inputs_[static_cast<std::size_t>(q)] =
            group_->slot(call.phase, q).segments[0].data + static_cast<std::size_t>(rank_) * part_bytes;
      }
      outputs_[0] = slot.output;
      dispatch_reduction(slot.dtype, op, "in-process collective", [&]<class T, class Op, bool kMean>() {
        reduce_blocks<T, Op, kMean>(inputs_.data(), n, outputs_.data(), 1, part);
      });
    });
  }

  // Rank r reduces its range of each tensor from every rank's buffer into its own buffer, where
  // the range is: no rank writes what another reads (each writes only its own range of its own
  // buffers, which the others do not read), and nothing is packed or copied back. Riders need
  // the sum on every rank: they go the packed way.
  void do_reduce_scatter_ranges(std::span<Tensor> tensors, std::span<const std::int64_t> shard_elements,
                                std::span<Tensor> riders, ReduceOp op, const CallOptions& options) override {
    if (!riders.empty()) {
      Communicator::do_reduce_scatter_ranges(tensors, shard_elements, riders, op, options);
      return;
    }
    Call call = begin(OpKind::kReduceScatter, options);
    Slot& slot = *call.slot;
    slot.reduce = op;
    publish_ranges(slot, tensors, shard_elements);
    if (slot.error.empty() && !reducible(slot.dtype)) slot.error = not_reducible(slot.dtype);
    enter(call);
    run_then_exit(call, [&] {
      const int n = size();
      if (n == 1) return;
      dispatch_reduction(slot.dtype, op, "in-process collective", [&]<class T, class Op, bool kMean>() {
        for_each_range(slot, rank_, [&](std::size_t i, std::size_t offset, std::int64_t count) {
          for (int q = 0; q < n; ++q) {
            inputs_[static_cast<std::size_t>(q)] = group_->slot(call.phase, q).segments[i].data + offset;
          }
          outputs_[0] = slot.segments[i].data + offset;
          reduce_blocks<T, Op, kMean>(inputs_.data(), n, outputs_.data(), 1, count);
        });
      });
    });
  }

  // Rank r copies every other rank's range of each tensor from that rank's buffer into its own.
  void do_all_gather_ranges(std::span<Tensor> tensors, std::span<const std::int64_t> shard_elements,
                            const CallOptions& options) override {
    Call call = begin(OpKind::kAllGather, options);
    Slot& slot = *call.slot;
    publish_ranges(slot, tensors, shard_elements);
    enter(call);
    run_then_exit(call, [&] {
      const std::size_t esize = dtype_size(slot.dtype);
      for (int q = 0; q < size(); ++q) {
        if (q == rank_) continue;
        const Slot& source = group_->slot(call.phase, q);
        for_each_range(slot, q, [&](std::size_t i, std::size_t offset, std::int64_t count) {
          std::memcpy(slot.segments[i].data + offset, source.segments[i].data + offset,
                      static_cast<std::size_t>(count) * esize);
        });
      }
    });
  }

  void do_barrier(const CallOptions& options) override {
    Call call = begin(OpKind::kBarrier, options);
    enter(call);
  }

  // The send goes into the pair's mailbox (it never waits), then the recv waits for its message:
  // two neighbours exchanging both ways cannot deadlock.
  void do_send_recv(const Tensor& send_tensor, int send_peer, Tensor& recv_tensor, int recv_peer,
                    const CallOptions& options) override {
    const Clock::time_point deadline = deadline_after(options.timeout);
    const std::string_view op = detail::point_to_point_name(send_peer, recv_peer);
    const auto label = [&](bool receiving) {
      const int peer = receiving ? recv_peer : send_peer;
      const auto& counters = receiving ? received_from_ : sent_to_;
      return detail::point_to_point_label(op, receiving, counters[static_cast<std::size_t>(peer)],
                                          fmt::format("rank {}", peer), fmt::format("rank {}", rank_));
    };
    // Both halves' arguments are checked before anything is sent.
    for (const bool receiving : {false, true}) {
      if ((receiving ? recv_peer : send_peer) < 0) continue;
      const std::string problem =
          detail::host_tensor_problem(receiving ? recv_tensor : send_tensor,
                                      receiving ? "the tensor to receive into" : "the tensor to send", kBackendName);
      if (!problem.empty()) throw InvalidArgument(fmt::format("{}: {}", label(receiving), problem));
    }
    if (send_peer >= 0) {
      if (group_->failed()) throw group_->unusable_now(label(false));
      Group::Message message{.dtype = send_tensor.dtype(), .elements = send_tensor.num_elements()};
      const auto* data = static_cast<const std::byte*>(send_tensor.raw_data());
      message.bytes.assign(data, data + send_tensor.nbytes());
      group_->post(rank_, send_peer, std::move(message));
      ++sent_to_[static_cast<std::size_t>(send_peer)];
    }
    if (recv_peer < 0) return;
    Group::Message message;
    switch (group_->take(recv_peer, rank_, deadline, message)) {
      case Group::Taken::kMessage: break;
      case Group::Taken::kFailed: throw group_->unusable_now(label(true));
      case Group::Taken::kTimedOut:
        throw DeadlineExceeded(
            fmt::format("{}: rank {} sent nothing within {} ms", label(true), recv_peer, options.timeout.count()));
    }
    const std::string what = label(true);
    ++received_from_[static_cast<std::size_t>(recv_peer)];  // a mismatched message is dropped
    if (message.dtype != recv_tensor.dtype() || message.elements != recv_tensor.num_elements()) {
      throw InvalidArgument(
          fmt::format("{}: {}", what,
                      detail::point_to_point_mismatch(recv_peer, message.dtype, message.elements, rank_,
                                                      recv_tensor.dtype(), recv_tensor.num_elements())));
    }
    if (!message.bytes.empty()) std::memcpy(recv_tensor.raw_data(), message.bytes.data(), message.bytes.size());
  }

 public:
  void abort(const std::string& reason) override { group_->abort(reason); }

 private:
  struct Call {
    std::uint64_t seq = 0;
    std::uint64_t phase = 0;
    Slot* slot = nullptr;
    Clock::time_point deadline;
    std::chrono::milliseconds timeout{0};
    OpKind kind = OpKind::kBarrier;
    // "all_reduce #12", formatted only for a message: the steady state allocates nothing.
    std::string label() const { return detail::call_label(kind, seq); }
  };

  // Starts a call: takes its sequence number and clears this rank's slot for its entry phase.
  Call begin(OpKind kind, const CallOptions& options) {
    Call call;
    call.deadline = deadline_after(options.timeout);
    call.timeout = options.timeout;
    call.seq = seq_.fetch_add(1, std::memory_order_relaxed);
    call.kind = kind;
    call.phase = group_->phase();
    Slot& slot = group_->slot(call.phase, rank_);
    slot.kind = kind;
    slot.seq = call.seq;
    slot.dtype = kFloat32;
    slot.elements = 0;
    slot.reduce = ReduceOp::kSum;
    slot.root = 0;
    slot.error.clear();
    slot.segments.clear();
    slot.output = nullptr;
    slot.shards.clear();
    call.slot = &slot;
    return call;
  }

  // Publishes (the slot is filled), waits for every rank and checks that all agree. Every rank
  // reaches the same verdict from the same slots, so all throw or none does.
  void enter(const Call& call) {
    group_->enter(rank_, call.phase, call.deadline, call.timeout, call.kind, call.seq);
    if (auto problem = disagreement(call.phase)) throw InvalidArgument(fmt::format("{}: {}", call.label(), *problem));
  }

  std::optional<std::string> disagreement(std::uint64_t phase) {
    const int n = size();
    for (int q = 0; q < n; ++q) {
      const Slot& s = group_->slot(phase, q);
      if (!s.error.empty()) return fmt::format("rank {}: {}", q, s.error);
    }
    const Slot& a = group_->slot(phase, 0);
    for (int q = 1; q < n; ++q) {
      const Slot& b = group_->slot(phase, q);
      if (a.kind != b.kind || a.seq != b.seq) {
        return fmt::format("rank 0 issued {}, rank {} issued {}", detail::call_label(a.kind, a.seq), q,
                           detail::call_label(b.kind, b.seq));
      }
      if (a.elements != b.elements) {
        if (a.dtype == b.dtype) {
          return fmt::format("rank 0 has {} {} elements, rank {} has {}", a.elements, a.dtype, q, b.elements);
        }
        return fmt::format("rank 0 has {} {} elements, rank {} has {} {} elements", a.elements, a.dtype, q, b.elements,
                           b.dtype);
      }
      if (a.dtype != b.dtype && a.elements > 0) {
        return fmt::format("rank 0 has {} {} elements, rank {} has {} {} elements", a.elements, a.dtype, q, b.elements,
                           b.dtype);
      }
      if ((a.kind == OpKind::kAllReduce || a.kind == OpKind::kReduceScatter) && a.reduce != b.reduce) {
        return fmt::format("rank 0 reduces with {}, rank {} with {}", reduce_op_name(a.reduce), q,
                           reduce_op_name(b.reduce));
      }
      const bool ranges = !a.shards.empty() || !b.shards.empty();  // a range collective
      if (ranges && (a.shards != b.shards || a.segments.size() != b.segments.size())) {
        return fmt::format("rank 0 splits {} tensors into ranges of {} elements, rank {} splits {} into ranges of {}",
                           a.segments.size(), a.shards, q, b.segments.size(), b.shards);
      }
      for (std::size_t i = 0; ranges && i < a.shards.size(); ++i) {
        if (a.segments[i].elements != b.segments[i].elements) {
          return fmt::format("tensor {} has {} elements on rank 0, {} on rank {}", i, a.segments[i].elements,
                             b.segments[i].elements, q);
        }
      }
      if (a.kind == OpKind::kBroadcast && a.root != b.root) {
        return fmt::format("rank 0 broadcasts from root {}, rank {} from root {}", a.root, q, b.root);
      }
    }
    return std::nullopt;
  }

  // Runs this rank's share of the work, then the exit phase, even when the work threw: the other
  // ranks wait there for us.
  template <class Work>
  void run_then_exit(const Call& call, Work&& work) {
    std::exception_ptr error;
    try {
      work();
    } catch (...) {
      error = std::current_exception();
    }
    group_->exit(rank_, call.phase + 1);
    if (error) std::rethrow_exception(error);
  }

  // Calls fn(count) for each run of [begin, end) of the logical buffer (the published segments
  // concatenated) over which every rank's memory is contiguous, with inputs_[q] pointing at rank
  // q's part of the run. Ranks may split their buffers into different tensors.
  template <class Fn>
  void for_each_run(std::uint64_t phase, std::int64_t begin, std::int64_t end, std::int64_t esize, Fn&& fn) {
    if (begin >= end) return;
    const int n = size();
    for (int q = 0; q < n; ++q) {
      const auto& segments = group_->slot(phase, q).segments;
      Cursor& c = cursors_[static_cast<std::size_t>(q)];
      c.segments = segments.data();
      c.index = 0;
      c.offset = begin;
      while (c.offset >= segments[c.index].elements) c.offset -= segments[c.index++].elements;
    }
    for (std::int64_t remaining = end - begin; remaining > 0;) {
      std::int64_t run = remaining;
      for (const Cursor& c : cursors_) run = std::min(run, c.segments[c.index].elements - c.offset);
      for (int q = 0; q < n; ++q) {
        const Cursor& c = cursors_[static_cast<std::size_t>(q)];
        inputs_[static_cast<std::size_t>(q)] = c.segments[c.index].data + c.offset * esize;
      }
      fn(run);
      for (Cursor& c : cursors_) {
        c.offset += run;
        if (c.offset == c.segments[c.index].elements) {
          ++c.index;
          c.offset = 0;
        }
      }
      remaining -= run;
    }
  }

  // What is wrong with tensor i of a call's span (host memory, the span's one dtype), or "".
  static std::string tensor_problem(std::span<const Tensor> tensors, std::size_t i, DType dtype) {
    const Tensor& t = tensors[i];
    std::string problem =
        detail::host_tensor_problem(t, fmt::format("tensor {} of {}", i, tensors.size()), kBackendName);
    if (problem.empty() && t.dtype() != dtype) {
      problem = fmt::format("tensor {} of {} has dtype {}, tensor 0 has {}; one call takes one dtype", i,
                            tensors.size(), t.dtype(), dtype);
    }
    return problem;
  }

  // The range collectives' entry: every tensor's buffer and range size, one dtype.
  static void publish_ranges(Slot& slot, std::span<Tensor> tensors, std::span<const std::int64_t> shard_elements) {
    slot.dtype = tensors.front().dtype();
    slot.shards.assign(shard_elements.begin(), shard_elements.end());
    for (std::size_t i = 0; i < tensors.size() && slot.error.empty(); ++i) {
      const Tensor& t = tensors[i];
      slot.error = tensor_problem(tensors, i, slot.dtype);
      slot.segments.push_back({static_cast<std::byte*>(t.raw_data()), t.num_elements()});
      slot.elements += t.num_elements();
    }
  }

  // Calls fn(tensor index, byte offset, element count) for rank's non-empty range of each tensor.
  template <class Fn>
  static void for_each_range(const Slot& slot, int rank, Fn&& fn) {
    const std::size_t esize = dtype_size(slot.dtype);
    for (std::size_t i = 0; i < slot.segments.size(); ++i) {
      const std::int64_t elements = slot.segments[i].elements, shard = slot.shards[i];
      const std::int64_t begin = std::min(elements, rank * shard), end = std::min(elements, (rank + 1) * shard);
      if (end > begin) fn(i, static_cast<std::size_t>(begin) * esize, end - begin);
    }
  }

  static void add_segment(Slot& slot, const Tensor& t) {
    const std::int64_t n = t.num_elements();
    if (n == 0) return;
    slot.segments.push_back({static_cast<std::byte*>(t.raw_data()), n});
    slot.elements += n;
  }

  static std::string not_reducible(DType dtype) {
    return fmt::format(
        "{} tensors cannot be reduced; the in-process group reduces float32, float64, float16, bfloat16, int32 and "
        "int64",
        dtype);
  }

  struct Cursor {
    const Segment* segments = nullptr;
    std::size_t index = 0;
    std::int64_t offset = 0;
  };

  std::shared_ptr<Group> group_;
  const int rank_;
  std::atomic<std::uint64_t> seq_{0};
  // Point-to-point: the messages this rank sent to / received from each peer (the pairs' message
  // numbers). This rank's thread only.
  std::vector<std::uint64_t> sent_to_;
  std::vector<std::uint64_t> received_from_;
  // Scratch for the work, sized once: the steady state allocates nothing.
  std::vector<void*> inputs_;
  std::vector<void*> outputs_;
  std::vector<Cursor> cursors_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_in_process_group(int size) {
  TANDEM_REQUIRE(size >= 1 && size < (1 << 24), InvalidArgument,
                 "make_in_process_group: a group has 1 to 2^24 - 1 ranks, got {}", size);
  auto group = std::make_shared<Group>(size);
  std::vector<std::unique_ptr<Communicator>> communicators;
  communicators.reserve(static_cast<std::size_t>(size));
  for (int rank = 0; rank < size; ++rank) {
    communicators.push_back(std::make_unique<InProcessCommunicator>(group, rank));
  }
  return communicators;
}

}  // namespace tandem::collective
