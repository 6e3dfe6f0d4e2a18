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
// The largest part of a chunk: Gloo's own segment size.
constexpr std::size_t kMaxPartBytes = std::size_t{1} << 20;
// Chunks whose copies to the peers are in flight ahead of the chunk being reduced: a chunk's
// reduced part then goes out between later chunks' copies instead of after all of them.
constexpr std::size_t kChunksAhead = 2;
// Setups kept for the buffers reduced most recently: a step's buckets, the packs of a large one.
constexpr std::size_t kMaxCachedSetups = 64;
// The slot prefixes of the two phases: above gloo's own (0x01 to 0x08), so that a call's messages
// never match a gloo collective's, and one per phase, so that a pair's messages of one phase
// cannot be matched with the other phase's receives.
constexpr std::uint8_t kReduceScatterSlot = 0x41;
constexpr std::uint8_t kAllGatherSlot = 0x42;

// What is left of the call's time, for one gloo wait (at least 1 ms: gloo treats 0 as "no wait").
std::chrono::milliseconds remaining(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

}  // namespace

// Elements [begin, begin + elements) of the buffer, split into n parts (part_of).
struct OrderedAllReduce::Chunk {
  std::int64_t begin = 0;
  std::int64_t elements = 0;
  std::size_t scratch_offset = 0;                           // of this rank's part's n - 1 copies
  std::unique_ptr<gloo::transport::UnboundBuffer> data;     // the chunk in the caller's buffer
  std::unique_ptr<gloo::transport::UnboundBuffer> scratch;  // the copies, in scratch_
};

struct OrderedAllReduce::Setup {
  std::byte* bytes = nullptr;
  std::int64_t elements = 0;
  DType dtype = kFloat32;
  std::int64_t align = 1;  // part boundaries, in elements
  std::vector<Chunk> chunks;
};

OrderedAllReduce::OrderedAllReduce(std::shared_ptr<gloo::Context> context) : context_(std::move(context)) {}

OrderedAllReduce::~OrderedAllReduce() = default;

OrderedAllReduce::Setup& OrderedAllReduce::setup(std::byte* bytes, std::int64_t elements, DType dtype) {
  for (auto& entry : cache_) {
    if (entry->bytes == bytes && entry->elements == elements && entry->dtype == dtype) return *entry;
  }
  const int n = context_->size;
  const std::size_t esize = dtype_size(dtype);
  auto made = std::make_unique<Setup>();
  made->bytes = bytes;
  made->elements = elements;
  made->dtype = dtype;
  made->align = static_cast<std::int64_t>(std::max<std::size_t>(1, kPartAlignBytes / esize));
  const std::int64_t part_limit =
      std::max<std::int64_t>(made->align, static_cast<std::int64_t>(kMaxPartBytes / esize) / made->align * made->align);
  std::size_t scratch_bytes = 0;
  for (std::int64_t begin = 0; begin < elements; begin += part_limit * n) {
    Chunk chunk;
    chunk.begin = begin;
    chunk.elements = std::min(part_limit * n, elements - begin);
    const auto [mine, mine_end] = part_of(chunk.elements, n, context_->rank, made->align);
    chunk.scratch_offset = scratch_bytes;
    scratch_bytes += static_cast<std::size_t>(n - 1) * static_cast<std::size_t>(mine_end - mine) * esize;
    made->chunks.push_back(std::move(chunk));
  }
  // Every setup's copies share one scratch area (calls run one at a time); when it grows, the
  // setups over the old one go.
  if (scratch_bytes > scratch_.size()) {
    cache_.clear();
    next_eviction_ = 0;
    scratch_.resize(scratch_bytes);
  }
  for (Chunk& chunk : made->chunks) {
    const auto [mine, mine_end] = part_of(chunk.elements, n, context_->rank, made->align);
    chunk.data = context_->createUnboundBuffer(bytes + static_cast<std::size_t>(chunk.begin) * esize,
                                               static_cast<std::size_t>(chunk.elements) * esize);
    const std::size_t copies = static_cast<std::size_t>(n - 1) * static_cast<std::size_t>(mine_end - mine) * esize;
    if (copies > 0) chunk.scratch = context_->createUnboundBuffer(scratch_.data() + chunk.scratch_offset, copies);
  }
  if (cache_.size() < kMaxCachedSetups) {
    cache_.push_back(std::move(made));
    return *cache_.back();
  }
  auto& slot = cache_[next_eviction_];
  next_eviction_ = (next_eviction_ + 1) % kMaxCachedSetups;
  slot = std::move(made);
  return *slot;
}

void OrderedAllReduce::interrupt() {
  std::lock_guard lock(mutex_);
  if (running_ == nullptr) return;
  for (const Chunk& chunk : running_->chunks) {
    chunk.data->abortWaitRecv();
    chunk.data->abortWaitSend();
    if (chunk.scratch) chunk.scratch->abortWaitRecv();
  }
}

bool OrderedAllReduce::run(std::byte* bytes, std::int64_t elements, DType dtype, ReduceOp op, std::uint32_t tag,
                           Clock::time_point deadline) {
  Setup& call = setup(bytes, elements, dtype);
  {
    std::lock_guard lock(mutex_);
    running_ = &call;
  }
  struct Done {
    OrderedAllReduce& self;
    ~Done() {
      std::lock_guard lock(self.mutex_);
      self.running_ = nullptr;
    }
  } done{*this};

  const int n = context_->size;
  const int me = context_->rank;
  const std::size_t esize = dtype_size(dtype);
  // Part q of a chunk, in bytes from the chunk's start: (offset, size).
  const auto part = [&](const Chunk& chunk, int q) {
    const auto [begin, end] = part_of(chunk.elements, n, q, call.align);
    return std::pair{static_cast<std::size_t>(begin) * esize, static_cast<std::size_t>(end - begin) * esize};
  };
  // Peer q's copy of this rank's part lands in copy q (q < me) or q - 1 (q > me).
  const auto copy_offset = [&](int q, std::size_t part_size) {
    return static_cast<std::size_t>(q < me ? q : q - 1) * part_size;
  };
  const auto scatter_slot = gloo::Slot::build(kReduceScatterSlot, tag);
  const auto gather_slot = gloo::Slot::build(kAllGatherSlot, tag);
  // Peers in turn from the next rank, so that the ranks do not all start with the same one.
  const auto peer = [&](int i) { return (me + i) % n; };

  // Every receive of both phases first, so that every peer may send as soon as it has the data;
  // then this rank's copies of the peers' parts of the first chunks. A pair matches the messages
  // of one slot in order, and both sides go through the chunks in the same order.
  auto& gathers = gathers_;  // per chunk: the all-gather's receives, and sends of both phases
  auto& sends = sends_;
  gathers.assign(call.chunks.size(), 0);
  sends.assign(call.chunks.size(), 0);
  for (std::size_t c = 0; c < call.chunks.size(); ++c) {
    const Chunk& chunk = call.chunks[c];
    const auto [mine, my_size] = part(chunk, me);
    for (int i = 1; i < n; ++i) {
      const int q = peer(i);
      if (const auto [offset, size] = part(chunk, q); size > 0) {
        chunk.data->recv(q, gather_slot, offset, size);
        ++gathers[c];
      }
      if (my_size > 0) chunk.scratch->recv(q, scatter_slot, copy_offset(q, my_size), my_size);
    }
  }
  const auto send_copies = [&](std::size_t c) {
    if (c >= call.chunks.size()) return;
    const Chunk& chunk = call.chunks[c];
    for (int i = 1; i < n; ++i) {
      if (const auto [offset, size] = part(chunk, peer(i)); size > 0) {
        chunk.data->send(peer(i), scatter_slot, offset, size);
        ++sends[c];
      }
    }
  };
  for (std::size_t c = 0; c < kChunksAhead; ++c) send_copies(c);
  // Each chunk's part as its copies arrive: reduced in rank order (this rank's own copy is input
  // `me`), then sent to every peer, and a later chunk's copies sent on. (Chunk c's copies leave
  // after chunk c - kChunksAhead is reduced, which needs only copies that left before: no rank
  // waits for one that waits for it.)
  inputs_.resize(static_cast<std::size_t>(n));
  for (std::size_t c = 0; c < call.chunks.size(); ++c) {
    const Chunk& chunk = call.chunks[c];
    const auto [mine, my_size] = part(chunk, me);
    if (my_size == 0) {
      send_copies(c + kChunksAhead);
      continue;
    }
    for (int i = 1; i < n; ++i) {
      if (!chunk.scratch->waitRecv(remaining(deadline))) return false;
    }
    std::byte* own = bytes + static_cast<std::size_t>(chunk.begin) * esize + mine;
    for (int q = 0; q < n; ++q) {
      inputs_[static_cast<std::size_t>(q)] =
          q == me ? static_cast<const void*>(own)
                  : static_cast<const std::byte*>(chunk.scratch->ptr) + copy_offset(q, my_size);
    }
    void* output = own;
    const auto count = static_cast<std::int64_t>(my_size / esize);
    dispatch_reduction(dtype, op, "gloo rank-ordered all_reduce", [&]<class T, class Op, bool kMean>() {
      reduce_blocks<T, Op, false>(inputs_.data(), n, &output, 1, count);
    });
    for (int i = 1; i < n; ++i) {
      chunk.data->send(peer(i), gather_slot, mine, my_size);
      ++sends[c];
    }
    send_copies(c + kChunksAhead);
  }
  for (std::size_t c = 0; c < call.chunks.size(); ++c) {
    for (int i = 0; i < gathers[c]; ++i) {
      if (!call.chunks[c].data->waitRecv(remaining(deadline))) return false;
    }
    for (int i = 0; i < sends[c]; ++i) {
      if (!call.chunks[c].data->waitSend(remaining(deadline))) return false;
    }
  }
  return true;
}

}  // namespace tandem::collective::detail
