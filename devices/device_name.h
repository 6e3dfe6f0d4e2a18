// tandem/devices/device_name.h — TensorFlow-style device names and their parser.
#pragma once

#include <string>
#include <string_view>

namespace tandem::devices {

enum class DeviceType { kCPU, kGPU };

std::string_view device_type_name(DeviceType type);  // "CPU", "GPU"

// /job:<job>/replica:<r>/task:<t>/device:<TYPE>:<index>. Components other than the device may be
// omitted when parsing; they default to the local process (job "localhost", replica 0, task 0).
struct DeviceName {
  std::string job = "localhost";
  int replica = 0;
  int task = 0;
  DeviceType type = DeviceType::kCPU;
  int index = 0;

  // Accepts the full form, any subset of its components in order ("/job:worker/task:1/device:GPU:0"),
  // "/device:CPU:0", the legacy "/cpu:0", and the short "CPU:0"; the type is case-insensitive.
  // Throws InvalidArgument that quotes the name and says what was expected.
  static DeviceName parse(std::string_view text);

  std::string full() const;        // "/job:localhost/replica:0/task:0/device:CPU:0"
  std::string short_form() const;  // "CPU:0"
  bool operator==(const DeviceName&) const = default;
};

}  // namespace tandem::devices
