#include "tandem/strategy/variable.h"

#include "tandem/strategy/strategy.h"

namespace tandem::strategy {

Variable::Variable(Strategy& strategy, VariableOptions options, std::vector<Tensor> copies)
    : strategy_(&strategy),
      name_(std::move(options.name)),
      trainable_(options.trainable),
      synchronization_(options.synchronization),
      aggregation_(options.aggregation),
      copies_(std::move(copies)) {
  TANDEM_ASSERT(!copies_.empty(), "variable {} has no copies", name_);
}

Tensor& Variable::value(int replica) {
  TANDEM_REQUIRE(replica >= 0 && replica < num_replicas(), InvalidArgument, "variable \"{}\" has {} replica copies; asked for {}",
                 name_, num_replicas(), replica);
  return copies_[static_cast<std::size_t>(replica)];
}

const Tensor& Variable::value(int replica) const { return const_cast<Variable*>(this)->value(replica); }

Tensor Variable::read_value() const {
  if (synchronization_ == VariableSynchronization::kOnRead && copies_.size() > 1 &&
      (aggregation_ == VariableAggregation::kSum || aggregation_ == VariableAggregation::kMean)) {
    return strategy_->reduce(aggregation_ == VariableAggregation::kSum ? ReduceOp::kSum : ReduceOp::kMean, copies_);
  }
  return copies_.front().to(devices::default_cpu_device()).clone();
}

void Variable::assign(const Tensor& value) {
  TANDEM_REQUIRE(value.defined() && value.dtype() == dtype() && value.shape() == shape(), InvalidArgument,
                 "assign to variable \"{}\": got {} {}; expected {} {}", name_,
                 value.defined() ? graph::dtype_name(value.dtype()) : "undefined", value.defined() ? value.shape() : Shape{},
                 dtype(), shape());
  for (auto& copy : copies_) copy.copy_from(value);
}

}  // namespace tandem::strategy
