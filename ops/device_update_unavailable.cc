// Builds without CUDA: no tensor ever lives in GPU memory, so these are never reached in practice.
#include "tandem/base/errors.h"
#include "tandem/ops/detail/device_update.h"

namespace tandem::ops::detail {

void apply_update_on_device(devices::Device& device, graph::DType /*dtype*/, const UpdateParams& /*params*/,
                            std::span<const UpdateTensor> /*tensors*/, const ParamsInMemory& /*in_memory*/) {
  throw Unimplemented(fmt::format("optimizer updates on {}: tandem was built without CUDA", device.short_name()));
}
double squared_norm_on_device(const graph::Tensor& t) {
  throw Unimplemented(fmt::format("gradient norms on {}: tandem was built without CUDA", t.device().short_name()));
}
bool all_finite_on_device(std::span<const graph::Tensor> tensors) {
  throw Unimplemented(fmt::format("finiteness checks on {}: tandem was built without CUDA",
                                  tensors.empty() ? std::string("a GPU") : tensors.front().device().short_name()));
}

void convert_on_device(devices::Device& device, const void* /*from*/, graph::DType /*from_dtype*/, void* /*to*/,
                       graph::DType /*to_dtype*/, std::int64_t /*n*/) {
  throw Unimplemented(fmt::format("conversions on {}: tandem was built without CUDA", device.short_name()));
}

}  // namespace tandem::ops::detail
