// tandem/strategy/cross_device_ops.h — how a strategy's replicas reduce across devices.
//
// Named as in TensorFlow. A CrossDeviceOps makes the communicator group the replicas use for
// gradient all-reduce; MirroredStrategy picks one as TF does (NCCL when every device is a GPU,
// else the in-process reduction), or takes the one a user passes.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/collective/communicator.h"
#include "tandem/devices/device.h"

namespace tandem::strategy {

class CrossDeviceOps {
 public:
  virtual ~CrossDeviceOps() = default;
  virtual std::string name() const = 0;
  // One communicator per replica device (rank i for devices[i]). Throws InvalidArgument when the
  // devices are of a kind this implementation cannot serve.
  virtual std::vector<std::unique_ptr<collective::Communicator>> make_group(
      const std::vector<devices::Device*>& devices) const = 0;
};

// Replicas that are threads of this process on CPU devices: shared memory, each replica reducing
// its own chunk of every buffer (collective::make_in_process_group).
class InProcessAllReduce final : public CrossDeviceOps {
 public:
  std::string name() const override { return "InProcessAllReduce"; }
  std::vector<std::unique_ptr<collective::Communicator>> make_group(
      const std::vector<devices::Device*>& devices) const override;
};

// GPU replicas of this process through NCCL (builds with CUDA and NCCL).
class NcclAllReduce final : public CrossDeviceOps {
 public:
  std::string name() const override { return "NcclAllReduce"; }
  std::vector<std::unique_ptr<collective::Communicator>> make_group(
      const std::vector<devices::Device*>& devices) const override;
};

// TF's ReductionToOneDevice: every replica's tensors are copied to one device (the host), reduced
// there by one thread, and the result copied back to every replica. Works for any mix of
// devices, at the cost of all traffic passing through one place; the reference the other
// implementations are tested against, and the fallback for devices no other one serves.
// (TF's HierarchicalCopyAllReduce is a DGX-1 topology trick between 8 GPUs; it has no use on the
// machines tandem targets and is not provided.)
class ReductionToOneDevice final : public CrossDeviceOps {
 public:
  std::string name() const override { return "ReductionToOneDevice"; }
  std::vector<std::unique_ptr<collective::Communicator>> make_group(
      const std::vector<devices::Device*>& devices) const override;
};

// The element-wise reduction of equal-shaped tensors, computed on the host in replica order;
// throws InvalidArgument naming `what` when shapes or dtypes differ. Used by Strategy::reduce and
// ReductionToOneDevice.
Tensor reduce_on_host(collective::ReduceOp op, std::span<const Tensor> values, std::string_view what);

// TF's choice for a set of devices: NCCL when all are GPUs, otherwise the in-process reduction.
std::shared_ptr<CrossDeviceOps> choose_cross_device_ops(const std::vector<devices::Device*>& devices);

}  // namespace tandem::strategy
