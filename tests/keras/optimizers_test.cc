// Each optimizer against its Keras 3 update rule computed by hand in double precision.
#include <doctest/doctest.h>

#include <cmath>

#include "tandem/keras_like/optimizers.h"
#include "tandem/strategy/strategy.h"

using namespace tandem;
using namespace tandem::keras;

namespace {

VariablePtr make_variable(const std::vector<float>& values, const std::string& name = "w") {
  strategy::VariableOptions options;
  options.name = name;
  options.initial_value = Tensor::from_vector<float>(values, {static_cast<std::int64_t>(values.size())});
  return strategy::default_strategy().create_variable(std::move(options));
}

// Runs `steps` updates with the given gradients; returns the variable's values.
std::vector<float> run(OptimizerSpec spec, std::vector<float> w0, const std::vector<std::vector<float>>& grads) {
  auto v = make_variable(w0);
  Optimizer opt(spec);
  opt.build({v});
  for (const auto& g : grads) {
    opt.apply(0, {Tensor::from_vector<float>(g, {static_cast<std::int64_t>(g.size())})});
    opt.finish_step();
  }
  CHECK(opt.iterations() == static_cast<std::int64_t>(grads.size()));
  return v->read_value().to_vector<float>();
}

void check_close(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-5));
}

const std::vector<float> kW0{1.0f, -2.0f, 0.5f};
const std::vector<std::vector<float>> kGrads{{0.1f, -0.2f, 0.3f}, {0.05f, 0.4f, -0.1f}, {-0.3f, 0.1f, 0.2f}};

}  // namespace

TEST_CASE("SGD: plain, momentum, nesterov (Keras 3 rules)") {
  for (double momentum : {0.0, 0.9}) {
    for (bool nesterov : {false, true}) {
      const double lr = 0.1;
      std::vector<double> w(kW0.begin(), kW0.end()), m(3, 0.0);
      for (const auto& g : kGrads) {
        for (int i = 0; i < 3; ++i) {
          if (momentum == 0) {
            w[i] -= lr * g[i];
          } else {
            m[i] = momentum * m[i] - lr * g[i];
            w[i] += nesterov ? momentum * m[i] - lr * g[i] : m[i];
          }
        }
      }
      CAPTURE(momentum);
      CAPTURE(nesterov);
      check_close(run(SGD{.learning_rate = lr, .momentum = momentum, .nesterov = nesterov}, kW0, kGrads), w);
    }
  }
}

TEST_CASE("Adam, AdamW and amsgrad") {
  for (int variant = 0; variant < 3; ++variant) {
    const double lr = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-7, wd = variant == 1 ? 0.004 : 0.0;
    const bool amsgrad = variant == 2;
    std::vector<double> w(kW0.begin(), kW0.end()), m(3, 0.0), v(3, 0.0), vhat(3, 0.0);
    int t = 0;
    for (const auto& g : kGrads) {
      ++t;
      const double alpha = lr * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t));
      for (int i = 0; i < 3; ++i) {
        w[i] -= w[i] * wd * lr;
        m[i] += (g[i] - m[i]) * (1 - b1);
        v[i] += (g[i] * g[i] - v[i]) * (1 - b2);
        double second = v[i];
        if (amsgrad) {
          vhat[i] = std::max(vhat[i], v[i]);
          second = vhat[i];
        }
        w[i] -= m[i] * alpha / (std::sqrt(second) + eps);
      }
    }
    CAPTURE(variant);
    const auto got = variant == 1 ? run(AdamW{.learning_rate = lr}, kW0, kGrads)
                                  : run(Adam{.learning_rate = lr, .amsgrad = amsgrad}, kW0, kGrads);
    check_close(got, w);
  }
}

TEST_CASE("RMSprop: plain, momentum, centered") {
  for (double momentum : {0.0, 0.5}) {
    for (bool centered : {false, true}) {
      const double lr = 0.01, rho = 0.9, eps = 1e-7;
      std::vector<double> w(kW0.begin(), kW0.end()), vel(3, 0.0), mom(3, 0.0), avg(3, 0.0);
      for (const auto& g : kGrads) {
        for (int i = 0; i < 3; ++i) {
          vel[i] = rho * vel[i] + (1 - rho) * g[i] * g[i];
          double denominator = vel[i] + eps;
          if (centered) {
            avg[i] = rho * avg[i] + (1 - rho) * g[i];
            denominator = vel[i] - avg[i] * avg[i] + eps;
          }
          const double increment = lr * g[i] / std::sqrt(denominator);
          if (momentum > 0) {
            mom[i] = momentum * mom[i] + increment;
            w[i] -= mom[i];
          } else {
            w[i] -= increment;
          }
        }
      }
      CAPTURE(momentum);
      CAPTURE(centered);
      check_close(run(RMSprop{.learning_rate = lr, .momentum = momentum, .centered = centered}, kW0, kGrads), w);
    }
  }
}

TEST_CASE("gradient clipping: clipvalue, clipnorm, global_clipnorm") {
  const std::vector<std::vector<float>> big{{3.0f, -4.0f, 0.0f}};  // norm 5
  check_close(run(SGD{.learning_rate = 1.0, .clipvalue = 1.0}, kW0, big), {0.0, -1.0, 0.5});
  check_close(run(SGD{.learning_rate = 1.0, .clipnorm = 1.0}, kW0, big), {1.0 - 0.6, -2.0 + 0.8, 0.5});

  // Global norm over two variables: sqrt(5^2 + 12^2) = 13.
  auto a = make_variable({0.0f, 0.0f}, "a");
  auto b = make_variable({0.0f}, "b");
  Optimizer opt(SGD{.learning_rate = 1.0, .global_clipnorm = 1.0});
  opt.build({a, b});
  opt.apply(0, {Tensor::from_vector<float>({3, 4}, {2}), Tensor::from_vector<float>({12}, {1})});
  check_close(a->read_value().to_vector<float>(), {-3.0 / 13, -4.0 / 13});
  check_close(b->read_value().to_vector<float>(), {-12.0 / 13});
  CHECK_THROWS_AS(Optimizer(SGD{.clipnorm = 1.0, .global_clipnorm = 1.0}), InvalidArgument);
  CHECK_THROWS_AS(Optimizer(SGD{.clipvalue = -1.0}), InvalidArgument);
}

TEST_CASE("Keras defaults and names") {
  CHECK(std::get<Adam>(OptimizerRef("adam").spec()).learning_rate == 0.001);
  CHECK(std::get<Adam>(OptimizerRef("adam").spec()).epsilon == 1e-7);
  CHECK(std::get<SGD>(OptimizerRef("sgd").spec()).learning_rate == 0.01);
  CHECK(std::get<AdamW>(OptimizerRef("adamw").spec()).weight_decay == 0.004);
  CHECK(std::get<RMSprop>(OptimizerRef("rmsprop").spec()).rho == 0.9);
  CHECK_THROWS_WITH_AS(OptimizerRef("adagrad"), doctest::Contains("unknown optimizer \"adagrad\""), InvalidArgument);
  Optimizer opt(OptimizerRef("adam").spec());
  CHECK(opt.name() == "adam");
  opt.set_learning_rate(0.5);
  CHECK(opt.learning_rate() == 0.5);
  CHECK_THROWS_AS(opt.set_learning_rate(-1), InvalidArgument);
}

TEST_CASE("a gradient of the wrong shape is refused naming the variable") {
  auto v = make_variable({1, 2, 3});
  Optimizer opt(Adam{});
  opt.build({v});
  CHECK_THROWS_WITH_AS(opt.apply(0, {Tensor::zeros({2}, kFloat32)}), doctest::Contains("gradient of \"w\""),
                       InvalidArgument);
  CHECK(opt.slots().size() == 2);
  CHECK(opt.slots()[0].first == "w/m");
}

TEST_CASE("slots under another strategy's scope are refused, naming both strategies") {
  OneDeviceStrategy first("CPU:0");
  OneDeviceStrategy second("CPU:0");
  VariablePtr v;
  {
    auto scope = first.scope();
    strategy::VariableOptions options;
    options.name = "kernel";
    options.initial_value = Tensor::zeros({2}, kFloat32);
    v = strategy::get_strategy().create_variable(std::move(options));
  }
  auto scope = second.scope();
  Optimizer opt(Adam{});
  try {
    opt.build({v});
    FAIL("expected FailedPrecondition");
  } catch (const FailedPrecondition& e) {
    const std::string what = e.what();
    CHECK(what.find(first.name()) != std::string::npos);
    CHECK(what.find(second.name()) != std::string::npos);
    CHECK(what.find("\"kernel\"") != std::string::npos);
  }
}

TEST_CASE("apply_variable: one variable at a time, bitwise apply(); refused where the update looks across variables") {
  const std::vector<OptimizerSpec> specs{Adam{.learning_rate = 0.01}, AdamW{.learning_rate = 0.01},
                                         SGD{.learning_rate = 0.1, .momentum = 0.9},
                                         RMSprop{.learning_rate = 0.01, .centered = true}};
  for (const auto& spec : specs) {
    // Two variables updated by apply() together, and by apply_variable() for the first with
    // apply() taking the second: the same bits, step after step.
    auto a0 = make_variable(kW0, "a0"), a1 = make_variable({3.0f, -1.0f}, "a1");
    auto b0 = make_variable(kW0, "b0"), b1 = make_variable({3.0f, -1.0f}, "b1");
    Optimizer whole(spec), split(spec);
    whole.build({a0, a1});
    split.build({b0, b1});
    CHECK(split.updates_per_variable(0));
    for (const auto& g : kGrads) {
      const Tensor g0 = Tensor::from_vector<float>(g, {3});
      const Tensor g1 = Tensor::from_vector<float>({g[1], g[0]}, {2});
      whole.apply(0, {g0, g1});
      whole.finish_step();
      split.apply_variable(0, 0, g0);
      split.apply(0, {Tensor(), g1});
      split.finish_step();
    }
    CHECK(a0->read_value().to_vector<float>() == b0->read_value().to_vector<float>());
    CHECK(a1->read_value().to_vector<float>() == b1->read_value().to_vector<float>());
    CHECK(a0->read_value().to_vector<float>() != kW0);
  }
  const auto refused = [](OptimizerRef ref) {
    auto v = make_variable(kW0);
    std::unique_ptr<Optimizer> opt = ref.loss_scale_optimizer()
                                         ? std::make_unique<Optimizer>(*ref.loss_scale_optimizer())
                                         : std::make_unique<Optimizer>(ref.spec());
    opt->build({v});
    CHECK_FALSE(opt->updates_per_variable(0));
    CHECK_THROWS_WITH_AS(opt->apply_variable(0, 0, Tensor::from_vector<float>({0.1f, 0.2f, 0.3f}, {3})),
                         doctest::Contains("one variable at a time"), FailedPrecondition);
    CHECK_THROWS_WITH_AS(opt->apply(0, {Tensor()}), doctest::Contains("no gradient for variable \"w\""),
                         InvalidArgument);
    CHECK(v->read_value().to_vector<float>() == kW0);
  };
  refused(Adam{.clipnorm = 1.0});
  refused(Adam{.global_clipnorm = 1.0});
  refused(SGD{.gradient_accumulation_steps = 2});
  refused(LossScaleOptimizer{.inner_optimizer = Adam{}});
}
