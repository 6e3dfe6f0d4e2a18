// tandem/devices/detail/cuda_device.h — CUDA GPUs (built when the CUDA toolkit is found).
//
// Discovery and creation go through functions that exist in every build, so the registry does
// not need #ifdefs: without CUDA, discover_cuda_devices() reports "built without CUDA".
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tandem/devices/device.h"

namespace tandem::devices::detail {

struct CudaDiscovery {
  int count = 0;
  std::string message;  // "1 CUDA device(s): NVIDIA H200", "no CUDA driver (...)", ...
};

// Never throws: every failure (no driver, no device, a broken install) means zero GPUs.
CudaDiscovery discover_cuda_devices();

// Creates the device for GPU `index`; only called for index < discover_cuda_devices().count.
std::unique_ptr<Device> make_cuda_device(int index);

}  // namespace tandem::devices::detail
