#include "tandem/strategy/variable.h"

#include "tandem/strategy/strategy.h"

#include <algorithm>
#include <cstring>

namespace tandem::strategy {

ShardSpec ShardSpec::even(const Shape& global_shape, int num_shards) {
  TANDEM_ASSERT(num_shards >= 1, "{} shards", num_shards);
  const std::int64_t n = global_shape.num_elements();
  return {.num_shards = num_shards, .shard_elements = (n + num_shards - 1) / num_shards, .global_shape = global_shape};
}

std::int64_t ShardSpec::begin(int shard) const {
  return std::min(global_shape.num_elements(), static_cast<std::int64_t>(shard) * shard_elements);
}

std::int64_t ShardSpec::end(int shard) const {
  return std::min(global_shape.num_elements(), static_cast<std::int64_t>(shard + 1) * shard_elements);
}

Tensor flat_view(const Tensor& tensor, std::int64_t offset, std::int64_t count) {
  TANDEM_ASSERT(offset >= 0 && count >= 0 && offset + count <= tensor.num_elements(),
                "flat_view [{}, {}) of a tensor of {} elements", offset, offset + count, tensor.num_elements());
  return Tensor({count}, tensor.dtype(), tensor.buffer(),
                tensor.byte_offset() + static_cast<std::size_t>(offset) * graph::dtype_size(tensor.dtype()));
}

Variable::Variable(Strategy& strategy, VariableOptions options, std::vector<Tensor> copies,
                   std::optional<ShardSpec> sharding)
    : strategy_(&strategy),
      name_(std::move(options.name)),
      trainable_(options.trainable),
      synchronization_(options.synchronization),
      aggregation_(options.aggregation),
      copies_(std::move(copies)),
      sharding_(std::move(sharding)) {
  TANDEM_ASSERT(!copies_.empty(), "variable {} has no copies", name_);
}

// The other workers' shards of `out` are zeros here: the sum over the workers, in float64 (exact
// for every floating type, one term non-zero), is the whole value (a zero's sign aside).
Tensor Variable::sum_over_workers(const Tensor& out) const {
  std::vector<double> values(static_cast<std::size_t>(out.num_elements()));
  graph::dispatch<graph::FloatTypes>(dtype(), "read_value of a sharded variable", [&]<class T>() {
    const T* p = out.data<T>();
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<double>(p[i]);
  });
  strategy_->sum_across_workers(values);
  Tensor whole = Tensor::empty(out.shape(), dtype());
  graph::dispatch<graph::FloatTypes>(dtype(), "read_value of a sharded variable", [&]<class T>() {
    T* p = whole.data<T>();
    for (std::size_t i = 0; i < values.size(); ++i) p[i] = static_cast<T>(values[i]);
  });
  return whole;
}

Tensor& Variable::value(int replica) {
  TANDEM_REQUIRE(replica >= 0 && replica < num_replicas(), InvalidArgument,
                 "variable \"{}\" has {} copies (it was created under {}), but replica {} uses it; create it under the "
                 "scope of the strategy that runs it",
                 name_, num_replicas(), strategy_->name(), replica);
  return copies_[static_cast<std::size_t>(replica)];
}

const Tensor& Variable::value(int replica) const { return const_cast<Variable*>(this)->value(replica); }

Tensor Variable::read_value() const {
  if (sharding_) {
    // Each local shard's elements, padding dropped, at their place in the flattened value.
    const int first = strategy_->global_replica_index(0);
    Tensor out = Tensor::zeros(sharding_->global_shape, dtype());
    for (std::size_t r = 0; r < copies_.size(); ++r) {
      const int s = first + static_cast<int>(r);
      const std::int64_t b = sharding_->begin(s), e = sharding_->end(s);
      if (e > b) flat_view(out, b, e - b).copy_from(flat_view(copies_[r], 0, e - b));
    }
    if (strategy_->num_workers() > 1) out = sum_over_workers(out);
    return out;
  }
  if (synchronization_ == VariableSynchronization::kOnRead && copies_.size() > 1 &&
      (aggregation_ == VariableAggregation::kSum || aggregation_ == VariableAggregation::kMean)) {
    return strategy_->reduce(aggregation_ == VariableAggregation::kSum ? ReduceOp::kSum : ReduceOp::kMean, copies_);
  }
  return copies_.front().to(devices::default_cpu_device()).clone();
}

void Variable::check_copies_equal() const {
  if (copies_.size() < 2 || synchronization_ == VariableSynchronization::kOnRead || sharding_) return;
  const Tensor first = copies_.front().to(devices::default_cpu_device());
  for (std::size_t r = 1; r < copies_.size(); ++r) {
    const Tensor other = copies_[r].to(devices::default_cpu_device());
    const auto* a = static_cast<const unsigned char*>(first.raw_data());
    const auto* b = static_cast<const unsigned char*>(other.raw_data());
    const std::size_t element = graph::dtype_size(first.dtype());
    for (std::size_t i = 0; i < first.nbytes(); i += element) {
      if (std::memcmp(a + i, b + i, element) != 0) {
        throw FailedPrecondition(fmt::format(
            "mirrored variable \"{}\": the copies of replica 0 ({}) and replica {} ({}) differ at element {}; every "
            "replica must apply the same updates",
            name_, copies_.front().device().short_name(), r, copies_[r].device().short_name(), i / element));
      }
    }
  }
}

void Variable::assign(const Tensor& value) {
  TANDEM_REQUIRE(value.defined() && value.dtype() == dtype() && value.shape() == global_shape(), InvalidArgument,
                 "assign to variable \"{}\": got {} {}; expected {} {}", name_,
                 value.defined() ? graph::dtype_name(value.dtype()) : "undefined",
                 value.defined() ? value.shape() : Shape{}, dtype(), global_shape());
  if (sharding_) {
    // Each local copy takes its shard's elements; the padding after them stays zero. Every worker
    // holds the whole value: no communication.
    const int first = strategy_->global_replica_index(0);
    for (std::size_t r = 0; r < copies_.size(); ++r) {
      const int s = first + static_cast<int>(r);
      const std::int64_t b = sharding_->begin(s), e = sharding_->end(s);
      Tensor& copy = copies_[r];
      copy.device().fill_zero(copy.raw_data(), copy.nbytes());
      if (e > b) flat_view(copy, 0, e - b).copy_from(flat_view(value, b, e - b));
    }
    return;
  }
  if (synchronization_ == VariableSynchronization::kOnRead && aggregation_ == VariableAggregation::kSum &&
      copies_.size() > 1) {
    Tensor divided = value.to(devices::default_cpu_device()).clone();
    graph::dispatch<graph::NumericTypes>(dtype(), "assign to an on-read SUM variable", [&]<class T>() {
      T* data = divided.data<T>();
      for (std::int64_t i = 0; i < divided.num_elements(); ++i)
        data[i] = static_cast<T>(data[i] / static_cast<T>(copies_.size()));
    });
    for (auto& copy : copies_) copy.copy_from(divided);
    return;
  }
  for (auto& copy : copies_) copy.copy_from(value);
}

void Variable::assign_per_replica(const std::vector<Tensor>& per_replica) {
  TANDEM_REQUIRE(!sharding_, FailedPrecondition,
                 "variable \"{}\" is sharded (each replica holds another part of it); set it with assign(), not "
                 "from per-replica values",
                 name_);
  TANDEM_REQUIRE(per_replica.size() == copies_.size(), InvalidArgument,
                 "variable \"{}\" has {} copies; got {} per-replica values", name_, copies_.size(), per_replica.size());
  for (std::size_t r = 0; r < per_replica.size(); ++r) {
    TANDEM_REQUIRE(per_replica[r].defined() && per_replica[r].dtype() == dtype() && per_replica[r].shape() == shape(),
                   InvalidArgument, "variable \"{}\": replica {}'s value is {} {}; expected {} {}", name_, r,
                   per_replica[r].defined() ? graph::dtype_name(per_replica[r].dtype()) : "undefined",
                   per_replica[r].defined() ? per_replica[r].shape() : Shape{}, dtype(), shape());
  }
  if (synchronization_ == VariableSynchronization::kOnRead) {
    for (std::size_t r = 0; r < copies_.size(); ++r) copies_[r].copy_from(per_replica[r]);
    return;
  }
  Tensor value;
  switch (aggregation_) {
    case VariableAggregation::kNone:
      TANDEM_REQUIRE(copies_.size() == 1, FailedPrecondition,
                     "mirrored variable \"{}\" was updated by {} replicas but has aggregation NONE: create it with "
                     "aggregation SUM, MEAN or ONLY_FIRST_REPLICA to say how the updates combine",
                     name_, copies_.size());
      value = per_replica.front();
      break;
    case VariableAggregation::kSum: value = reduce_on_host(ReduceOp::kSum, per_replica, name_); break;
    case VariableAggregation::kMean: value = reduce_on_host(ReduceOp::kMean, per_replica, name_); break;
    case VariableAggregation::kOnlyFirstReplica: value = per_replica.front(); break;
  }
  for (auto& copy : copies_) copy.copy_from(value);
}

}  // namespace tandem::strategy
