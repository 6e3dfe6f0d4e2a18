// Keras's initializers (keras/src/initializers), with the same formulas and fan rules.
#include "tandem/keras_like/initializers.h"

#include <cmath>
#include <random>

#include "tandem/base/errors.h"

namespace tandem::keras {
namespace {

constexpr std::string_view kKnown =
    "glorot_uniform, glorot_normal, he_normal, he_uniform, lecun_normal, lecun_uniform, zeros, ones, random_normal, "
    "normal, random_uniform, uniform, truncated_normal";
// Keras's truncated normal keeps draws within two standard deviations; dividing the target
// stddev by this constant (the stddev of a unit normal truncated at +-2) gives the variance the
// variance-scaling initializers ask for.
constexpr double kTruncatedNormalStddev = 0.87962566103423978;

struct Fans {
  double in = 1, out = 1;
};
// Keras's compute_fans: [in, out]; [..., in, out] conv kernels multiply by the receptive field.
Fans fans(const Shape& shape) {
  if (shape.rank() == 0) return {1, 1};
  if (shape.rank() == 1) return {static_cast<double>(shape[0]), static_cast<double>(shape[0])};
  if (shape.rank() == 2) return {static_cast<double>(shape[0]), static_cast<double>(shape[1])};
  double receptive = 1;
  for (int i = 0; i < shape.rank() - 2; ++i) receptive *= static_cast<double>(shape[i]);
  return {receptive * static_cast<double>(shape[shape.rank() - 2]),
          receptive * static_cast<double>(shape[shape.rank() - 1])};
}

}  // namespace

Initializer::Initializer(std::string_view name) : name_(name) {
  // Keras's aliases, and the defaults of the parameterised ones.
  if (name == "uniform" || name == "random_uniform") {
    *this = random_uniform();
    return;
  }
  if (name == "normal" || name == "random_normal") {
    *this = random_normal();
    return;
  }
  if (name == "truncated_normal") {
    *this = truncated_normal();
    return;
  }
  static const std::vector<std::string_view> known = {"glorot_uniform", "glorot_normal", "he_normal", "he_uniform",
                                                      "lecun_normal",   "lecun_uniform", "zeros",     "ones"};
  TANDEM_REQUIRE(std::find(known.begin(), known.end(), name) != known.end(), InvalidArgument,
                 "unknown initializer \"{}\"; known: {}", name, kKnown);
}

Initializer Initializer::constant(double value) { return with_parameters("constant", value, 0.0); }

Initializer Initializer::with_parameters(std::string_view name, double a, double b) {
  Initializer init("zeros");
  init.name_ = name;
  init.a_ = a;
  init.b_ = b;
  return init;
}

Initializer Initializer::random_uniform(double minval, double maxval) {
  TANDEM_REQUIRE(minval < maxval, InvalidArgument, "initializer random_uniform: minval {} must be below maxval {}",
                 minval, maxval);
  return with_parameters("random_uniform", minval, maxval);
}

Initializer Initializer::random_normal(double mean, double stddev) {
  TANDEM_REQUIRE(stddev > 0, InvalidArgument, "initializer random_normal: stddev is {}; expected a positive number",
                 stddev);
  return with_parameters("random_normal", mean, stddev);
}

Initializer Initializer::truncated_normal(double mean, double stddev) {
  TANDEM_REQUIRE(stddev > 0, InvalidArgument, "initializer truncated_normal: stddev is {}; expected a positive number",
                 stddev);
  return with_parameters("truncated_normal", mean, stddev);
}

Tensor Initializer::operator()(const Shape& shape, DType dtype, std::uint64_t seed) const {
  TANDEM_REQUIRE(shape.is_fully_defined(), InvalidArgument, "initializer {}: shape {} is not fully defined", name_,
                 shape);
  const auto n = static_cast<std::size_t>(shape.num_elements());
  std::vector<double> values(n, 0.0);
  std::mt19937_64 rng(seed);
  const Fans f = fans(shape);
  const auto uniform_between = [&](double lo, double hi) {
    std::uniform_real_distribution<double> dist(lo, hi);
    for (auto& v : values) v = dist(rng);
  };
  const auto uniform = [&](double limit) { uniform_between(-limit, limit); };
  const auto truncated_normal = [&](double stddev, double mean = 0.0) {
    std::normal_distribution<double> dist(0.0, 1.0);
    for (auto& v : values) {
      double z = 0;
      do {
        z = dist(rng);
      } while (std::abs(z) > 2.0);
      v = mean + z * stddev;
    }
  };
  if (name_ == "zeros") {
  } else if (name_ == "ones") {
    std::fill(values.begin(), values.end(), 1.0);
  } else if (name_ == "constant") {
    std::fill(values.begin(), values.end(), a_);
  } else if (name_ == "glorot_uniform") {
    uniform(std::sqrt(6.0 / (f.in + f.out)));
  } else if (name_ == "glorot_normal") {
    truncated_normal(std::sqrt(2.0 / (f.in + f.out)) / kTruncatedNormalStddev);
  } else if (name_ == "he_normal") {
    truncated_normal(std::sqrt(2.0 / f.in) / kTruncatedNormalStddev);
  } else if (name_ == "he_uniform") {
    uniform(std::sqrt(6.0 / f.in));
  } else if (name_ == "lecun_normal") {
    truncated_normal(std::sqrt(1.0 / f.in) / kTruncatedNormalStddev);
  } else if (name_ == "lecun_uniform") {
    uniform(std::sqrt(3.0 / f.in));
  } else if (name_ == "random_normal") {
    std::normal_distribution<double> dist(a_, b_);
    for (auto& v : values) v = dist(rng);
  } else if (name_ == "truncated_normal") {
    truncated_normal(b_, a_);
  } else if (name_ == "random_uniform") {
    uniform_between(a_, b_);
  }
  Tensor out;
  graph::dispatch<graph::NumericTypes>(dtype, fmt::format("initializer {}", name_), [&]<class T>() {
    std::vector<T> typed(n);
    for (std::size_t i = 0; i < n; ++i) typed[i] = static_cast<T>(values[i]);
    out = Tensor::from_vector<T>(typed, shape);
  });
  return out;
}

}  // namespace tandem::keras
