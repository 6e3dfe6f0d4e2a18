// GPU device tests. Where no GPU is usable the program exits 77, which CTest reports as skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "tandem/devices/device.h"
#include "tandem/graph/tensor.h"

using namespace tandem;

namespace {
constexpr int kSkipped = 77;  // CTest's SKIP_RETURN_CODE for this suite
}

TEST_CASE("host -> GPU -> GPU -> host round trip on every GPU") {
  for (auto* gpu : devices::list_logical_devices(devices::DeviceType::kGPU)) {
    CAPTURE(gpu->full_name());
    CHECK_FALSE(gpu->host_accessible());
    std::vector<float> values(1 << 20);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.5f;
    const auto before = gpu->allocator().stats();
    {
      auto on_gpu = Tensor::from_vector<float>(values, {1 << 20}, *gpu);
      auto copy = on_gpu.clone();
      CHECK(copy.to_vector<float>() == values);
      CHECK(gpu->allocator().stats().bytes_in_use == before.bytes_in_use + 2 * (4 << 20));
      CHECK_THROWS_AS(on_gpu.data<float>(), FailedPrecondition);
      auto zeros = Tensor::zeros({16}, kFloat32, *gpu);
      CHECK(zeros.to_vector<float>() == std::vector<float>(16, 0.0f));
    }
    CHECK(gpu->allocator().stats().bytes_in_use == before.bytes_in_use);
    gpu->synchronize();
  }
}

TEST_CASE("an impossible GPU allocation is ResourceExhausted with free bytes") {
  for (auto* gpu : devices::list_logical_devices(devices::DeviceType::kGPU)) {
    CHECK_THROWS_WITH_AS(gpu->allocator().allocate(std::size_t{1} << 52), doctest::Contains("out of GPU memory"),
                         ResourceExhausted);
    // The device still works afterwards.
    CHECK(Tensor::from_vector<float>({1, 2}, {2}, *gpu).to_vector<float>() == std::vector<float>{1, 2});
  }
}

int main(int argc, char** argv) {
  if (devices::num_gpus() == 0) {
    std::printf("skipped: no GPU (%s)\n", devices::gpu_discovery_message().c_str());
    return kSkipped;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
