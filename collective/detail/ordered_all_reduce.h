// tandem/collective/detail/ordered_all_reduce.h — the Gloo communicator's rank-ordered all-reduce:
// every element is combined in rank order, (((x0 op x1) op x2) ...), exactly as the in-process
// and shared-memory groups combine it (detail::reduce_blocks), so that n worker processes sum
// bitwise as MirroredStrategy's n replica threads do. Not part of the public contract.
//
// Who calls: the Gloo communicator (gloo.cc), once per pack of an all_reduce when
// GlooOptions::all_reduce_algorithm is kRankOrdered; one call at a time per communicator (the
// calling thread's; like the communicator itself, not thread-safe).
//
// The algorithm: a reduce-scatter in which rank r owns part r of the buffer (detail::part_of, the
// in-process group's split) and receives every other rank's copy of that part, combines all n in
// rank order and writes the result into its buffer; then an all-gather in which each owner sends
// its reduced part to every other rank. In each phase every rank sends and receives (n - 1) / n of
// the buffer, as Gloo's ring does; the ring's bandwidth, in n - 1 streams at once instead of one.
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
// run() returns early, with the call unfinished, when one of its waits is aborted
// (UnboundBuffer::abortWaitRecv / abortWaitSend on the buffers prepare() returned: the caller's
// abort and failure monitor).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
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
  // context: the connected mesh of the communicator (every pair to every other rank).
  explicit OrderedAllReduce(std::shared_ptr<gloo::Context> context);
  ~OrderedAllReduce();
  OrderedAllReduce(const OrderedAllReduce&) = delete;
  OrderedAllReduce& operator=(const OrderedAllReduce&) = delete;

  // One call's buffers: `data`, the caller's buffer, which the peers' reduced parts are received
  // into and this rank's parts are sent from; `scratch`, where the peers' copies of this rank's
  // part arrive. Valid until the next prepare().
  struct Call {
    std::byte* bytes = nullptr;
    std::int64_t elements = 0;
    DType dtype = kFloat32;
    gloo::transport::UnboundBuffer* data = nullptr;
    gloo::transport::UnboundBuffer* scratch = nullptr;
  };
  // Sets up an all-reduce of `elements` elements of `dtype` at `bytes` (the buffers, made once per
  // address and size and kept: a training step reduces the same few buckets every step).
  Call prepare(std::byte* bytes, std::int64_t elements, DType dtype);

  // All-reduces call's buffer in place with op (kMean sums: the caller divides, as it does after
  // Gloo's ring). tag: the same on every rank for this call and different for calls that must not
  // match (gloo.cc mixes the sequence number, dtype, count and op into it); the messages use slots
  // of their own, so they never meet gloo's collectives'. Every wait ends by `deadline`.
  // Returns false when a wait was aborted.
  bool run(const Call& call, ReduceOp op, std::uint32_t tag, Clock::time_point deadline);

 private:
  struct CachedBuffer;
  gloo::transport::UnboundBuffer* data_buffer(std::byte* bytes, std::size_t size);
  gloo::transport::UnboundBuffer* scratch_buffer(std::size_t size);

  std::shared_ptr<gloo::Context> context_;
  std::vector<CachedBuffer> cache_;
  std::size_t next_eviction_ = 0;
  std::vector<std::byte> scratch_;
  std::unique_ptr<gloo::transport::UnboundBuffer> scratch_buffer_;
  std::vector<const void*> inputs_;  // the reduction's inputs, in rank order
};

}  // namespace tandem::collective::detail
