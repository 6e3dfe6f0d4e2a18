// tandem/devices/detail/caching_allocator.h — a caching allocator over a raw device allocator
// (cudaMalloc on GPUs), after PyTorch's CUDACachingAllocator, without block splitting.
//
// cudaMalloc and cudaFree synchronise the device and cost tens of microseconds to milliseconds;
// a training step allocates the same sizes every step. So freed blocks are kept in free lists
// and handed out again:
//   - Sizes are rounded up to a size class: multiples of kMinBlockBytes up to 4 KiB, then four
//     classes per power of two (2^k, 1.25, 1.5 and 1.75 x 2^k), so at most 25% is wasted and a
//     size that recurs always finds its class.
//   - Free lists are per stream: a block freed by work on stream S is reused only for work on S,
//     whose order guarantees the earlier kernels are done with it, with no event. A block used on
//     another stream must be freed after that stream has synchronised with S (the caller's job,
//     as with PyTorch's record_stream).
//   - When the raw allocator is out of memory, every cached block is released and the request
//     retried once; if it still fails, ResourceExhausted states the request, the device's free
//     and total bytes, and what this allocator holds.
// Thread-safe: one mutex; allocation is a map lookup.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tandem/devices/allocator.h"

namespace tandem::devices::detail {

// The memory a caching allocator draws from. CUDA builds use cudaMalloc / cudaFree; tests a fake.
class RawDeviceMemory {
 public:
  virtual ~RawDeviceMemory() = default;
  // nullptr when the device is out of memory; other failures throw.
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void free(void* pointer, std::size_t bytes) noexcept = 0;
  // (free, total) bytes of the device, for the out-of-memory message.
  virtual std::pair<std::size_t, std::size_t> memory_info() = 0;
};

struct CachingAllocatorStats {
  std::int64_t allocated_bytes = 0;  // in blocks handed out (size classes)
  std::int64_t peak_allocated_bytes = 0;
  std::int64_t reserved_bytes = 0;  // taken from the raw allocator: allocated + cached
  std::int64_t peak_reserved_bytes = 0;
  std::int64_t cached_bytes = 0;     // reserved but free, ready for reuse
  std::int64_t raw_allocations = 0;  // calls to the raw allocator that succeeded
  std::int64_t raw_frees = 0;
  std::int64_t cache_hits = 0;     // allocations served from a free list
  std::int64_t cache_flushes = 0;  // out-of-memory retries that released the cache
};

// Streams are named by their native handle (cudaStream_t), nullptr for the device's compute stream.
using StreamHandle = const void*;

class CachingAllocator final : public Allocator {
 public:
  static constexpr std::size_t kMinBlockBytes = 512;           // cudaMalloc aligns to 256
  static constexpr std::size_t kLinearClassLimitBytes = 4096;  // 512-byte steps up to here

  CachingAllocator(std::string device_name, std::unique_ptr<RawDeviceMemory> raw);
  ~CachingAllocator() override;

  // Allocator: a block for work on the compute stream.
  void* allocate(std::size_t bytes, std::size_t alignment = kDefaultAlignmentBytes) override;
  void deallocate(void* pointer, std::size_t bytes) noexcept override;

  // A block for work on `stream`; its free list is that stream's.
  void* allocate_on(StreamHandle stream, std::size_t bytes);
  // empty_cache() (below) gives every cached block back to the raw allocator.
  CachingAllocatorStats caching_stats() const;
  void empty_cache() override;

  // The size class a request is rounded to.
  static std::size_t size_class(std::size_t bytes);

 protected:
  std::pair<std::int64_t, std::int64_t> reserved_bytes() const override;

 private:
  struct Block {
    std::size_t size = 0;  // the size class
    StreamHandle stream = nullptr;
  };
  using FreeKey = std::pair<StreamHandle, std::size_t>;

  void release_cache_locked();

  std::string device_name_;
  std::unique_ptr<RawDeviceMemory> raw_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, Block> live_;       // handed out
  std::map<FreeKey, std::vector<void*>> free_;  // cached, per (stream, class)
  CachingAllocatorStats stats_;
};

}  // namespace tandem::devices::detail
