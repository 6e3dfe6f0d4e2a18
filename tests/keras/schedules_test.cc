// Learning-rate schedules against Keras 3's formulas in float64 at many steps, optimizers driven by
// them (the rate of a step is schedule(iterations before it)), and AdamW's
// exclude_from_weight_decay against a float64 hand computation.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <numbers>

#include "common/error_message.h"
#include "tandem/keras_like/keras.h"

using namespace tandem;
using namespace tandem::keras;

namespace {

constexpr double kPi = std::numbers::pi;

// Each schedule against its formula written out, for steps 0..last; also the points where the
// formula changes branch, which the caller checks by value.
void check_schedule(const LearningRate& rate, const std::function<double(double)>& formula, std::int64_t last) {
  for (std::int64_t step = 0; step <= last; ++step) {
    CAPTURE(step);
    const double want = formula(static_cast<double>(step));
    CHECK(rate(step) == doctest::Approx(want).epsilon(1e-14).scale(0));
  }
}

VariablePtr make_variable(const std::vector<double>& values, const std::string& name) {
  strategy::VariableOptions options;
  options.name = name;
  options.initial_value = Tensor::from_vector<double>(values, {static_cast<std::int64_t>(values.size())});
  return strategy::default_strategy().create_variable(std::move(options));
}

Tensor gradient(const std::vector<double>& values) {
  return Tensor::from_vector<double>(values, {static_cast<std::int64_t>(values.size())});
}

void check_close(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-12));
  }
}

}  // namespace

TEST_CASE("CosineDecay without warmup: Keras 3's formula, constant after decay_steps") {
  const double initial = 0.1, alpha = 0.2;
  const std::int64_t decay_steps = 1000;
  const LearningRate rate = CosineDecay{.initial_learning_rate = initial, .decay_steps = decay_steps, .alpha = alpha};
  check_schedule(
      rate,
      [&](double step) {
        const double s = std::min(step, 1000.0);
        return initial * ((1 - alpha) * 0.5 * (1 + std::cos(kPi * s / 1000.0)) + alpha);
      },
      1500);
  CHECK(rate(0) == initial);
  CHECK(rate(500) == doctest::Approx(initial * (1 + alpha) / 2).epsilon(1e-15));
  CHECK(rate(1000) == doctest::Approx(initial * alpha).epsilon(1e-15));
  CHECK(rate(100000) == doctest::Approx(initial * alpha).epsilon(1e-15));
  CHECK(LearningRate(CosineDecay{.initial_learning_rate = 1.0, .decay_steps = 10})(10) == doctest::Approx(0.0));
}

TEST_CASE("CosineDecay with warmup: linear from initial to warmup_target, then the cosine from the target") {
  const double initial = 1e-4, target = 1e-3, alpha = 0.1;
  const LearningRate rate = CosineDecay{.initial_learning_rate = initial,
                                        .decay_steps = 400,
                                        .alpha = alpha,
                                        .warmup_target = target,
                                        .warmup_steps = 100};
  check_schedule(
      rate,
      [&](double step) {
        if (step < 100) return initial + (target - initial) * step / 100;
        const double s = std::min(step - 100, 400.0);
        return target * ((1 - alpha) * 0.5 * (1 + std::cos(kPi * s / 400)) + alpha);
      },
      700);
  // The warmup's boundaries: its first step, its last, the first of the decay, the decay's end.
  CHECK(rate(0) == initial);
  CHECK(rate(50) == doctest::Approx((initial + target) / 2).epsilon(1e-15));
  CHECK(rate(99) == doctest::Approx(initial + (target - initial) * 0.99).epsilon(1e-15));
  CHECK(rate(100) == doctest::Approx(target).epsilon(1e-15));
  CHECK(rate(300) == doctest::Approx(target * (1 + alpha) / 2).epsilon(1e-15));
  CHECK(rate(500) == doctest::Approx(target * alpha).epsilon(1e-15));
  CHECK(rate(5000) == doctest::Approx(target * alpha).epsilon(1e-15));
  // A warmup target with no warmup steps decays from the target at once (Keras's branch).
  const LearningRate no_steps = CosineDecay{.initial_learning_rate = 1.0, .decay_steps = 10, .warmup_target = 2.0};
  CHECK(no_steps(0) == 2.0);
  CHECK(no_steps(5) == doctest::Approx(1.0).epsilon(1e-15));
}

TEST_CASE("ExponentialDecay: smooth and staircase") {
  for (const bool staircase : {false, true}) {
    CAPTURE(staircase);
    const LearningRate rate =
        ExponentialDecay{.initial_learning_rate = 0.5, .decay_steps = 7, .decay_rate = 0.9, .staircase = staircase};
    check_schedule(
        rate,
        [&](double step) {
          const double p = staircase ? std::floor(step / 7) : step / 7;
          return 0.5 * std::pow(0.9, p);
        },
        300);
    CHECK(rate(0) == 0.5);
    CHECK(rate(7) == doctest::Approx(0.45).epsilon(1e-15));
    CHECK(rate(6) == doctest::Approx(staircase ? 0.5 : 0.5 * std::pow(0.9, 6.0 / 7)).epsilon(1e-15));
  }
}

TEST_CASE("InverseTimeDecay: smooth and staircase") {
  for (const bool staircase : {false, true}) {
    CAPTURE(staircase);
    const LearningRate rate =
        InverseTimeDecay{.initial_learning_rate = 0.1, .decay_steps = 5, .decay_rate = 0.5, .staircase = staircase};
    check_schedule(
        rate,
        [&](double step) {
          const double p = staircase ? std::floor(step / 5) : step / 5;
          return 0.1 / (1 + 0.5 * p);
        },
        300);
    CHECK(rate(10) == doctest::Approx(0.05).epsilon(1e-15));
    CHECK(rate(9) == doctest::Approx(staircase ? 0.1 / 1.5 : 0.1 / 1.9).epsilon(1e-15));
  }
}

TEST_CASE("PiecewiseConstantDecay: a boundary belongs to the interval it ends") {
  const LearningRate rate = PiecewiseConstantDecay{.boundaries = {10, 20, 35}, .values = {1.0, 0.5, 0.1, 0.01}};
  check_schedule(
      rate,
      [](double step) {
        if (step <= 10) return 1.0;
        if (step <= 20) return 0.5;
        if (step <= 35) return 0.1;
        return 0.01;
      },
      100);
  CHECK(rate(10) == 1.0);
  CHECK(rate(11) == 0.5);
  CHECK(rate(20) == 0.5);
  CHECK(rate(21) == 0.1);
  CHECK(rate(36) == 0.01);
}

TEST_CASE("bad schedule arguments are refused when the optimizer is made, naming the schedule and argument") {
  using testing::error_message;
  const auto message = [](auto make) { return error_message([&] { (void)make(); }); };
  CHECK(message([] { return SGD{.learning_rate = CosineDecay{.initial_learning_rate = 0.1}}; }) ==
        "CosineDecay: decay_steps must be > 0; got 0");
  CHECK(message([] {
          return AdamW{.learning_rate = CosineDecay{.initial_learning_rate = 0.1, .decay_steps = -5, .name = "warm"}};
        }) == "CosineDecay \"warm\": decay_steps must be > 0; got -5");
  CHECK(message([] { return Adam{.learning_rate = CosineDecay{.initial_learning_rate = -0.1, .decay_steps = 5}}; })
            .find("CosineDecay: initial_learning_rate must be finite and not negative; got -0.1") == 0);
  CHECK(message([] {
          return Adam{.learning_rate = CosineDecay{.initial_learning_rate = 0.0, .decay_steps = 5, .warmup_target = -1}};
        }).find("warmup_target") != std::string::npos);
  CHECK(message([] {
          return Adam{.learning_rate = CosineDecay{
                          .initial_learning_rate = 0.0, .decay_steps = 5, .warmup_target = 1, .warmup_steps = -1}};
        }).find("CosineDecay: warmup_steps must not be negative") == 0);
  CHECK(message([] { return SGD{.learning_rate = ExponentialDecay{.initial_learning_rate = 0.1, .decay_rate = 0.9}}; })
            .find("ExponentialDecay: decay_steps") == 0);
  CHECK(message([] {
          return SGD{.learning_rate = ExponentialDecay{.initial_learning_rate = 0.1, .decay_steps = 3, .decay_rate = -1}};
        }).find("ExponentialDecay: decay_rate must be finite") == 0);
  CHECK(message([] {
          return SGD{.learning_rate = InverseTimeDecay{.initial_learning_rate = 0.1, .decay_steps = 0, .decay_rate = 1}};
        }).find("InverseTimeDecay: decay_steps") == 0);
  CHECK(message([] {
          return SGD{.learning_rate = PiecewiseConstantDecay{.boundaries = {5, 5}, .values = {1, 2, 3}}};
        }) == "PiecewiseConstantDecay: boundaries must be strictly increasing; boundaries[1] = 5 follows 5");
  CHECK(message([] { return SGD{.learning_rate = PiecewiseConstantDecay{.boundaries = {5, 10}, .values = {1, 2}}}; }) ==
        "PiecewiseConstantDecay: values must have one element more than boundaries; got 2 boundaries and 2 values");
  CHECK(message([] { return SGD{.learning_rate = PiecewiseConstantDecay{.boundaries = {5}, .values = {1, -2}}}; })
            .find("PiecewiseConstantDecay: values[1] must be finite and not negative") == 0);
  CHECK(message([] { return Optimizer(SGD{.learning_rate = -0.5}); }) ==
        "sgd: learning rate -0.5 must be finite and not negative");
  CHECK(message([] { return Optimizer(SGD{.learning_rate = std::nan("")}); }).find("sgd: learning rate") == 0);
}

TEST_CASE("every optimizer takes a constant or a schedule; Keras's serialised config") {
  const AdamW scheduled{.learning_rate = CosineDecay{.initial_learning_rate = 0.0,
                                                     .decay_steps = 1000,
                                                     .warmup_target = 1e-3,
                                                     .warmup_steps = 100}};
  const AdamW constant{.learning_rate = 1e-3};
  CHECK(constant.learning_rate == 1e-3);
  CHECK(scheduled.learning_rate.is_schedule());
  CHECK(scheduled.learning_rate.kind() == "CosineDecay");
  CHECK(scheduled.learning_rate.to_json() ==
        R"({"class_name":"CosineDecay","config":{"initial_learning_rate":0.0,"decay_steps":1000,"alpha":0.0,)"
        R"("name":"CosineDecay","warmup_target":0.001,"warmup_steps":100}})");
  CHECK(LearningRate(ExponentialDecay{.initial_learning_rate = 0.1, .decay_steps = 10, .decay_rate = 0.5}).to_json() ==
        R"({"class_name":"ExponentialDecay","config":{"initial_learning_rate":0.1,"decay_steps":10,)"
        R"("decay_rate":0.5,"staircase":false,"name":"ExponentialDecay"}})");
  CHECK(LearningRate(PiecewiseConstantDecay{.boundaries = {3}, .values = {0.5, 0.25}}).to_json() ==
        R"({"class_name":"PiecewiseConstantDecay","config":{"boundaries":[3],"values":[0.5,0.25],)"
        R"("name":"PiecewiseConstant"}})");
  CHECK(LearningRate(CosineDecay{.decay_steps = 5}).to_json().find(R"("warmup_target":null)") != std::string::npos);
  CHECK(LearningRate(0.25).to_json() == "0.25");
  CHECK(LearningRate(0.25).kind() == "constant");
  for (const OptimizerRef& ref :
       {OptimizerRef(SGD{.learning_rate = InverseTimeDecay{.initial_learning_rate = 0.1, .decay_steps = 1,
                                                           .decay_rate = 1}}),
        OptimizerRef(Adam{.learning_rate = ExponentialDecay{.initial_learning_rate = 0.1, .decay_steps = 1,
                                                            .decay_rate = 0.5}}),
        OptimizerRef(RMSprop{.learning_rate = PiecewiseConstantDecay{.boundaries = {0}, .values = {0.1, 0.05}}}),
        OptimizerRef(scheduled)}) {
    const Optimizer optimizer(ref.spec());
    CHECK(optimizer.learning_rate_config().is_schedule());
  }
}

TEST_CASE("an optimizer's rate is the schedule at its iterations; a constant cannot be set over a schedule") {
  // SGD without momentum: each step moves w by exactly rate * g, so w tells the rate each step used.
  auto w = make_variable({0.0}, "w");
  Optimizer sgd(SGD{.learning_rate = PiecewiseConstantDecay{.boundaries = {0, 1, 2}, .values = {1, 2, 4, 8}}});
  sgd.build({w});
  std::vector<double> used;
  double before = 0;
  for (int step = 0; step < 5; ++step) {
    CHECK(sgd.learning_rate() == sgd.learning_rate_config()(sgd.iterations()));
    sgd.apply(0, {gradient({-1.0})});
    sgd.finish_step();
    const double now = w->read_value().to_vector<double>()[0];
    used.push_back(now - before);
    before = now;
  }
  // Step 1 (iterations 0) used schedule(0) = 1: Keras evaluates before incrementing.
  CHECK(used == std::vector<double>{1, 2, 4, 8, 8});
  CHECK(sgd.learning_rate() == 8);

  const auto message = testing::error_message<FailedPrecondition>([&] { sgd.set_learning_rate(0.5); });
  CHECK(message.find("sgd: this optimizer was created with a learning-rate schedule (PiecewiseConstantDecay)") == 0);
  // A schedule may replace a schedule, and a constant a constant (Keras's learning_rate setter).
  sgd.set_learning_rate(ExponentialDecay{.initial_learning_rate = 1.0, .decay_steps = 5, .decay_rate = 0.5});
  CHECK(sgd.learning_rate() == doctest::Approx(0.5));  // iterations 5
  Optimizer constant(SGD{.learning_rate = 0.1});
  constant.set_learning_rate(0.2);
  CHECK(constant.learning_rate() == 0.2);
  CHECK_FALSE(constant.learning_rate_config().is_schedule());
}

TEST_CASE("gradient accumulation: the update step's rate is the schedule at the real iterations") {
  // Keras 3: "learning rate schedules will look at the real iterations value (optimizer steps)".
  auto w = make_variable({0.0}, "w");
  Optimizer sgd(SGD{.learning_rate = PiecewiseConstantDecay{.boundaries = {0, 1, 2, 3}, .values = {1, 2, 3, 4, 5}},
                    .gradient_accumulation_steps = 2});
  sgd.build({w});
  REQUIRE_FALSE(sgd.is_update_step());
  sgd.finish_step();  // a micro-step: the reducer adds its gradient into the accumulators
  REQUIRE(sgd.is_update_step());
  sgd.apply(0, {gradient({-4.0})});  // the sum of two steps' gradients: their mean is -2
  sgd.finish_step();
  CHECK(w->read_value().to_vector<double>()[0] == doctest::Approx(2.0 * 2));  // schedule(1) = 2
}

TEST_CASE("Adam with a warmup cosine schedule against a float64 hand computation") {
  const CosineDecay schedule{.initial_learning_rate = 0.0, .decay_steps = 6, .warmup_target = 0.05, .warmup_steps = 2};
  const std::vector<std::vector<double>> grads{{0.1, -0.2}, {0.05, 0.4}, {-0.3, 0.1}, {0.2, 0.2}, {-0.1, 0.3}};
  auto w = make_variable({1.0, -2.0}, "w");
  Optimizer adam(Adam{.learning_rate = schedule});
  adam.build({w});
  std::vector<double> want{1.0, -2.0}, m(2, 0.0), v(2, 0.0);
  const double b1 = 0.9, b2 = 0.999, eps = 1e-7;
  for (std::size_t k = 0; k < grads.size(); ++k) {
    adam.apply(0, {gradient(grads[k])});
    adam.finish_step();
    // Steps 0 and 1 warm up (0, 0.025); the decay then starts at the target.
    const double step = static_cast<double>(k);
    const double lr = step < 2 ? 0.05 * step / 2 : 0.05 * 0.5 * (1 + std::cos(kPi * (step - 2) / 6));
    const double t = step + 1;
    const double alpha = lr * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t));
    for (int i = 0; i < 2; ++i) {
      m[i] += (grads[k][i] - m[i]) * (1 - b1);
      v[i] += (grads[k][i] * grads[k][i] - v[i]) * (1 - b2);
      want[i] -= m[i] * alpha / (std::sqrt(v[i]) + eps);
    }
  }
  check_close(w->read_value().to_vector<double>(), want);
}

TEST_CASE("AdamW's exclude_from_weight_decay: excluded variables are not decayed, the others are") {
  const std::vector<std::string> names{"dense/kernel", "dense/bias", "layer_normalization/gamma",
                                       "layer_normalization/beta", "embedding/embeddings"};
  const std::vector<std::vector<double>> initial{{1.0, -2.0}, {0.5, 0.25}, {1.0, 1.5}, {0.1, -0.3}, {-1.0, 2.0}};
  const std::vector<std::vector<double>> grads{{0.1, -0.2}, {0.05, 0.4}, {-0.3, 0.1}};
  const double wd = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-7;
  const ExponentialDecay schedule{.initial_learning_rate = 0.05, .decay_steps = 2, .decay_rate = 0.5};

  // Runs 3 steps; `configure` may exclude after construction. Returns each variable's values.
  const auto run = [&](const AdamW& spec, const std::function<void(Optimizer&, std::vector<VariablePtr>&)>& configure) {
    std::vector<VariablePtr> variables;
    for (std::size_t i = 0; i < names.size(); ++i) variables.push_back(make_variable(initial[i], names[i]));
    Optimizer adamw(spec);
    configure(adamw, variables);
    adamw.build(variables);
    for (const auto& g : grads) {
      adamw.apply(0, std::vector<Tensor>(variables.size(), gradient(g)));
      adamw.finish_step();
    }
    std::vector<std::vector<double>> out;
    for (const auto& v : variables) out.push_back(v->read_value().to_vector<double>());
    return std::pair{out, std::move(variables)};
  };
  // Keras 3's AdamW by hand: w -= w * wd * lr (when decayed), then Adam's step.
  const auto hand = [&](const std::vector<bool>& decayed) {
    std::vector<std::vector<double>> out;
    for (std::size_t n = 0; n < names.size(); ++n) {
      std::vector<double> w = initial[n], m(2, 0.0), v(2, 0.0);
      for (std::size_t k = 0; k < grads.size(); ++k) {
        const double lr = 0.05 * std::pow(0.5, static_cast<double>(k) / 2);
        const double t = static_cast<double>(k + 1);
        const double alpha = lr * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t));
        for (int i = 0; i < 2; ++i) {
          if (decayed[n]) w[i] -= w[i] * wd * lr;
          m[i] += (grads[k][i] - m[i]) * (1 - b1);
          v[i] += (grads[k][i] * grads[k][i] - v[i]) * (1 - b2);
          w[i] -= m[i] * alpha / (std::sqrt(v[i]) + eps);
        }
      }
      out.push_back(w);
    }
    return out;
  };
  const auto no_change = [](Optimizer&, std::vector<VariablePtr>&) {};

  SUBCASE("the field: patterns searched in the names") {
    const auto [got, variables] =
        run(AdamW{.learning_rate = schedule, .weight_decay = wd, .exclude_from_weight_decay = {"bias", "gamma", "beta"}},
            no_change);
    const auto want = hand({true, false, false, false, true});
    for (std::size_t n = 0; n < names.size(); ++n) {
      CAPTURE(names[n]);
      check_close(got[n], want[n]);
    }
    // Without exclusions every variable decays, and the excluded ones above did not.
    const auto [all, unused] = run(AdamW{.learning_rate = schedule, .weight_decay = wd}, no_change);
    const auto all_decayed = hand({true, true, true, true, true});
    for (std::size_t n = 0; n < names.size(); ++n) check_close(all[n], all_decayed[n]);
    CHECK(got[1] != all[1]);
    CHECK(got[0] == all[0]);
  }
  SUBCASE("the method: var_list and regular expressions, replacing the field's patterns") {
    const auto [got, variables] =
        run(AdamW{.learning_rate = schedule, .weight_decay = wd, .exclude_from_weight_decay = {"kernel"}},
            [](Optimizer& adamw, std::vector<VariablePtr>& vars) {
              adamw.exclude_from_weight_decay({vars[4]}, {"gam+a$", "^dense/b"});
            });
    const auto want = hand({true, false, false, true, false});
    for (std::size_t n = 0; n < names.size(); ++n) {
      CAPTURE(names[n]);
      check_close(got[n], want[n]);
    }
  }
  SUBCASE("asked after build, or with a bad pattern: refused") {
    auto v = make_variable({1.0}, "dense/bias");
    Optimizer adamw(AdamW{});
    CHECK(adamw.uses_weight_decay(*v));
    CHECK(testing::error_message([&] { adamw.exclude_from_weight_decay({}, {"bias("}); })
              .find("adamw: exclude_from_weight_decay pattern \"bias(\" is not a regular expression") == 0);
    CHECK_THROWS_AS(Optimizer(AdamW{.exclude_from_weight_decay = {"[unclosed"}}), InvalidArgument);
    adamw.exclude_from_weight_decay({}, {"bias"});
    CHECK_FALSE(adamw.uses_weight_decay(*v));
    adamw.build({v});
    CHECK(testing::error_message<FailedPrecondition>([&] { adamw.exclude_from_weight_decay({}, {"kernel"}); })
              .find("can only be configured before the optimizer is built") != std::string::npos);
    // Rules without weight decay decay nothing.
    CHECK_FALSE(Optimizer(Adam{}).uses_weight_decay(*v));
    CHECK_FALSE(Optimizer(AdamW{.weight_decay = 0}).uses_weight_decay(*v));
  }
}

// Sets a constant-rate optimizer to a schedule's value before each step, as fit() should do by
// itself with the schedule.
class FollowSchedule : public Callback {
 public:
  explicit FollowSchedule(LearningRate schedule) : schedule_(std::move(schedule)) {}
  void on_train_batch_begin(std::int64_t /*batch*/, Logs& /*logs*/) override {
    Optimizer& optimizer = model().optimizer();
    optimizer.set_learning_rate(schedule_(optimizer.iterations()));
  }

 private:
  LearningRate schedule_;
};

TEST_CASE("fit() uses schedule(iterations) at every step") {
  const PiecewiseConstantDecay schedule{.boundaries = {2, 5}, .values = {0.1, 0.03, 0.01}};
  auto x = Tensor::from_vector<float>({0.1f, 0.2f, 0.3f, -0.5f, 0.4f, 0.9f, 1.0f, -1.0f, 0.0f, 0.3f, 0.3f, 0.3f}, {4, 3});
  auto y = Tensor::from_vector<float>({1, 0, 0, 1, 1, 1, 0, 0}, {4, 2});
  const auto train = [&](OptimizerRef optimizer, std::vector<CallbackPtr> callbacks) {
    set_global_seed(11);
    Model model = Sequential({Input({3}), Dense(4, "tanh"), Dense(2)});
    model.compile(optimizer, "mse");
    model.fit(x, y, {.batch_size = 1, .epochs = 2, .verbose = 0, .callbacks = callbacks, .shuffle = false});
    CHECK(model.optimizer().iterations() == 8);
    std::vector<std::vector<float>> out;
    for (const auto& w : model.get_weights()) out.push_back(w.to_vector<float>());
    return std::pair{out, model.optimizer().learning_rate()};
  };
  const auto [scheduled, last_rate] = train(SGD{.learning_rate = schedule}, {});
  CHECK(last_rate == 0.01);
  const auto [followed, unused] = train(SGD{.learning_rate = 1.0}, {std::make_shared<FollowSchedule>(schedule)});
  CHECK(scheduled == followed);
  // A constant differs: the schedule did change the steps.
  const auto [constant, rate] = train(SGD{.learning_rate = 0.1}, {});
  CHECK(constant != scheduled);
}
