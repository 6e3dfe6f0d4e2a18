// tandem/ops/cuda/kernel_util.h — what the GPU kernels' host side shares (cuda_kernels.cc,
// array_cuda_kernels.cc): the launch stream, launch checks, dtype checks, and the deferred report
// of a bad id that a kernel found on the device.
//
// Host C++ only. check_launch throws Internal naming the node; require_types throws
// InvalidArgument; the deferred check of defer_bad_id_check throws what its report throws.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "tandem/base/errors.h"
#include "tandem/graph/op_registry.h"
#include "tandem/ops/cuda/launchers.h"

namespace tandem::ops::cuda {

inline ElementType type_of(const graph::Tensor& t) { return static_cast<ElementType>(t.dtype()); }
inline cudaStream_t stream_of(graph::KernelContext& ctx) {
  return static_cast<cudaStream_t>(ctx.device().compute_stream().native_handle());
}

// Launch errors (a bad configuration, a missing sm_90 image) surface here, naming the node.
inline void check_launch(graph::KernelContext& ctx) {
  const cudaError_t status = last_launch_error();
  if (status != cudaSuccess) [[unlikely]] {
    throw Internal(fmt::format("{}: CUDA kernel launch failed on {}: {} ({})", ctx.label(), ctx.device().short_name(),
                               cudaGetErrorName(status), cudaGetErrorString(status)));
  }
}

inline void require_types(graph::KernelContext& ctx, const graph::Tensor& t,
                          std::initializer_list<graph::DType> accepted) {
  if (std::find(accepted.begin(), accepted.end(), t.dtype()) != accepted.end()) return;
  graph::detail::throw_unsupported_dtype(fmt::format("{} on {}", ctx.label(), ctx.device().short_name()), t.dtype(),
                                         accepted);
}
inline constexpr std::initializer_list<graph::DType> kFloat = {graph::DType::kF32, graph::DType::kF64,
                                                               graph::DType::kF16, graph::DType::kBF16};
inline constexpr std::initializer_list<graph::DType> kNumeric = {graph::DType::kF32, graph::DType::kF64,
                                                                 graph::DType::kF16, graph::DType::kBF16,
                                                                 graph::DType::kI32, graph::DType::kI64};

// Bad ids found on the device (a label outside the classes, an index outside params' rows): the
// kernel lowers a flag in this node's scratch memory (slot `slot`, preset here to `n`) to the
// smallest bad position, and a check deferred until the step is queued reads it back and calls
// report(position, id), which throws. The kernel itself never waits, so it can be recorded in a
// CUDA graph. Returns the flag for the launcher (unsigned long long for atomicMin).
template <class Report>
unsigned long long* defer_bad_id_check(graph::KernelContext& ctx, std::size_t slot, const graph::Tensor& ids,
                                       std::int64_t n, Report report) {
  graph::Tensor& flag = ctx.scratch(slot, {1}, graph::DType::kI64);
  fill(ElementType::kI64, static_cast<double>(n), flag.raw_data(), 1, stream_of(ctx));
  check_launch(ctx);
  devices::Device* device = &ctx.device();
  const void* flag_data = flag.raw_data();
  const void* id_data = ids.raw_data();
  const bool narrow = ids.dtype() == graph::DType::kI32;
  ctx.defer([=, report = std::move(report)] {
    std::int64_t first_bad = n;
    device->copy_to_host(&first_bad, flag_data, sizeof(first_bad));  // waits for the kernel
    if (first_bad == n) return;
    std::int64_t id = 0;
    if (narrow) {
      std::int32_t value = 0;
      device->copy_to_host(&value, static_cast<const std::int32_t*>(id_data) + first_bad, sizeof(value));
      id = value;
    } else {
      device->copy_to_host(&id, static_cast<const std::int64_t*>(id_data) + first_bad, sizeof(id));
    }
    report(first_bad, id);
  });
  return static_cast<unsigned long long*>(flag.raw_data());
}

}  // namespace tandem::ops::cuda
