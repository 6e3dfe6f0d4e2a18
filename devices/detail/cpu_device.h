// tandem/devices/detail/cpu_device.h — a logical CPU device: host memory and a share of the cores.
#pragma once

#include <memory>

#include "tandem/devices/detail/thread_pool.h"
#include "tandem/devices/device.h"

namespace tandem::devices::detail {

class InlineStream final : public Stream {
 public:
  void synchronize() override {}
  void* native_handle() const override { return nullptr; }
};

class CpuDevice final : public Device {
 public:
  // memory_limit_bytes: LogicalDeviceConfiguration::memory_limit_bytes (0: none).
  CpuDevice(int index, int intra_op_threads, std::int64_t memory_limit_bytes = 0);

  Allocator& allocator() override { return allocator_; }
  Stream& compute_stream() override { return stream_; }
  bool host_accessible() const override { return true; }
  void copy_from_host(void* device_dst, const void* host_src, std::size_t bytes) override;
  void copy_to_host(void* host_dst, const void* device_src, std::size_t bytes) override;
  void copy_on_device(void* device_dst, const void* device_src, std::size_t bytes) override;
  void fill_zero(void* device_dst, std::size_t bytes) override;
  void synchronize() override {}

  int intra_op_threads() const override { return pool_.num_threads(); }
  void parallel_for(std::int64_t n, std::int64_t min_grain, FunctionRef<void(std::int64_t, std::int64_t)> fn) override;

 private:
  CpuAllocator allocator_;
  InlineStream stream_;
  ThreadPool pool_;
};

}  // namespace tandem::devices::detail
