// Reproducible random float32 values, uniform in [-2, 2), for tests that compare two computations
// of the same thing (emulated GPU arithmetic, cuDNN's documented semantics) on arbitrary data.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace tandem::testing {

inline std::vector<float> random_values(std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = u(rng);
  return v;
}

}  // namespace tandem::testing
