// tandem/keras_like/schedules.h — Keras 3's learning-rate schedules (keras.optimizers.schedules)
// and the learning rate every optimizer takes: a constant or one of them.
//
//   model.compile(keras::AdamW{.learning_rate = keras::CosineDecay{.initial_learning_rate = 0,
//                                                                  .decay_steps = 4750,
//                                                                  .warmup_target = 1e-3,
//                                                                  .warmup_steps = 250}}, ...);
//   model.compile(keras::SGD{.learning_rate = 0.1}, ...);
//
// The optimizer evaluates its schedule at its iterations before each step (Keras's
// schedule(optimizer.iterations), before the increment): the first step uses schedule(0). The
// formulas are Keras 3's, evaluated in float64 (Keras evaluates them in float32).
//
// Callers: keras_like/optimizers (each optimizer's learning_rate field), saving.cc (training
// checkpoints carry the schedule's config). Nothing blocks. Converting a schedule with bad
// arguments into a LearningRate (which an optimizer's `.learning_rate = schedule` does) throws
// InvalidArgument naming the schedule and the argument, so a bad schedule never reaches a step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace tandem::keras {

// Cosine decay from initial_learning_rate to initial_learning_rate * alpha over decay_steps
// steps, then constant. With warmup_target: first a linear warmup from initial_learning_rate to
// warmup_target over warmup_steps steps, then the cosine decay from warmup_target to
// warmup_target * alpha over decay_steps more.
struct CosineDecay {
  double initial_learning_rate = 0.0;
  std::int64_t decay_steps = 0;  // required: > 0
  double alpha = 0.0;
  std::string name = "CosineDecay";
  std::optional<double> warmup_target;
  std::int64_t warmup_steps = 0;
  bool operator==(const CosineDecay&) const = default;
};

// initial_learning_rate * decay_rate ^ (step / decay_steps); the exponent's division is an
// integer one (floor) under staircase.
struct ExponentialDecay {
  double initial_learning_rate = 0.0;
  std::int64_t decay_steps = 0;  // required: > 0
  double decay_rate = 0.0;
  bool staircase = false;
  std::string name = "ExponentialDecay";
  bool operator==(const ExponentialDecay&) const = default;
};

// values[0] while step <= boundaries[0], values[i] while boundaries[i-1] < step <= boundaries[i],
// values.back() after the last boundary. boundaries strictly increasing, one value more.
struct PiecewiseConstantDecay {
  std::vector<std::int64_t> boundaries;
  std::vector<double> values;
  std::string name = "PiecewiseConstant";
  bool operator==(const PiecewiseConstantDecay&) const = default;
};

// initial_learning_rate / (1 + decay_rate * step / decay_steps); the division floored under
// staircase.
struct InverseTimeDecay {
  double initial_learning_rate = 0.0;
  std::int64_t decay_steps = 0;  // required: > 0
  double decay_rate = 0.0;
  bool staircase = false;
  std::string name = "InverseTimeDecay";
  bool operator==(const InverseTimeDecay&) const = default;
};

// An optimizer's learning rate: a constant (the optimizer may change it: set_learning_rate,
// ReduceLROnPlateau) or a schedule of the step (fixed: Keras refuses to set a float over it).
class LearningRate {
 public:
  using Value = std::variant<double, CosineDecay, ExponentialDecay, PiecewiseConstantDecay, InverseTimeDecay>;

  // A constant is checked by the optimizer that takes it (its error names the optimizer); a
  // schedule here: InvalidArgument naming it and the argument (decay_steps <= 0, a negative or
  // non-finite rate, boundaries not strictly increasing, values not one more than boundaries).
  LearningRate(double constant) : value_(constant) {}  // NOLINT: `.learning_rate = 1e-3`
  LearningRate(CosineDecay schedule);                  // NOLINT: `.learning_rate = CosineDecay{...}`
  LearningRate(ExponentialDecay schedule);             // NOLINT
  LearningRate(PiecewiseConstantDecay schedule);       // NOLINT
  LearningRate(InverseTimeDecay schedule);             // NOLINT

  // The rate of the step that follows `iterations` completed steps (iterations >= 0).
  double operator()(std::int64_t iterations) const;
  bool is_schedule() const { return !std::holds_alternative<double>(value_); }
  const Value& value() const { return value_; }
  // Keras's class name ("CosineDecay"), "constant" for a constant.
  std::string_view kind() const;
  // The schedule as Keras's keras.optimizers.schedules.serialize() writes it, in one line:
  // {"class_name": "CosineDecay", "config": {"initial_learning_rate": 0.0, ...}}; a constant as its
  // number. Equal configs give equal text.
  std::string to_json() const;

  bool operator==(const LearningRate&) const = default;

 private:
  Value value_;
};

}  // namespace tandem::keras
