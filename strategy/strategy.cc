#include "tandem/strategy/strategy.h"

#include <atomic>
#include <thread>
#include <vector>

#include "tandem/base/errors.h"

namespace tandem::strategy {
namespace {

thread_local std::vector<Strategy*> tls_scope_stack;
std::atomic<int> g_strategy_count{0};

std::string describe(const std::string& kind, const std::vector<devices::Device*>& devices) {
  std::string names;
  for (auto* d : devices) names += fmt::format("{}{}", names.empty() ? "" : ", ", d->short_name());
  return fmt::format("{}#{} ({})", kind, ++g_strategy_count, names);
}

class DefaultStrategy final : public Strategy {
 public:
  DefaultStrategy() : Strategy("DefaultStrategy", {&devices::default_cpu_device()}) {}
};

}  // namespace

Strategy::Strategy(std::string kind, std::vector<devices::Device*> devices)
    : name_(describe(kind, devices)), devices_(std::move(devices)) {
  TANDEM_ASSERT(!devices_.empty(), "{} has no devices", kind);
}

Strategy::~Strategy() = default;

Strategy::Scope::Scope(Strategy& strategy) {
  for (const Strategy* active : tls_scope_stack) {
    TANDEM_REQUIRE(active == &strategy, FailedPrecondition,
                   "cannot enter the scope of {} inside the scope of {}: mixing different strategies is not "
                   "supported; close the first scope before opening the second",
                   strategy.name(), active->name());
  }
  tls_scope_stack.push_back(&strategy);
}

Strategy::Scope::~Scope() { tls_scope_stack.pop_back(); }

Strategy::Scope Strategy::scope() { return Scope(*this); }

std::shared_ptr<Variable> Strategy::create_variable(VariableOptions options) {
  TANDEM_REQUIRE(options.initial_value.defined(), InvalidArgument, "variable \"{}\": no initial value", options.name);
  std::vector<Tensor> copies;
  copies.reserve(devices_.size());
  for (auto* device : devices_) {
    Tensor copy = Tensor::empty(options.initial_value.shape(), options.initial_value.dtype(), *device);
    copy.copy_from(options.initial_value);
    copies.push_back(std::move(copy));
  }
  return std::make_shared<Variable>(*this, std::move(options), std::move(copies));
}

void Strategy::run(const std::function<void(ReplicaContext&)>& fn) {
  // One local replica per device; several replicas run in parallel threads.
  if (devices_.size() == 1) {
    ReplicaContext context(*this, 0);
    fn(context);
    return;
  }
  std::vector<std::exception_ptr> errors(devices_.size());
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < devices_.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        ReplicaContext context(*this, static_cast<int>(r));
        fn(context);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

Tensor Strategy::reduce(ReduceOp op, const std::vector<Tensor>& per_replica) const {
  TANDEM_REQUIRE(!per_replica.empty(), InvalidArgument, "{}: reduce of no values", name_);
  auto& host = devices::default_cpu_device();
  Tensor result = per_replica.front().to(host).clone();
  graph::dispatch<graph::NumericTypes>(result.dtype(), "Strategy::reduce", [&]<class T>() {
    T* out = result.data<T>();
    const auto n = result.num_elements();
    for (std::size_t r = 1; r < per_replica.size(); ++r) {
      TANDEM_REQUIRE(per_replica[r].shape() == result.shape() && per_replica[r].dtype() == result.dtype(),
                     InvalidArgument, "{}: reduce of replica {}'s {} {} with replica 0's {} {}", name_, r,
                     per_replica[r].dtype(), per_replica[r].shape(), result.dtype(), result.shape());
      const Tensor other = per_replica[r].to(host);
      const T* in = other.data<T>();
      for (std::int64_t i = 0; i < n; ++i) out[i] += in[i];
    }
    if (op == ReduceOp::kMean) {
      for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(out[i] / static_cast<T>(per_replica.size()));
    }
  });
  return result;
}

int ReplicaContext::num_replicas_in_sync() const { return strategy_.num_replicas_in_sync(); }

devices::Device& ReplicaContext::device() const {
  return *strategy_.replica_devices()[static_cast<std::size_t>(replica_id_)];
}

Tensor ReplicaContext::all_reduce(ReduceOp /*op*/, const Tensor& value) {
  TANDEM_REQUIRE(strategy_.num_replicas_in_sync() == 1, Unimplemented,
                 "{}: all_reduce across {} replicas needs the collective layer (MirroredStrategy)", strategy_.name(),
                 strategy_.num_replicas_in_sync());
  return value;
}

Strategy& default_strategy() {
  static auto* strategy = new DefaultStrategy;  // lives as long as the variables it made
  return *strategy;
}

Strategy& get_strategy() { return tls_scope_stack.empty() ? default_strategy() : *tls_scope_stack.back(); }

bool has_strategy() { return !tls_scope_stack.empty(); }

OneDeviceStrategy::OneDeviceStrategy(std::string_view device)
    : Strategy("OneDeviceStrategy", {&devices::get_device(device)}) {}

}  // namespace tandem::strategy
