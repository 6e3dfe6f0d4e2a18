#include "tandem/strategy/cross_device_ops.h"

#include <algorithm>

#include "tandem/base/errors.h"
#include "tandem/collective/in_process.h"
#include "tandem/collective/nccl.h"
#include "tandem/graph/dtype.h"

namespace tandem::strategy {

Tensor reduce_on_host(collective::ReduceOp op, std::span<const Tensor> values, std::string_view what) {
  TANDEM_REQUIRE(!values.empty(), InvalidArgument, "{}: no values to reduce", what);
  auto& host = devices::default_cpu_device();
  Tensor result = values.front().to(host).clone();
  graph::dispatch<graph::NumericTypes>(result.dtype(), what, [&]<class T>() {
    T* out = result.data<T>();
    const auto n = result.num_elements();
    for (std::size_t r = 1; r < values.size(); ++r) {
      TANDEM_REQUIRE(values[r].shape() == result.shape() && values[r].dtype() == result.dtype(), InvalidArgument,
                     "{}: replica {}'s {} {} does not match replica 0's {} {}", what, r, values[r].dtype(),
                     values[r].shape(), result.dtype(), result.shape());
      const Tensor other = values[r].to(host);
      const T* in = other.data<T>();
      for (std::int64_t i = 0; i < n; ++i) {
        switch (op) {
          case collective::ReduceOp::kSum:
          case collective::ReduceOp::kMean: out[i] += in[i]; break;
          case collective::ReduceOp::kMax: out[i] = std::max(out[i], in[i]); break;
          case collective::ReduceOp::kMin: out[i] = std::min(out[i], in[i]); break;
        }
      }
    }
    if (op == collective::ReduceOp::kMean) {
      for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(out[i] / static_cast<T>(values.size()));
    }
  });
  return result;
}

namespace {

// One rank of a ReductionToOneDevice group: all_reduce gathers on rank 0's thread; every other
// collective is the underlying in-process group's (it synchronises, times out and aborts).
class ReduceToOneCommunicator final : public collective::Communicator {
 public:
  struct Shared {
    std::vector<std::span<Tensor>> published;  // each rank's tensors of the current all_reduce
  };
  ReduceToOneCommunicator(std::unique_ptr<collective::Communicator> inner, std::shared_ptr<Shared> shared)
      : inner_(std::move(inner)), shared_(std::move(shared)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::uint64_t sequence_number() const override { return inner_->sequence_number(); }
  std::string_view backend() const override { return "reduction-to-one-device"; }

 protected:
  void do_all_reduce(std::span<Tensor> tensors, collective::ReduceOp op, const collective::CallOptions& options) override {
    shared_->published[static_cast<std::size_t>(rank())] = tensors;
    inner_->barrier(options);  // every rank has published (or the group failed: that throws)
    std::exception_ptr error;
    if (rank() == 0) {
      try {
        reduce_published(op);
      } catch (...) {
        error = std::current_exception();
        inner_->abort("ReductionToOneDevice: the reduction on rank 0 failed");
      }
    }
    inner_->barrier(options);  // nobody returns while rank 0 still reads or writes its tensors
    if (error) std::rethrow_exception(error);
  }
  void do_broadcast(Tensor& tensor, int root, const collective::CallOptions& options) override {
    inner_->broadcast(tensor, root, options);
  }
  void do_all_gather(const Tensor& input, Tensor& output, const collective::CallOptions& options) override {
    inner_->all_gather(input, output, options);
  }
  void do_reduce_scatter(const Tensor& input, Tensor& output, collective::ReduceOp op,
                      const collective::CallOptions& options) override {
    inner_->reduce_scatter(input, output, op, options);
  }
  void do_barrier(const collective::CallOptions& options) override { inner_->barrier(options); }
 public:
  void abort(const std::string& reason) override { inner_->abort(reason); }

 private:
  void reduce_published(collective::ReduceOp op) {
    const auto& published = shared_->published;
    for (std::size_t r = 1; r < published.size(); ++r) {
      TANDEM_REQUIRE(published[r].size() == published[0].size(), InvalidArgument,
                     "ReductionToOneDevice all_reduce #{}: rank {} passed {} tensors, rank 0 passed {}",
                     sequence_number(), r, published[r].size(), published[0].size());
    }
    std::vector<Tensor> values(published.size());
    for (std::size_t k = 0; k < published[0].size(); ++k) {
      for (std::size_t r = 0; r < published.size(); ++r) values[r] = published[r][k];
      const Tensor reduced =
          reduce_on_host(op, values, fmt::format("ReductionToOneDevice all_reduce #{}", sequence_number()));
      for (std::size_t r = 0; r < published.size(); ++r) published[r][k].copy_from(reduced);
    }
  }

  std::unique_ptr<collective::Communicator> inner_;
  std::shared_ptr<Shared> shared_;
};

}  // namespace

std::vector<std::unique_ptr<collective::Communicator>> InProcessAllReduce::make_group(
    const std::vector<devices::Device*>& devices) const {
  for (auto* d : devices) {
    // One replica exchanges nothing: any device will do.
    TANDEM_REQUIRE(devices.size() == 1 || d->host_accessible(), InvalidArgument,
                   "InProcessAllReduce reduces host memory; {} is not a CPU device (use NcclAllReduce for GPUs)",
                   d->short_name());
  }
  return collective::make_in_process_group(static_cast<int>(devices.size()));
}

std::vector<std::unique_ptr<collective::Communicator>> NcclAllReduce::make_group(
    const std::vector<devices::Device*>& devices) const {
  std::vector<int> ordinals;
  for (auto* d : devices) {
    TANDEM_REQUIRE(d->type() == devices::DeviceType::kGPU, InvalidArgument,
                   "NcclAllReduce needs GPU devices; {} is not one (use InProcessAllReduce for CPUs)", d->short_name());
    ordinals.push_back(d->index());
  }
  return collective::make_nccl_group(ordinals);
}

std::vector<std::unique_ptr<collective::Communicator>> ReductionToOneDevice::make_group(
    const std::vector<devices::Device*>& devices) const {
  auto inner = collective::make_in_process_group(static_cast<int>(devices.size()));
  auto shared = std::make_shared<ReduceToOneCommunicator::Shared>();
  shared->published.resize(devices.size());
  std::vector<std::unique_ptr<collective::Communicator>> group;
  for (auto& communicator : inner) {
    group.push_back(std::make_unique<ReduceToOneCommunicator>(std::move(communicator), shared));
  }
  return group;
}

std::shared_ptr<CrossDeviceOps> choose_cross_device_ops(const std::vector<devices::Device*>& devices) {
  const bool all_gpus = std::all_of(devices.begin(), devices.end(),
                                    [](const devices::Device* d) { return d->type() == devices::DeviceType::kGPU; });
  if (all_gpus && collective::nccl_available()) return std::make_shared<NcclAllReduce>();
  return std::make_shared<InProcessAllReduce>();
}

}  // namespace tandem::strategy
