// Keras 3's learning-rate schedules (keras/src/optimizers/schedules/learning_rate_schedule.py):
// the same formulas, in float64, and their configs as Keras serialises them.
#include "tandem/keras_like/schedules.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "tandem/base/errors.h"

namespace tandem::keras {
namespace {

using Json = nlohmann::ordered_json;  // keys in Keras's get_config() order

template <class S>
constexpr std::string_view kind_of() {
  if constexpr (std::is_same_v<S, CosineDecay>) return "CosineDecay";
  if constexpr (std::is_same_v<S, ExponentialDecay>) return "ExponentialDecay";
  if constexpr (std::is_same_v<S, PiecewiseConstantDecay>) return "PiecewiseConstantDecay";
  if constexpr (std::is_same_v<S, InverseTimeDecay>) return "InverseTimeDecay";
}

// How errors name a schedule: its kind, and its name when the user gave one.
template <class S>
std::string describe(const S& schedule) {
  return schedule.name == S{}.name ? std::string(kind_of<S>())
                                   : fmt::format("{} \"{}\"", kind_of<S>(), schedule.name);
}

template <class S>
void require_rate(const S& schedule, std::string_view argument, double value) {
  TANDEM_REQUIRE(std::isfinite(value) && value >= 0, InvalidArgument,
                 "{}: {} must be finite and not negative; got {}",
                 describe(schedule), argument, value);
}

template <class S>
void require_decay_steps(const S& schedule) {
  TANDEM_REQUIRE(schedule.decay_steps > 0, InvalidArgument, "{}: decay_steps must be > 0; got {}", describe(schedule),
                 schedule.decay_steps);
}

void validate(const CosineDecay& s) {
  require_decay_steps(s);
  require_rate(s, "initial_learning_rate", s.initial_learning_rate);
  require_rate(s, "alpha", s.alpha);
  if (s.warmup_target) require_rate(s, "warmup_target", *s.warmup_target);
  TANDEM_REQUIRE(s.warmup_steps >= 0, InvalidArgument, "{}: warmup_steps must not be negative; got {}", describe(s),
                 s.warmup_steps);
}

// ExponentialDecay, InverseTimeDecay: the same arguments.
template <class S>
void validate_decay_rate_schedule(const S& s) {
  require_decay_steps(s);
  require_rate(s, "initial_learning_rate", s.initial_learning_rate);
  // A negative rate makes ExponentialDecay's power NaN and InverseTimeDecay's divisor reach zero.
  require_rate(s, "decay_rate", s.decay_rate);
}

void validate(const PiecewiseConstantDecay& s) {
  TANDEM_REQUIRE(s.values.size() == s.boundaries.size() + 1, InvalidArgument,
                 "{}: values must have one element more than boundaries; got {} boundaries and {} values", describe(s),
                 s.boundaries.size(), s.values.size());
  for (std::size_t i = 1; i < s.boundaries.size(); ++i) {
    TANDEM_REQUIRE(s.boundaries[i - 1] < s.boundaries[i], InvalidArgument,
                   "{}: boundaries must be strictly increasing; boundaries[{}] = {} follows {}", describe(s), i,
                   s.boundaries[i], s.boundaries[i - 1]);
  }
  for (std::size_t i = 0; i < s.values.size(); ++i) require_rate(s, fmt::format("values[{}]", i), s.values[i]);
}

// Keras's _decay_function: from `from` down to from * alpha as step goes from 0 to decay_steps.
double cosine(double step, double decay_steps, double from, double alpha) {
  const double cosine_decayed = 0.5 * (1.0 + std::cos(std::numbers::pi * (step / decay_steps)));
  return from * ((1.0 - alpha) * cosine_decayed + alpha);
}

double evaluate(const CosineDecay& s, double step) {
  const auto decay_steps = static_cast<double>(s.decay_steps);
  if (!s.warmup_target) return cosine(std::min(step, decay_steps), decay_steps, s.initial_learning_rate, s.alpha);
  const auto warmup_steps = static_cast<double>(s.warmup_steps);
  step = std::min(step, decay_steps + warmup_steps);
  if (step < warmup_steps) {
    return (*s.warmup_target - s.initial_learning_rate) * (step / warmup_steps) + s.initial_learning_rate;
  }
  return cosine(step - warmup_steps, decay_steps, *s.warmup_target, s.alpha);
}

// step / decay_steps, floored under staircase: ExponentialDecay's exponent, InverseTimeDecay's
// multiplier.
template <class S>
double decay_progress(const S& s, double step) {
  const double p = step / static_cast<double>(s.decay_steps);
  return s.staircase ? std::floor(p) : p;
}

double evaluate(const ExponentialDecay& s, double step) {
  return s.initial_learning_rate * std::pow(s.decay_rate, decay_progress(s, step));
}

double evaluate(const InverseTimeDecay& s, double step) {
  return s.initial_learning_rate / (1.0 + s.decay_rate * decay_progress(s, step));
}

double evaluate(const PiecewiseConstantDecay& s, double step) {
  // The first interval whose upper boundary the step has not passed (boundaries are inclusive).
  const auto upper = std::lower_bound(s.boundaries.begin(), s.boundaries.end(), step,
                                      [](std::int64_t boundary, double x) { return static_cast<double>(boundary) < x; });
  return s.values[static_cast<std::size_t>(upper - s.boundaries.begin())];
}

Json config(const CosineDecay& s) {
  return Json{{"initial_learning_rate", s.initial_learning_rate},
              {"decay_steps", s.decay_steps},
              {"alpha", s.alpha},
              {"name", s.name},
              {"warmup_target", s.warmup_target ? Json(*s.warmup_target) : Json(nullptr)},
              {"warmup_steps", s.warmup_steps}};
}

template <class S>
requires std::is_same_v<S, ExponentialDecay> || std::is_same_v<S, InverseTimeDecay> Json config(const S& s) {
  return Json{{"initial_learning_rate", s.initial_learning_rate},
              {"decay_steps", s.decay_steps},
              {"decay_rate", s.decay_rate},
              {"staircase", s.staircase},
              {"name", s.name}};
}

Json config(const PiecewiseConstantDecay& s) {
  return Json{{"boundaries", s.boundaries}, {"values", s.values}, {"name", s.name}};
}

}  // namespace

LearningRate::LearningRate(CosineDecay schedule) : value_(std::move(schedule)) {
  validate(std::get<CosineDecay>(value_));
}
LearningRate::LearningRate(ExponentialDecay schedule) : value_(std::move(schedule)) {
  validate_decay_rate_schedule(std::get<ExponentialDecay>(value_));
}
LearningRate::LearningRate(PiecewiseConstantDecay schedule) : value_(std::move(schedule)) {
  validate(std::get<PiecewiseConstantDecay>(value_));
}
LearningRate::LearningRate(InverseTimeDecay schedule) : value_(std::move(schedule)) {
  validate_decay_rate_schedule(std::get<InverseTimeDecay>(value_));
}

double LearningRate::operator()(std::int64_t iterations) const {
  const auto step = static_cast<double>(iterations);
  return std::visit(
      [&](const auto& v) {
        if constexpr (std::is_same_v<std::decay_t<decltype(v)>, double>) {
          return v;
        } else {
          return evaluate(v, step);
        }
      },
      value_);
}

std::string_view LearningRate::kind() const {
  return std::visit(
      [](const auto& v) -> std::string_view {
        using V = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<V, double>) {
          return "constant";
        } else {
          return kind_of<V>();
        }
      },
      value_);
}

std::string LearningRate::to_json() const {
  const Json json = std::visit(
      [&](const auto& v) -> Json {
        if constexpr (std::is_same_v<std::decay_t<decltype(v)>, double>) {
          return Json(v);
        } else {
          return Json{{"class_name", kind()}, {"config", config(v)}};
        }
      },
      value_);
  return json.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace tandem::keras
