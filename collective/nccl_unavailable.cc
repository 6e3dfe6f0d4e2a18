// Builds without CUDA (or without NCCL): GPU groups are not available. Callers that pick a
// backend ask nccl_available() first; make_nccl_group and make_nccl_process_communicator say why
// they cannot.
#include "tandem/collective/nccl.h"
#include "tandem/collective/detail/nccl_process_options.h"

namespace tandem::collective {

namespace {

constexpr std::string_view kNoNccl =
    "this build of tandem has no NCCL (it was configured without CUDA, or without NCCL's library and header)";

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_nccl_group(const std::vector<int>& cuda_devices) {
  throw Unimplemented(fmt::format("make_nccl_group over {} GPU(s): {}", cuda_devices.size(), kNoNccl));
}

std::unique_ptr<Communicator> make_nccl_process_communicator(NcclProcessOptions options) {
  // Bad options are InvalidArgument in every build, as in builds with NCCL.
  detail::check_nccl_process_options(options);
  throw Unimplemented(
      fmt::format("make_nccl_process_communicator for rank {} of {} on CUDA device {}: {}; the Gloo communicator "
                  "(collective/gloo.h) connects processes without GPUs",
                  options.rank, options.size, options.cuda_device, kNoNccl));
}

bool nccl_available() { return false; }

}  // namespace tandem::collective
