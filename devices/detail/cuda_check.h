// tandem/devices/detail/cuda_check.h — the CUDA runtime's check macro and a current-device guard,
// for the files of CUDA builds (devices/, collective/nccl.cc, the GPU kernels).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include <fmt/format.h>

#include "tandem/base/errors.h"

// TANDEM_CUDA_CHECK(expr, device_name): every CUDA runtime call goes through this; a failure
// throws tandem::Internal with the call, file:line, CUDA's own error name and string, and the device.
#define TANDEM_CUDA_CHECK(expr, device_name) \
  do { \
    const cudaError_t tandem_cuda_status = (expr); \
    if (tandem_cuda_status != cudaSuccess) [[unlikely]] { \
      throw ::tandem::Internal(::fmt::format("{}:{}: CUDA call `{}` failed on {}: {} ({})", __FILE__, __LINE__, #expr, \
                                             (device_name), cudaGetErrorName(tandem_cuda_status), \
                                             cudaGetErrorString(tandem_cuda_status))); \
    } \
  } while (0)

namespace tandem::devices::detail {

// Makes CUDA device `ordinal` current on the calling thread for the guard's lifetime.
class ScopedCudaDevice {
 public:
  ScopedCudaDevice(int ordinal, const std::string& name) {
    TANDEM_CUDA_CHECK(cudaGetDevice(&previous_), name);
    if (previous_ != ordinal) TANDEM_CUDA_CHECK(cudaSetDevice(ordinal), name);
  }
  ~ScopedCudaDevice() { cudaSetDevice(previous_); }
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace tandem::devices::detail
