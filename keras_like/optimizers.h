// tandem/keras_like/optimizers.h — optimizers with Keras 3's update rules and defaults.
//
//   model.compile("adam", ...);                                      // Adam{} defaults
//   model.compile(keras::SGD{.learning_rate = 0.1, .momentum = 0.9, .nesterov = true}, ...);
//
// The update of each variable runs as one fused pass over its elements on the replica's device
// (clip, decay, moments and the step together). Every replica applies the same (all-reduced)
// gradients to its own copy, so copies stay equal without another exchange.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "tandem/graph/tensor.h"
#include "tandem/strategy/variable.h"

namespace tandem::keras {

using VariablePtr = std::shared_ptr<strategy::Variable>;

// Gradient clipping, as Keras: clipnorm clips each gradient's norm, clipvalue each element,
// global_clipnorm the norm of all gradients together (at most one of the two norms).
// gradient_accumulation_steps = N (Keras 3): the weights change every N-th step, with the mean
// of the last N steps' gradients; iterations still count every step. Under a distribution
// strategy the steps in between do not all-reduce (like DDP's no_sync).
struct SGD {
  double learning_rate = 0.01;
  double momentum = 0.0;
  bool nesterov = false;
  std::optional<double> clipnorm, clipvalue, global_clipnorm;
  std::optional<int> gradient_accumulation_steps;
};
struct Adam {
  double learning_rate = 0.001;
  double beta_1 = 0.9;
  double beta_2 = 0.999;
  double epsilon = 1e-7;
  bool amsgrad = false;
  std::optional<double> clipnorm, clipvalue, global_clipnorm;
  std::optional<int> gradient_accumulation_steps;
};
struct AdamW {
  double learning_rate = 0.001;
  double weight_decay = 0.004;
  double beta_1 = 0.9;
  double beta_2 = 0.999;
  double epsilon = 1e-7;
  bool amsgrad = false;
  std::optional<double> clipnorm, clipvalue, global_clipnorm;
  std::optional<int> gradient_accumulation_steps;
};
struct RMSprop {
  double learning_rate = 0.001;
  double rho = 0.9;
  double momentum = 0.0;
  double epsilon = 1e-7;
  bool centered = false;
  std::optional<double> clipnorm, clipvalue, global_clipnorm;
  std::optional<int> gradient_accumulation_steps;
};

using OptimizerSpec = std::variant<SGD, Adam, AdamW, RMSprop>;

// An optimizer as compile() takes it: "sgd", "adam", "adamw", "rmsprop" (Keras defaults) or an
// object. An unknown name throws InvalidArgument listing the known ones.
class OptimizerRef {
 public:
  OptimizerRef(const char* name) : OptimizerRef(std::string_view(name)) {}  // NOLINT: Keras strings
  OptimizerRef(std::string_view name);                                       // NOLINT
  OptimizerRef(const std::string& name) : OptimizerRef(std::string_view(name)) {}  // NOLINT
  template <class O>
    requires std::is_constructible_v<OptimizerSpec, O>
  OptimizerRef(O optimizer) : spec_(std::move(optimizer)) {}  // NOLINT

  const OptimizerSpec& spec() const { return spec_; }

 private:
  OptimizerSpec spec_;
};

// The optimizer a compiled model owns. Thread-safety: apply() for different replicas may run
// concurrently (each touches its own copies); everything else from one thread between steps.
class Optimizer {
 public:
  explicit Optimizer(OptimizerSpec spec);
  ~Optimizer();

  const OptimizerSpec& spec() const { return spec_; }
  std::string name() const;  // "adam"
  double learning_rate() const { return learning_rate_; }
  void set_learning_rate(double learning_rate);
  // Steps applied so far (Keras's optimizer.iterations).
  std::int64_t iterations() const { return iterations_; }
  void set_iterations(std::int64_t iterations) { iterations_ = iterations; }

  // Creates the slots (moments, momentum) of these variables, through each variable's own
  // strategy: a slot under a different strategy's scope than its variable is FailedPrecondition
  // naming both. Idempotent for the same variables.
  void build(const std::vector<VariablePtr>& variables);
  // Applies one gradient per built variable (same order; each on the replica's device, same
  // shape) to replica `replica`'s copies. Does not advance iterations. With gradient
  // accumulation, call it on update steps only, with the gradients summed over the accumulated
  // steps (add_accumulated); it divides by the step count and clears this replica's accumulators.
  void apply(int replica, const std::vector<Tensor>& gradients);

  // Gradient accumulation (1 when off).
  int accumulation_steps() const { return accumulation_steps_; }
  // Whether the coming step changes the weights (always, without accumulation).
  bool is_update_step() const { return (iterations_ + 1) % accumulation_steps_ == 0; }
  // A step that is not an update step: adds the gradients to replica's accumulators.
  void accumulate(int replica, const std::vector<Tensor>& gradients);
  // An update step: adds replica's accumulated gradient of variable `index` into `gradient`.
  void add_accumulated(int replica, std::size_t index, Tensor& gradient);
  // Ends a step: iterations += 1. Call once per step after every replica's apply().
  void finish_step() { ++iterations_; }

  // Slot variables by name ("dense/kernel/m"), for checkpoints.
  const std::vector<std::pair<std::string, VariablePtr>>& slots() const { return slot_list_; }
  const std::vector<VariablePtr>& variables() const { return variables_; }

 private:
  OptimizerSpec spec_;
  double learning_rate_;
  std::int64_t iterations_ = 0;
  std::vector<VariablePtr> variables_;
  // Per variable: its slots in the order the update rule uses them.
  std::vector<std::vector<VariablePtr>> slots_;
  std::vector<std::pair<std::string, VariablePtr>> slot_list_;
  int accumulation_steps_ = 1;
  std::vector<VariablePtr> accumulators_;  // per variable, when accumulating
};

}  // namespace tandem::keras
