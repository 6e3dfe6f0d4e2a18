// tandem/collective/detail/ordered_all_reduce.h — the Gloo communicator's rank-ordered all-reduce:
// every element is combined in rank order, (((x0 op x1) op x2) ...), exactly as the in-process
// and shared-memory groups combine it (detail::reduce_blocks), so that n worker processes sum
// bitwise as MirroredStrategy's n replica threads do. Not part of the public contract.
//
// Who calls: the Gloo communicator (gloo.cc), once per pack of an all_reduce when
// GlooOptions::all_reduce_algorithm is kRankOrdered: run() from the calling thread, one call at a
// time; interrupt() from any thread.
//
// The algorithm: a reduce-scatter in which rank r owns part r of the buffer (detail::part_of, the
// in-process group's split) and receives every other rank's copy of that part, combines all n in
// rank order and writes the result into its buffer; then an all-gather in which each owner sends
// its reduced part to every other rank. In each phase every rank sends and receives (n - 1) / n of
// the buffer, as Gloo's ring does, in n - 1 streams at once instead of one. A large buffer goes
// in chunks of n parts of at most 1 MiB (Gloo's segment size), so that a chunk is reduced and
// sent on while the next ones arrive.
//
// Latency. Gloo's TCP pairs send a message only once the receiver has posted its receive (the
// receiver's notification travels first), so each exchange that waits for the one before costs a
// full round trip: the ring takes about 2 (n - 1) round trips. Here every receive of both phases
// is posted when the call starts, so the notifications of the all-gather travel during the
// reduce-scatter: the first phase's data arrives one round trip after the start, and the second's
// half a round trip later, at any rank count: 1.5 round trips a call.
//
// Throws what gloo's own collectives throw (gloo::IoException for a timeout or a lost connection,
// gloo::EnforceNotMet for a violated precondition); the caller turns them into tandem's errors.
// run() returns false, with the call unfinished, when interrupt() ended one of its waits.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "tandem/collective/communicator.h"
#include "tandem/collective/detail/common.h"

namespace gloo {
class Context;
namespace transport {
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace tandem::collective::detail {

class OrderedAllReduce {
 public:
  // context: the connected mesh of the communicator (a pair to every other rank).
  explicit OrderedAllReduce(std::shared_ptr<gloo::Context> context);
  ~OrderedAllReduce();
  OrderedAllReduce(const OrderedAllReduce&) = delete;
  OrderedAllReduce& operator=(const OrderedAllReduce&) = delete;

  // All-reduces `elements` elements of `dtype` at `bytes`, in place, with op (kMean sums: the
  // caller divides, as it does after Gloo's ring). tag: the same on every rank for this call and
  // different for calls that must not match (gloo.cc mixes the sequence number, dtype, count and
  // op into it); the messages use slots of their own, so they never meet gloo's collectives'.
  // Every wait ends by `deadline`. Returns false when interrupted.
  bool run(std::byte* bytes, std::int64_t elements, DType dtype, ReduceOp op, std::uint32_t tag,
           Clock::time_point deadline);
  // Makes the waits of the call in progress, if any, return at once (run() then returns false):
  // the communicator's abort and failure monitor.
  void interrupt();

 private:
  struct Chunk;
  struct Setup;
  // The buffers of a call on (bytes, elements, dtype), made once and kept: a training step reduces
  // the same few buckets every step, and gloo's buffers cost allocations to make.
  Setup& setup(std::byte* bytes, std::int64_t elements, DType dtype);

  std::shared_ptr<gloo::Context> context_;
  std::vector<std::unique_ptr<Setup>> cache_;
  std::size_t next_eviction_ = 0;
  std::vector<std::byte> scratch_;    // where the peers' copies of this rank's parts arrive
  std::vector<const void*> inputs_;   // the reduction's inputs, in rank order
  std::vector<int> gathers_, sends_;  // run()'s per-chunk message counts
  std::mutex mutex_;
  Setup* running_ = nullptr;  // guarded by mutex_: the call interrupt() ends
};

}  // namespace tandem::collective::detail
