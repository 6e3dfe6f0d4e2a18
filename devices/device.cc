#include "tandem/devices/device.h"

namespace tandem::devices {

void Device::parallel_for(std::int64_t n, std::int64_t /*min_grain*/,
                          FunctionRef<void(std::int64_t, std::int64_t)> fn) {
  if (n > 0) fn(0, n);
}

}  // namespace tandem::devices
