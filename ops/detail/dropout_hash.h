// tandem/ops/detail/dropout_hash.h — dropout's counter-based mask, shared by the CPU and GPU kernels.
//
// Element i of a dropout keeps its value when a hash of (stream key, i) clears a threshold, so
// the mask depends neither on how the elements are split over threads nor on the device: the
// same (executor seed, node, step, attr seed) drops the same elements on CPUs and GPUs.
#pragma once

#include <cstdint>

#include "tandem/ops/detail/host_device.h"

namespace tandem::ops::detail {

inline constexpr std::uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ULL;
// 53 random bits are compared with rate * 2^53: exact in a double, never overflows for rate < 1.
inline constexpr double kTwoPow53 = 9007199254740992.0;

// splitmix64's finaliser: a bijective 64-bit mix with full avalanche.
TANDEM_HOST_DEVICE inline std::uint64_t mix64(std::uint64_t z) {
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ULL;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The stream key of one dropout node in one step: the kernel's random seed and the op's seed.
TANDEM_HOST_DEVICE inline std::uint64_t dropout_key(std::uint64_t random_seed, std::uint64_t attr_seed) {
  return mix64(random_seed ^ mix64(attr_seed + kGoldenGamma));
}
// Elements with rate * 2^53 > dropout_bits(key, i) are dropped.
TANDEM_HOST_DEVICE inline std::uint64_t dropout_threshold(double rate) {
  return static_cast<std::uint64_t>(rate * kTwoPow53);
}
TANDEM_HOST_DEVICE inline std::uint64_t dropout_bits(std::uint64_t key, std::int64_t i) {
  return mix64(key + static_cast<std::uint64_t>(i) * kGoldenGamma) >> 11;
}

}  // namespace tandem::ops::detail
