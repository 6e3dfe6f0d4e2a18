// The caching allocator the CUDA device uses, over a fake raw allocator with a fixed capacity:
// size classes, reuse per stream, statistics, the cache released on out-of-memory, and the
// ResourceExhausted message. The logic is the same for cudaMalloc, so it is tested here, on CPUs.
#include <doctest/doctest.h>

#include <cstdlib>
#include <set>

#include "tandem/base/errors.h"
#include "tandem/devices/detail/caching_allocator.h"

using namespace tandem;
using namespace tandem::devices::detail;

namespace {

// malloc with a capacity, counting calls; returns nullptr past the capacity like cudaMalloc's
// cudaErrorMemoryAllocation.
struct FakeMemory final : RawDeviceMemory {
  std::size_t capacity;
  std::size_t used = 0;
  int allocations = 0;
  int frees = 0;
  explicit FakeMemory(std::size_t capacity_bytes) : capacity(capacity_bytes) {}
  void* allocate(std::size_t bytes) override {
    if (used + bytes > capacity) return nullptr;
    used += bytes;
    ++allocations;
    return std::malloc(bytes);
  }
  void free(void* pointer, std::size_t bytes) noexcept override {
    used -= bytes;
    ++frees;
    std::free(pointer);
  }
  std::pair<std::size_t, std::size_t> memory_info() override { return {capacity - used, capacity}; }
};

struct Fixture {
  FakeMemory* raw;
  CachingAllocator allocator;
  explicit Fixture(std::size_t capacity = std::size_t{64} << 20)
      : raw(new FakeMemory(capacity)), allocator("GPU:0", std::unique_ptr<RawDeviceMemory>(raw)) {}
};

const void* const kOtherStream = reinterpret_cast<const void*>(0x1234);

}  // namespace

TEST_CASE("size classes: 512-byte steps to 4 KiB, then four per power of two") {
  CHECK(CachingAllocator::size_class(0) == 512);
  CHECK(CachingAllocator::size_class(1) == 512);
  CHECK(CachingAllocator::size_class(512) == 512);
  CHECK(CachingAllocator::size_class(513) == 1024);
  CHECK(CachingAllocator::size_class(4096) == 4096);
  CHECK(CachingAllocator::size_class(4097) == 5120);  // 4 KiB * 1.25
  CHECK(CachingAllocator::size_class(6000) == 6144);  // * 1.5
  CHECK(CachingAllocator::size_class(7000) == 7168);  // * 1.75
  CHECK(CachingAllocator::size_class(7169) == 8192);
  CHECK(CachingAllocator::size_class((1u << 20) + 1) == (1u << 20) + (1u << 18));
  for (std::size_t bytes = 1; bytes < (std::size_t{1} << 24); bytes = bytes * 3 / 2 + 7) {
    const std::size_t c = CachingAllocator::size_class(bytes);
    CHECK(c >= bytes);
    CHECK(c % 512 == 0);
    CHECK(static_cast<double>(c) <= std::max(512.0, 1.25 * static_cast<double>(bytes) + 512));
  }
}

TEST_CASE("a freed block is reused for the same size class on the same stream, without the raw allocator") {
  Fixture f;
  void* a = f.allocator.allocate(10000);
  f.allocator.deallocate(a, 10000);
  void* b = f.allocator.allocate(10100);  // same class (10240)
  CHECK(b == a);
  CHECK(f.raw->allocations == 1);
  auto stats = f.allocator.caching_stats();
  CHECK(stats.cache_hits == 1);
  CHECK(stats.allocated_bytes == 10240);
  CHECK(stats.reserved_bytes == 10240);
  CHECK(stats.cached_bytes == 0);

  // Another stream does not get the block: its work is not ordered after the block's last use.
  f.allocator.deallocate(b, 10100);
  void* c = f.allocator.allocate_on(kOtherStream, 10000);
  CHECK(c != a);
  CHECK(f.raw->allocations == 2);
  // Freed on the other stream, it goes back to that stream's list.
  f.allocator.deallocate(c, 10000);
  CHECK(f.allocator.allocate_on(kOtherStream, 10000) == c);
  CHECK(f.allocator.allocate(10000) == a);
}

TEST_CASE("statistics: allocated, peak, reserved and cached bytes; the Allocator counters too") {
  Fixture f;
  std::set<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.insert(f.allocator.allocate(1 << 20));
  CHECK(blocks.size() == 4);
  auto stats = f.allocator.caching_stats();
  CHECK(stats.allocated_bytes == 4 << 20);
  CHECK(stats.peak_allocated_bytes == 4 << 20);
  CHECK(stats.reserved_bytes == 4 << 20);
  CHECK(f.allocator.stats().bytes_in_use == 4 << 20);
  for (void* p : blocks) f.allocator.deallocate(p, 1 << 20);
  stats = f.allocator.caching_stats();
  CHECK(stats.allocated_bytes == 0);
  CHECK(stats.peak_allocated_bytes == 4 << 20);
  CHECK(stats.cached_bytes == 4 << 20);
  CHECK(stats.reserved_bytes == 4 << 20);
  CHECK(f.allocator.stats().bytes_in_use == 0);
  CHECK(f.allocator.stats().peak_bytes_in_use == 4 << 20);

  f.allocator.empty_cache();
  stats = f.allocator.caching_stats();
  CHECK(stats.reserved_bytes == 0);
  CHECK(stats.cached_bytes == 0);
  CHECK(stats.peak_reserved_bytes == 4 << 20);
  CHECK(f.raw->frees == 4);
  CHECK(f.raw->used == 0);
}

TEST_CASE("out of memory: the cache is released and the request retried before failing") {
  Fixture f(std::size_t{8} << 20);
  // Fill the device with cached 2 MiB blocks, then ask for 6 MiB: only the flush makes room.
  void* blocks[4];
  for (auto& b : blocks) b = f.allocator.allocate(2 << 20);
  for (auto& b : blocks) f.allocator.deallocate(b, 2 << 20);
  CHECK(f.raw->used == std::size_t{8} << 20);
  void* big = f.allocator.allocate(6 << 20);
  CHECK(big != nullptr);
  const auto stats = f.allocator.caching_stats();
  CHECK(stats.cache_flushes == 1);
  CHECK(stats.cached_bytes == 0);
  CHECK(stats.reserved_bytes == 6 << 20);
  f.allocator.deallocate(big, 6 << 20);
}

TEST_CASE("out of memory for good: ResourceExhausted with the request, the device's free bytes and what is held") {
  Fixture f(std::size_t{8} << 20);
  void* held = f.allocator.allocate(5 << 20);  // class 5 MiB
  try {
    f.allocator.allocate(4 << 20);
    FAIL("allocation past the capacity succeeded");
  } catch (const ResourceExhausted& e) {
    const std::string message = e.what();
    INFO(message);
    CHECK(message.find("GPU:0: out of memory allocating 4.00 MiB (4194304 bytes") != std::string::npos);
    CHECK(message.find("the device has 3.00 MiB free of 8.00 MiB") != std::string::npos);
    CHECK(message.find("tandem holds 5.00 MiB (5.00 MiB in use by tensors") != std::string::npos);
  }
  // Nothing changed: the held block is still live and the allocator still works.
  CHECK(f.allocator.caching_stats().allocated_bytes == 5 << 20);
  f.allocator.deallocate(held, 5 << 20);
  void* again = f.allocator.allocate(5 << 20);
  CHECK(again == held);
  f.allocator.deallocate(again, 5 << 20);
}

TEST_CASE("freeing a pointer the allocator did not hand out changes nothing") {
  Fixture f;
  int local = 0;
  f.allocator.deallocate(&local, 4);
  f.allocator.deallocate(nullptr, 4);
  CHECK(f.allocator.caching_stats().cached_bytes == 0);
}
