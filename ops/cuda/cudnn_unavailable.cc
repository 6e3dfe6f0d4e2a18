// Builds without cuDNN's header (or without CUDA): convolution and pooling always run on tandem's
// own kernels; cudnn_status() says why. The GPU kernels ask cudnn_enabled() first, so the calls
// below are never reached; they throw rather than return something plausible.
#include <atomic>

#include "tandem/base/errors.h"
#include "tandem/ops/cuda/cudnn.h"

namespace tandem::ops::cuda {
namespace {

#if TANDEM_HAVE_CUDA
constexpr std::string_view kNoCudnn =
    "not built: CMake found no cuDNN 9 cudnn.h (in the CUDA toolkit or -DTANDEM_CUDNN_INCLUDE_DIR, e.g. "
    "site-packages/nvidia/cudnn/include)";
#else
constexpr std::string_view kNoCudnn = "not built: this build of tandem has no CUDA";
#endif

std::atomic<std::uint64_t> fallback_runs{0};

[[noreturn]] void unavailable(std::string_view call, const CudnnTarget& target) {
  throw FailedPrecondition(fmt::format("{} on {}: cuDNN is {}", call, target.device_name, kNoCudnn));
}

}  // namespace

std::string cudnn_status() { return std::string(kNoCudnn); }

bool cudnn_enabled() { return false; }

CudnnPathCounts cudnn_path_counts() { return {0, fallback_runs.load()}; }

void count_cudnn_path(bool used_cudnn) {
  if (!used_cudnn) fallback_runs.fetch_add(1, std::memory_order_relaxed);
}

std::optional<std::size_t> cudnn_conv_prepare(const CudnnTarget& target, CudnnConvDirection, const detail::CudnnPlan&) {
  unavailable("cudnn_conv_prepare", target);
}

void cudnn_conv(const CudnnTarget& target, CudnnConvDirection, const detail::CudnnPlan&, const void*, const void*,
                void*, void*, std::size_t) {
  unavailable("cudnn_conv", target);
}

void cudnn_pool_forward(const CudnnTarget& target, const detail::CudnnPlan&, const void*, void*) {
  unavailable("cudnn_pool_forward", target);
}

void cudnn_avg_pool_backward(const CudnnTarget& target, const detail::CudnnPlan&, const void*, const void*, void*) {
  unavailable("cudnn_avg_pool_backward", target);
}

}  // namespace tandem::ops::cuda
