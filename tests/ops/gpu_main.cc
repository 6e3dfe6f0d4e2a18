// ops_gpu_test's main: the op cases run with the GPU comparison of op_test_harness.cc
// (TANDEM_OP_TEST_GPU). Where no GPU is usable the program exits 77, which CTest reports as skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "tandem/devices/device.h"

int main(int argc, char** argv) {
  if (tandem::devices::num_gpus() == 0) {
    std::printf("skipped: no GPU (%s)\n", tandem::devices::gpu_discovery_message().c_str());
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
