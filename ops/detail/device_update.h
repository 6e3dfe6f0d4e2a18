// tandem/ops/detail/device_update.h — optimizer steps, gradient checks and conversions on tensors in
// GPU memory.
//
// keras_like's Optimizer calls these when its variables live on a GPU. CUDA builds implement them
// with one fused kernel launch per kMaxUpdateTensors tensors (ops/cuda/kernels.cu, the update
// rules of update_rules.h that the CPU loops use too); other builds throw Unimplemented. Every
// call queues work on the device's compute stream; the reads (norm, finiteness) then wait for it.
#pragma once

#include <span>

#include "tandem/graph/tensor.h"
#include "tandem/ops/detail/update_rules.h"

namespace tandem::ops::detail {

// Where a launch recorded in a CUDA graph reads what changes from step to step (both in the
// device's memory, or null): the UpdateParams (then `params` passed by value is ignored), and the
// step's fault word (graph::KernelContext::fault_word): non-zero, the update leaves every tensor
// as it was.
struct ParamsInMemory {
  const void* params = nullptr;
  const void* fault_word = nullptr;
};
void apply_update_on_device(devices::Device& device, graph::DType dtype, const UpdateParams& params,
                            std::span<const UpdateTensor> tensors, const ParamsInMemory& in_memory = {});
// Sum of squares of the elements (blocks until known).
double squared_norm_on_device(const graph::Tensor& t);
// Whether every element of every tensor is finite (blocks until known).
bool all_finite_on_device(std::span<const graph::Tensor> tensors);
// Converts n elements of device memory between dtypes (rounding to nearest even), queued on the
// device's compute stream: gradient compression's narrowing and widening.
void convert_on_device(devices::Device& device, const void* from, graph::DType from_dtype, void* to,
                       graph::DType to_dtype, std::int64_t n);

}  // namespace tandem::ops::detail
