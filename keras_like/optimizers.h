// tandem/keras_like/optimizers.h — optimizers with Keras 3's update rules and defaults.
//
//   model.compile("adam", ...);                                      // Adam{} defaults
//   model.compile(keras::SGD{.learning_rate = 0.1, .momentum = 0.9, .nesterov = true}, ...);
//   model.compile(keras::LossScaleOptimizer{.inner_optimizer = keras::Adam{}}, ...);  // float16
//   model.compile(keras::AdamW{.learning_rate = keras::CosineDecay{.initial_learning_rate = 1e-3,
//                                                                  .decay_steps = 5000},
//                              .exclude_from_weight_decay = {"bias", "gamma", "beta"}}, ...);
//
// learning_rate is a constant or a schedule (schedules.h): the rate of each step is the
// schedule's value at the optimizer's iterations before that step, as in Keras.
//
// The update of each variable runs as one fused pass over its elements on the replica's device
// (clip, decay, moments and the step together). Every replica applies the same (all-reduced)
// gradients to its own copy, so copies stay equal without another exchange. Under ZeRO
// (DistributionOptions::zero k1, k2) the strategy reduce-scatters the gradients instead: each
// replica gets its shard of each gradient, keeps its shard of each slot, and updates its range
// of each variable; the gradient reducer's gather_updated then makes the copies whole. Norms for
// clipping and the loss scale's finiteness check are agreed across the shards (one small
// all-reduce each), so results are bitwise those without ZeRO on the same replica count.
// Gradient accumulators stay whole under stages 1 and 2.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "tandem/graph/tensor.h"
#include "tandem/keras_like/schedules.h"
#include "tandem/strategy/variable.h"

namespace tandem::ops::detail {
struct UpdateParams;
struct UpdateTensor;
}  // namespace tandem::ops::detail

namespace tandem::keras {

using VariablePtr = std::shared_ptr<strategy::Variable>;

// Gradient clipping, as Keras: clipnorm clips each gradient's norm, clipvalue each element,
// global_clipnorm the norm of all gradients together (at most one of the two norms).
// gradient_accumulation_steps = N (Keras 3): the weights change every N-th step, with the mean
// of the last N steps' gradients; iterations still count every step. Under a distribution
// strategy the steps in between do not all-reduce (like DDP's no_sync).
struct SGD {
  LearningRate learning_rate = 0.01;
  double momentum = 0.0;
  bool nesterov = false;
  std::optional<double> clipnorm, clipvalue, global_clipnorm;
  std::optional<int> gradient_accumulation_steps;
};
struct Adam {
  LearningRate learning_rate = 0.001;
  double beta_1 = 0.9;
  double beta_2 = 0.999;
  double epsilon = 1e-7;
  bool amsgrad = false;
  std::optional<double> clipnorm, clipvalue, global_clipnorm;
  std::optional<int> gradient_accumulation_steps;
};
struct AdamW {
  LearningRate learning_rate = 0.001;
  double weight_decay = 0.004;
  double beta_1 = 0.9;
  double beta_2 = 0.999;
  double epsilon = 1e-7;
  bool amsgrad = false;
  std::optional<double> clipnorm, clipvalue, global_clipnorm;
  std::optional<int> gradient_accumulation_steps;
  // Keras's exclude_from_weight_decay(var_names=...): a variable whose name ("dense/bias",
  // "layer_normalization/gamma") contains a match of any of these regular expressions is not
  // decayed. {"bias", "gamma", "beta"} keeps biases and normalisation weights out.
  std::vector<std::string> exclude_from_weight_decay;
};
struct RMSprop {
  LearningRate learning_rate = 0.001;
  double rho = 0.9;
  double momentum = 0.0;
  double epsilon = 1e-7;
  bool centered = false;
  std::optional<double> clipnorm, clipvalue, global_clipnorm;
  std::optional<int> gradient_accumulation_steps;
};

using OptimizerSpec = std::variant<SGD, Adam, AdamW, RMSprop>;

// The slots a rule keeps per variable, in the order its update uses them: SGD {momentum} (none
// without momentum); RMSprop {velocity, [momentum], [average_gradient]}; Adam and AdamW {m, v,
// [v_hat]}. What Optimizer::build creates, and what keras::distribution::plan counts.
std::vector<std::string> slot_names(const OptimizerSpec& spec);

// Keras 3's LossScaleOptimizer: dynamic loss scaling around another optimizer, so that small
// float16 gradients do not underflow. Every training step, fit() multiplies the loss by the
// current scale and, after the gradient all-reduce, checks the gradients:
//   - all finite: applies them divided by the scale (exact: the scale is a power of two) through
//     the inner optimizer, and counts the step; after dynamic_growth_steps such steps in a row the
//     scale doubles and the count restarts;
//   - any inf or NaN: the step is skipped (weights, slots and iterations unchanged), the scale
//     halves and the count restarts. As in Keras 3 there is no floor.
// The scale and the count are optimizer state (Keras's dynamic_scale and step_counter): training
// checkpoints and BackupAndRestore keep them. Every replica sees the same all-reduced gradients,
// so all replicas take the same decision without another exchange (under ZeRO each sees its shard
// only, and one small all-reduce of the verdict makes them agree). The inner optimizer may not
// use gradient_accumulation_steps (Unimplemented).
struct LossScaleOptimizer {
  OptimizerSpec inner_optimizer = Adam{};
  double initial_scale = 32768.0;  // 2^15
  int dynamic_growth_steps = 2000;
};

// An optimizer as compile() takes it: "sgd", "adam", "adamw", "rmsprop" (Keras defaults) or an
// object. An unknown name throws InvalidArgument listing the known ones.
class OptimizerRef {
 public:
  OptimizerRef(const char* name) : OptimizerRef(std::string_view(name)) {}         // NOLINT: Keras strings
  OptimizerRef(std::string_view name);                                             // NOLINT
  OptimizerRef(const std::string& name) : OptimizerRef(std::string_view(name)) {}  // NOLINT
  template <class O>
  requires std::is_constructible_v<OptimizerSpec, O> OptimizerRef(O optimizer)
      : spec_(std::move(optimizer)) {}        // NOLINT
  OptimizerRef(LossScaleOptimizer optimizer)  // NOLINT
      : spec_(optimizer.inner_optimizer), loss_scale_(std::move(optimizer)) {}

  // The optimizer that updates the weights (the inner one under loss scaling).
  const OptimizerSpec& spec() const { return spec_; }
  // Set when the optimizer is a LossScaleOptimizer.
  const std::optional<LossScaleOptimizer>& loss_scale_optimizer() const { return loss_scale_; }

 private:
  OptimizerSpec spec_;
  std::optional<LossScaleOptimizer> loss_scale_;
};

// The optimizer a compiled model owns. Thread-safety: apply() for different replicas may run
// concurrently (each touches its own copies); everything else from one thread between steps.
class Optimizer {
 public:
  explicit Optimizer(OptimizerSpec spec);
  // Loss scaling around spec.inner_optimizer. Throws InvalidArgument for a scale that is not a
  // positive finite number or dynamic_growth_steps < 1.
  explicit Optimizer(LossScaleOptimizer spec);
  ~Optimizer();

  // The optimizer that updates the weights (the inner one under loss scaling).
  const OptimizerSpec& spec() const { return spec_; }
  const std::optional<LossScaleOptimizer>& loss_scale_optimizer() const { return loss_scale_; }
  std::string name() const;  // "adam"; "loss_scale_optimizer(adam)" under loss scaling
  // The rate the coming step uses: the constant, or the schedule at iterations() (Keras's
  // optimizer.learning_rate).
  double learning_rate() const { return learning_rate_(iterations_); }
  // What the optimizer was given: a constant (changed by set_learning_rate) or a schedule.
  const LearningRate& learning_rate_config() const { return learning_rate_; }
  // Keras's `optimizer.learning_rate = x`: a schedule replaces what was there; a constant
  // replaces a constant, and over a schedule throws FailedPrecondition (Keras's TypeError: the
  // optimizer was created with a LearningRateSchedule). A negative or non-finite constant throws
  // InvalidArgument.
  void set_learning_rate(LearningRate learning_rate);
  // Steps applied so far (Keras's optimizer.iterations).
  std::int64_t iterations() const { return iterations_; }
  void set_iterations(std::int64_t iterations) { iterations_ = iterations; }

  // Keras's exclude_from_weight_decay(var_list, var_names): the variables of var_list, and those
  // whose name contains a match of a regular expression of var_names, are not decayed (AdamW's
  // weight_decay; the other rules decay nothing). Replaces the previous exclusions, the spec's
  // exclude_from_weight_decay included. Keras 3 searches the variable's short name ("bias"); the
  // names here are paths ("dense/bias"), so a pattern may name a layer too. Throws
  // FailedPrecondition once built (as Keras: before the first step or build()), InvalidArgument
  // for a pattern that is not a regular expression.
  void exclude_from_weight_decay(const std::vector<VariablePtr>& var_list = {},
                                 const std::vector<std::string>& var_names = {});
  // Whether the update decays this variable (weight decay on, and not excluded).
  bool uses_weight_decay(const strategy::Variable& variable) const;

  // Creates the slots (moments, momentum) of these variables, through each variable's own
  // strategy: a slot under a different strategy's scope than its variable is FailedPrecondition
  // naming both. Idempotent for the same variables.
  void build(const std::vector<VariablePtr>& variables);
  // Applies one gradient per built variable (same order; each on the replica's device, same
  // shape, or for a variable the strategy reduce-scatters (ZeRO) the 1-D shard [shard_elements]
  // of replica's range) to replica `replica`'s copies. Does not advance iterations. With gradient
  // accumulation, call it on update steps only, with the gradients summed over the accumulated
  // steps (accumulators()); it divides by the step count and clears this replica's accumulators.
  // Under loss scaling the gradients are those of the scaled loss: a finite step applies them
  // unscaled and counts it in replica's copy of the loss-scale state, a non-finite one changes
  // only that state (see LossScaleOptimizer). Returns whether the weights were updated (false
  // only for a skipped step: then do not call finish_step()). Every replica must get the same
  // gradients, so that their loss-scale states stay equal.
  // An undefined entry is a variable apply_variable already updated this step.
  bool apply(int replica, const std::vector<Tensor>& gradients);

  // --- Updates during backward (ZeRO stages 2 and 3: strategy::GradientReducerOptions::update) --
  // Whether apply_variable may update replica's variables one at a time, as their gradients
  // arrive: nothing in the step's update looks across variables or waits for the whole step (no
  // loss scaling, no clipping by norm, no gradient accumulation), and the variables are in host
  // memory (a GPU replica's update is one fused launch).
  bool updates_per_variable(int replica) const;
  // Applies built variable `variable`'s gradient (its shard under ZeRO) to replica's copy exactly
  // as apply() would this step: the same numbers, bitwise. Then pass apply() an undefined tensor
  // for it. Caller: replica's thread, while backward still runs (the gradient reducer's release
  // of a handed-off gradient). Throws FailedPrecondition unless updates_per_variable(replica).
  void apply_variable(int replica, std::size_t variable, const Tensor& gradient);

  // The factor the training loss is multiplied by: the current dynamic scale (replica's copy;
  // all copies are equal), 1 without loss scaling; the initial scale before build().
  double loss_scale(int replica = 0) const;
  // Finite steps since the scale last changed (Keras's step_counter); 0 without loss scaling.
  std::int64_t loss_scale_step_counter(int replica = 0) const;

  // Gradient accumulation (1 when off).
  int accumulation_steps() const { return accumulation_steps_; }
  // Whether the coming step changes the weights (always, without accumulation).
  bool is_update_step() const { return (iterations_ + 1) % accumulation_steps_ == 0; }
  // Per built variable, the sum of its gradients over the steps since the last update (slots,
  // so that checkpoints carry them); empty without accumulation. The strategy's gradient reducer
  // adds each micro-step's gradients into them and folds them into the update step's gradients;
  // apply() clears them.
  const std::vector<VariablePtr>& accumulators() const { return accumulators_; }
  // Ends a step: iterations += 1. Call once per step after every replica's apply().
  void finish_step() { ++iterations_; }

  // --- Updates recorded in a CUDA graph (the trainer's whole-step graphs) ---------------------
  // A graph replays its kernels with the arguments they were recorded with, so the numbers that
  // change from step to step (the learning rate, Adam's bias corrections) must come from device
  // memory. Whether replica's update can: its variables are on a GPU, all of one dtype, and
  // nothing in the step needs the host (no loss scaling, no clipping by norm, no accumulation).
  bool can_update_from_device_memory(int replica) const;
  // Copies the coming step's numbers (as apply() would compute them at the current iterations())
  // into replica's device memory, queued on its compute stream before the step's work. Callers:
  // replica's thread, once per step, before the step is queued or replayed. Does not wait for the
  // device, except for the previous step's copy still pending.
  void stage_update_params(int replica);
  // Queues replica's update reading the numbers stage_update_params wrote: one fused launch, the
  // same work on every call, no host waits; the device skips it when *fault_word (device memory,
  // may be null) is non-zero. Does not advance iterations (finish_step() does).
  void queue_update_from_device_memory(int replica, const std::vector<Tensor>& gradients, const void* fault_word);
  // The device memory queue_update_from_device_memory touches besides the gradients (variables,
  // slots, the staged numbers): a recording holding it is stale when any of it moves.
  std::vector<const void*> update_addresses(int replica) const;

  // Slot variables by name ("dense/kernel/m"), for checkpoints. Under loss scaling the list
  // starts with "loss_scale_optimizer/dynamic_scale" (float32) and
  // "loss_scale_optimizer/step_counter" (int64), scalars.
  const std::vector<std::pair<std::string, VariablePtr>>& slots() const { return slot_list_; }
  const std::vector<VariablePtr>& variables() const { return variables_; }

 private:
  OptimizerSpec spec_;
  LearningRate learning_rate_;
  std::int64_t iterations_ = 0;
  // exclude_from_weight_decay's arguments; per built variable, whether it is decayed.
  std::vector<VariablePtr> excluded_variables_;
  std::vector<std::string> excluded_patterns_;
  std::vector<bool> decays_;
  std::vector<VariablePtr> variables_;
  // Per variable: its slots in the order the update rule uses them.
  std::vector<std::vector<VariablePtr>> slots_;
  std::vector<std::pair<std::string, VariablePtr>> slot_list_;
  int accumulation_steps_ = 1;
  std::vector<VariablePtr> accumulators_;  // per variable, when accumulating
  std::optional<LossScaleOptimizer> loss_scale_;
  VariablePtr dynamic_scale_, step_counter_;  // built with the slots, under loss scaling
  struct StagedParams;                        // per replica: stage_update_params's pinned and device copies
  std::vector<std::unique_ptr<StagedParams>> staged_params_;

  // ZeRO (DistributionOptions::zero >= k1): per variable, how it is sharded when the strategy
  // reduce-scatters its gradient (its gradient is then this replica's shard, its slots are
  // sharded, and the update covers this replica's range only); unset for whole variables.
  std::vector<std::optional<strategy::ShardSpec>> shards_;
  bool sharded_ = false;  // any variable is

  // apply()'s update, with the gradients multiplied by `unscale` (1 / loss scale).
  void update(int replica, const std::vector<Tensor>& gradients, double unscale);
  // update()'s work for one variable in host memory: replica's range of it, the gradient scaled by
  // global_scale (and clipped by its own norm, from `norms`, under clipnorm).
  void update_host_variable(int replica, std::size_t vi, const Tensor& grad, double global_scale, double mean_scale,
                            const std::vector<double>& norms);
  // update() for variables in GPU memory: one fused kernel for all of them (per variable under
  // clipnorm, with `norms` from squared_norms).
  void update_on_device(int replica, const std::vector<Tensor>& gradients, double global_scale, double mean_scale,
                        const std::vector<double>& norms);
  // The elements of variable `variable` replica updates: (first, count); all of them unless sharded.
  std::pair<std::int64_t, std::int64_t> update_range(std::size_t variable, int replica) const;
  // Replica's shard index (its global index among the replicas in sync).
  int shard_of(int replica) const;
  // Sums `values` over the replicas in sync, in place (one small all-reduce; replica's thread,
  // every replica alike).
  void sum_over_replicas(int replica, std::vector<double>& values) const;
  // Per variable, the squared norm of its whole gradient, in an order independent of sharding.
  std::vector<double> squared_norms(int replica, const std::vector<Tensor>& gradients) const;
  // The fused kernel's numbers for the coming step (gradient_scale = global_scale).
  ops::detail::UpdateParams device_update_params(double global_scale) const;
  // The fused kernel's tensors: replica's variables and slots with these gradients.
  std::vector<ops::detail::UpdateTensor> device_update_tensors(int replica, const std::vector<Tensor>& gradients) const;
};

}  // namespace tandem::keras
