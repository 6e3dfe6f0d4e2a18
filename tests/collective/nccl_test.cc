// What the NCCL group has beyond the Communicator contract (contract/ checks every collective and
// failure on it, on as many GPUs as the machine has): the checks of its devices, and of a tensor's
// device. Where no GPU is usable, or the build has no NCCL, the program exits 77, which CTest
// reports as skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "tandem/collective/nccl.h"
#include "tandem/devices/device.h"

using namespace tandem;
using namespace tandem::collective;

namespace {

constexpr int kSkipped = 77;  // CTest's SKIP_RETURN_CODE for this suite

}  // namespace

TEST_CASE("make_nccl_group checks its devices") {
  CHECK(nccl_available());
  CHECK_THROWS_AS(make_nccl_group({}), InvalidArgument);
  CHECK_THROWS_WITH_AS(make_nccl_group({devices::num_gpus()}), doctest::Contains("there is no CUDA device"),
                       InvalidArgument);
  if (devices::num_gpus() >= 2)
    CHECK_THROWS_WITH_AS(make_nccl_group({1, 1}), doctest::Contains("listed twice"), InvalidArgument);
}

TEST_CASE("a tensor in host memory is refused, and (the rank never issued the collective) fails the group") {
  auto group = make_nccl_group({0});
  Communicator& comm = *group[0];
  Tensor host = Tensor::zeros({4}, kFloat32);
  CHECK_THROWS_WITH_AS(
      comm.all_reduce(host, ReduceOp::kSum),
      "all_reduce #0 on rank 0 of 1 (GPU:0): tensor 0 of 1 is on CPU:0; this rank's communicator runs on GPU:0",
      InvalidArgument);
  CHECK_THROWS_WITH_AS(comm.barrier(), doctest::Contains("barrier #1: the group failed"), Unavailable);
}

int main(int argc, char** argv) {
  if (devices::num_gpus() == 0) {
    std::printf("skipped: no GPU (%s)\n", devices::gpu_discovery_message().c_str());
    return kSkipped;
  }
  try {
    make_nccl_group({0});
  } catch (const Unimplemented& e) {
    std::printf("skipped: %s\n", e.what());
    return kSkipped;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
