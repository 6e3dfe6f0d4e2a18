// Builds without CUDA (or without NCCL): GPU groups are not available. Callers that pick a
// backend ask nccl_available() first; make_nccl_group says why it cannot.
#include "tandem/collective/communicator.h"

namespace tandem::collective {

std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>& cuda_devices) {
  throw Unimplemented(fmt::format(
      "make_nccl_group over {} GPU(s): this build of tandem has no NCCL (it was configured without CUDA, or "
      "without NCCL's library and header)",
      cuda_devices.size()));
}

bool nccl_available() { return false; }

}  // namespace tandem::collective
