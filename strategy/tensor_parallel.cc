// Megatron's f and g operators: the ops "TensorParallelCopy" (a view forward; its gradient is
// "TensorParallelAllReduce") and "TensorParallelAllReduce" (its gradient is the identity), and
// the registry through which their kernels find a device's communicator.
#include "tandem/strategy/tensor_parallel.h"

#include <atomic>
#include <map>
#include <mutex>

#include "tandem/base/errors.h"
#include "tandem/collective/in_process.h"
#include "tandem/graph/op_registry.h"
#include "tandem/ops/ops.h"

namespace tandem::strategy::tensor_parallel {
namespace {

constexpr const char* kCopyOp = "TensorParallelCopy";
constexpr const char* kAllReduceOp = "TensorParallelAllReduce";
constexpr const char* kMaxOp = "TensorParallelMax";
constexpr const char* kGatherOp = "TensorParallelAllGather";  // along dimension 0
constexpr const char* kOwnPartOp = "TensorParallelOwnPart";   // this device's rows of dimension 0
constexpr const char* kShiftOp = "TensorParallelShiftByRank";  // integer ids - rank x rows

// The live groups by id: a kernel's attribute names its group by id (attributes hold values, not
// pointers), and a destroyed group's id is refused rather than read after it is freed.
struct Registry {
  std::mutex mutex;
  std::map<std::int64_t, const Group*> groups;
  std::atomic<std::int64_t> next_id{1};
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: groups may outlive static destruction order
  return *r;
}

const Group& find_group(std::int64_t id, const std::string& label) {
  std::lock_guard lock(registry().mutex);
  const auto it = registry().groups.find(id);
  TANDEM_REQUIRE(it != registry().groups.end(), FailedPrecondition,
                 "{}: its tensor-parallel group {} no longer exists (keep the Group alive while executors run "
                 "graphs that use it)",
                 label, id);
  return *it->second;
}

std::vector<graph::TensorSpec> same_as_input(graph::ShapeContext& ctx) {
  ctx.require_float(0);
  return {ctx.input(0)};
}

std::vector<graph::Output> all_reduce_of_grad(graph::GradContext& ctx);
std::vector<graph::Output> identity_grad(graph::GradContext& ctx) { return {ctx.grad(0)}; }

graph::Output add_op(graph::Output x, const char* op, std::int64_t group) {
  TANDEM_REQUIRE(x.defined(), InvalidArgument, "{}: the input is undefined", op);
  ops::register_all();
  return x.graph->add(op, {x}, graph::Attrs{{"group", group}});
}

std::vector<graph::Output> all_reduce_of_grad(graph::GradContext& ctx) {
  return {add_op(ctx.grad(0), kAllReduceOp, ctx.attrs().get_int("group"))};
}

// Combines the group's copies: output = input, then all-reduced in place.
template <collective::ReduceOp kOp>
void all_reduce_kernel(graph::KernelContext& ctx) {
  const Group& group = find_group(ctx.attrs().get_int("group"), ctx.label());
  Tensor& out = ctx.output(0);
  ctx.device().copy_on_device(out.raw_data(), ctx.input(0).raw_data(), out.nbytes());
  group.communicator(ctx.device()).all_reduce(out, kOp);
}

// Dimension 0 times the group's size.
std::vector<graph::TensorSpec> gathered_shape(graph::ShapeContext& ctx) {
  ctx.require_float(0);
  graph::TensorSpec out = ctx.input(0);
  ctx.require(out.shape.rank() >= 1, "needs at least one dimension; got {}", out.shape);
  if (out.shape[0] != Shape::kUnknown) out.shape[0] *= ctx.attrs().get_int("size");
  return {out};
}

// Dimension 0 divided by the group's size (which must divide it).
std::vector<graph::TensorSpec> own_part_shape(graph::ShapeContext& ctx) {
  ctx.require_float(0);
  graph::TensorSpec out = ctx.input(0);
  ctx.require(out.shape.rank() >= 1, "needs at least one dimension; got {}", out.shape);
  const std::int64_t size = ctx.attrs().get_int("size");
  if (out.shape[0] != Shape::kUnknown) {
    ctx.require(out.shape[0] % size == 0, "dimension 0 ({}) must divide by the group's {} devices", out.shape[0], size);
    out.shape[0] /= size;
  }
  return {out};
}

graph::Output add_sized_op(graph::Output x, const char* op, const Group& group) {
  ops::register_all();
  return x.graph->add(op, {x}, graph::Attrs{{"group", group.id()}, {"size", group.size()}});
}

// The gather and the own part are each other's gradients: backward of a gather takes this
// device's rows of the gradient; backward of taking them gathers every device's.
std::vector<graph::Output> own_part_of_grad(graph::GradContext& ctx) {
  return {ctx.grad(0).graph->add(
      kOwnPartOp, {ctx.grad(0)},
      graph::Attrs{{"group", ctx.attrs().get_int("group")}, {"size", ctx.attrs().get_int("size")}})};
}

std::vector<graph::Output> gather_of_grad(graph::GradContext& ctx) {
  return {ctx.grad(0).graph->add(
      kGatherOp, {ctx.grad(0)},
      graph::Attrs{{"group", ctx.attrs().get_int("group")}, {"size", ctx.attrs().get_int("size")}})};
}

void gather_kernel(graph::KernelContext& ctx) {
  const Group& group = find_group(ctx.attrs().get_int("group"), ctx.label());
  group.communicator(ctx.device()).all_gather(ctx.input(0), ctx.output(0));
}

// The rank is the executor's device's in the group, found at run time: one graph serves every
// device of the group.
void own_part_kernel(graph::KernelContext& ctx) {
  const Group& group = find_group(ctx.attrs().get_int("group"), ctx.label());
  const Tensor& in = ctx.input(0);
  Tensor& out = ctx.output(0);
  const auto rank = static_cast<std::size_t>(group.rank_of(ctx.device()));
  ctx.device().copy_on_device(out.raw_data(), static_cast<const char*>(in.raw_data()) + rank * out.nbytes(),
                              out.nbytes());
}

// Integer ids minus rank x rows: the ids of this device's piece of a vocabulary.
void shift_kernel(graph::KernelContext& ctx) {
  const Group& group = find_group(ctx.attrs().get_int("group"), ctx.label());
  const std::int64_t offset = group.rank_of(ctx.device()) * ctx.attrs().get_int("rows");
  const Tensor& in = ctx.input(0);
  Tensor& out = ctx.output(0);
  graph::dispatch<graph::IntegerTypes>(in.dtype(), ctx.label(), [&]<class T>() {
    const T* src = in.data<T>();
    T* dst = out.data<T>();
    for (std::int64_t i = 0; i < in.num_elements(); ++i) dst[i] = static_cast<T>(src[i] - static_cast<T>(offset));
  });
}

std::vector<graph::TensorSpec> integer_like_input(graph::ShapeContext& ctx) {
  const DType dtype = ctx.input(0).dtype;
  ctx.require(dtype == DType::kI32 || dtype == DType::kI64, "needs int32 or int64 ids; got {}", dtype);
  return {ctx.input(0)};
}

void register_ops() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto& r = graph::OpRegistry::global();
    r.add({.name = kCopyOp,
           .min_inputs = 1,
           .max_inputs = 1,
           .shape_fn = same_as_input,
           .grad_fn = all_reduce_of_grad,
           .forwards_input = 0});
    // Host-synchronising (the collective waits for the other devices' threads): never captured.
    // CPU only for now: a GPU executor runs it on host copies (its communicator's all_reduce
    // takes host tensors there); an on-stream NCCL kernel is for when a GPU can test it.
    const graph::KernelOptions options{.low_precision = graph::LowPrecision::kNative, .capturable = false};
    r.add(
        {.name = kAllReduceOp, .min_inputs = 1, .max_inputs = 1, .shape_fn = same_as_input, .grad_fn = identity_grad});
    r.add_kernel(kAllReduceOp, devices::DeviceType::kCPU, all_reduce_kernel<collective::ReduceOp::kSum>, options);
    // No gradient function: used on values whose gradient is not wanted (a softmax's shift).
    r.add({.name = kMaxOp, .min_inputs = 1, .max_inputs = 1, .shape_fn = same_as_input});
    r.add_kernel(kMaxOp, devices::DeviceType::kCPU, all_reduce_kernel<collective::ReduceOp::kMax>, options);
    r.add({.name = kGatherOp, .min_inputs = 1, .max_inputs = 1, .shape_fn = gathered_shape, .grad_fn = own_part_of_grad});
    r.add_kernel(kGatherOp, devices::DeviceType::kCPU, gather_kernel, options);
    r.add(
        {.name = kOwnPartOp, .min_inputs = 1, .max_inputs = 1, .shape_fn = own_part_shape, .grad_fn = gather_of_grad});
    r.add_kernel(kOwnPartOp, devices::DeviceType::kCPU, own_part_kernel, options);
    // Integers: no gradient.
    r.add({.name = kShiftOp, .min_inputs = 1, .max_inputs = 1, .shape_fn = integer_like_input});
    r.add_kernel(kShiftOp, devices::DeviceType::kCPU, shift_kernel);
  });
}

}  // namespace

std::shared_ptr<Group> Group::registered(std::vector<devices::Device*> devices,
                                        std::vector<collective::Communicator*> communicators) {
  register_ops();
  const std::int64_t id = registry().next_id++;
  std::shared_ptr<Group> group(new Group(id, std::move(devices), std::move(communicators)));
  std::lock_guard lock(registry().mutex);
  registry().groups[id] = group.get();
  return group;
}

std::shared_ptr<Group> Group::create(std::vector<devices::Device*> devices,
                                     std::vector<collective::Communicator*> communicators) {
  TANDEM_REQUIRE(!devices.empty() && devices.size() == communicators.size(), InvalidArgument,
                 "tensor_parallel::Group: {} devices but {} communicators; give one communicator per device",
                 devices.size(), communicators.size());
  for (std::size_t i = 0; i < devices.size(); ++i) {
    TANDEM_REQUIRE(communicators[i] != nullptr && communicators[i]->size() == communicators[0]->size() &&
                       communicators[i]->size() >= static_cast<int>(devices.size()),
                   InvalidArgument,
                   "tensor_parallel::Group: the communicator of device {} (index {}) must belong to one group of at "
                   "least {} ranks with the others",
                   devices[i]->short_name(), i, devices.size());
    for (std::size_t j = 0; j < i; ++j) {
      TANDEM_REQUIRE(communicators[j]->rank() != communicators[i]->rank(), InvalidArgument,
                     "tensor_parallel::Group: devices {} and {} both have rank {}", devices[j]->short_name(),
                     devices[i]->short_name(), communicators[i]->rank());
    }
  }
  return registered(std::move(devices), std::move(communicators));
}

std::shared_ptr<Group> Group::create_grouped(std::vector<devices::Device*> devices,
                                             std::vector<collective::Communicator*> communicators) {
  TANDEM_REQUIRE(!devices.empty() && devices.size() == communicators.size(), InvalidArgument,
                 "tensor_parallel::Group: {} devices but {} communicators; give one communicator per device",
                 devices.size(), communicators.size());
  for (std::size_t i = 0; i < devices.size(); ++i) {
    TANDEM_REQUIRE(communicators[i] != nullptr && communicators[i]->size() == communicators[0]->size(),
                   InvalidArgument, "tensor_parallel::Group: the groups of devices {} and {} differ in size",
                   devices[0]->short_name(), devices[i]->short_name());
  }
  return registered(std::move(devices), std::move(communicators));
}

std::shared_ptr<Group> Group::create_in_process(std::vector<devices::Device*> devices,
                                                const std::vector<int>& group_of) {
  TANDEM_REQUIRE(!devices.empty() && devices.size() == group_of.size(), InvalidArgument,
                 "tensor_parallel::Group: {} devices but {} group indices", devices.size(), group_of.size());
  std::map<int, std::vector<std::size_t>> members;  // group index -> device indices, in device order
  for (std::size_t i = 0; i < devices.size(); ++i) members[group_of[i]].push_back(i);
  const std::size_t size = members.begin()->second.size();
  std::vector<collective::Communicator*> communicators(devices.size(), nullptr);
  std::vector<std::unique_ptr<collective::Communicator>> owned;
  for (const auto& [index, indices] : members) {
    TANDEM_REQUIRE(indices.size() == size, InvalidArgument,
                   "tensor_parallel::Group: group {} has {} devices, group {} has {}; every group needs as many",
                   members.begin()->first, size, index, indices.size());
    auto comms = collective::make_in_process_group(static_cast<int>(size));
    for (std::size_t k = 0; k < indices.size(); ++k) {
      communicators[indices[k]] = comms[k].get();
      owned.push_back(std::move(comms[k]));
    }
  }
  auto group = registered(std::move(devices), std::move(communicators));
  group->owned_ = std::move(owned);
  group->size_of_groups_ = static_cast<int>(size);
  return group;
}

Group::Group(std::int64_t id, std::vector<devices::Device*> devices,
             std::vector<collective::Communicator*> communicators)
    : id_(id), devices_(std::move(devices)), communicators_(std::move(communicators)) {}

void Group::abort(const std::string& reason) {
  for (auto& c : owned_) c->abort(reason);
}

collective::CommunicationStats Group::stats() const {
  collective::CommunicationStats total;
  for (const auto* list : {&owned_, &retired_}) {
    for (const auto& c : *list) total += c->stats();
  }
  return total;
}

void Group::renew() {
  if (owned_.empty()) return;
  // Same membership as before: the devices whose communicators were one group stay one.
  std::map<const collective::Communicator*, std::size_t> index_of;
  for (std::size_t k = 0; k < owned_.size(); ++k) index_of[owned_[k].get()] = k;
  const auto size = static_cast<std::size_t>(size_of_groups_);
  std::vector<std::unique_ptr<collective::Communicator>> fresh;
  for (std::size_t first = 0; first < owned_.size(); first += size) {
    auto comms = collective::make_in_process_group(static_cast<int>(size));
    for (auto& c : comms) fresh.push_back(std::move(c));
  }
  for (auto& c : communicators_) c = fresh[index_of.at(c)].get();
  for (auto& c : owned_) retired_.push_back(std::move(c));
  owned_ = std::move(fresh);
}

Group::~Group() {
  std::lock_guard lock(registry().mutex);
  registry().groups.erase(id_);
}

// The index of `device` among the group's local devices.
std::size_t Group::local_index(const devices::Device& device) const {
  for (std::size_t i = 0; i < devices_.size(); ++i) {
    if (devices_[i] == &device) return i;
  }
  throw InvalidArgument(fmt::format("device {} is not in {}", device.short_name(), to_string()));
}

int Group::rank_of(const devices::Device& device) const { return communicators_[local_index(device)]->rank(); }

collective::Communicator& Group::communicator(const devices::Device& device) const {
  return *communicators_[local_index(device)];
}

std::string Group::to_string() const {
  std::string names;
  for (const auto* d : devices_) names += fmt::format("{}{}", names.empty() ? "" : ", ", d->short_name());
  return fmt::format("tensor-parallel group {} ({} here of {})", id_, names, size());
}

graph::Output copy_to_group(graph::Output x, const Group& group) { return add_op(std::move(x), kCopyOp, group.id()); }

graph::Output reduce_from_group(graph::Output x, const Group& group) {
  return add_op(std::move(x), kAllReduceOp, group.id());
}

graph::Output max_over_group(graph::Output x, const Group& group) { return add_op(std::move(x), kMaxOp, group.id()); }

namespace {

// `op` applied along `axis`: the collectives work on dimension 0, so `axis` is brought there and
// back.
graph::Output along_axis(graph::Output x, int axis, const char* op, const Group& group, const char* caller) {
  TANDEM_REQUIRE(x.defined() && axis >= 0 && axis < x.shape().rank(), InvalidArgument, "{}: axis {} of {}", caller,
                 axis, x.defined() ? x.shape().to_string() : std::string("nothing"));
  std::vector<std::int64_t> perm(static_cast<std::size_t>(x.shape().rank()));
  for (std::size_t d = 0; d < perm.size(); ++d) perm[d] = static_cast<std::int64_t>(d);
  std::swap(perm[0], perm[static_cast<std::size_t>(axis)]);
  const graph::Output front = axis == 0 ? x : ops::transpose(x, perm);
  const graph::Output done = add_sized_op(front, op, group);
  return axis == 0 ? done : ops::transpose(done, perm);
}

}  // namespace

graph::Output gather_from_group(graph::Output x, int axis, const Group& group) {
  return along_axis(std::move(x), axis, kGatherOp, group, "gather_from_group");
}

graph::Output scatter_to_group(graph::Output x, int axis, const Group& group) {
  return along_axis(std::move(x), axis, kOwnPartOp, group, "scatter_to_group");
}

namespace {

// ids - vocab_start, in ids' integer type: the rows of this device's piece (others out of range).
// kVocabStartOfRank: rank x rows, the rank found when the executor runs.
graph::Output local_ids(graph::Output ids, std::int64_t vocab_start, std::int64_t rows, const Group& group) {
  if (vocab_start == kVocabStartOfRank) {
    ops::register_all();
    return ids.graph->add(kShiftOp, {ids}, graph::Attrs{{"group", group.id()}, {"rows", rows}});
  }
  return vocab_start == 0 ? ids : ops::sub(ids, ops::scalar_like(ids, static_cast<double>(vocab_start)));
}

}  // namespace

graph::Output vocab_parallel_embedding(graph::Output ids, graph::Output table_piece, std::int64_t vocab_start,
                                       const Group& group) {
  TANDEM_REQUIRE(ids.defined() && table_piece.defined() && table_piece.shape().rank() == 2, InvalidArgument,
                 "vocab_parallel_embedding: needs ids and a [rows, dim] table piece; got {}",
                 table_piece.defined() ? table_piece.shape().to_string() : std::string("none"));
  const std::int64_t rows = table_piece.shape()[0], dim = table_piece.shape()[1];
  Shape out_shape = ids.shape();
  out_shape.push_back(dim);
  // An id outside the piece gets an all-zero one-hot row (OneHot's out-of-range rule), so its
  // looked-up row is zeros here and comes from the device that holds it.
  const graph::Output one_hot = ops::one_hot(ops::reshape(local_ids(ids, vocab_start, rows, group), {-1}), rows);
  graph::Output rows_found = ops::matmul(ops::cast(one_hot, table_piece.dtype()), table_piece);
  return ops::reshape(reduce_from_group(rows_found, group), out_shape);
}

graph::Output vocab_parallel_cross_entropy(graph::Output logits_piece, graph::Output labels, std::int64_t vocab_start,
                                           const Group& group) {
  TANDEM_REQUIRE(
      logits_piece.defined() && labels.defined() && logits_piece.shape().rank() == 2 && labels.shape().rank() == 1,
      InvalidArgument,
      "vocab_parallel_cross_entropy: needs logits [rows, V / t] and labels [rows]; got {} "
      "and {}",
      logits_piece.defined() ? logits_piece.shape().to_string() : "none",
      labels.defined() ? labels.shape().to_string() : "none");
  const std::int64_t columns = logits_piece.shape()[1];
  // The shift for a stable softmax: the row's maximum over every device's columns. Any shift
  // gives the same loss and gradient, so none flows through it.
  const graph::Output shift =
      max_over_group(ops::stop_gradient(ops::reduce_max(logits_piece, {.axes = {1}, .keep_dims = true})), group);
  const graph::Output z = ops::sub(logits_piece, shift);
  const graph::Output sum_exp = reduce_from_group(ops::reduce_sum(ops::exp(z), {.axes = {1}}), group);
  const graph::Output target_mask =
      ops::cast(ops::one_hot(local_ids(labels, vocab_start, columns, group), columns), z.dtype());
  const graph::Output target = reduce_from_group(ops::reduce_sum(ops::mul(z, target_mask), {.axes = {1}}), group);
  return ops::sub(ops::log(sum_exp), target);
}

}  // namespace tandem::strategy::tensor_parallel
