#include <doctest/doctest.h>

#include <cstring>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <thread>

#include "tandem/base/errors.h"
#include "tandem/devices/device.h"
#include "tandem/graph/tensor.h"

using namespace tandem;
using devices::DeviceType;

TEST_CASE("logical CPU devices come from TANDEM_NUM_CPU_DEVICES and share the cores") {
  const auto cpus = devices::list_logical_devices(DeviceType::kCPU);
  REQUIRE(cpus.size() == 4);  // set by CTest for this suite
  for (int i = 0; i < 4; ++i) {
    CHECK(cpus[static_cast<std::size_t>(i)]->short_name() == fmt::format("CPU:{}", i));
    CHECK(cpus[static_cast<std::size_t>(i)]->full_name() ==
          fmt::format("/job:localhost/replica:0/task:0/device:CPU:{}", i));
    CHECK(cpus[static_cast<std::size_t>(i)]->intra_op_threads() == std::max(1, devices::usable_cpu_cores() / 4));
  }
  CHECK(&devices::get_device("/device:CPU:2") == cpus[2]);
  CHECK(&devices::get_device("/job:localhost/replica:0/task:0/device:CPU:3") == cpus[3]);
  CHECK(&devices::default_cpu_device() == cpus[0]);
}

TEST_CASE("configuring devices after they exist is refused") {
  devices::list_logical_devices();
  CHECK_THROWS_WITH_AS(devices::set_logical_device_configuration({.num_cpu_devices = 2}),
                       doctest::Contains("already created"), FailedPrecondition);
  CHECK_THROWS_AS(devices::set_logical_device_configuration({.num_cpu_devices = 0}), InvalidArgument);
}

TEST_CASE("unknown local devices are NotFound and list the local devices") {
  CHECK_THROWS_WITH_AS(devices::get_device("CPU:9"), doctest::Contains("local devices: CPU:0, CPU:1, CPU:2, CPU:3"),
                       NotFound);
  CHECK_THROWS_AS(devices::get_device("/job:worker/task:1/device:CPU:0"), NotFound);
  CHECK_THROWS_AS(devices::get_device("CPU"), InvalidArgument);
}

TEST_CASE("no CUDA driver here means zero GPUs, and GPU names are NotFound, never a crash") {
  // This machine class has the toolkit but no driver or device; a build without CUDA says so too.
  if (devices::num_gpus() == 0) {
    CHECK(devices::list_logical_devices(DeviceType::kGPU).empty());
    CHECK_FALSE(devices::gpu_discovery_message().empty());
    CHECK_THROWS_WITH_AS(devices::get_device("GPU:0"), doctest::Contains("GPUs:"), NotFound);
    MESSAGE("GPU discovery: ", devices::gpu_discovery_message());
  } else {
    MESSAGE("GPUs present: ", devices::gpu_discovery_message());
  }
}

TEST_CASE("the allocator is aligned and counts current and peak bytes") {
  auto& device = devices::get_device("CPU:1");
  auto& allocator = device.allocator();
  const auto before = allocator.stats();
  allocator.reset_peak_bytes_in_use();
  {
    auto a = Tensor::empty({1000}, kFloat32, device);
    auto b = Tensor::empty({10}, kFloat64, device);
    CHECK(reinterpret_cast<std::uintptr_t>(a.raw_data()) % devices::kDefaultAlignmentBytes == 0);
    CHECK(reinterpret_cast<std::uintptr_t>(b.raw_data()) % devices::kDefaultAlignmentBytes == 0);
    CHECK(allocator.stats().bytes_in_use == before.bytes_in_use + 4080);
  }
  const auto after = allocator.stats();
  CHECK(after.bytes_in_use == before.bytes_in_use);
  CHECK(after.peak_bytes_in_use >= before.bytes_in_use + 4080);
  CHECK(after.num_allocations == before.num_allocations + 2);
}

TEST_CASE("an impossible allocation is ResourceExhausted naming the device") {
  auto& device = devices::get_device("CPU:0");
  CHECK_THROWS_WITH_AS(device.allocator().allocate(std::size_t{1} << 62),
                       doctest::Contains("CPU:0: out of host memory"), ResourceExhausted);
}

TEST_CASE("a CPU allocator with a memory limit refuses what would pass it, naming device and limit") {
  devices::CpuAllocator allocator("CPU:7", 1000);
  void* a = allocator.allocate(600);
  try {
    (void)allocator.allocate(600);
    FAIL("expected ResourceExhausted");
  } catch (const ResourceExhausted& e) {
    const std::string message = e.what();
    CHECK(message.find("CPU:7") != std::string::npos);
    CHECK(message.find("600 bytes") != std::string::npos);
    CHECK(message.find("limit of 1000 bytes") != std::string::npos);
  }
  CHECK(allocator.stats().bytes_in_use == 600);  // the refused request took nothing
  void* b = allocator.allocate(400);             // exactly at the limit is allowed
  allocator.deallocate(a, 600);
  allocator.deallocate(b, 400);
  void* c = allocator.allocate(1000);
  allocator.deallocate(c, 1000);
  devices::LogicalDeviceConfiguration negative{.memory_limit_bytes = -1};
  CHECK_THROWS_AS(devices::set_logical_device_configuration(negative), InvalidArgument);
}

TEST_CASE("CPU devices: one inline stream, events already reached, pinned staging and async copies done at once") {
  auto& cpu = devices::default_cpu_device();
  CHECK(&cpu.communication_stream() == &cpu.compute_stream());
  auto event = cpu.create_event();
  event->record(cpu.compute_stream());
  event->wait(cpu.communication_stream());
  CHECK(event->done());
  event->synchronize();
  devices::PinnedHostBuffer staging(cpu, 1000);
  CHECK(staging.bytes() == 1000);
  CHECK(reinterpret_cast<std::uintptr_t>(staging.data()) % devices::kDefaultAlignmentBytes == 0);
  std::vector<std::uint8_t> source(1000);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = static_cast<std::uint8_t>(i * 7);
  cpu.copy_from_host_async(staging.data(), source.data(), source.size(), cpu.compute_stream());
  CHECK(std::memcmp(staging.data(), source.data(), source.size()) == 0);
  devices::PinnedHostBuffer moved = std::move(staging);
  CHECK(staging.data() == nullptr);
  CHECK(moved.bytes() == 1000);
  const auto stats = cpu.allocator().stats();
  CHECK(stats.bytes_reserved == stats.bytes_in_use);  // nothing cached on CPUs
}

TEST_CASE("copies between devices and tensor helpers") {
  auto& d0 = devices::get_device("CPU:0");
  auto& d1 = devices::get_device("CPU:1");
  auto t = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3}, d0);
  auto u = t.to(d1);
  CHECK(&u.device() == &d1);
  CHECK(u.to_vector<float>() == t.to_vector<float>());
  CHECK(t.to(d0).raw_data() == t.raw_data());
  auto v = t.reshape({3, 2});
  CHECK(v.raw_data() == t.raw_data());
  CHECK(v.shape() == Shape{3, 2});
  CHECK_THROWS_WITH_AS(t.reshape({4, 2}), doctest::Contains("cannot reshape a tensor of shape (2, 3)"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(t.data<double>(), doctest::Contains("has dtype float32; it was read as float64"),
                       InvalidArgument);
  auto c = t.clone();
  c.data<float>()[0] = 9;
  CHECK(t.to_vector<float>()[0] == 1);
  CHECK(Tensor::scalar<double>(2.5).item<double>() == 2.5);
  CHECK(t.to_string() == "Tensor(shape=(2, 3), dtype=float32, device=CPU:0, [[1, 2, 3], [4, 5, 6]])");
  CHECK_THROWS_AS(Tensor::empty({-1, 3}, kFloat32), InvalidArgument);
}

TEST_CASE("parallel_for covers the range once, propagates exceptions, and nests inline") {
  devices::LogicalDeviceConfiguration unused;  // (documented defaults compile)
  (void)unused;
  for (auto* device : devices::list_logical_devices(DeviceType::kCPU)) {
    std::vector<std::atomic<int>> hits(100000);
    device->parallel_for(100000, 1000, [&](std::int64_t b, std::int64_t e) {
      for (auto i = b; i < e; ++i) hits[static_cast<std::size_t>(i)]++;
    });
    CHECK(std::all_of(hits.begin(), hits.end(), [](const std::atomic<int>& h) { return h.load() == 1; }));
    CHECK_THROWS_WITH(device->parallel_for(1000, 1,
                                           [](std::int64_t b, std::int64_t) {
                                             if (b == 0) throw InvalidArgument("chunk failed");
                                           }),
                      "chunk failed");
    std::atomic<std::int64_t> total{0};
    device->parallel_for(8, 1, [&](std::int64_t b, std::int64_t e) {
      device->parallel_for(1000, 1, [&](std::int64_t ib, std::int64_t ie) { total += (ie - ib) * (e - b); });
    });
    CHECK(total.load() == 8000);
  }
}

TEST_CASE("concurrent callers on one device each finish their own work") {
  auto& device = devices::default_cpu_device();
  std::atomic<std::int64_t> sum{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int round = 0; round < 50; ++round) {
        device.parallel_for(10000, 100, [&](std::int64_t b, std::int64_t e) { sum += e - b; });
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(sum.load() == 4 * 50 * 10000);
}
