#include "tandem/devices/allocator.h"

#include <cstdlib>
#include <tuple>

#include "tandem/base/errors.h"

namespace tandem::devices {

AllocatorStats Allocator::stats() const {
  AllocatorStats s{bytes_in_use_.load(std::memory_order_relaxed), peak_bytes_in_use_.load(std::memory_order_relaxed),
                   num_allocations_.load(std::memory_order_relaxed)};
  std::tie(s.bytes_reserved, s.peak_bytes_reserved) = reserved_bytes();
  return s;
}

std::pair<std::int64_t, std::int64_t> Allocator::reserved_bytes() const {
  return {bytes_in_use_.load(std::memory_order_relaxed), peak_bytes_in_use_.load(std::memory_order_relaxed)};
}

void Allocator::reset_peak_bytes_in_use() {
  peak_bytes_in_use_.store(bytes_in_use_.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

void Allocator::record_allocation(std::size_t bytes) {
  const auto now = bytes_in_use_.fetch_add(static_cast<std::int64_t>(bytes), std::memory_order_relaxed) +
                   static_cast<std::int64_t>(bytes);
  num_allocations_.fetch_add(1, std::memory_order_relaxed);
  auto peak = peak_bytes_in_use_.load(std::memory_order_relaxed);
  while (now > peak && !peak_bytes_in_use_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void Allocator::record_deallocation(std::size_t bytes) {
  bytes_in_use_.fetch_sub(static_cast<std::int64_t>(bytes), std::memory_order_relaxed);
}

void* CpuAllocator::allocate(std::size_t bytes, std::size_t alignment) {
  TANDEM_ASSERT(alignment > 0 && (alignment & (alignment - 1)) == 0, "alignment {} is not a power of two", alignment);
  // aligned_alloc wants a size that is a multiple of the alignment; zero-byte tensors still get
  // a distinct, valid pointer.
  const std::size_t rounded = bytes == 0 ? alignment : (bytes + alignment - 1) / alignment * alignment;
  // The check and the count are not one atomic step: threads allocating at once may pass the
  // limit together by up to their requests. The limit models a device's size, not a hard quota.
  if (memory_limit_bytes_ > 0 && stats().bytes_in_use + static_cast<std::int64_t>(bytes) > memory_limit_bytes_) {
    throw ResourceExhausted(fmt::format(
        "{}: allocating {} bytes would pass the device's memory limit of {} bytes ({} bytes in use; "
        "LogicalDeviceConfiguration.memory_limit_bytes)",
        device_name_, bytes, memory_limit_bytes_, stats().bytes_in_use));
  }
  void* pointer = std::aligned_alloc(alignment, rounded);
  if (pointer == nullptr) {
    const auto in_use = stats().bytes_in_use;
    throw ResourceExhausted(
        fmt::format("{}: out of host memory allocating {} bytes ({} bytes in use)", device_name_, bytes, in_use));
  }
  record_allocation(bytes);
  return pointer;
}

void CpuAllocator::deallocate(void* pointer, std::size_t bytes) noexcept {
  if (pointer == nullptr) return;
  std::free(pointer);
  record_deallocation(bytes);
}

}  // namespace tandem::devices
