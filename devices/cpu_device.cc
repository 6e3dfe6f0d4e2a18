#include "tandem/devices/detail/cpu_device.h"

#include <cstring>

namespace tandem::devices::detail {

namespace {
DeviceName cpu_name(int index) {
  DeviceName name;
  name.type = DeviceType::kCPU;
  name.index = index;
  return name;
}
}  // namespace

CpuDevice::CpuDevice(int index, int intra_op_threads, std::int64_t memory_limit_bytes)
    : Device(cpu_name(index)), allocator_(cpu_name(index).short_form(), memory_limit_bytes), pool_(intra_op_threads) {}

void CpuDevice::copy_from_host(void* device_dst, const void* host_src, std::size_t bytes) {
  if (bytes != 0) std::memcpy(device_dst, host_src, bytes);
}
void CpuDevice::copy_to_host(void* host_dst, const void* device_src, std::size_t bytes) {
  if (bytes != 0) std::memcpy(host_dst, device_src, bytes);
}
void CpuDevice::copy_on_device(void* device_dst, const void* device_src, std::size_t bytes) {
  if (bytes != 0) std::memmove(device_dst, device_src, bytes);
}
void CpuDevice::fill_zero(void* device_dst, std::size_t bytes) {
  if (bytes != 0) std::memset(device_dst, 0, bytes);
}

void CpuDevice::parallel_for(std::int64_t n, std::int64_t min_grain, FunctionRef<void(std::int64_t, std::int64_t)> fn) {
  pool_.parallel_for(n, min_grain, fn);
}

}  // namespace tandem::devices::detail
