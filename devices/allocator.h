// tandem/devices/allocator.h — device memory with byte counters.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace tandem::devices {

// Every buffer is aligned for the widest vector load we issue (AVX-512: 64 bytes).
inline constexpr std::size_t kDefaultAlignmentBytes = 64;

struct AllocatorStats {
  std::int64_t bytes_in_use = 0;
  std::int64_t peak_bytes_in_use = 0;
  std::int64_t num_allocations = 0;  // calls to allocate() since the device was created
  // Memory taken from the system: in use plus what a caching allocator keeps for reuse (GPUs);
  // equal to bytes_in_use where nothing is cached (CPUs).
  std::int64_t bytes_reserved = 0;
  std::int64_t peak_bytes_reserved = 0;
};

// Thread-safe. allocate() throws ResourceExhausted (naming the device, the request and what is in
// use) when memory runs out; it never returns nullptr. deallocate() takes the size that was asked for.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(std::size_t bytes, std::size_t alignment = kDefaultAlignmentBytes) = 0;
  virtual void deallocate(void* pointer, std::size_t bytes) noexcept = 0;

  AllocatorStats stats() const;
  // Starts a new peak measurement from the current use.
  void reset_peak_bytes_in_use();
  // Gives memory kept for reuse back to the system (torch.cuda.empty_cache()); no-op on CPUs.
  virtual void empty_cache() {}

 protected:
  void record_allocation(std::size_t bytes);
  void record_deallocation(std::size_t bytes);
  // (reserved, peak reserved) for stats(); the default is the in-use counters.
  virtual std::pair<std::int64_t, std::int64_t> reserved_bytes() const;

 private:
  std::atomic<std::int64_t> bytes_in_use_{0};
  std::atomic<std::int64_t> peak_bytes_in_use_{0};
  std::atomic<std::int64_t> num_allocations_{0};
};

// Host memory from aligned_alloc, up to memory_limit_bytes in use at once (0: no limit).
class CpuAllocator final : public Allocator {
 public:
  explicit CpuAllocator(std::string device_name, std::int64_t memory_limit_bytes = 0)
      : device_name_(std::move(device_name)), memory_limit_bytes_(memory_limit_bytes) {}
  void* allocate(std::size_t bytes, std::size_t alignment = kDefaultAlignmentBytes) override;
  void deallocate(void* pointer, std::size_t bytes) noexcept override;

 private:
  std::string device_name_;
  std::int64_t memory_limit_bytes_;
};

}  // namespace tandem::devices
