#include "tandem/devices/detail/caching_allocator.h"

#include <algorithm>
#include <bit>

#include <fmt/format.h>

#include "tandem/base/errors.h"

namespace tandem::devices::detail {
namespace {

std::string human_bytes(std::size_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.2f} {}", value, kUnits[unit]);
}

}  // namespace

CachingAllocator::CachingAllocator(std::string device_name, std::unique_ptr<RawDeviceMemory> raw)
    : device_name_(std::move(device_name)), raw_(std::move(raw)) {}

CachingAllocator::~CachingAllocator() {
  // Blocks still handed out belong to tensors that outlive the device (devices live until exit):
  // leave them; give back the cache.
  std::lock_guard lock(mutex_);
  release_cache_locked();
}

std::size_t CachingAllocator::size_class(std::size_t bytes) {
  if (bytes <= kLinearClassLimitBytes) {
    return std::max<std::size_t>(kMinBlockBytes, (bytes + kMinBlockBytes - 1) / kMinBlockBytes * kMinBlockBytes);
  }
  // Four classes per octave: 2^k * {1, 1.25, 1.5, 1.75}.
  const std::size_t octave = std::bit_floor(bytes);
  const std::size_t quarter = octave / 4;
  const std::size_t rounded = (bytes + quarter - 1) / quarter * quarter;
  return rounded;
}

void* CachingAllocator::allocate(std::size_t bytes, std::size_t alignment) {
  TANDEM_REQUIRE(alignment <= 256, InvalidArgument, "{}: alignment {} is more than the device's 256 bytes",
                 device_name_, alignment);
  return allocate_on(nullptr, bytes);
}

void* CachingAllocator::allocate_on(StreamHandle stream, std::size_t bytes) {
  const std::size_t size = size_class(bytes);
  std::lock_guard lock(mutex_);
  void* pointer = nullptr;
  if (auto it = free_.find({stream, size}); it != free_.end() && !it->second.empty()) {
    pointer = it->second.back();
    it->second.pop_back();
    stats_.cached_bytes -= static_cast<std::int64_t>(size);
    ++stats_.cache_hits;
  } else {
    pointer = raw_->allocate(size);
    if (pointer == nullptr && stats_.cached_bytes > 0) {
      // Out of memory with blocks cached (perhaps for other sizes or streams): give them all
      // back and try once more.
      release_cache_locked();
      ++stats_.cache_flushes;
      pointer = raw_->allocate(size);
    }
    if (pointer == nullptr) {
      const auto [free_bytes, total_bytes] = raw_->memory_info();
      throw ResourceExhausted(fmt::format(
          "{}: out of memory allocating {} ({} bytes, size class {}): the device has {} free of {}; tandem holds {} "
          "({} in use by tensors, {} cached and already released to retry). Use a smaller batch or model, or fewer "
          "replicas per GPU",
          device_name_, human_bytes(bytes), bytes, human_bytes(size), human_bytes(free_bytes), human_bytes(total_bytes),
          human_bytes(static_cast<std::size_t>(stats_.reserved_bytes)),
          human_bytes(static_cast<std::size_t>(stats_.allocated_bytes)),
          human_bytes(static_cast<std::size_t>(stats_.cached_bytes))));
    }
    ++stats_.raw_allocations;
    stats_.reserved_bytes += static_cast<std::int64_t>(size);
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  }
  live_.emplace(pointer, Block{size, stream});
  stats_.allocated_bytes += static_cast<std::int64_t>(size);
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  record_allocation(bytes);
  return pointer;
}

void CachingAllocator::deallocate(void* pointer, std::size_t bytes) noexcept {
  if (pointer == nullptr) return;
  std::lock_guard lock(mutex_);
  const auto it = live_.find(pointer);
  if (it == live_.end()) return;  // not ours: nothing safe to do in a noexcept path
  const Block block = it->second;
  live_.erase(it);
  stats_.allocated_bytes -= static_cast<std::int64_t>(block.size);
  stats_.cached_bytes += static_cast<std::int64_t>(block.size);
  try {
    free_[{block.stream, block.size}].push_back(pointer);
  } catch (...) {  // no memory for the free list: give the block back instead
    stats_.cached_bytes -= static_cast<std::int64_t>(block.size);
    stats_.reserved_bytes -= static_cast<std::int64_t>(block.size);
    ++stats_.raw_frees;
    raw_->free(pointer, block.size);
  }
  record_deallocation(bytes);
}

void CachingAllocator::empty_cache() {
  std::lock_guard lock(mutex_);
  release_cache_locked();
}

void CachingAllocator::release_cache_locked() {
  for (auto& [key, pointers] : free_) {
    for (void* p : pointers) {
      raw_->free(p, key.second);
      ++stats_.raw_frees;
      stats_.reserved_bytes -= static_cast<std::int64_t>(key.second);
      stats_.cached_bytes -= static_cast<std::int64_t>(key.second);
    }
  }
  free_.clear();
}

std::pair<std::int64_t, std::int64_t> CachingAllocator::reserved_bytes() const {
  std::lock_guard lock(mutex_);
  return {stats_.reserved_bytes, stats_.peak_reserved_bytes};
}

CachingAllocatorStats CachingAllocator::caching_stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

}  // namespace tandem::devices::detail
