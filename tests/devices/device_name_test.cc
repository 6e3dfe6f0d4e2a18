#include <doctest/doctest.h>

#include "tandem/base/errors.h"
#include "tandem/devices/device_name.h"

#include <string>
#include <vector>

using tandem::InvalidArgument;
using tandem::devices::DeviceName;
using tandem::devices::DeviceType;

TEST_CASE("device names parse in every TensorFlow form") {
  const auto full = DeviceName::parse("/job:localhost/replica:0/task:0/device:CPU:0");
  CHECK(full.job == "localhost");
  CHECK(full.type == DeviceType::kCPU);
  CHECK(full.index == 0);
  CHECK(full.full() == "/job:localhost/replica:0/task:0/device:CPU:0");
  CHECK(full.short_form() == "CPU:0");

  const auto short_gpu = DeviceName::parse("GPU:3");
  CHECK(short_gpu.type == DeviceType::kGPU);
  CHECK(short_gpu.index == 3);
  CHECK(DeviceName::parse("/device:GPU:1").index == 1);
  CHECK(DeviceName::parse("/cpu:2").index == 2);
  CHECK(DeviceName::parse("gpu:0").type == DeviceType::kGPU);

  const auto worker = DeviceName::parse("/job:worker/task:3/device:GPU:1");
  CHECK(worker.job == "worker");
  CHECK(worker.task == 3);
  CHECK(worker.replica == 0);
  CHECK(worker.full() == "/job:worker/replica:0/task:3/device:GPU:1");
}

TEST_CASE("malformed device names are rejected with the name and the expected form") {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "empty"},
      {"GPU0", "has no \":<index>\""},
      {"TPU:0", "unknown device type \"TPU\""},
      {"CPU:-1", "not a non-negative integer"},
      {"CPU:1x", "not a non-negative integer"},
      {"/job:localhost/replica:0/task:0", "names no device"},
      {"/job:localhost//device:CPU:0", "empty component"},
      {"/device:CPU:0/task:1", "must come last"},
      {"/task:1/job:worker/device:CPU:0", "repeated or out of order"},
      {"/job:9lives/device:CPU:0", "job name"},
      {"/host:a/device:CPU:0", "unknown component \"host\""},
      {"/job:worker/task:x/device:CPU:0", "task \"x\""},
  };
  for (const auto& [name, why] : bad) {
    CAPTURE(name);
    try {
      DeviceName::parse(name);
      FAIL("expected InvalidArgument");
    } catch (const InvalidArgument& e) {
      const std::string what = e.what();
      CHECK(what.find("malformed device name \"" + name + "\"") != std::string::npos);
      CHECK(what.find(why) != std::string::npos);
      CHECK(what.find("expected a name like") != std::string::npos);
    }
  }
}
