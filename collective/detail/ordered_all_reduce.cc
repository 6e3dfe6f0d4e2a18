// The rank-ordered all-reduce over Gloo's pairs (see ordered_all_reduce.h for why and how).
#include "tandem/collective/detail/ordered_all_reduce.h"

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <algorithm>

#include "tandem/collective/detail/reduce_kernels.h"

namespace tandem::collective::detail {
namespace {

// Part boundaries on 64-byte multiples, as the in-process group's (a part is one vector loop).
constexpr std::size_t kPartAlignBytes = 64;
// Buffers kept for the addresses reduced most recently: a step's buckets, the packs of a large one.
constexpr std::size_t kMaxCachedBuffers = 64;
// The slot prefixes of the two phases: above gloo's own (0x01 to 0x08), so that a call's messages
// never match a gloo collective's, and one per phase, so that a pair's two messages of one call
// cannot be matched with each other's receive.
constexpr std::uint8_t kReduceScatterSlot = 0x41;
constexpr std::uint8_t kAllGatherSlot = 0x42;

// What is left of the call's time, for one gloo wait (at least 1 ms: gloo treats 0 as "no wait").
std::chrono::milliseconds remaining(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

}  // namespace

struct OrderedAllReduce::CachedBuffer {
  std::byte* bytes = nullptr;
  std::size_t size = 0;
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
};

OrderedAllReduce::OrderedAllReduce(std::shared_ptr<gloo::Context> context) : context_(std::move(context)) {}

OrderedAllReduce::~OrderedAllReduce() = default;

gloo::transport::UnboundBuffer* OrderedAllReduce::data_buffer(std::byte* bytes, std::size_t size) {
  for (auto& entry : cache_) {
    if (entry.bytes == bytes && entry.size == size) return entry.buffer.get();
  }
  CachedBuffer entry{bytes, size, context_->createUnboundBuffer(bytes, size)};
  if (cache_.size() < kMaxCachedBuffers) {
    cache_.push_back(std::move(entry));
    return cache_.back().buffer.get();
  }
  auto& slot = cache_[next_eviction_];
  next_eviction_ = (next_eviction_ + 1) % kMaxCachedBuffers;
  slot = std::move(entry);
  return slot.buffer.get();
}

gloo::transport::UnboundBuffer* OrderedAllReduce::scratch_buffer(std::size_t size) {
  if (!scratch_buffer_ || scratch_.size() < size) {
    scratch_buffer_.reset();
    scratch_.resize(std::max<std::size_t>(size, 1));
    scratch_buffer_ = context_->createUnboundBuffer(scratch_.data(), scratch_.size());
  }
  return scratch_buffer_.get();
}

OrderedAllReduce::Call OrderedAllReduce::prepare(std::byte* bytes, std::int64_t elements, DType dtype) {
  const int n = context_->size;
  const std::size_t esize = dtype_size(dtype);
  const auto align = static_cast<std::int64_t>(std::max<std::size_t>(1, kPartAlignBytes / esize));
  const auto [begin, end] = part_of(elements, n, context_->rank, align);
  Call call{bytes, elements, dtype};
  call.data = data_buffer(bytes, static_cast<std::size_t>(elements) * esize);
  call.scratch = scratch_buffer(static_cast<std::size_t>(n - 1) * static_cast<std::size_t>(end - begin) * esize);
  return call;
}

bool OrderedAllReduce::run(const Call& call, ReduceOp op, std::uint32_t tag, Clock::time_point deadline) {
  const int n = context_->size;
  const int me = context_->rank;
  const std::size_t esize = dtype_size(call.dtype);
  const auto align = static_cast<std::int64_t>(std::max<std::size_t>(1, kPartAlignBytes / esize));
  // Part q of the buffer, in bytes: [offset, offset + size).
  const auto part = [&](int q) {
    const auto [begin, end] = part_of(call.elements, n, q, align);
    return std::pair{static_cast<std::size_t>(begin) * esize, static_cast<std::size_t>(end - begin) * esize};
  };
  const auto [mine, my_size] = part(me);
  // Peer q's copy of this rank's part lands at scratch slot q (q < me) or q - 1 (q > me).
  const auto scratch_offset = [&](int q) { return static_cast<std::size_t>(q < me ? q : q - 1) * my_size; };
  const auto scatter_slot = gloo::Slot::build(kReduceScatterSlot, tag);
  const auto gather_slot = gloo::Slot::build(kAllGatherSlot, tag);

  // Every receive of both phases first, so that every peer may send as soon as it has the data;
  // then this rank's copies of the peers' parts. Peers in turn from the next rank, so that the
  // ranks do not all start with rank 0.
  int gathers = 0, sends = 0;
  for (int i = 1; i < n; ++i) {
    const int q = (me + i) % n;
    if (const auto [offset, size] = part(q); size > 0) {
      call.data->recv(q, gather_slot, offset, size);
      ++gathers;
    }
    if (my_size > 0) call.scratch->recv(q, scatter_slot, scratch_offset(q), my_size);
  }
  for (int i = 1; i < n; ++i) {
    const int q = (me + i) % n;
    if (const auto [offset, size] = part(q); size > 0) {
      call.data->send(q, scatter_slot, offset, size);
      ++sends;
    }
  }

  if (my_size > 0) {
    for (int i = 1; i < n; ++i) {
      if (!call.scratch->waitRecv(remaining(deadline))) return false;
    }
    // Rank order: this rank's own copy is input `me`.
    auto& inputs = inputs_;
    inputs.resize(static_cast<std::size_t>(n));
    for (int q = 0; q < n; ++q) {
      inputs[static_cast<std::size_t>(q)] = q == me ? static_cast<const void*>(call.bytes + mine)
                                                    : static_cast<const std::byte*>(call.scratch->ptr) + scratch_offset(q);
    }
    void* output = call.bytes + mine;
    const auto count = static_cast<std::int64_t>(my_size / esize);
    dispatch_reduction(call.dtype, op, "gloo rank-ordered all_reduce", [&]<class T, class Op, bool kMean>() {
      reduce_blocks<T, Op, false>(inputs.data(), n, &output, 1, count);
    });
    for (int i = 1; i < n; ++i) {
      call.data->send((me + i) % n, gather_slot, mine, my_size);
      ++sends;
    }
  }

  for (int i = 0; i < gathers; ++i) {
    if (!call.data->waitRecv(remaining(deadline))) return false;
  }
  for (int i = 0; i < sends; ++i) {
    if (!call.data->waitSend(remaining(deadline))) return false;
  }
  return true;
}

}  // namespace tandem::collective::detail
