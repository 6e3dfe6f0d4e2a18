// Keras 3's optimizers (keras/src/optimizers), one fused pass per variable.
//
// Per variable and replica: optional clipping (a norm pass first when clipping by norm), then the
// update rule over the elements, split over the device's threads. Gradients arrive already
// combined across replicas, so every replica computes the same new values.
#include "tandem/keras_like/optimizers.h"

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <regex>

#include "tandem/ops/cpu/isa.h"
#include "tandem/ops/detail/device_update.h"
#include "tandem/ops/detail/update_rules.h"
#include "tandem/strategy/strategy.h"

namespace tandem::keras {

// One replica's staged numbers: written into page-locked memory by the host, copied to the device
// on the compute stream ahead of the step (`copied` marks that copy, so that the next step's
// write waits for it rather than changing the bytes under it).
struct Optimizer::StagedParams {
  devices::PinnedHostBuffer host;
  Tensor on_device;
  std::unique_ptr<devices::Event> copied;
  bool copy_pending = false;
};

namespace {

constexpr std::string_view kKnownOptimizers = "sgd, adam, adamw, rmsprop";
// The most slots a rule keeps per variable (RMSprop: velocity, momentum, average gradient).
constexpr std::size_t kMaxSlots = 3;
// Elements per chunk of an update loop: enough work to be worth waking a thread.
constexpr std::int64_t kUpdateGrain = 16 * 1024;

struct Clip {
  std::optional<double> clipnorm, clipvalue, global_clipnorm;
};

Clip clip_of(const OptimizerSpec& spec) {
  return std::visit([](const auto& o) { return Clip{o.clipnorm, o.clipvalue, o.global_clipnorm}; }, spec);
}

int accumulation_steps_of(const OptimizerSpec& spec) {
  return std::visit([](const auto& o) { return o.gradient_accumulation_steps.value_or(1); }, spec);
}

// Whether every element of every gradient is finite: one read pass, on the device's threads.
// The exponent bits are tested as integers, so the loop vectorises (an OR reduction) and does
// not depend on the compiler honouring isfinite().
template <class T>
bool range_finite(const T* p, std::int64_t b, std::int64_t e) {
  using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  constexpr Bits kExponent = static_cast<Bits>(sizeof(T) == 4 ? 0x7f800000ull : 0x7ff0000000000000ull);
  Bits bad = 0;
  for (std::int64_t i = b; i < e; ++i) {
    Bits bits;
    std::memcpy(&bits, p + i, sizeof bits);
    bad |= static_cast<Bits>((bits & kExponent) == kExponent);
  }
  return bad == 0;
}

bool all_finite(const std::vector<Tensor>& gradients) {
  if (!gradients.empty() && !gradients.front().device().host_accessible()) {
    return ops::detail::all_finite_on_device(gradients);
  }
  for (const Tensor& grad : gradients) {
    std::atomic<bool> finite{true};
    graph::dispatch<graph::FloatTypes>(grad.dtype(), "loss_scale_optimizer finiteness check", [&]<class T>() {
      const T* g = static_cast<const T*>(grad.raw_data());
      grad.device().parallel_for(grad.num_elements(), kUpdateGrain, [&](std::int64_t b, std::int64_t e) {
        if (!range_finite(g, b, e)) finite.store(false, std::memory_order_relaxed);
      });
    });
    if (!finite.load()) return false;
  }
  return true;
}

// A gradient must match its variable's copy in shape (or, for a variable updated by shard, the
// shard's: `expected`), dtype and device.
void require_matching_gradient(const std::string& optimizer, const strategy::Variable& variable, const Tensor& w,
                               const Tensor& grad, const Shape& expected) {
  TANDEM_REQUIRE(grad.shape() == expected && grad.dtype() == w.dtype() && &grad.device() == &w.device(),
                 InvalidArgument, "{}: gradient of \"{}\" is {} {} on {}; expected {} {} on {}", optimizer,
                 variable.name(), grad.dtype(), grad.shape(), grad.device().short_name(), w.dtype(), expected,
                 w.device().short_name());
}

// One replica's copy of a scalar state variable, read and written without a kernel.
template <class T>
T read_scalar(const Tensor& copy) {
  return copy.device().host_accessible() ? copy.data<T>()[0] : copy.item<T>();
}
template <class T>
void write_scalar(Tensor& copy, T value) {
  if (copy.device().host_accessible()) {
    copy.data<T>()[0] = value;
  } else {
    copy.copy_from(Tensor::scalar<T>(value));
  }
}

std::string rule_name(const OptimizerSpec& spec) {
  return std::visit(
      [](const auto& o) -> std::string {
        using O = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<O, SGD>) return "sgd";
        if constexpr (std::is_same_v<O, Adam>) return "adam";
        if constexpr (std::is_same_v<O, AdamW>) return "adamw";
        if constexpr (std::is_same_v<O, RMSprop>) return "rmsprop";
      },
      spec);
}

LearningRate learning_rate_of(const OptimizerSpec& spec) {
  return std::visit([](const auto& o) { return o.learning_rate; }, spec);
}

// AdamW's weight_decay; 0 for the rules without one.
double weight_decay_of(const OptimizerSpec& spec) {
  return std::visit(
      [](const auto& o) {
        if constexpr (std::is_same_v<std::decay_t<decltype(o)>, AdamW>) {
          return o.weight_decay;
        } else {
          return 0.0;
        }
      },
      spec);
}

// exclude_from_weight_decay's var_names as regular expressions (Keras: re.search of any of them
// in the name). ECMAScript's syntax agrees with Python's re on the patterns names need.
std::vector<std::regex> compile_patterns(const std::string& optimizer, const std::vector<std::string>& patterns) {
  std::vector<std::regex> out;
  for (const auto& pattern : patterns) {
    try {
      out.emplace_back(pattern);
    } catch (const std::regex_error& e) {
      throw InvalidArgument(fmt::format("{}: exclude_from_weight_decay pattern \"{}\" is not a regular expression: {}",
                                        optimizer, pattern, e.what()));
    }
  }
  return out;
}

}  // namespace

std::vector<std::string> slot_names(const OptimizerSpec& spec) {
  return std::visit(
      [](const auto& o) -> std::vector<std::string> {
        using O = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<O, SGD>) {
          return o.momentum != 0.0 ? std::vector<std::string>{"momentum"} : std::vector<std::string>{};
        } else if constexpr (std::is_same_v<O, RMSprop>) {
          std::vector<std::string> names{"velocity"};
          if (o.momentum > 0.0) names.push_back("momentum");
          if (o.centered) names.push_back("average_gradient");
          return names;
        } else {  // Adam, AdamW
          std::vector<std::string> names{"m", "v"};
          if (o.amsgrad) names.push_back("v_hat");
          return names;
        }
      },
      spec);
}

namespace {

template <class T>
double squared_norm(devices::Device& device, const T* g, std::int64_t n) {
  // Two partial sums per thread at most; the order is fixed by the chunking, not the threads.
  std::vector<double> partial(
      static_cast<std::size_t>(std::max<std::int64_t>(1, (n + kUpdateGrain - 1) / kUpdateGrain)), 0.0);
  device.parallel_for(static_cast<std::int64_t>(partial.size()), 1, [&](std::int64_t b, std::int64_t e) {
    for (std::int64_t c = b; c < e; ++c) {
      double s = 0;
      const std::int64_t lo = c * kUpdateGrain, hi = std::min(n, lo + kUpdateGrain);
      for (std::int64_t i = lo; i < hi; ++i) s += static_cast<double>(g[i]) * static_cast<double>(g[i]);
      partial[static_cast<std::size_t>(c)] = s;
    }
  });
  double total = 0;
  for (double s : partial) total += s;
  return total;
}

// The squared L2 norm of a gradient (or a view of one), in float64, on its device.
double squared_norm_of(const Tensor& g) {
  if (!g.device().host_accessible()) return ops::detail::squared_norm_on_device(g);
  double total = 0;
  graph::dispatch<graph::FloatTypes>(g.dtype(), "optimizer", [&]<class T>() {
    total = squared_norm(g.device(), static_cast<const T*>(g.raw_data()), g.num_elements());
  });
  return total;
}

// The update loops run in the CPU kernels' build for this CPU's instruction-set level
// (ops/cpu/isa.h, ops/cpu/update_kernels.cc): they are the hottest memory-bound loops of a step.
using ops::detail::AdamStep;
using ops::detail::GradientTransform;
using ops::detail::RmspropStep;
using ops::detail::SgdStep;

}  // namespace

OptimizerRef::OptimizerRef(std::string_view name) {
  if (name == "sgd" || name == "SGD") {
    spec_ = SGD{};
  } else if (name == "adam" || name == "Adam") {
    spec_ = Adam{};
  } else if (name == "adamw" || name == "AdamW") {
    spec_ = AdamW{};
  } else if (name == "rmsprop" || name == "RMSprop") {
    spec_ = RMSprop{};
  } else {
    throw InvalidArgument(fmt::format("unknown optimizer \"{}\"; known: {}", name, kKnownOptimizers));
  }
}

Optimizer::Optimizer(OptimizerSpec spec)
    : spec_(std::move(spec)),
      learning_rate_(learning_rate_of(spec_)),
      accumulation_steps_(accumulation_steps_of(spec_)) {
  if (const auto* adamw = std::get_if<AdamW>(&spec_)) exclude_from_weight_decay({}, adamw->exclude_from_weight_decay);
  TANDEM_REQUIRE(accumulation_steps_ >= 1, InvalidArgument,
                 "{}: gradient_accumulation_steps must be at least 1; got {}", name(), accumulation_steps_);
  const Clip clip = clip_of(spec_);
  TANDEM_REQUIRE(!(clip.clipnorm && clip.global_clipnorm), InvalidArgument,
                 "{}: set clipnorm or global_clipnorm, not both (as in Keras)", name());
  for (const auto& [what, value] : {std::pair{"clipnorm", clip.clipnorm}, std::pair{"clipvalue", clip.clipvalue},
                                    std::pair{"global_clipnorm", clip.global_clipnorm}}) {
    TANDEM_REQUIRE(!value || *value > 0, InvalidArgument, "{}: {} must be positive; got {}", name(), what,
                   value.value_or(0));
  }
  set_learning_rate(learning_rate_);
}

Optimizer::Optimizer(LossScaleOptimizer spec) : Optimizer(spec.inner_optimizer) {
  loss_scale_ = std::move(spec);
  TANDEM_REQUIRE(std::isfinite(loss_scale_->initial_scale) && loss_scale_->initial_scale > 0, InvalidArgument,
                 "{}: initial_scale must be a positive finite number; got {}", name(), loss_scale_->initial_scale);
  TANDEM_REQUIRE(loss_scale_->initial_scale <= static_cast<double>(std::numeric_limits<float>::max()) &&
                     static_cast<float>(loss_scale_->initial_scale) > 0,
                 InvalidArgument, "{}: initial_scale {} is outside float32's range (the scale is kept as float32)",
                 name(), loss_scale_->initial_scale);
  TANDEM_REQUIRE(loss_scale_->dynamic_growth_steps >= 1, InvalidArgument,
                 "{}: dynamic_growth_steps must be at least 1; got {}", name(), loss_scale_->dynamic_growth_steps);
  // A skipped step would also have to drop the accumulated micro-steps; not supported yet.
  TANDEM_REQUIRE(accumulation_steps_ == 1, Unimplemented,
                 "{}: the inner optimizer's gradient_accumulation_steps ({}) is not supported under loss scaling",
                 name(), accumulation_steps_);
}

Optimizer::~Optimizer() = default;

std::string Optimizer::name() const {
  return loss_scale_ ? fmt::format("loss_scale_optimizer({})", rule_name(spec_)) : rule_name(spec_);
}

void Optimizer::set_learning_rate(LearningRate learning_rate) {
  if (const auto* constant = std::get_if<double>(&learning_rate.value())) {
    TANDEM_REQUIRE(!learning_rate_.is_schedule(), FailedPrecondition,
                   "{}: this optimizer was created with a learning-rate schedule ({}), hence its learning rate is not "
                   "settable to {}; create it with a constant learning_rate to set it (as Keras)",
                   name(), learning_rate_.kind(), *constant);
    TANDEM_REQUIRE(std::isfinite(*constant) && *constant >= 0, InvalidArgument,
                   "{}: learning rate {} must be finite and not negative", name(), *constant);
  }
  learning_rate_ = std::move(learning_rate);
}

void Optimizer::exclude_from_weight_decay(const std::vector<VariablePtr>& var_list,
                                          const std::vector<std::string>& var_names) {
  TANDEM_REQUIRE(variables_.empty() && slot_list_.empty(), FailedPrecondition,
                 "{}: exclude_from_weight_decay() can only be configured before the optimizer is built (before the "
                 "first training step)",
                 name());
  compile_patterns(name(), var_names);  // refuses a bad pattern now, not at the first step
  excluded_variables_ = var_list;
  excluded_patterns_ = var_names;
}

bool Optimizer::uses_weight_decay(const strategy::Variable& variable) const {
  if (weight_decay_of(spec_) == 0.0) return false;
  if (std::any_of(excluded_variables_.begin(), excluded_variables_.end(),
                  [&](const VariablePtr& v) { return v.get() == &variable; })) {
    return false;
  }
  const auto patterns = compile_patterns(name(), excluded_patterns_);
  return std::none_of(patterns.begin(), patterns.end(),
                      [&](const std::regex& pattern) { return std::regex_search(variable.name(), pattern); });
}

void Optimizer::build(const std::vector<VariablePtr>& variables) {
  if (variables == variables_) return;
  TANDEM_REQUIRE(variables_.empty(), FailedPrecondition,
                 "{}: already built for {} variables; an optimizer serves one model", name(), variables_.size());
  const auto names = slot_names(spec_);
  if (loss_scale_ && !variables.empty()) {
    // Keras's own variables of the LossScaleOptimizer, one copy per replica like the slots.
    strategy::Strategy& owner = variables.front()->strategy();
    strategy::VariableOptions scale;
    scale.name = "loss_scale_optimizer/dynamic_scale";
    scale.initial_value = Tensor::scalar<float>(static_cast<float>(loss_scale_->initial_scale));
    scale.trainable = false;
    dynamic_scale_ = owner.create_variable(std::move(scale));
    strategy::VariableOptions counter;
    counter.name = "loss_scale_optimizer/step_counter";
    counter.initial_value = Tensor::scalar<std::int64_t>(0);
    counter.trainable = false;
    step_counter_ = owner.create_variable(std::move(counter));
    slot_list_.emplace_back(dynamic_scale_->name(), dynamic_scale_);
    slot_list_.emplace_back(step_counter_->name(), step_counter_);
  }
  const Clip clip = clip_of(spec_);
  for (const auto& variable : variables) {
    // Tensor and pipeline parallelism: a norm or a finiteness check of the gradients would need
    // the devices' parts summed over the group, which the update does not do yet.
    TANDEM_REQUIRE(
        !variable->tensor_split() || (!clip.clipnorm && !clip.global_clipnorm && !loss_scale_), Unimplemented,
        "{}: variable \"{}\" is split over '{}' by ModelParallel; {} with tensor- or pipeline-parallel weights is "
        "not built yet (each device sees its own part of the gradients only): use clipvalue, or no clipping and "
        "no loss scaling",
        name(), variable->name(), variable->tensor_split()->axis,
        loss_scale_     ? "loss scaling"
        : clip.clipnorm ? "clipnorm"
                        : "global_clipnorm");
  }
  for (const auto& variable : variables) {
    strategy::Strategy& owner = variable->strategy();
    TANDEM_REQUIRE(!strategy::has_strategy() || &strategy::get_strategy() == &owner, FailedPrecondition,
                   "{}: the slots of variable \"{}\" would be created under the scope of {}, but the variable belongs "
                   "to {}; create the optimizer (compile, fit) under the variable's strategy",
                   name(), variable->name(), strategy::get_strategy().name(), owner.name());
    if (accumulation_steps_ > 1) {
      strategy::VariableOptions options;
      options.name = fmt::format("{}/gradient_accumulator", variable->name());
      options.initial_value = Tensor::zeros(variable->global_shape(), variable->dtype());
      options.trainable = false;
      options.tensor_split = variable->tensor_split();
      accumulators_.push_back(owner.create_variable(std::move(options)));
      slot_list_.emplace_back(accumulators_.back()->name(), accumulators_.back());
    }
    // ZeRO: this replica updates its shard of a reduce-scattered variable, so its slots keep that
    // shard only (the accumulators above stay whole: micro-steps add whole gradients into them).
    shards_.push_back(owner.zero_shard_spec(*variable));
    const bool sharded = shards_.back().has_value();
    sharded_ = sharded_ || sharded;
    std::vector<VariablePtr> slots;
    for (const auto& slot : names) {
      strategy::VariableOptions options;
      options.name = fmt::format("{}/{}", variable->name(), slot);
      options.initial_value = Tensor::zeros(variable->global_shape(), variable->dtype());
      options.trainable = false;
      options.sharded = sharded;
      options.tensor_split = variable->tensor_split();  // a split weight's slots are split alike
      auto created = owner.create_variable(std::move(options));
      slot_list_.emplace_back(created->name(), created);
      slots.push_back(std::move(created));
    }
    slots_.push_back(std::move(slots));
    decays_.push_back(uses_weight_decay(*variable));
  }
  variables_ = variables;
}

double Optimizer::loss_scale(int replica) const {
  if (!loss_scale_) return 1.0;
  if (!dynamic_scale_) return static_cast<double>(static_cast<float>(loss_scale_->initial_scale));
  return static_cast<double>(read_scalar<float>(dynamic_scale_->value(replica)));
}

std::int64_t Optimizer::loss_scale_step_counter(int replica) const {
  if (!step_counter_) return 0;
  return read_scalar<std::int64_t>(step_counter_->value(replica));
}

std::pair<std::int64_t, std::int64_t> Optimizer::update_range(std::size_t variable, int replica) const {
  const auto& sharding = shards_[variable];
  // A replica holding nothing of it (another pipeline stage's weight) updates nothing.
  if (!sharding || variables_[variable]->value(replica).num_elements() == 0) {
    return {0, variables_[variable]->value(replica).num_elements()};
  }
  const int s = shard_of(replica);
  // Stage 3: the replica's copy of the variable is its shard itself, from its first element.
  const std::int64_t first = variables_[variable]->sharding() ? 0 : sharding->begin(s);
  return {first, sharding->end(s) - sharding->begin(s)};
}

// The data-parallel shard (Strategy::data_shard): every replica in sync's own under data
// parallelism; under tensor parallelism the batch-axis position, each piece sharded along it.
int Optimizer::shard_of(int replica) const { return variables_.front()->strategy().data_shard(replica); }

void Optimizer::sum_over_replicas(int replica, std::vector<double>& values) const {
  strategy::Strategy& owner = variables_.front()->strategy();
  if (owner.num_replicas_in_sync() == 1 || values.empty()) return;
  auto& device = variables_.front()->value(replica).device();
  Tensor buffer = Tensor::from_vector(values, {static_cast<std::int64_t>(values.size())}).to(device);
  owner.communicator(replica).all_reduce(buffer, collective::ReduceOp::kSum,
                                         {.timeout = owner.distribution_options().collective_timeout});
  values = buffer.to(devices::default_cpu_device()).to_vector<double>();
}

// Per variable, its gradient's squared norm, summed in one order however the state is sharded:
// over the shards of ShardSpec::even across the replicas in sync (each in its own chunked
// pass), then the shards in order. Under ZeRO each replica has its own shard's sums only; the
// table [shard][variable] is then completed by one small all-reduce, exact since every entry is
// non-zero on one replica only. Unsharded, each replica fills every row itself: the same numbers,
// so clipping is bitwise the same with and without ZeRO on the same replica count (and, on one
// replica, one pass per gradient as before).
std::vector<double> Optimizer::squared_norms(int replica, const std::vector<Tensor>& gradients) const {
  const int n = variables_.front()->strategy().data_shards_in_sync();
  const std::size_t count = variables_.size();
  const int me = shard_of(replica);
  std::vector<double> table(static_cast<std::size_t>(n) * count, 0.0);
  for (std::size_t vi = 0; vi < count; ++vi) {
    const auto& sharding = shards_[vi];
    const strategy::ShardSpec spec = sharding ? *sharding : strategy::ShardSpec::even(variables_[vi]->graph_shape(), n);
    for (int q = 0; q < n; ++q) {
      if (sharded_ && q != me) continue;  // another replica's row
      const std::int64_t b = spec.begin(q), e = spec.end(q);
      const Tensor part = sharding ? strategy::flat_view(gradients[vi], 0, e - b)
                                   : strategy::flat_view(gradients[vi], b, e - b);
      table[static_cast<std::size_t>(q) * count + vi] = squared_norm_of(part);
    }
  }
  if (sharded_) sum_over_replicas(replica, table);
  std::vector<double> norms(count, 0.0);
  for (std::size_t vi = 0; vi < count; ++vi) {
    for (int q = 0; q < n; ++q) norms[vi] += table[static_cast<std::size_t>(q) * count + vi];
  }
  return norms;
}

bool Optimizer::apply(int replica, const std::vector<Tensor>& gradients) {
  // An undefined gradient stands for a variable apply_variable updated, which only an update
  // that looks at one variable at a time allows (norms and the inf/NaN check read every gradient).
  for (std::size_t vi = 0; vi < gradients.size() && vi < variables_.size(); ++vi) {
    TANDEM_REQUIRE(gradients[vi].defined() || updates_per_variable(replica), InvalidArgument,
                   "{}: no gradient for variable \"{}\"; only an update without loss scaling, clipping by norm or "
                   "accumulation takes variables one at a time (apply_variable)",
                   name(), variables_[vi]->name());
  }
  if (!loss_scale_ || !dynamic_scale_) {
    update(replica, gradients, 1.0);
    return true;
  }
  TANDEM_REQUIRE(gradients.size() == variables_.size(), InvalidArgument, "{}: {} gradients for {} variables", name(),
                 gradients.size(), variables_.size());
  Tensor& scale_copy = dynamic_scale_->value(replica);
  Tensor& counter_copy = step_counter_->value(replica);
  const float scale = read_scalar<float>(scale_copy);
  // Under ZeRO each replica holds other shards: every replica must take the same decision.
  std::vector<double> non_finite{all_finite(gradients) ? 0.0 : 1.0};
  if (sharded_) sum_over_replicas(replica, non_finite);
  if (non_finite.front() != 0.0) {
    write_scalar(scale_copy, scale * 0.5f);
    write_scalar(counter_copy, std::int64_t{0});
    return false;
  }
  update(replica, gradients, 1.0 / static_cast<double>(scale));
  const std::int64_t counter = read_scalar<std::int64_t>(counter_copy);
  if (counter + 1 >= loss_scale_->dynamic_growth_steps) {
    write_scalar(scale_copy, scale * 2.0f);
    write_scalar(counter_copy, std::int64_t{0});
  } else {
    write_scalar(counter_copy, counter + 1);
  }
  return true;
}

void Optimizer::update(int replica, const std::vector<Tensor>& gradients, double unscale) {
  TANDEM_REQUIRE(gradients.size() == variables_.size(), InvalidArgument, "{}: {} gradients for {} variables", name(),
                 gradients.size(), variables_.size());
  const Clip clip = clip_of(spec_);
  // With accumulation the gradients are sums over the accumulated steps: their mean is what
  // Keras clips and applies. Under loss scaling they are also divided by the scale (a power of
  // two: exact), folded into the same factor so that unscaling costs no pass of its own.
  const double mean_scale = unscale / static_cast<double>(accumulation_steps_);
  if (variables_.empty()) return;
  // Clipping by norm needs the gradients' norms first (across shards under ZeRO).
  std::vector<double> norms;
  if (clip.clipnorm || clip.global_clipnorm) norms = squared_norms(replica, gradients);
  double global_scale = 1.0;
  if (clip.global_clipnorm && !clip.clipnorm) {
    double total = 0;
    for (const double squared : norms) total += squared;
    const double norm = std::sqrt(total) * mean_scale;
    if (norm > *clip.global_clipnorm) global_scale = *clip.global_clipnorm / norm;
  }
  global_scale *= mean_scale;

  if (!variables_.front()->value(replica).device().host_accessible()) {
    update_on_device(replica, gradients, global_scale, mean_scale, norms);
    return;
  }

  for (std::size_t vi = 0; vi < variables_.size(); ++vi) {
    if (!gradients[vi].defined()) continue;  // apply_variable updated it during backward
    update_host_variable(replica, vi, gradients[vi], global_scale, mean_scale, norms);
  }
  for (auto& acc : accumulators_) {
    Tensor& a = acc->value(replica);
    a.device().fill_zero(a.raw_data(), a.nbytes());
  }
}

// One variable of update() on the host: its range (its shard under ZeRO) with the step's numbers.
void Optimizer::update_host_variable(int replica, std::size_t vi, const Tensor& grad, double global_scale,
                                     double mean_scale, const std::vector<double>& norms) {
  const Clip clip = clip_of(spec_);
  const double lr = learning_rate();
  const auto t = static_cast<double>(iterations_ + 1);
  Tensor& w = variables_[vi]->value(replica);
  const auto [first, n] = update_range(vi, replica);
  require_matching_gradient(name(), *variables_[vi], w, grad,
                            shards_[vi] && w.num_elements() > 0 ? Shape{shards_[vi]->shard_elements} : w.shape());
  auto& device = w.device();
  graph::dispatch<graph::FloatTypes>(w.dtype(), name(), [&]<class T>() {
    T* var = static_cast<T*>(w.raw_data()) + first;
    const T* g = static_cast<const T*>(grad.raw_data());
    double scale = global_scale;
    if (clip.clipnorm) {
      const double norm = std::sqrt(norms[vi]) * mean_scale;
      if (norm > *clip.clipnorm) scale *= *clip.clipnorm / norm;
    }
    GradientTransform<T> gt{static_cast<T>(scale), static_cast<T>(clip.clipvalue.value_or(0)),
                            clip.clipvalue && !clip.clipnorm && !clip.global_clipnorm};
    std::array<T*, kMaxSlots> slot{};
    for (std::size_t s = 0; s < slots_[vi].size(); ++s)
      slot[s] = static_cast<T*>(slots_[vi][s]->value(replica).raw_data());

    const ops::cpu::UpdateLoops<T>& loops = ops::cpu::update_loops<T>();
    std::visit(
        [&](const auto& o) {
          using O = std::decay_t<decltype(o)>;
          if constexpr (std::is_same_v<O, SGD>) {
            const SgdStep<T> step{static_cast<T>(lr), static_cast<T>(o.momentum), o.nesterov};
            device.parallel_for(n, kUpdateGrain, [&, step, gt](std::int64_t b, std::int64_t e) {
              loops.sgd(var, slot[0], g, b, e, step, gt);
            });
          } else if constexpr (std::is_same_v<O, RMSprop>) {
            const RmspropStep<T> step{static_cast<T>(lr), static_cast<T>(o.rho), static_cast<T>(o.momentum),
                                      static_cast<T>(o.epsilon)};
            T* mom = o.momentum > 0 ? slot[1] : nullptr;
            T* average = o.centered ? slot[o.momentum > 0 ? 2 : 1] : nullptr;
            device.parallel_for(n, kUpdateGrain, [&, step, gt](std::int64_t b, std::int64_t e) {
              loops.rmsprop(var, slot[0], mom, average, g, b, e, step, gt);
            });
          } else {  // Adam, AdamW (AdamW first decays: w -= w * weight_decay * lr)
            T decay = T(0);
            if constexpr (std::is_same_v<O, AdamW>) {
              if (decays_[vi]) decay = static_cast<T>(o.weight_decay * lr);
            }
            const double beta1_power = std::pow(o.beta_1, t), beta2_power = std::pow(o.beta_2, t);
            const AdamStep<T> step{static_cast<T>(lr * std::sqrt(1.0 - beta2_power) / (1.0 - beta1_power)),
                                   static_cast<T>(1.0 - o.beta_1), static_cast<T>(1.0 - o.beta_2),
                                   static_cast<T>(o.epsilon), decay};
            T* v_hat = o.amsgrad ? slot[2] : nullptr;
            device.parallel_for(n, kUpdateGrain, [&, step, gt](std::int64_t b, std::int64_t e) {
              loops.adam(var, slot[0], slot[1], v_hat, g, b, e, step, gt);
            });
          }
        },
        spec_);
  });
}

bool Optimizer::updates_per_variable(int replica) const {
  if (variables_.empty() || loss_scale_ || accumulation_steps_ != 1) return false;
  const Clip clip = clip_of(spec_);
  if (clip.clipnorm || clip.global_clipnorm) return false;
  return variables_.front()->value(replica).device().host_accessible();
}

void Optimizer::apply_variable(int replica, std::size_t variable, const Tensor& gradient) {
  TANDEM_REQUIRE(updates_per_variable(replica), FailedPrecondition,
                 "{}: apply_variable needs an update that looks at one variable at a time (no loss scaling, "
                 "no clipping by norm, no gradient accumulation) on variables in host memory",
                 name());
  TANDEM_REQUIRE(variable < variables_.size() && gradient.defined(), InvalidArgument,
                 "{}: apply_variable of variable {} of {}{}", name(), variable, variables_.size(),
                 gradient.defined() ? "" : " with no gradient");
  update_host_variable(replica, variable, gradient, 1.0, 1.0, {});
}

// The fused kernel's numbers: the rule's scalars as update() computes them for the coming step.
ops::detail::UpdateParams Optimizer::device_update_params(double global_scale) const {
  const Clip clip = clip_of(spec_);
  const double lr = learning_rate();
  const auto t = static_cast<double>(iterations_ + 1);
  ops::detail::UpdateParams params;
  params.clip = clip.clipvalue && !clip.clipnorm && !clip.global_clipnorm;
  params.clip_value = clip.clipvalue.value_or(0);
  params.gradient_scale = global_scale;
  std::visit(
      [&](const auto& o) {
        using O = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<O, SGD>) {
          params.rule = ops::detail::UpdateRule::kSgd;
          params.rate = lr;
          params.momentum = o.momentum;
          params.nesterov = o.nesterov;
        } else if constexpr (std::is_same_v<O, RMSprop>) {
          params.rule = ops::detail::UpdateRule::kRmsprop;
          params.rate = lr;
          params.rho = o.rho;
          params.momentum = o.momentum;
          params.epsilon = o.epsilon;
        } else {
          params.rule = ops::detail::UpdateRule::kAdam;
          if constexpr (std::is_same_v<O, AdamW>) params.decay = o.weight_decay * lr;
          const double beta1_power = std::pow(o.beta_1, t), beta2_power = std::pow(o.beta_2, t);
          params.rate = lr * std::sqrt(1.0 - beta2_power) / (1.0 - beta1_power);
          params.beta_1_complement = 1.0 - o.beta_1;
          params.beta_2_complement = 1.0 - o.beta_2;
          params.epsilon = o.epsilon;
        }
      },
      spec_);
  return params;
}

std::vector<ops::detail::UpdateTensor> Optimizer::device_update_tensors(int replica,
                                                                        const std::vector<Tensor>& gradients) const {
  TANDEM_REQUIRE(gradients.size() == variables_.size(), InvalidArgument, "{}: {} gradients for {} variables", name(),
                 gradients.size(), variables_.size());
  std::vector<ops::detail::UpdateTensor> tensors;
  for (std::size_t vi = 0; vi < variables_.size(); ++vi) {
    const Tensor& w = variables_[vi]->value(replica);
    const Tensor& grad = gradients[vi];
    const auto [first, n] = update_range(vi, replica);
    require_matching_gradient(name(), *variables_[vi], w, grad,
                              shards_[vi] && w.num_elements() > 0 ? Shape{shards_[vi]->shard_elements} : w.shape());
    ops::detail::UpdateTensor u;
    u.var = static_cast<std::byte*>(w.raw_data()) + static_cast<std::size_t>(first) * graph::dtype_size(w.dtype());
    u.grad = grad.raw_data();
    u.elements = n;
    u.weight_decay = decays_[vi];  // params.decay applies to this tensor (not excluded)
    // Slot order per rule (slot_names): SGD {momentum}; RMSprop {velocity, [momentum], [average]};
    // Adam {m, v, [v_hat]}. The kernel's RMSprop wants {velocity, momentum, average} by position.
    const auto slot_data = [&](std::size_t s) { return slots_[vi][s]->value(replica).raw_data(); };
    std::visit(
        [&](const auto& o) {
          using O = std::decay_t<decltype(o)>;
          if constexpr (std::is_same_v<O, RMSprop>) {
            u.slots[0] = slot_data(0);
            std::size_t next = 1;
            if (o.momentum > 0) u.slots[1] = slot_data(next++);
            if (o.centered) u.slots[2] = slot_data(next++);
          } else {
            for (std::size_t s = 0; s < slots_[vi].size(); ++s) u.slots[s] = slot_data(s);
          }
        },
        spec_);
    tensors.push_back(u);
  }
  return tensors;
}

// The same step for variables in GPU memory: one fused kernel launch for all variables (per
// variable under clipnorm, whose factor differs).
void Optimizer::update_on_device(int replica, const std::vector<Tensor>& gradients, double global_scale,
                                 double mean_scale, const std::vector<double>& norms) {
  const Clip clip = clip_of(spec_);
  ops::detail::UpdateParams params = device_update_params(global_scale);
  const auto tensors = device_update_tensors(replica, gradients);
  auto& device = variables_.front()->value(replica).device();
  const DType dtype = variables_.front()->dtype();
  const bool uniform_dtype =
      std::all_of(variables_.begin(), variables_.end(), [&](const auto& v) { return v->dtype() == dtype; });
  if (!clip.clipnorm && uniform_dtype) {
    ops::detail::apply_update_on_device(device, dtype, params, tensors);
  } else {
    for (std::size_t vi = 0; vi < tensors.size(); ++vi) {
      double scale = global_scale;
      if (clip.clipnorm) {
        const double norm = std::sqrt(norms[vi]) * mean_scale;
        if (norm > *clip.clipnorm) scale *= *clip.clipnorm / norm;
      }
      params.gradient_scale = scale;
      ops::detail::apply_update_on_device(device, variables_[vi]->dtype(), params, {&tensors[vi], 1});
    }
  }
  for (auto& acc : accumulators_) {
    Tensor& a = acc->value(replica);
    a.device().fill_zero(a.raw_data(), a.nbytes());
  }
}

// --- Updates recorded in CUDA graphs ---------------------------------------------------------------

bool Optimizer::can_update_from_device_memory(int replica) const {
  if (variables_.empty() || loss_scale_ || accumulation_steps_ != 1 || sharded_) return false;
  const Clip clip = clip_of(spec_);
  if (clip.clipnorm || clip.global_clipnorm) return false;
  const Tensor& first = variables_.front()->value(replica);
  if (first.device().host_accessible()) return false;
  const DType dtype = first.dtype();
  if (dtype != DType::kF32 && dtype != DType::kF64) return false;
  return std::all_of(variables_.begin(), variables_.end(), [&](const auto& v) { return v->dtype() == dtype; });
}

void Optimizer::stage_update_params(int replica) {
  TANDEM_REQUIRE(can_update_from_device_memory(replica), FailedPrecondition,
                 "{}: replica {}'s update cannot read its numbers from device memory", name(), replica);
  if (staged_params_.size() <= static_cast<std::size_t>(replica))
    staged_params_.resize(static_cast<std::size_t>(replica) + 1);
  auto& staged = staged_params_[static_cast<std::size_t>(replica)];
  auto& device = variables_.front()->value(replica).device();
  constexpr std::size_t kBytes = sizeof(ops::detail::UpdateParams);
  if (staged == nullptr) {
    staged = std::make_unique<StagedParams>();
    staged->host = devices::PinnedHostBuffer(device, kBytes);
    staged->on_device = Tensor::empty({static_cast<std::int64_t>(kBytes)}, DType::kU8, device);
    staged->copied = device.create_event();
  }
  if (staged->copy_pending) staged->copied->synchronize();
  const ops::detail::UpdateParams params = device_update_params(1.0);
  std::memcpy(staged->host.data(), &params, kBytes);
  device.copy_from_host_async(staged->on_device.raw_data(), staged->host.data(), kBytes, device.compute_stream());
  staged->copied->record(device.compute_stream());
  staged->copy_pending = true;
}

void Optimizer::queue_update_from_device_memory(int replica, const std::vector<Tensor>& gradients,
                                                const void* fault_word) {
  TANDEM_REQUIRE(staged_params_.size() > static_cast<std::size_t>(replica) &&
                     staged_params_[static_cast<std::size_t>(replica)] != nullptr,
                 FailedPrecondition, "{}: replica {}'s update numbers were never staged (stage_update_params)", name(),
                 replica);
  const auto tensors = device_update_tensors(replica, gradients);
  auto& device = variables_.front()->value(replica).device();
  // The kernel reads the staged copy: the by-value numbers are not looked at.
  ops::detail::apply_update_on_device(
      device, variables_.front()->dtype(), ops::detail::UpdateParams{}, tensors,
      {.params = staged_params_[static_cast<std::size_t>(replica)]->on_device.raw_data(), .fault_word = fault_word});
}

std::vector<const void*> Optimizer::update_addresses(int replica) const {
  std::vector<const void*> addresses;
  for (std::size_t vi = 0; vi < variables_.size(); ++vi) {
    addresses.push_back(variables_[vi]->value(replica).raw_data());
    for (const auto& slot : slots_[vi]) addresses.push_back(slot->value(replica).raw_data());
  }
  if (staged_params_.size() > static_cast<std::size_t>(replica) && staged_params_[static_cast<std::size_t>(replica)]) {
    addresses.push_back(staged_params_[static_cast<std::size_t>(replica)]->on_device.raw_data());
  }
  return addresses;
}

}  // namespace tandem::keras
