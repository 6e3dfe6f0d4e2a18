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
    CHECK_THROWS_WITH_AS(gpu->allocator().allocate(std::size_t{1} << 52), doctest::Contains("out of memory allocating"),
                         ResourceExhausted);
    // The device still works afterwards.
    CHECK(Tensor::from_vector<float>({1, 2}, {2}, *gpu).to_vector<float>() == std::vector<float>{1, 2});
  }
}

TEST_CASE("the caching allocator reuses freed GPU blocks; empty_cache gives them back") {
  for (auto* gpu : devices::list_logical_devices(devices::DeviceType::kGPU)) {
    gpu->allocator().empty_cache();
    const auto before = gpu->allocator().stats();
    void* a = gpu->allocator().allocate(3 << 20);
    gpu->allocator().deallocate(a, 3 << 20);
    void* b = gpu->allocator().allocate(3 << 20);
    CHECK(b == a);
    const auto held = gpu->allocator().stats();
    CHECK(held.bytes_reserved >= held.bytes_in_use);
    gpu->allocator().deallocate(b, 3 << 20);
    gpu->allocator().empty_cache();
    CHECK(gpu->allocator().stats().bytes_reserved == before.bytes_reserved);
  }
}

TEST_CASE("an asynchronous copy from pinned memory on the communication stream, ordered by an event") {
  for (auto* gpu : devices::list_logical_devices(devices::DeviceType::kGPU)) {
    constexpr std::int64_t kElements = 1 << 22;
    devices::PinnedHostBuffer staging(*gpu, kElements * sizeof(float));
    auto* host = static_cast<float*>(staging.data());
    for (std::int64_t i = 0; i < kElements; ++i) host[i] = static_cast<float>(i % 1000);
    Tensor target = Tensor::empty({kElements}, kFloat32, *gpu);
    gpu->copy_from_host_async(target.raw_data(), host, staging.bytes(), gpu->communication_stream());
    auto copied = gpu->create_event();
    copied->record(gpu->communication_stream());
    copied->wait(gpu->compute_stream());  // what the compute stream does next sees the copy
    copied->synchronize();
    CHECK(copied->done());
    const auto back = target.to_vector<float>();
    CHECK(back[0] == 0.0f);
    CHECK(back[999] == 999.0f);
    CHECK(back[kElements - 1] == static_cast<float>((kElements - 1) % 1000));
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
